"""How fast can a kernel only read device memory, and does the paged KV cache's access pattern
cost bandwidth? The decode attention reads the KV cache and writes almost nothing, so its
ceiling is the read rate, not the copy rate (bytes read + written).

1. A Triton streaming sum over 4 GB in a persistent grid, swept over programs per SM, elements
   per load, warps and loads in flight, against torch's sum and copy.
2. The same sum over a paged cache as the attention reads it: programs of 4 warps, 4 an SM,
   each one (request, KV head) reading 64-token tiles through a block table, one or two tiles
   in flight. The blocks of each request are either consecutive or scattered at random, and
   each block holds its tokens' heads side by side (pagoda's layout: a head's row is 256 bytes
   every 2 KB) or each head's tokens together (4 KB runs). No arithmetic beyond a sum, so the
   gap to (1) is what the pattern costs.

  python3 benchmarks/read_ceiling.py
"""
import torch
import triton
import triton.language as tl
import triton.testing


@triton.jit
def _sum_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, UNROLL: tl.constexpr):
    pid, grid = tl.program_id(0), tl.num_programs(0)
    acc = tl.zeros([BLOCK], tl.float32)
    step = grid * BLOCK * UNROLL
    for start in range(pid * BLOCK * UNROLL, n, step):
        for u in tl.static_range(UNROLL):
            offs = start + u * BLOCK + tl.arange(0, BLOCK)
            acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc, 0))


@triton.jit
def _paged_sum_kernel(cache_ptr, table_ptr, out_ptr, tiles, stride_block, stride_token, stride_head,
                      NUM_KV_HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
                      HEAD_DIM: tl.constexpr, IN_FLIGHT: tl.constexpr):
    pid = tl.program_id(0)
    seq, head = pid // NUM_KV_HEADS, pid % NUM_KV_HEADS
    offs_n = tl.arange(0, TILE_N)
    offs_d = tl.arange(0, HEAD_DIM)
    table = table_ptr + seq.to(tl.int64) * tiles * (TILE_N // BLOCK_SIZE)
    acc = tl.zeros([TILE_N, HEAD_DIM], tl.float32)
    for t in tl.range(0, tiles, IN_FLIGHT):
        for u in tl.static_range(IN_FLIGHT):
            block = tl.load(table + (t + u) * (TILE_N // BLOCK_SIZE) + offs_n // BLOCK_SIZE).to(tl.int64)
            off = block * stride_block + (offs_n % BLOCK_SIZE) * stride_token + head * stride_head
            acc += tl.load(cache_ptr + off[:, None] + offs_d[None, :]).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(tl.sum(acc, 1), 0))


def streaming(x, sms, rate):
    out = torch.empty(64 * sms, device="cuda", dtype=torch.float32)
    results = []
    for per_sm in (1, 2, 4, 8, 16):
        for block in (1024, 2048, 4096):
            for warps in (4, 8):
                for unroll in (1, 2, 4):
                    grid = (per_sm * sms,)
                    fn = lambda: _sum_kernel[grid](x, out, x.numel(), BLOCK=block, UNROLL=unroll, num_warps=warps)
                    try:
                        fn()
                        torch.testing.assert_close(out[:grid[0]].sum(), x.sum(dtype=torch.float32), rtol=1e-3, atol=1.0)
                        results.append((rate(triton.testing.do_bench(fn)), per_sm, block, warps, unroll))
                    except Exception as e:   # out of registers, or a wrong sum
                        print(f"{per_sm}/SM block {block} warps {warps} unroll {unroll}: {type(e).__name__}")
    print("streaming sum, GB/s (best over elements a load) by programs/SM x warps x loads in flight:")
    for per_sm in (1, 2, 4, 8, 16):
        cells = []
        for warps in (4, 8):
            for unroll in (1, 2, 4):
                best = max((r[0] for r in results if r[1:2] == (per_sm,) and r[3:] == (warps, unroll)), default=0)
                cells.append(f"{best:5.0f}")
        print(f"  {per_sm:2d}/SM  4 warps x1 x2 x4: {' '.join(cells[:3])}   8 warps x1 x2 x4: {' '.join(cells[3:])}")
    results.sort(reverse=True)
    print("streaming read ceiling: %.0f GB/s (%d programs/SM, %d elements a load, %d warps, %d loads in flight)"
          % results[0])


def paged(sms, rate):
    num_kv_heads, block_size, head_dim, tile_n = 8, 16, 128, 64
    num_blocks = (4 << 30) // (block_size * num_kv_heads * head_dim * 2)   # 4 GiB of K
    cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    seqs = 4 * sms // num_kv_heads                       # one wave of 4 programs an SM
    blocks_per_seq = num_blocks // seqs // 4 * 4        # whole tiles of 4 blocks
    tiles = blocks_per_seq // (tile_n // block_size)
    gen = torch.Generator(device="cuda").manual_seed(0)
    tables = {"consecutive": torch.arange(seqs * blocks_per_seq, device="cuda", dtype=torch.int32),
              "scattered": torch.randperm(num_blocks, device="cuda", generator=gen)[:seqs * blocks_per_seq].int()}
    out = torch.empty(seqs * num_kv_heads, device="cuda", dtype=torch.float32)
    nbytes = seqs * blocks_per_seq * block_size * num_kv_heads * head_dim * 2
    print(f"paged sum: {seqs} requests x {num_kv_heads} KV heads, {tiles} tiles of {tile_n} tokens each, "
          f"{nbytes / 2**30:.1f} GiB, 4 warps, GB/s:")
    for layout in ("heads inside each token (pagoda)", "each head's tokens together"):
        if layout.startswith("each"):   # the same bytes, (block, head, token, dim)
            view = cache.view(num_blocks, num_kv_heads, block_size, head_dim)
            strides = (view.stride(0), view.stride(2), view.stride(1))
        else:
            strides = (cache.stride(0), cache.stride(1), cache.stride(2))
        for order, table in tables.items():
            cells = []
            for in_flight in (1, 2):
                fn = lambda: _paged_sum_kernel[(seqs * num_kv_heads,)](
                    cache, table, out, tiles, *strides, NUM_KV_HEADS=num_kv_heads, BLOCK_SIZE=block_size,
                    TILE_N=tile_n, HEAD_DIM=head_dim, IN_FLIGHT=in_flight, num_warps=4)
                cells.append(f"{in_flight} tile{'s' if in_flight > 1 else ''} in flight {rate(triton.testing.do_bench(fn), nbytes):5.0f}")
            print(f"  {layout:34s} {order:11s}: {'  '.join(cells)}")


def main():
    x = torch.randn(2 << 30, device="cuda", dtype=torch.bfloat16)   # 4 GiB
    nbytes = x.numel() * 2
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    y = torch.empty_like(x)
    rate = lambda ms, b=nbytes: b / ms / 1e6   # GB/s
    print(f"torch sum: {rate(triton.testing.do_bench(lambda: x.sum(dtype=torch.float32))):.0f} GB/s")
    print(f"torch copy (read + write): {rate(triton.testing.do_bench(lambda: y.copy_(x)), 2 * nbytes):.0f} GB/s")
    del y
    streaming(x, sms, rate)
    del x
    torch.cuda.empty_cache()
    paged(sms, rate)


if __name__ == "__main__":
    main()
