"""Programmatic dependent launch into cuBLAS GEMMs: which GEMM kernels wait for their
predecessor's writes, and what programmatic edges into them would gain.

pagoda's Triton kernels are launched with PDL (``kernels.triton_utils``); torch launches cuBLAS
without it, so each GEMM of a decode layer starts only once the kernel before it has completed.
The edges of a captured graph can be made programmatic after capture (CUDA 12.3's edge data,
what a PDL launch captures as), but that is correct only where the GEMM kernel itself waits
(``griddepcontrol.wait``) before reading its input. This probe measures whether it does (on the
H200 with CUDA 13's cuBLAS, 2026-12-01: none of its GEMM kernels does; BENCHMARKS.md).

1. Safety, per cuBLAS kernel: a graph of [a Triton kernel that lets its dependents launch at
   once, then spins and only then writes x] -> ``F.linear(x, w)``, its edge into the GEMM made
   programmatic. A GEMM kernel that does not wait reads x before it is written (x is zeroed
   before each replay) and gives a wrong product. Every linear shape of Qwen3-0.6B and
   Llama-3-8B at every decode graph size and the mixed graphs' token counts; a plain Triton copy
   kernel (no wait) is the control that must fail.
2. Gain: a graph of LAYERS decoder MLP halves as a decode step runs them ([fused add + RMSNorm]
   -> gate_up GEMM -> SiLU-and-mul -> down GEMM), us a layer, edges as captured vs programmatic
   into the kernels that passed 1.

  python3 benchmarks/pdl_gemm_probe.py [--out DIR]
"""
import argparse
import ctypes
import functools
import json
import os
import re
import sys

import common  # before pagoda: puts the checkout to benchmark (PAGODA_ROOT) on sys.path
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from pagoda.kernels import triton_ops

del common  # (imported for its sys.path entry alone)

MODELS = {"qwen3": dict(hidden=1024, inter=3072, heads=16, kv_heads=8, head_dim=128),
          "llama": dict(hidden=4096, inter=14336, heads=32, kv_heads=8, head_dim=128)}
ROWS = [1, 2, 4] + list(range(8, 257, 8)) + [384, 512, 768, 1024, 1536, 2048]
WRITER = "_late_copy_kernel"

# The CUDA driver's graph API by ctypes: edges, kernel nodes' names, programmatic edges.
_KERNEL_NODE = 0                  # CU_GRAPH_NODE_TYPE_KERNEL
_PROGRAMMATIC = 1                 # CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC
_PORT_PROGRAMMATIC = 1            # CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC


class _EdgeData(ctypes.Structure):      # CUgraphEdgeData
    _fields_ = [("from_port", ctypes.c_ubyte), ("to_port", ctypes.c_ubyte), ("type", ctypes.c_ubyte),
                ("reserved", ctypes.c_ubyte * 5)]


class _KernelNodeParams(ctypes.Structure):     # CUDA_KERNEL_NODE_PARAMS_v2
    _fields_ = [("func", ctypes.c_void_p), ("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared_mem_bytes", ctypes.c_uint), ("kernel_params", ctypes.c_void_p),
                ("extra", ctypes.c_void_p), ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


@functools.cache
def _libcuda():
    return ctypes.CDLL("libcuda.so.1")


def _check(result: int, what: str) -> None:
    if result != 0:
        raise RuntimeError(f"{what} failed with CUresult {result}")


def kernel_name(node: int) -> str | None:
    """The name of a kernel node's function (None for other nodes)."""
    cuda = _libcuda()
    kind = ctypes.c_int()
    _check(cuda.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind)), "cuGraphNodeGetType")
    if kind.value != _KERNEL_NODE:
        return None
    params = _KernelNodeParams()
    _check(cuda.cuGraphKernelNodeGetParams_v2(ctypes.c_void_p(node), ctypes.byref(params)),
           "cuGraphKernelNodeGetParams")
    name = ctypes.c_char_p()
    if params.func:
        _check(cuda.cuFuncGetName(ctypes.byref(name), ctypes.c_void_p(params.func)), "cuFuncGetName")
    else:
        _check(cuda.cuKernelGetName(ctypes.byref(name), ctypes.c_void_p(params.kern)), "cuKernelGetName")
    return name.value.decode()


