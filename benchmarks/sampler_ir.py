"""Registers and spills of the sampling kernel (kernels/triton_sampling.py) for sm_90, on the CPU:
compiles each variant to PTX and runs Triton's ptxas -v on it. At 8 warps a program, more than
128 registers leave one program per SM instead of two (256 rows would take two waves).
Variants: without filters (Gumbel-max or greedy) and filtered, bf16 / fp16 / float32 logits, a vocabulary and row
stride divisible by 16 (Qwen3, Llama 3) or not.

  python benchmarks/sampler_ir.py
"""

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from common import ptxas_usage
from pagoda.kernels import triton_sampling as ts

POINTERS = {"temperature_ptr": "*fp32", "seeds_ptr": "*i64", "top_k_ptr": "*i64", "top_p_ptr": "*fp32",
            "min_p_ptr": "*fp32", "list_vals_ptr": "*fp32", "list_ids_ptr": "*i32", "out_ptr": "*i64",
            "thresholds_ptr": "*fp32", "part_score_ptr": "*fp32", "part_idx_ptr": "*i32"}


def compile_kernel(kernel, dtype: str, aligned: bool):
    shift = {"bf16": 16, "fp16": 13, "fp32": 0}[dtype]
    names = kernel.arg_names
    const = {k: v for k, v in dict(BLOCK_V=ts.BLOCK_V, LIST_CAP=ts.LIST_CAP, SEARCH_BLOCK=ts.SEARCH_BLOCK,
                                   COPY_BLOCK=ts.COPY_BLOCK, SHIFT=shift, THRESHOLDS=False,
                                   USE_PDL=True).items() if k in names}
    sig = {n: f"*{dtype}" if n == "logits_ptr" else POINTERS.get(n, "i32") for n in names if n not in const}
    # (what a launch specializes: 16-byte aligned pointers; integers divisible by 16)
    divisible = [n for n in sig if n.endswith("_ptr") or aligned]
    sig.update({n: "constexpr" for n in const})
    src = ASTSource(fn=kernel, signature=sig, constexprs={(names.index(n),): v for n, v in const.items()},
                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in divisible})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8, "launch_pdl": True})


def main():
    print(f"SEARCH_BLOCK {ts.SEARCH_BLOCK}, COPY_BLOCK {ts.COPY_BLOCK}, BLOCK_V {ts.BLOCK_V}")
    for name, kernel in (("without filters", ts._gumbel_max_kernel), ("filtered", ts._sample_kernel)):
        for dtype in ("bf16", "fp16", "fp32"):
            for aligned in (True, False):
                usage = ptxas_usage(compile_kernel(kernel, dtype, aligned))
                print(f"{name:16s} {dtype} {'vocab % 16 == 0' if aligned else 'odd vocab':15s} {usage}")


if __name__ == "__main__":
    main()
