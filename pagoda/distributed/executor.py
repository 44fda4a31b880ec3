"""Executors run the model runner on every rank. One process for now; multiprocessing and Ray
executors plug in behind the same three calls."""
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
    p = config.parallel
    if p.world_size > 1 or p.data_parallel_size > 1:
        raise NotImplementedError(
            f"tensor_parallel_size={p.tensor_parallel_size}, pipeline_parallel_size="
            f"{p.pipeline_parallel_size}, data_parallel_size={p.data_parallel_size}: distributed "
            "execution is not implemented yet; use 1 for each.")
    return UniProcExecutor(config)
