"""CUDA graphs of the model's forward. A step of a small model is hundreds of small kernels;
launched eagerly each costs 15-60 us of host time, often more than it runs. Replaying a
captured graph launches them all at once.

Graphs are captured over persistent input buffers, for two ladders of sizes:

- Decode steps (one token per request), by batch size up to MAX_CAPTURE_SIZE. A batch of B
  requests is padded to the next captured size.
- Mixed steps (prefills and prompt chunks, with or without decodes), by token count up to
  MAX_MIXED_CAPTURE tokens, about sqrt(2) apart, with up to MAX_MIXED_REQS requests. A step of
  T tokens is padded to the next size, and its requests with empty ones to as many as that
  size holds (every launch's programs for them still start, search and exit). Which
  requests are decodes is not known at capture, so the attention runs two launches that each
  skip the other's requests. On the H200 this took W2's time to first token (Qwen3-0.6B,
  batch 1, a 512-token prompt) from 20-27 ms to 4.5-5 ms. Larger steps run eagerly: their
  launches are a small part of their GPU time: graphs of W1's 16,384-token steps with room
  for 320 requests left W1 unchanged, and padded requests are not free (padded to 1,024
  requests, those steps took 48.6 ms instead of 42.6, one run each).

- With speculative decoding, verification steps (every request a token and up to k drafts), by
  number of requests up to MAX_MIXED_REQS, in powers of two, each request k + 1 token slots:
  their attention is one launch of (k + 1)-query tiles, split over the context as decodes are
  (a mixed graph's second launch must take prompts as long as the graph, and a request's one
  program would read a long context alone).

Padding tokens write no KV (slot -1) and belong to no request; their outputs are dropped."""
import bisect

import torch

from pagoda.model.layers.attention import AttentionMetadata, set_forward_context


# Larger decode batches run eagerly: their launches are a small part of their GPU time, and
# each graph costs capture time and memory (vLLM's default limit too).
MAX_CAPTURE_SIZE = 512
MAX_MIXED_CAPTURE = 2048
# A bound on the padding requests' cost, which was not measured at these sizes; steps with more
# requests run eagerly, as before these graphs.
MAX_MIXED_REQS = 256


def max_graph_tokens() -> int:
    """The most tokens a graph's step may hold (padding included)."""
    return max(MAX_CAPTURE_SIZE, MAX_MIXED_CAPTURE)


def capture_sizes(max_num_seqs: int) -> list[int]:
    top = min(max_num_seqs, MAX_CAPTURE_SIZE)
    sizes = [1, 2, 4] + list(range(8, top + 1, 8)) + [top]    # (top: every batch up to it has a graph)
    return sorted({min(s, top) for s in sizes})


def mixed_capture_sizes(max_num_batched_tokens: int) -> list[int]:
    """Token counts about sqrt(2) apart (at most a third of a padded step is padding)."""
    top = min(max_num_batched_tokens, MAX_MIXED_CAPTURE)
    ladder = [s for e in range(6, max(top, 64).bit_length()) for s in (1 << e, 3 << (e - 1))]
    return sorted({s for s in ladder if s < top} | {top})


