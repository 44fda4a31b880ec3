"""vLLM's LLM.start_profile / stop_profile: the torch profiler on every rank (CPU activity, and
the GPU's kernels on CUDA), its traces written when it stops, one file a rank
(``*.pt.trace.json.gz``, for chrome://tracing or Perfetto) into $PAGODA_TORCH_PROFILER_DIR, or
vLLM's $VLLM_TORCH_PROFILER_DIR."""
import os

import torch

PROFILER_DIR_VARS = ("PAGODA_TORCH_PROFILER_DIR", "VLLM_TORCH_PROFILER_DIR")


def profiler_dir() -> str:
    for name in PROFILER_DIR_VARS:
        if os.environ.get(name):
            return os.environ[name]
    raise RuntimeError(f"Profiling is off: set {PROFILER_DIR_VARS[0]} (or {PROFILER_DIR_VARS[1]}) to the folder "
                       "the traces go to.")


def start(worker, directory: str) -> None:
    """collective_rpc's function: the profiler on this rank's worker, until ``stop``."""
    if getattr(worker, "profiler", None) is not None:
        raise RuntimeError("The profiler is running already: stop_profile first.")
    os.makedirs(directory, exist_ok=True)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available() and worker.runner.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    worker.profiler = torch.profiler.profile(
        activities=activities, on_trace_ready=torch.profiler.tensorboard_trace_handler(directory, use_gzip=True))
    worker.profiler.start()


def stop(worker) -> None:
    """collective_rpc's function: stop this rank's profiler, which writes its trace."""
    if getattr(worker, "profiler", None) is None:
        raise RuntimeError("The profiler is not running: start_profile first.")
    profiler, worker.profiler = worker.profiler, None
    profiler.stop()
