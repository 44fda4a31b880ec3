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
3. K and V through shared memory into the tensor cores, as the attention takes them (two dots
   a tile, with or without the online softmax): by pointers (cp.async, as the attention loads
   them, one or two buffers) or by TMA descriptors (a 16-token box per cache block, several
   stages); in one wave of long programs, in many waves of short ones, and in one decode
   launch's worth (256 requests of 8 KV heads, about 4 waves). The gaps between these say what
   the staging, the softmax and the launch's last wave cost.

  python3 benchmarks/read_ceiling.py
"""
import math

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


@triton.jit
def _paged_dot_kernel(q_ptr, k_ptr, v_ptr, k_desc, v_desc, table_ptr, out_ptr, tiles_ptr, row_tiles,
                      stride_block, stride_token, stride_head, NUM_KV_HEADS: tl.constexpr,
                      BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                      TMA: tl.constexpr, STAGES: tl.constexpr, SOFTMAX: tl.constexpr):
    # Program (request, KV head): tiles_ptr[request] tiles of its block table's row (row_tiles long)
    pid = tl.program_id(0)
    seq, head = pid // NUM_KV_HEADS, pid % NUM_KV_HEADS
    offs_n = tl.arange(0, TILE_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + tl.arange(0, 16)[:, None] * HEAD_DIM + offs_d[None, :])
    acc = tl.zeros([16, HEAD_DIM], tl.float32)
    m_i = tl.full([16], float("-inf"), tl.float32)
    l_i = tl.zeros([16], tl.float32)
    BLOCKS: tl.constexpr = TILE_N // BLOCK_SIZE
    table = table_ptr + seq.to(tl.int64) * row_tiles * BLOCKS
    for t in tl.range(0, tl.load(tiles_ptr + seq), num_stages=STAGES):
        if TMA:   # a box of the block's BLOCK_SIZE tokens of this head, a dot pair each
            for u in tl.static_range(BLOCKS):
                row = tl.load(table + t * BLOCKS + u) * BLOCK_SIZE
                k = k_desc.load([row, head * HEAD_DIM])
                v = v_desc.load([row, head * HEAD_DIM])
                s = tl.dot(q, tl.trans(k))
                acc += tl.dot(s.to(v.dtype), v)
        else:
            block = tl.load(table + t * BLOCKS + offs_n // BLOCK_SIZE).to(tl.int64)
            off = block * stride_block + (offs_n % BLOCK_SIZE) * stride_token + head * stride_head
            k = tl.load(k_ptr + off[:, None] + offs_d[None, :])
            v = tl.load(v_ptr + off[:, None] + offs_d[None, :])
            s = tl.dot(q, tl.trans(k))
            if SOFTMAX:   # the attention's online softmax (its row max and sum cross the warps)
                m_new = tl.maximum(m_i, tl.max(s, 1))
                p = tl.math.exp2(s - m_new[:, None])
                alpha = tl.math.exp2(m_i - m_new)
                l_i = l_i * alpha + tl.sum(p, 1)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
                m_i = m_new
            else:
                acc += tl.dot(s.to(v.dtype), v)
    if SOFTMAX:
        acc = acc / l_i[:, None]
    tl.store(out_ptr + pid, tl.sum(tl.sum(acc, 1), 0))


def paged_dot(sms, rate, device="cuda", gib=4, per_sm=(4, 8), tiles=None, softmax=False, seqs=None,
              ragged=False):
    """(3): K and V of a paged cache (pagoda's layout, blocks scattered) through two dots a
    tile; GB/s of K + V read. Checked against torch on the same blocks. Programs of ``tiles``
    64-token tiles each (several waves; the attention's at W1's batch 256 have about 11), or
    one wave of ``per_sm`` programs an SM reading the whole cache; with ``softmax``, the
    attention's online softmax between the dots. With ``seqs`` (and ``tiles``), that many requests
    of 8 KV heads only, as one decode launch has (4 waves at batch 256), each ``tiles`` long or,
    with ``ragged``, from 1 to 2 * tiles - 1 tiles, longest first."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    num_kv_heads, block_size, head_dim = 8, 16, 128
    num_blocks = int(gib * 2**30) // (2 * block_size * num_kv_heads * head_dim * 2)
    gen = torch.Generator(device=device).manual_seed(0)
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, device=device, dtype=torch.bfloat16,
                        generator=gen) * 0.05
    q = torch.randn(16, head_dim, device=device, dtype=torch.bfloat16, generator=gen) * 0.05
    descs = [TensorDescriptor.from_tensor(c.view(num_blocks * block_size, num_kv_heads * head_dim),
                                          [block_size, head_dim]) for c in cache]
    print(f"paged K/V through two dots a tile{' and a softmax' if softmax else ''} ({gib} GiB, blocks "
          f"scattered, 4 warps), GB/s:")
    for programs in ([None] if tiles else per_sm):
        if tiles:
            blocks_per_seq = 4 * (2 * tiles - 1 if ragged else tiles)
            seqs = seqs or num_blocks // blocks_per_seq
        else:
            seqs = programs * sms // num_kv_heads
            blocks_per_seq = num_blocks // seqs // 4 * 4
        assert seqs * blocks_per_seq <= num_blocks, "more requests than the cache holds"
        perm = torch.randperm(num_blocks, device=device, generator=gen)[:seqs * blocks_per_seq].int()
        out = torch.empty(seqs * num_kv_heads, device=device, dtype=torch.float32)
        lens = torch.full((seqs,), blocks_per_seq // 4, device=device, dtype=torch.int32)   # 64-token tiles
        if ragged:
            lens = torch.randint(1, 2 * tiles, (seqs,), device=device, generator=gen).sort(descending=True).values
            lens = lens.int()
        nbytes = 2 * int(lens.sum()) * 4 * block_size * num_kv_heads * head_dim * 2
        expect = None
        cells = []
        for tma, tile_n, stages in [(False, 64, 3), (False, 64, 5), (False, 32, 5)] + ([] if softmax else [
                (True, 64, 2), (True, 64, 3), (True, 32, 4), (True, 16, 6), (True, 16, 8)]):
            fn = lambda: _paged_dot_kernel[(seqs * num_kv_heads,)](
                q, cache[0], cache[1], descs[0], descs[1], perm, out, lens * (64 // tile_n),
                blocks_per_seq * block_size // tile_n,
                cache.stride(1), cache.stride(2), cache.stride(3), NUM_KV_HEADS=num_kv_heads, BLOCK_SIZE=block_size,
                TILE_N=tile_n, HEAD_DIM=head_dim, TMA=tma, STAGES=stages, SOFTMAX=softmax, num_warps=4)
            name = f"{'TMA' if tma else 'ptr'} {tile_n}x{stages}"
            try:
                fn()
                if expect is None:   # every variant sums the same products
                    k, v = (c[perm.long()].view(seqs, -1, num_kv_heads, head_dim).float() for c in cache)
                    valid = torch.arange(k.shape[1], device=device) < lens[:, None] * 64
                    s = torch.einsum("md,bnhd->bhmn", q.float(), k)
                    if softmax:   # (exp2)
                        s = (s * math.log(2)).masked_fill(~valid[:, None, None], float("-inf")).softmax(-1)
                    else:
                        s = s.to(torch.bfloat16).float() * valid[:, None, None]
                    expect = torch.einsum("bhmn,bnhd->bh", s, v).flatten()
                    del k, v, s
                torch.testing.assert_close(out, expect, rtol=2e-2, atol=2e-2 * expect.abs().max().item())
                cells.append(f"{name} {rate(triton.testing.do_bench(fn) if device == 'cuda' else 1.0, nbytes):5.0f}")
            except Exception as e:   # out of resources, or a wrong sum
                cells.append(f"{name} {type(e).__name__}")
        shape = f"{programs} programs an SM" if programs else f"{seqs * num_kv_heads} programs of {tiles} tiles"
        print(f"  {shape}{' on average' if ragged else ''}: " + "  ".join(cells))


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
    for tiles, softmax, seqs, ragged in [(None, False, None, False), (None, True, None, False),
                                         (11, False, None, False), (11, True, None, False),
                                         (11, True, 256, False), (11, True, 256, True)]:
        paged_dot(sms, rate, tiles=tiles, softmax=softmax, seqs=seqs, ragged=ragged)


if __name__ == "__main__":
    main()
