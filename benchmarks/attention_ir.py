"""Does Triton software-pipeline the paged-attention kernel's K/V loop? Compiles the kernel for
sm_90 to TTGIR (no GPU needed: runs on the CPU) and counts the asynchronous copies the
pipeliner emits. Zero means every tile's block-table, K and V loads are waited for in turn,
so each program runs at the memory latency, not the bandwidth. Also checks that the kernel
built for programmatic dependent launch waits on the previous grid (``griddepcontrol.wait`` in
its PTX).

  python benchmarks/attention_ir.py
"""

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from common import ptxas_usage
from pagoda.kernels import triton_attention as ta

POINTERS = {"q_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "out_ptr": "*bf16",
            "part_acc_ptr": "*fp32", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32",
            "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32",
            "cos_sin_ptr": "*fp32", "norm_ptr": "*bf16"}
SCALARS = ["qk_scale", "v_scale", "num_seqs", "stride_qt", "stride_qh", "stride_ot", "stride_oh",
           "stride_kb", "stride_ks", "stride_kh", "stride_bt", "stride_cs", "eps"]


def compile_kernel(block_m: int, num_segments: int, use_pdl: bool = False, rope: bool = True,
                   kv: str = "bf16"):
    """The kernel for Qwen3-0.6B heads (16 q / 8 kv, head_dim 128, q norm + rotary), bf16 (the
    cache ``kv``: bf16, or fp8e4nv for an FP8 cache), block size 16."""
    tiles = ta.TILES[block_m]
    const = dict(NUM_HEADS=16, GROUP=2, HEAD_DIM=128, HEAD_DIM_P=128, BLOCK_SIZE=16, BLOCK_M=block_m,
                 BLOCK_Q=block_m // 2, TILE_N=tiles["TILE_N"], NUM_SEGMENTS=num_segments, DOT_PRECISION="tf32",
                 LOOP_STAGES=tiles["num_stages"], DECODE=block_m == 16, SKIP_DECODES=False, HAS_ROPE=rope, HAS_NORM=rope,
                 FP8_DOTS_F16=kv != "bf16", USE_PDL=use_pdl, WINDOW=0, SOFTCAP=0.0, NORM_UNIT_OFFSET=False,
                 ROTARY_DIM=128)
    sig = dict(POINTERS, k_cache_ptr=f"*{kv}", v_cache_ptr=f"*{kv}")
    sig.update({name: ("fp32" if name in ("qk_scale", "v_scale", "eps") else "i32") for name in SCALARS})
    sig.update({name: "constexpr" for name in const})
    names = ta._paged_attention_kernel.arg_names
    # As the launches specialise them: pointers and strides divisible by 16 (not the values
    # that change every step, num_seqs among them, and not stride_bt: do_not_specialize)
    aligned = [n for n in list(POINTERS) + SCALARS if n not in ("qk_scale", "v_scale", "num_seqs", "eps", "stride_bt")]
    src = ASTSource(fn=ta._paged_attention_kernel, signature=sig,
                    constexprs={(names.index(n),): v for n, v in const.items()},
                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": tiles["num_warps"], "num_stages": tiles["num_stages"],
                                   "launch_pdl": use_pdl, **({"maxnreg": tiles["maxnreg"]} if "maxnreg" in tiles else {})})


def main():
    cases = [(16, 1, "decode", "bf16"), (16, 4, "decode, split KV", "bf16"), (128, 1, "prefill", "bf16"),
             (16, 1, "decode, FP8 cache", "fp8e4nv"), (128, 1, "prefill, FP8 cache", "fp8e4nv")]
    for block_m, segments, label, kv in cases:
        for rope in (False, True):
            kernel = compile_kernel(block_m, segments, rope=rope, kv=kv)
            ir = kernel.asm["ttgir"]
            print(f"{label:20s} BLOCK_M={block_m:<3d} segments={segments} rope={rope!s:5s}: "
                  f"{ir.count('async_copy_global_to_local')} async copies, {ir.count('async_wait')} waits, "
                  f"{ptxas_usage(kernel)}")
    ptx = compile_kernel(16, 1, use_pdl=True).asm["ptx"]
    print(f"with USE_PDL: griddepcontrol.wait {ptx.count('griddepcontrol.wait')}x, "
          f"launch_dependents {ptx.count('griddepcontrol.launch_dependents')}x in the PTX")


if __name__ == "__main__":
    main()