def edges(graph: int) -> list[tuple[int, int, _EdgeData]]:
    """The graph's edges: (from node, to node, edge data)."""
    cuda = _libcuda()
    n = ctypes.c_size_t()
    _check(cuda.cuGraphGetEdges_v2(ctypes.c_void_p(graph), None, None, None, ctypes.byref(n)), "cuGraphGetEdges")
    src, dst = (ctypes.c_void_p * n.value)(), (ctypes.c_void_p * n.value)()
    data = (_EdgeData * n.value)()
    _check(cuda.cuGraphGetEdges_v2(ctypes.c_void_p(graph), src, dst, data, ctypes.byref(n)), "cuGraphGetEdges")
    return [(src[i] or 0, dst[i] or 0, data[i]) for i in range(n.value)]


def make_programmatic(graph: int, into: str) -> list[str]:
    """Turn each default edge from a kernel into a kernel whose name ``into`` matches into a
    programmatic one (as a PDL launch captures), before the graph is instantiated. Returns the
    names of the kernels whose incoming edge changed."""
    cuda = _libcuda()
    names: dict[int, str | None] = {}

    def name(node):
        if node not in names:
            names[node] = kernel_name(node)
        return names[node]

    changed = []
    for src, dst, data in edges(graph):
        if data.type != 0 or name(src) is None or name(dst) is None or not re.search(into, name(dst)):
            continue
        new = _EdgeData(from_port=_PORT_PROGRAMMATIC, to_port=0, type=_PROGRAMMATIC)
        pair = (ctypes.c_void_p * 1)(src), (ctypes.c_void_p * 1)(dst)
        _check(cuda.cuGraphRemoveDependencies_v2(ctypes.c_void_p(graph), *pair, ctypes.byref(data), 1),
               "cuGraphRemoveDependencies")
        _check(cuda.cuGraphAddDependencies_v2(ctypes.c_void_p(graph), *pair, ctypes.byref(new), 1),
               "cuGraphAddDependencies")
        changed.append(name(dst))
    return changed



@triton.jit
def _late_copy_kernel(src, dst, n, spin, BLOCK: tl.constexpr):
    tl.extra.cuda.gdc_launch_dependents()          # the dependents may launch now
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(src + offs, mask=offs < n, other=0.0).to(tl.float32)
    acc = v
    for _ in range(spin):                          # (acc stays v: x.5 + x.5 is exact)
        acc = acc * 0.5 + v * 0.5
    tl.store(dst + offs, acc.to(dst.dtype.element_ty), mask=offs < n)


@triton.jit
def _copy_kernel(src, dst, n, BLOCK: tl.constexpr):   # the control: reads without waiting
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst + offs, tl.load(src + offs, mask=offs < n), mask=offs < n)


def late_copy(src, dst, spin=20000):
    n = src.numel()
    _late_copy_kernel[(triton.cdiv(n, 1024),)](src, dst, n, spin, BLOCK=1024)


def shapes(cfg):
    h, hd = cfg["hidden"], cfg["head_dim"]
    return {"qkv": ((cfg["heads"] + 2 * cfg["kv_heads"]) * hd, h), "o": (h, cfg["heads"] * hd),
            "gate_up": (2 * cfg["inter"], h), "down": (h, cfg["inter"])}


def first_kernel_after_writer(graph) -> str:
    for src, dst, _ in edges(graph.raw_cuda_graph()):
        if kernel_name(src) == WRITER:
            return kernel_name(dst)
    raise RuntimeError("the writer has no kernel after it")


