"""Helpers shared by the Triton kernel modules."""
import functools

import numpy as np
import torch
import triton
import triton.language as tl


def fix_interpreter_bugs() -> None:
    """CPU interpreter only (TRITON_INTERPRET=1): mend two bugs of triton 3.6's interpreter, for
    the duration of the process.

    - It turns a run-time scalar into a python int with ``int(array_of_one_element)``, which
      numpy >= 2.4 rejects, so a loop like ``range(tile_lo, tile_hi)`` over loaded values fails.
      Use ``.item()`` instead, for each interpreted launch (the interpreter restores its patches
      afterwards).
    - Its float -> FP8 conversion drops the carry when rounding up reaches the next power of
      two (E4M3: 7.84 -> 4.0, not 8.0). Conversions to or from FP8 go through torch, which rounds
      to nearest even as the GPU does."""
    if not triton.knobs.runtime.interpret:
        return
    try:
        from triton.runtime import interpreter
        original_patch, original_convert = interpreter._patch_lang_tensor, interpreter._convert_float
    except (ImportError, AttributeError):
        return
    if getattr(original_patch, "_pagoda_fixed", False):
        return

    def patched(tensor, scope):
        original_patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    torch_types = {tl.float8e4nv: torch.float8_e4m3fn, tl.float8e5: torch.float8_e5m2, tl.float16: torch.float16,
                   tl.bfloat16: torch.bfloat16, tl.float32: torch.float32}
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}

    def convert(data, src_type, dst_type, rounding_mode):
        src, dst = torch_types.get(src_type), torch_types.get(dst_type)
        if src is None or dst is None or not {src, dst} & {torch.float8_e4m3fn, torch.float8_e5m2}:
            return original_convert(data, src_type, dst_type, rounding_mode)
        x = torch.from_numpy(np.array(data)).view(src)
        return x.to(dst).view(bits[dst.itemsize]).numpy()

    patched._pagoda_fixed = True
    interpreter._patch_lang_tensor = patched
    interpreter._convert_float = convert


@functools.cache
def num_sms(device: torch.device) -> int:
    """The device's SMs, which the kernels' grids are sized to fill."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # interpreter on CPU: plan as for an H200, so the multi-program paths are exercised


# Programmatic dependent launch (Hopper and later). A decode step's CUDA graph is hundreds of
# kernels of a few microseconds each, and each launch waits for the previous kernel to drain.
# With PDL a kernel is launched while the previous one is still running: its programs start,
# then wait (pdl_wait) until the previous kernel's writes are visible, so the launch and start-up
# overlap the previous kernel's tail. A kernel that calls pdl_wait before its first memory
# access is correct whichever kernel precedes it (Triton, cuBLAS, torch); before it, a kernel
# may only read what no kernel still running can write: weights, the step's inputs, and what
# kernels before the previous one wrote (the previous kernel's programs let this one launch only
# after their own wait). That last holds only if at least one program of each launch reaches
# pdl_wait: a launch whose programs all exited before waiting could complete before its
# predecessor. 1 on, 0 off.
USE_PDL = 1


@functools.cache
def _pdl_supported(device_index: int) -> bool:
    return not triton.knobs.runtime.interpret and torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_launch(device: torch.device) -> dict:
    """The launch arguments of a kernel that starts with ``pdl_wait(USE_PDL)``."""
    if USE_PDL and device.type == "cuda" and _pdl_supported(
            torch.cuda.current_device() if device.index is None else device.index):
        return {"USE_PDL": True, "launch_pdl": True}
    return {"USE_PDL": False}


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """First statement of a kernel launched with ``pdl_launch``: wait for the previous kernel's
    writes, then let the next kernel launch (it waits in turn)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
