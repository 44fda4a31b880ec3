"""Can a decode step overlap its memory-bound attention with its compute-bound GEMMs?

A probe for a design choice, on the GPU: decode layers of Llama-3-8B and Qwen3-0.6B shapes
(qkv, paged attention, o, gate_up, SiLU-and-mul, down; their own weights and KV cache per
layer so nothing stays in L2), with W1-like ragged contexts, run three ways, each captured in
one CUDA graph:
  - whole:    the batch as one, on one stream (what the engine does now);
  - halves:   two half batches one after the other, on one stream (the cost of halving alone:
              the weights are read twice);
  - streams:  the two half batches on two streams, so one half's attention can run beside the
              other half's GEMMs (NanoFlow-style nano-batching).
If ``streams`` is well under ``whole``, splitting the decode batch over two streams pays.

  python3 benchmarks/overlap_probe.py
"""

import torch
import torch.nn.functional as F

from common import graph_ms
from pagoda.kernels import triton_attention as ta

MODELS = {  # hidden, q heads, kv heads, head_dim, intermediate
    "llama3-8b": (4096, 32, 8, 128, 14336),
    "qwen3-0.6b": (1024, 16, 8, 128, 3072),
}
LAYERS, BLOCK_SIZE, MAX_CTX = 6, 16, 2048


class Layer:
    def __init__(self, hidden, nh, nkv, hd, inter, batch, ctx_lens, dev, dtype):
        def w(n, k):
            return torch.randn(n, k, device=dev, dtype=dtype) * k ** -0.5
        self.nh, self.hd = nh, hd
        self.qkv, self.o = w((nh + 2 * nkv) * hd, hidden), w(hidden, nh * hd)
        self.gate_up, self.down = w(2 * inter, hidden), w(hidden, inter)
        blocks = [-(-int(c) // BLOCK_SIZE) for c in ctx_lens]
        self.kv_cache = torch.randn(2, sum(blocks), BLOCK_SIZE, nkv, hd, device=dev, dtype=dtype)
        perm = torch.randperm(sum(blocks), device=dev).to(torch.int32)
        self.tables = torch.zeros(batch, MAX_CTX // BLOCK_SIZE, device=dev, dtype=torch.int32)
        start = 0
        for i, n in enumerate(blocks):
            self.tables[i, :n] = perm[start:start + n]
            start += n
        self.seq_lens = torch.tensor(ctx_lens, device=dev, dtype=torch.int32)


def forward(x, layers, rows):
    """The decode layers for the batch rows ``rows`` (a slice), x updated in place."""
    n = rows.stop - rows.start
    qsl = torch.arange(n + 1, device=x.device, dtype=torch.int32)
    for layer in layers:
        h = x[rows]
        q = F.linear(h, layer.qkv)[:, :layer.nh * layer.hd].view(n, layer.nh, layer.hd)
        a = ta.paged_attention_triton(q, layer.kv_cache, layer.tables[rows], layer.seq_lens[rows],
                                      qsl, layer.hd ** -0.5, MAX_CTX, 1)
        h = h + F.linear(a.reshape(n, -1), layer.o)
        gate, up = F.linear(h, layer.gate_up).chunk(2, dim=-1)
        x[rows] = h + F.linear(F.silu(gate) * up, layer.down)


def main():
    dev, dtype = "cuda", torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    print(f"{'model':11s} {'batch':>5s} {'whole ms':>9s} {'halves ms':>9s} {'streams ms':>10s} {'streams/whole':>13s}")
    for model, (hidden, nh, nkv, hd, inter) in MODELS.items():
        for batch in (64, 128, 256):
            ctx = torch.randint(300, MAX_CTX, (batch,), generator=gen).tolist()
            layers = [Layer(hidden, nh, nkv, hd, inter, batch, ctx, dev, dtype) for _ in range(LAYERS)]
            x = torch.randn(batch, hidden, device=dev, dtype=dtype)
            half = batch // 2
            a, b = slice(0, half), slice(half, batch)
            side = torch.cuda.Stream()

            def streams():
                main_stream = torch.cuda.current_stream()
                side.wait_stream(main_stream)
                forward(x, layers, a)
                with torch.cuda.stream(side):
                    forward(x, layers, b)
                main_stream.wait_stream(side)

            whole = graph_ms(lambda: forward(x, layers, slice(0, batch)), rep=60)
            halves = graph_ms(lambda: (forward(x, layers, a), forward(x, layers, b)), rep=60)
            two = graph_ms(streams, rep=60)
            print(f"{model:11s} {batch:5d} {whole:9.3f} {halves:9.3f} {two:10.3f} {two / whole:12.2f}x",
                  flush=True)
            del layers
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