class CUDAGraphRunner:
    def __init__(self, model, backend, max_num_seqs: int, max_num_batched_tokens: int, max_blocks: int,
                 max_model_len: int, device: torch.device, num_speculative_tokens: int = 0, num_kv_groups: int = 1):
        self.model, self.backend = model, backend
        self.sizes = capture_sizes(max_num_seqs)
        self.mixed_sizes = mixed_capture_sizes(max_num_batched_tokens)
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        n = max(self.sizes[-1], self.mixed_sizes[-1])
        # Verification steps: up to spec_len tokens a request, as many requests as fit the buffers.
        self.spec_len = num_speculative_tokens + 1
        self.spec_sizes = [] if not num_speculative_tokens else [
            1 << e for e in range(min(max_num_seqs, MAX_MIXED_REQS, n // self.spec_len).bit_length())]
        r = max(self.sizes[-1], self._max_reqs(self.mixed_sizes[-1]))
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        # (slots and block tables: a row a KV cache group)
        self.slot_mapping = torch.full((num_kv_groups, n), -1, dtype=torch.long, device=device)
        self.decode_query_start_loc = torch.arange(r + 1, dtype=torch.int32, device=device)
        self.query_start_loc = torch.zeros(r + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(r, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(num_kv_groups, r, max_blocks, dtype=torch.int32, device=device)
        self.graphs: dict[tuple[str, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[str, int], torch.Tensor] = {}

    def _max_reqs(self, num_tokens: int) -> int:
        return min(self.max_num_seqs, num_tokens, MAX_MIXED_REQS)

    def _num_tokens(self, key: tuple[str, int]) -> int:
        return key[1] * self.spec_len if key[0] == "spec" else key[1]

    def _req_slots(self, key: tuple[str, int]) -> int:
        return self._max_reqs(key[1]) if key[0] == "mixed" else key[1]

    def _metadata(self, key: tuple[str, int]) -> list[AttentionMetadata]:
        """The buffers as a batch of size ``key``, for each KV cache group."""
        return [self._group_metadata(key, slots, tables) for slots, tables in zip(self.slot_mapping, self.block_tables)]

    def _group_metadata(self, key: tuple[str, int], slot_mapping: torch.Tensor,
                        block_tables: torch.Tensor) -> AttentionMetadata:
        # max_seq_len is fixed at capture: the kernels read each request's true length from
        # seq_lens, and the bound only sizes the split-KV grid.
        kind, n, r = key[0], self._num_tokens(key), self._req_slots(key)
        if kind == "decode":
            return AttentionMetadata(
                num_actual_tokens=n, num_decodes=n, slot_mapping=slot_mapping[:n],
                query_start_loc=self.decode_query_start_loc[:n + 1], seq_lens=self.seq_lens[:n],
                block_tables=block_tables[:n], max_query_len=1, max_seq_len=self.max_model_len,
                max_decode_seq_len=self.max_model_len)
        # (a verification step: no decodes apart, one launch of spec_len-query tiles)
        spec = kind == "spec"
        return AttentionMetadata(
            num_actual_tokens=n, num_decodes=0 if spec else None, slot_mapping=slot_mapping[:n],
            query_start_loc=self.query_start_loc[:r + 1], seq_lens=self.seq_lens[:r],
            block_tables=block_tables[:r], max_query_len=self.spec_len if spec else n,
            max_seq_len=self.max_model_len, max_decode_seq_len=self.max_model_len)

    def forward(self, key: tuple[str, int]) -> torch.Tensor:
        """The model over the buffers as a batch of size ``key``: what a graph captures (and,
        eagerly, what the tests compare against the unpadded batch)."""
        n = self._num_tokens(key)
        with set_forward_context(self._metadata(key), self.backend):
            return self.model(self.input_ids[:n], self.positions[:n])

    @torch.inference_mode()
    def capture(self) -> None:
        pool = None
        # Largest first: smaller ones reuse its memory. The buffers hold an empty batch (no
        # request has a query, every slot is -1), so the warm-up runs write nothing.
        keys = ([("mixed", n) for n in self.mixed_sizes] + [("decode", n) for n in self.sizes]
                + [("spec", r) for r in self.spec_sizes])
        for key in sorted(keys, key=lambda k: -self._num_tokens(k)):
            self.forward(key)                    # warm-up: compiles the kernels outside the graph
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[key] = self.forward(key)
            pool = graph.pool()
            self.graphs[key] = graph
        torch.cuda.synchronize()

    def release(self) -> None:
        """Destroy the graphs (before their NCCL communicators are torn down)."""
        self.graphs.clear()
        self.outputs.clear()

    def graph_key(self, num_reqs: int, num_tokens: int, max_query_len: int) -> tuple[str, int] | None:
        """The captured size a batch pads to, or None (run it eagerly)."""
        if num_reqs == num_tokens and num_reqs <= self.sizes[-1]:
            return "decode", self.sizes[bisect.bisect_left(self.sizes, num_reqs)]
        if self.spec_sizes and max_query_len <= self.spec_len and num_reqs <= self.spec_sizes[-1]:
            return "spec", self.spec_sizes[bisect.bisect_left(self.spec_sizes, num_reqs)]
        if num_tokens <= self.mixed_sizes[-1]:
            n = self.mixed_sizes[bisect.bisect_left(self.mixed_sizes, num_tokens)]
            if num_reqs <= self._max_reqs(n):
                return "mixed", n
        return None

    def load(self, key: tuple[str, int], inputs: dict[str, torch.Tensor],
             pending: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Copy a batch into the buffers, padded to ``key``. inputs: the flat batch (on the
        device); pending: (positions, token ids on the device) replacing input ids that the host
        does not know yet."""
        kind, n = key[0], self._num_tokens(key)
        b, r = len(inputs["input_ids"]), len(inputs["seq_lens"])
        for name in ("input_ids", "positions", "seq_lens"):
            getattr(self, name)[:len(inputs[name])].copy_(inputs[name], non_blocking=True)
        self.slot_mapping[:, :b].copy_(inputs["slot_mapping"], non_blocking=True)
        block_tables = inputs["block_tables"]
        self.block_tables[:, :r, :block_tables.shape[2]].copy_(block_tables, non_blocking=True)
        if pending is not None:
            self.input_ids[pending[0]] = pending[1]
        if n > b:       # (an empty fill still costs a few microseconds of host time)
            self.slot_mapping[:, b:n].fill_(-1)
        if kind == "decode":
            if n > r:
                self.seq_lens[r:n].fill_(1)
            return
        self.query_start_loc[:r + 1].copy_(inputs["query_start_loc"], non_blocking=True)
        slots = self._req_slots(key)
        if slots > r:
            self.query_start_loc[r + 1:slots + 1].fill_(b)    # empty requests

    def run(self, key: tuple[str, int], inputs: dict[str, torch.Tensor],
            pending: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        self.load(key, inputs, pending)
        self.graphs[key].replay()
        return self.outputs[key][:len(inputs["input_ids"])]
