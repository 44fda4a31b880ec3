"""distributed_executor_backend="ray" on the CPU: rank 0 in this process, ranks 1..N-1 Ray
actors of a one-node cluster meeting it over gloo at this node's address. Outputs must equal one
process's and the multiprocessing backend's; a failed or dead actor is an error naming its rank,
not a hang; the actors and their placement group go with the engine."""
import gc
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from pagoda import LLM
from tests.conftest import assert_no_leaks
from tests.quant_utils import quantize_folder
from tests.test_pipeline_parallel import _break_last_stage
from tests.test_tensor_parallel import (GREEDY, PROMPTS, SEEDED, SMALL, _fail_on_rank_1, assert_same, outputs_at,
                                        run, write_tiny_llama)

ray = pytest.importorskip("ray")
RAY = dict(SMALL, distributed_executor_backend="ray")


@pytest.fixture(scope="module", autouse=True)
def cluster():
    """One local cluster for the module, four logical CPUs (a bundle per rank of tp2 x pp2; the
    ranks share this machine's cores). The engines join it rather than start their own."""
    ray.init(num_cpus=4, include_dashboard=False, logging_level="error", log_to_driver=False)
    yield
    gc.collect()
    ray.shutdown()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_llama(str(tmp_path_factory.mktemp("ray") / "tiny"))


@pytest.fixture(scope="module")
def tiny4(tmp_path_factory):
    return write_tiny_llama(str(tmp_path_factory.mktemp("ray") / "tiny4"), layers=4)


def _pid(worker):
    return os.getpid()


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _ray_daemons() -> set[int]:
    """The Ray clusters' own processes (GCS servers, raylets) running on this machine."""
    found = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                exe = f.read().split(b"\0")[0]
        except OSError:
            continue
        if exe.endswith((b"/raylet", b"/gcs_server")) and _running(int(pid)):
            found.add(int(pid))
    return found


def what_it_runs(llm) -> tuple[list, list, object]:
    """The engine's actors, their processes' ids and their placement group."""
    executor = llm.llm_engine.executor
    pids = executor.collective_rpc(_pid)[1:] if executor.dead is None else []
    return list(executor.actors), pids, executor.pg


def assert_all_gone(actors, pids, pg, within_s: float = 20) -> None:
    """Once the engine is gone: its actors are dead, their processes have exited, their
    placement group is removed, and the cluster's CPUs are all free again."""
    gc.collect()
    for actor in actors:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actor.node.remote(), timeout=within_s)
    deadline = time.time() + within_s
    while time.time() < deadline and (any(map(_running, pids)) or ray.available_resources().get("CPU") != 4):
        time.sleep(0.1)
    assert not any(map(_running, pids))
    assert ray.util.placement_group_table(pg)["state"] == "REMOVED"
    assert ray.available_resources().get("CPU") == 4


def test_tp2_equals_tp1_and_mp(tiny):
    """Greedy tokens, their logprobs, prompt logprobs and seeded n=2 samples over two ranks, one
    an actor (with async scheduling), equal one process's, and the mp backend's to the bit."""
    ref, mp = outputs_at(tiny, 1), outputs_at(tiny, 2, async_scheduling=True)
    llm = LLM(tiny, tensor_parallel_size=2, async_scheduling=True, **RAY)
    assert type(llm.llm_engine.executor).__name__ == "RayExecutor"
    out = (llm.generate(PROMPTS, GREEDY, use_tqdm=False), run(llm, SEEDED))
    assert_same(ref, out)
    assert_same(mp, out, tol=1e-12)
    counts = llm.llm_engine.executor.collective_rpc("determine_num_blocks")
    assert len(counts) == 2 and llm.llm_engine.config.cache.num_blocks == min(counts)
    with pytest.raises(ValueError, match="longer than the maximum model length"):
        llm.generate({"prompt_token_ids": [5] * 300}, GREEDY, use_tqdm=False)
    assert_no_leaks(llm)
    ran = what_it_runs(llm)
    del llm
    assert_all_gone(*ran)


def test_worker_error_names_its_rank(tiny):
    llm = LLM(tiny, tensor_parallel_size=2, **RAY)
    executor = llm.llm_engine.executor
    with pytest.raises(RuntimeError, match="(?s)worker rank 1 failed.*ValueError: rank 1 cannot go on"):
        executor.collective_rpc(_fail_on_rank_1)
    with pytest.raises(RuntimeError, match="has stopped .*rank 1 failed"):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    assert_no_leaks(llm)
    ran = what_it_runs(llm)
    del llm
    assert_all_gone(*ran)


def _kill_rank_1(llm):
    os.kill(llm.llm_engine.executor.collective_rpc(_pid)[1], signal.SIGKILL)


def _break_last_stage_actor(llm):
    llm.llm_engine.executor.collective_rpc(_break_last_stage)


