"""LoRA's second matmul in Triton: ``reference.lora_expand`` (same arguments and result) in one
launch. The torch version is a mask multiply and an addmm: two kernels of a few microseconds
after the first matmul, for each adapted layer of every step, which at small batches cost more
than the work (W2 Llama-3-8B batch 1 on the H200: 4.21 -> 5.85 ms a step with one adapter).
Here each program masks its tokens' rows of ``xa`` to their own slot's columns as it loads
them, multiplies by its tile of B and adds into its tile of ``out``. B and the token slots are
read before the PDL wait: they were written before the previous kernel (the first matmul)."""
import torch
import triton
import triton.language as tl

from pagoda.kernels.triton_utils import fix_interpreter_bugs, pdl_launch, pdl_wait

fix_interpreter_bugs()


@triton.jit(do_not_specialize=["num_tokens"])
def _lora_expand_kernel(xa_ptr, b_ptr, slots_ptr, out_ptr, num_tokens, N, stride_xa, stride_b, stride_out,
                        K: tl.constexpr, WIDTH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_valid, n_valid = offs_m < num_tokens, offs_n < N
    slot = tl.load(slots_ptr + offs_m, mask=m_valid, other=-1)
    b_ptrs = b_ptr + offs_n[None, :].to(tl.int64) * stride_b + offs_k[:, None]
    b = tl.load(b_ptrs, mask=(offs_k[:, None] < K) & n_valid[None, :], other=0.0)    # (BLOCK_K, BLOCK_N)
    pdl_wait(USE_PDL)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    row = offs_m[:, None].to(tl.int64)
    for k0 in tl.static_range(0, K, BLOCK_K):
        k = k0 + offs_k
        if k0 > 0:
            b = tl.load(b_ptrs + k0, mask=(k[:, None] < K) & n_valid[None, :], other=0.0)
        # a token's row only in its own slot's columns (the rest, and tokens of no slot: 0)
        keep = (slot[:, None] == k[None, :] // WIDTH) & (k[None, :] < K)
        xa = tl.load(xa_ptr + row * stride_xa + k[None, :], mask=keep, other=0.0)
        acc += tl.dot(xa, b, input_precision=DOT_PRECISION)
    out_ptrs = out_ptr + row * stride_out + offs_n[None, :]
    tile = m_valid[:, None] & n_valid[None, :]
    out = tl.load(out_ptrs, mask=tile, other=0.0).to(tl.float32) + acc
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=tile)


def lora_expand(xa: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor, width: int,
                out: torch.Tensor) -> torch.Tensor:
    """See ``reference.lora_expand``. ``xa``, ``b`` and ``out`` with unit column strides."""
    num_tokens, k = xa.shape
    n = out.shape[1]
    assert b.shape == (n, k) and xa.stride(1) == b.stride(1) == out.stride(1) == 1
    if num_tokens == 0:
        return out
    block_m = 16 if num_tokens <= 16 else 64
    block_k = min(64, max(16, triton.next_power_of_2(k)))
    grid = (triton.cdiv(num_tokens, block_m), triton.cdiv(n, 128))
    _lora_expand_kernel[grid](xa, b, token_slots, out, num_tokens, n, xa.stride(0), b.stride(0), out.stride(0),
                              K=k, WIDTH=width, BLOCK_M=block_m, BLOCK_N=128, BLOCK_K=block_k,
                              DOT_PRECISION="ieee" if xa.dtype == torch.float32 else "tf32", num_warps=4,
                              **pdl_launch(xa.device))
    return out
