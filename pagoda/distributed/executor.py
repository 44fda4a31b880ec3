"""Executors run the model runner on every rank: in this process alone (tensor_parallel_size
1), or over worker processes on this node (multiproc_executor.py) or Ray actors on a cluster's
nodes (ray_executor.py). All answer the same calls; ``collective_rpc`` runs a function (or a
worker method) on every rank, each rank's worker (its ``runner``, its ``rank``) its first argument."""
import importlib
from dataclasses import replace

from pagoda.config import EngineConfig
from pagoda.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagoda.distributed.child_procs import run_call
from pagoda.runner.model_runner import ModelRunner


class RankWorker:
    """What collective_rpc's functions get of a rank: its ``runner`` (also ``model_runner``, vLLM's
    name) and ``rank``; with ``worker_extension_cls`` (vLLM's), that class's methods too, which
    collective_rpc calls by name."""
    runner: ModelRunner

    @property
    def model_runner(self) -> ModelRunner:
        return self.runner

    def extend(self, worker_extension_cls: str | None) -> None:
        if worker_extension_cls:
            module, _, name = worker_extension_cls.rpartition(".")
            try:
                extension = getattr(importlib.import_module(module), name)
            except (ImportError, AttributeError, ValueError) as e:
                raise ValueError(f"worker_extension_cls={worker_extension_cls!r} is not an importable class "
                                 f"(module.Class): {e}") from None
            self.__class__ = type(type(self).__name__, (type(self), extension), {})


class UniProcExecutor(RankWorker):
    rank = 0     # (the one rank's worker, as collective_rpc's functions see it)

    def __init__(self, config: EngineConfig):
        self.runner = ModelRunner(config)
        self.extend(config.worker_extension_cls)

    def collective_rpc(self, method, args: tuple = ()) -> list:
        return [run_call(self, method, args)]

    def determine_num_blocks(self) -> int:
        return self.runner.determine_num_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.runner.initialize_kv_cache(num_blocks)

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(sched)


class ParallelExecutor:
    """The calls that every rank answers, over a subclass's ``collective_rpc``."""

    def collective_rpc(self, method, args: tuple = ()) -> list:
        raise NotImplementedError

    def determine_num_blocks(self) -> int:
        return min(self.collective_rpc("determine_num_blocks"))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.collective_rpc("initialize_kv_cache", (num_blocks,))


def split_masks(sched: SchedulerOutput, world_size: int, tp_size: int) -> tuple[SchedulerOutput, int | None]:
    """(what the ranks that do not sample get, the worker rank that samples when it is not 0):
    structured outputs' masks (a vocabulary's bits a request) go to the rank that samples alone,
    not pickled to every rank each step."""
    if not sched.grammar_bitmasks:
        return sched, None
    driver = world_size - tp_size          # (the last stage's first rank: 0 without stages)
    return replace(sched, grammar_bitmasks={}), driver or None


def get_executor(config: EngineConfig):
    """The executor for ``config.parallel`` (checked by ParallelConfig.verify). One rank runs in
    this process whatever the backend: Ray would only add a process to talk to."""
    if config.parallel.world_size == 1:
        return UniProcExecutor(config)
    if config.parallel.distributed_executor_backend == "ray":
        from pagoda.distributed.ray_executor import RayExecutor
        return RayExecutor(config)
    from pagoda.distributed.multiproc_executor import MultiprocExecutor
    return MultiprocExecutor(config)
