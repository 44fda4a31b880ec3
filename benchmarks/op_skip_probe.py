"""What fusing the decoder layer's small kernels into its GEMMs could gain at most: runs
``throughput.py`` (same arguments) with some elementwise kernels replaced by views of their
inputs. The outputs are wrong but the shapes, the GEMMs and the attention are the same, so the
difference in tok/s bounds what a GEMM with the norm in its prologue and SiLU-and-mul in its
epilogue could save.

    python3 benchmarks/op_skip_probe.py norm,silu --model-config benchmarks/models/qwen3-0.6b.json

``none`` skips nothing (the plain engine); ``norm``: the residual add + RMSNorm between the layers' GEMMs (the first layer's norm and the
final one stay); ``silu``: SiLU-and-mul (the down projection then reads the gate half, a strided
view: no copy).
"""
import os
import runpy
import sys

import common  # before pagoda: puts the checkout to benchmark (PAGODA_ROOT) on sys.path
from pagoda.kernels import triton_ops

del common  # (imported for its sys.path entry alone)


def main():
    skip = set(sys.argv[1].split(",")) - {"", "none"}
    assert skip <= {"norm", "silu"}, skip
    if "norm" in skip:
        triton_ops.fused_add_rms_norm = lambda x, residual, weight, eps, out=None, residual_out=None: (x, residual)
    if "silu" in skip:
        triton_ops.silu_and_mul = lambda x, out=None: x[..., : x.shape[-1] // 2]
    print(f"op_skip_probe: skipping {sorted(skip) or 'nothing'}", flush=True)
    sys.argv = [os.path.join(os.path.dirname(__file__), "throughput.py")] + sys.argv[2:]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
