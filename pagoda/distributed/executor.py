"""Executors run the model runner on every rank: in this process alone (tensor_parallel_size
1), or over worker processes (multiproc_executor.py). Both answer the same three calls."""
from pagoda.config import EngineConfig
from pagoda.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagoda.runner.model_runner import ModelRunner


class UniProcExecutor:
    def __init__(self, config: EngineConfig):
        self.runner = ModelRunner(config)

    def determine_num_blocks(self) -> int:
        return self.runner.determine_num_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.runner.initialize_kv_cache(num_blocks)

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(sched)


def get_executor(config: EngineConfig):
    """The executor for ``config.parallel`` (checked by ParallelConfig.verify)."""
    if config.parallel.world_size == 1:
        return UniProcExecutor(config)
    from pagoda.distributed.multiproc_executor import MultiprocExecutor
    return MultiprocExecutor(config)
