"""data_parallel_backend="ray" on the CPU: the data-parallel replicas as Ray actors of a one-node
cluster, behind the same front (DPEngine) as the spawned replicas. Outputs must equal one
engine's; a bad request must leave the replicas running, a replica's start-up error must be
raised as it is, a killed actor must stop the engine, not hang it; the actors go with the
engine. The server's replicas are processes of this node: it refuses the Ray backend."""
import argparse
import gc
import json
import multiprocessing
import os
import subprocess
import sys
import textwrap
import time

import pytest

from pagoda import LLM, SamplingParams
from pagoda.engine.arg_utils import EngineArgs
from tests.test_ray_executor import _ray_daemons, _running
from tests.test_tensor_parallel import GREEDY, PROMPTS, SEEDED, SMALL, assert_same, outputs_at, run, write_tiny_llama

ray = pytest.importorskip("ray")
RAY_DP = dict(SMALL, data_parallel_size=2, data_parallel_backend="ray")
CPUS = 4


@pytest.fixture(scope="module", autouse=True)
def cluster():
    """One local cluster for the module, four logical CPUs: the shared engine's two replicas
    and one more engine's two (the replicas share this machine's cores)."""
    ray.init(num_cpus=CPUS, include_dashboard=False, logging_level="error", log_to_driver=False)
    yield
    Shared.llm = None
    gc.collect()
    ray.shutdown()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_llama(str(tmp_path_factory.mktemp("dpray") / "tiny"))


class Shared:
    """The dp=2 engine over Ray that the tests share; the last one drops it (and checks that
    its actors go with it)."""
    llm = None


@pytest.fixture
def dp2(tiny):
    if Shared.llm is None:
        Shared.llm = LLM(tiny, **RAY_DP)
    return Shared.llm


def _pid(engine):
    return os.getpid()


def _leftovers(engine):
    """(Run in a replica) what its engine still holds of requests that have ended."""
    kv = engine.kv_cache_manager
    return (engine.has_unfinished_requests(), list(kv.req_to_blocks), kv.pool.num_usable_blocks - kv.num_free_blocks,
            list(engine.output_processor.parents) + list(engine.output_processor.states))


def assert_no_leaks(llm) -> None:
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.llm_engine._call_all(_leftovers) == [(False, [], 0, [])] * 2


def assert_dead(actor, within_s: float = 20) -> None:
    """``actor`` is dead, soon: ray.kill is asynchronous (a call made just after it may still
    run before the kill arrives), so the calls are tried again for a while."""
    deadline = time.time() + within_s
    while time.time() < deadline:
        try:
            ray.get(actor.node.remote(), timeout=within_s)
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.1)
    pytest.fail(f"actor {actor} is still alive {within_s} s after its engine stopped")


def wait_for_cpus(count: float, within_s: float = 20) -> None:
    deadline = time.time() + within_s
    while time.time() < deadline and ray.available_resources().get("CPU", 0) != count:
        time.sleep(0.1)
    assert ray.available_resources().get("CPU", 0) == count


@pytest.fixture(scope="module")
def reference(tiny):
    return outputs_at(tiny, 1)


def test_dp2_over_ray_equals_dp1(dp2, reference):
    """Greedy tokens, their logprobs, prompt logprobs and seeded samples (n=2, top-p/top-k)
    from two replicas, each an actor in a process of its own, equal one engine's."""
    assert type(dp2.llm_engine.replicas).__name__ == "RayReplicas"
    pids = dp2.llm_engine._call_all(_pid)
    assert len(set(pids)) == 2 and os.getpid() not in pids
    assert ray.available_resources().get("CPU") == CPUS - 2        # one CPU an actor
    assert_same(reference, (dp2.generate(PROMPTS, GREEDY, use_tqdm=False), run(dp2, SEEDED)))


def _worker_pids(engine):
    return [p.pid for p in engine.executor.procs]


def test_dp2_tp2_over_ray(tiny, dp2, reference):
    """Each actor's replica runs its own tensor-parallel ranks as processes of its node; they
    end with the engine."""
    llm = LLM(tiny, tensor_parallel_size=2, **RAY_DP)
    workers = [pid for pids in llm.llm_engine._call_all(_worker_pids) for pid in pids]
    assert len(workers) == 2 and all(map(_running, workers))
    assert_same(reference, (llm.generate(PROMPTS, GREEDY, use_tqdm=False), run(llm, SEEDED)))
    del llm
    deadline = time.time() + 20
    while time.time() < deadline and any(map(_running, workers)):
        time.sleep(0.1)
    assert not any(map(_running, workers))
    wait_for_cpus(CPUS - 2)


def test_stats_sum_the_replicas(dp2):
    before = dp2.llm_engine.replica_stats()
    dp2.generate([{"prompt_token_ids": [7] * 20}] * 4, SamplingParams(max_tokens=2), use_tqdm=False)
    after = dp2.llm_engine.replica_stats()
    assert [a.num_prompt_tokens - b.num_prompt_tokens for a, b in zip(after, before)] == [40, 40]
    total = dp2.get_stats()
    assert total.num_prompt_tokens == sum(a.num_prompt_tokens for a in after)
    assert total.num_generation_tokens == sum(a.num_generation_tokens for a in after)
    assert total.num_kv_blocks == sum(a.num_kv_blocks for a in after) > after[0].num_kv_blocks