def safety_case(m, n, k, control=False, replays=5):
    """(kernel name, ok) for F.linear of m rows after the late writer, the edge made programmatic."""
    dev = "cuda"
    x_src = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * k ** -0.5
    ref = F.linear(x_src, w)
    x = torch.zeros_like(x_src)
    y2 = torch.empty_like(x_src)

    def body():
        late_copy(x_src, x)
        if control:
            _copy_kernel[(triton.cdiv(x.numel(), 1024),)](x, y2, x.numel(), BLOCK=1024)
            return y2
        return F.linear(x, w)

    body()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph):
        out = body()
    name = first_kernel_after_writer(graph)
    changed = make_programmatic(graph.raw_cuda_graph(), "^" + re.escape(name) + "$")
    assert changed, "no edge changed"
    graph.instantiate()
    expect = x_src if control else ref
    ok = True
    for _ in range(replays):
        x.zero_()
        torch.cuda.synchronize()
        graph.replay()
        torch.cuda.synchronize()
        err = (out.float() - expect.float()).abs().max().item()
        ok &= err <= 1e-2 * expect.float().abs().max().item()
    return name, ok


def mlp_layer_us(cfg, m, programmatic: str | None, layers=16):
    dev, dt = "cuda", torch.bfloat16
    h, inter = cfg["hidden"], cfg["inter"]
    ws = [(torch.randn(2 * inter, h, device=dev, dtype=dt) * h ** -0.5,
           torch.randn(h, inter, device=dev, dtype=dt) * inter ** -0.5) for _ in range(layers)]
    norm_w = torch.ones(h, device=dev, dtype=dt)
    x = torch.randn(m, h, device=dev, dtype=dt)
    res = torch.randn(m, h, device=dev, dtype=dt)

    def body():
        hid, r = x, res
        for w1, w2 in ws:
            hid, r = triton_ops.fused_add_rms_norm(hid, r, norm_w, 1e-6)
            hid = F.linear(triton_ops.silu_and_mul(F.linear(hid, w1)), w2)
        return hid

    body()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph):
        body()
    changed = make_programmatic(graph.raw_cuda_graph(), programmatic) if programmatic else []
    graph.instantiate()
    ms = triton.testing.do_bench(graph.replay, warmup=20, rep=100, return_mode="median")
    return ms * 1e3 / layers, len(changed)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="results/pdl_gemm")
    ap.add_argument("--rows", type=int, nargs="*", default=ROWS)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    results = {"control": [], "kernels": {}}
    for m in (8, 256):
        name, ok = safety_case(m, 1024, 1024, control=True)
        results["control"].append(ok)
        print(f"control (copy without a wait), {m} rows: {'right' if ok else 'WRONG'} (must be WRONG)", flush=True)
    for model, cfg in MODELS.items():
        for mat, (n, k) in shapes(cfg).items():
            for m in args.rows:
                try:
                    name, ok = safety_case(m, n, k)
                except Exception as e:   # noqa: BLE001  (reported, the sweep goes on)
                    print(f"{model} {mat} {m}: {type(e).__name__}: {e}", flush=True)
                    continue
                entry = results["kernels"].setdefault(name, {"ok": 0, "wrong": 0, "cases": []})
                entry["ok" if ok else "wrong"] += 1
                entry["cases"].append(f"{model} {mat} {m}")
                if not ok:
                    print(f"WRONG: {model} {mat} {m} rows: {name}", flush=True)
    print("\nkernel | cases right | wrong | e.g.")
    for name, e in sorted(results["kernels"].items()):
        print(f"{name[:90]} | {e['ok']} | {e['wrong']} | {e['cases'][0]}")
    waits = [name for name, e in results["kernels"].items() if e["wrong"] == 0]
    pattern = "^(" + "|".join(re.escape(n) for n in waits) + ")$" if waits else None
    results["pattern"] = pattern
    print("\nMLP halves in one graph, us a layer: edges as captured / programmatic into the GEMMs that waited")
    results["mlp"] = []
    for model, cfg in MODELS.items():
        for m in (1, 8, 64, 128, 256):
            base, _ = mlp_layer_us(cfg, m, None)
            new, n = mlp_layer_us(cfg, m, pattern) if pattern else (float("nan"), 0)
            results["mlp"].append(dict(model=model, rows=m, base_us=base, pdl_us=new, edges=n))
            print(f"{model} {m:4d} rows: {base:7.2f} / {new:7.2f} us ({n} edges changed)", flush=True)
    with open(os.path.join(args.out, "pdl_gemm.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