def _break_rank_0(llm):
    def broken_forward(*args):
        raise KeyError("rank 0's forward broke")
    llm.llm_engine.executor.worker.runner._forward = broken_forward


@pytest.mark.parametrize("model, layout, breaks, error", [
    # The last stage (an actor) fails in its forward while rank 0 waits for its tokens: the
    # actor's error, with its traceback.
    ("tiny4", dict(pipeline_parallel_size=2), _break_last_stage_actor,
     "(?s)worker rank 1 failed.*KeyError: .the last stage's forward broke"),
    # An actor's process is killed: rank 0 meets a dead peer in its first collective.
    ("tiny", dict(tensor_parallel_size=2), _kill_rank_1, "worker rank 1 died"),
    # Rank 0 fails: its own error, and the actors waiting on it are stopped.
    ("tiny", dict(tensor_parallel_size=2), _break_rank_0, "rank 0's forward broke"),
])
def test_failed_step_raises_soon_and_leaves_nothing(request, model, layout, breaks, error):
    llm = LLM(request.getfixturevalue(model), **layout, **RAY)
    breaks(llm)
    start = time.time()
    with pytest.raises((RuntimeError, KeyError), match=error):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert time.time() - start < 30
    assert_no_leaks(llm)
    ran = what_it_runs(llm)
    del llm
    assert_all_gone(*ran)


def test_start_up_failure_leaves_no_actor(tiny, tmp_path):
    """Every rank refuses the checkpoint: rank 0's error, and the cluster as it was."""
    folder = quantize_folder(tiny, str(tmp_path / "act"), "gptq", group=32, desc_act=True, v2=True)
    with pytest.raises(ValueError, match="act-order .* do not split over tensor_parallel_size=2"):
        LLM(folder, tensor_parallel_size=2, **RAY)
    gc.collect()
    deadline = time.time() + 20
    while time.time() < deadline and ray.available_resources().get("CPU") != 4:
        time.sleep(0.1)
    assert ray.available_resources().get("CPU") == 4
    assert not [a for a in ray.util.placement_group_table().values() if a["state"] != "REMOVED"]


def test_layout_errors(tiny, tiny4):
    with pytest.raises(ValueError, match="8 ranks need 8 CPUs in the Ray cluster .* it has 4"):
        LLM(tiny4, tensor_parallel_size=4, pipeline_parallel_size=2, **RAY)
    with pytest.raises(ValueError, match="not data_parallel_size=2 replicas.* set data_parallel_backend='ray'"):
        LLM(tiny, tensor_parallel_size=2, data_parallel_size=2, **RAY)
    assert ray.available_resources().get("CPU") == 4
    # One rank: no actor at all.
    llm = LLM(tiny, **RAY)
    assert type(llm.llm_engine.executor).__name__ == "UniProcExecutor"


# The spec's call, its model and sizes aside.
SPEC_SAMPLE = """
import json, os, sys
import ray
from pagoda import LLM
from tests.test_tensor_parallel import GREEDY, PROMPTS, SEEDED, SMALL

if __name__ == "__main__":
    llm = LLM(model=sys.argv[1], tensor_parallel_size=2, pipeline_parallel_size=2,
              distributed_executor_backend="ray", **SMALL)
    greedy = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    seeded = llm.generate(PROMPTS, SEEDED, use_tqdm=False)
    print(json.dumps({
        "pids": llm.llm_engine.executor.collective_rpc(lambda worker: os.getpid()),
        "node": ray.get_runtime_context().get_node_id(),
        "tokens": [o.outputs[0].token_ids for o in greedy],
        "logprobs": [o.outputs[0].cumulative_logprob for o in greedy],
        "seeded": [[c.token_ids for c in o.outputs] for o in seeded]}))
"""


def test_spec_sample_tp2_pp2_starts_its_own_cluster(tiny4, tmp_path):
    """The spec's multi-node call, on one node: with no cluster to join, the engine starts one
    (a CPU per rank counted), four ranks (two stages of two) give one process's outputs, and
    when the script ends nothing it started is left running."""
    daemons = _ray_daemons()
    script = tmp_path / "sample.py"
    script.write_text(textwrap.dedent(SPEC_SAMPLE))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, str(script), tiny4], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    greedy, seeded = outputs_at(tiny4, 1)
    assert got["tokens"] == [o.outputs[0].token_ids for o in greedy]
    assert got["logprobs"] == pytest.approx([o.outputs[0].cumulative_logprob for o in greedy], abs=1e-4)
    assert got["seeded"] == [[c.token_ids for c in o] for o in seeded]
    assert got["node"] != ray.get_runtime_context().get_node_id()      # (not this module's cluster)
    assert len(got["pids"]) == 4 and not any(map(_running, got["pids"][1:]))
    assert _ray_daemons() == daemons