def test_bad_request_raises_and_the_replicas_go_on(dp2):
    with pytest.raises(ValueError, match="longer than the maximum model length") as raised:
        dp2.generate([PROMPTS[0], PROMPTS[1], {"prompt_token_ids": [5] * 300}], GREEDY, use_tqdm=False)
    assert type(raised.value) is ValueError          # the replica's own, not Ray's wrapper of it
    assert_no_leaks(dp2)
    out = dp2.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in out] == [4, 4, 4]
    assert_no_leaks(dp2)


def test_start_up_failure_raises_its_value_error(tiny, dp2):
    """A replica's ValueError at start-up (its KV cache too small) is raised by LLM(...) as it
    is, and its actors are gone."""
    with pytest.raises(ValueError, match="less than one sequence of max_model_len") as raised:
        LLM(tiny, **dict(RAY_DP, kv_cache_memory_bytes=1 << 12))
    assert type(raised.value) is ValueError
    wait_for_cpus(CPUS - 2)


def test_killed_replica_stops_the_engine(tiny, dp2):
    llm = LLM(tiny, **RAY_DP)
    actors = list(llm.llm_engine.replicas.actors)
    ray.kill(actors[1])
    start = time.time()
    with pytest.raises(RuntimeError, match="data parallel replica 1 died"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert time.time() - start < 30
    assert_dead(actors[0])                 # the other one is stopped too
    with pytest.raises(RuntimeError, match="has stopped .*replica 1 died"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    del llm
    wait_for_cpus(CPUS - 2)


def test_actors_go_with_the_engine(tiny):
    """(Drops the shared engine; not through the fixture, which pytest would keep alive)
    `del llm` and garbage collection end every actor and its process, and give the cluster
    its CPUs back."""
    llm = Shared.llm or LLM(tiny, **RAY_DP)
    actors, pids = list(llm.llm_engine.replicas.actors), llm.llm_engine._call_all(_pid)
    assert all(map(_running, pids))
    del llm
    Shared.llm = None
    gc.collect()
    for actor in actors:
        assert_dead(actor)
    deadline = time.time() + 20
    while time.time() < deadline and any(map(_running, pids)):
        time.sleep(0.1)
    assert not any(map(_running, pids))
    wait_for_cpus(CPUS)


def test_backend_errors(tiny):
    from pagoda.engine.async_llm import AsyncLLM
    with pytest.raises(ValueError, match="Unknown data_parallel_backend 'nccl'; choose 'mp' or 'ray'"):
        LLM(tiny, **dict(RAY_DP, data_parallel_backend="nccl"))
    with pytest.raises(ValueError, match="not data_parallel_size=2 replicas.* set data_parallel_backend='ray'"):
        LLM(tiny, **dict(SMALL, data_parallel_size=2, distributed_executor_backend="ray"))
    # The server's replicas are engine core processes of this node: refused before any starts.
    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match="server's data_parallel_size=2 replicas are engine core processes"):
        AsyncLLM.from_engine_args(EngineArgs(tiny, **RAY_DP))
    assert set(multiprocessing.active_children()) == before
    assert ray.available_resources().get("CPU") == CPUS
    # One replica: the backend has nothing to place, for the server as for LLM.
    from pagoda.model.loader import read_arch_config
    one = EngineArgs(tiny, **dict(RAY_DP, data_parallel_size=1))
    assert one.parallel_config("cpu", read_arch_config(tiny)).data_parallel_backend == "ray"


def test_cli_flag():
    from pagoda.entrypoints.cli import add_engine_args, engine_args_from
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_args_from(p.parse_args(["-dp", "2", "--data-parallel-backend", "ray"])).data_parallel_backend == "ray"
    assert engine_args_from(p.parse_args([])).data_parallel_backend == "mp"
    with pytest.raises(SystemExit):
        p.parse_args(["--data-parallel-backend", "uni"])


SCRIPT = """
import json, os, sys
from pagoda import LLM
from tests.test_tensor_parallel import GREEDY, PROMPTS, SMALL

if __name__ == "__main__":
    llm = LLM(model=sys.argv[1], data_parallel_size=2, data_parallel_backend="ray", **SMALL)
    out = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    print(json.dumps({"pids": llm.llm_engine._call_all(lambda engine: os.getpid()),
                      "tokens": [o.outputs[0].token_ids for o in out]}))
"""


def test_script_starts_its_own_cluster_and_leaves_nothing(tiny, reference, tmp_path):
    """With no cluster to join the engine starts one; the script's replicas give one engine's
    tokens, and at its exit (no `del llm`) its actors and the cluster are gone."""
    daemons = _ray_daemons()
    script = tmp_path / "dp_ray.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, str(script), tiny], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["tokens"] == [o.outputs[0].token_ids for o in reference[0]]
    deadline = time.time() + 10
    while time.time() < deadline and (any(map(_running, got["pids"])) or _ray_daemons() != daemons):
        time.sleep(0.1)
    assert len(set(got["pids"])) == 2 and not any(map(_running, got["pids"]))
    assert _ray_daemons() == daemons
