"""CUDA graphs for decode steps. A decode step of a small model is hundreds of tiny kernels
whose launch cost dwarfs their run time; replaying a captured graph launches them all at once.

Graphs are captured for a ladder of batch sizes over persistent input buffers. A pure-decode
batch of B requests is padded to the next captured size: padding rows write no KV (slot -1),
read one slot of the null block, and their outputs are dropped."""
import torch

from pagoda.model.layers.attention import AttentionMetadata, set_forward_context


# Larger decode batches run eagerly: their launches are a small part of their GPU time, and
# each graph costs capture time and memory (vLLM's default limit too).
MAX_CAPTURE_SIZE = 512


def capture_sizes(max_num_seqs: int) -> list[int]:
    top = min(max_num_seqs, MAX_CAPTURE_SIZE)
    sizes = [1, 2, 4] + list(range(8, top + 1, 8)) + [top]    # (top: every batch up to it has a graph)
    return sorted({min(s, top) for s in sizes})


class CUDAGraphRunner:
    def __init__(self, model, backend, max_num_seqs: int, max_blocks: int, max_model_len: int,
                 device: torch.device):
        self.model, self.backend = model, backend
        self.sizes = capture_sizes(max_num_seqs)
        self.max_model_len = max_model_len
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def _metadata(self, bs: int) -> AttentionMetadata:
        # max_seq_len is fixed at capture: the kernels read each request's true length from
        # seq_lens, and the bound only sizes the split-KV grid.
        return AttentionMetadata(
            num_actual_tokens=bs, num_decodes=bs, slot_mapping=self.slot_mapping[:bs],
            query_start_loc=self.query_start_loc[:bs + 1], seq_lens=self.seq_lens[:bs],
            block_tables=self.block_tables[:bs], max_query_len=1, max_seq_len=self.max_model_len,
            max_decode_seq_len=self.max_model_len)

    def _forward(self, bs: int) -> torch.Tensor:
        with set_forward_context(self._metadata(bs), self.backend):
            return self.model(self.input_ids[:bs], self.positions[:bs])

    @torch.inference_mode()
    def capture(self) -> None:
        pool = None
        for bs in reversed(self.sizes):          # largest first: smaller ones reuse its memory
            self._forward(bs)                    # warm-up: compiles the kernels outside the graph
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bs] = self._forward(bs)
            pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()

    def can_run(self, num_reqs: int, num_tokens: int) -> bool:
        return bool(self.graphs) and num_reqs == num_tokens and num_reqs <= self.sizes[-1]

    def run(self, inputs: dict[str, torch.Tensor], pending: tuple[torch.Tensor, torch.Tensor] | None = None
            ) -> torch.Tensor:
        """inputs: the flat batch as host tensors (pinned); pending: (positions, token ids on the
        device) replacing input ids that the host does not know yet."""
        b = len(inputs["input_ids"])
        bs = next(s for s in self.sizes if s >= b)
        for name in ("input_ids", "positions", "slot_mapping", "seq_lens"):
            getattr(self, name)[:b].copy_(inputs[name], non_blocking=True)
        block_tables = inputs["block_tables"]
        self.block_tables[:b, :block_tables.shape[1]].copy_(block_tables, non_blocking=True)
        if pending is not None:
            self.input_ids[pending[0]] = pending[1]
        if bs > b:
            self.slot_mapping[b:bs].fill_(-1)
            self.seq_lens[b:bs].fill_(1)
        self.graphs[bs].replay()
        return self.outputs[bs][:b]
