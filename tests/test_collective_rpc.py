"""vLLM's LLM.collective_rpc and LLM.apply_model: a function run on every rank's worker (its
model shard), in one process, over tensor-parallel workers and data-parallel replicas; a
failing function raises, naming its rank, and leaves the engine generating. A worker extension
(worker_extension_cls) that updates the weights as RL frameworks do (model.load_weights)."""
import gc

import pytest

import torch
from safetensors import safe_open

from pagoda import LLM, SamplingParams
from pagoda.model.loader import iter_safetensors
from tests.test_tensor_parallel import write_tiny_llama

SMALL = dict(dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 24, max_model_len=128,
             device="cpu")
PROMPT = {"prompt_token_ids": [5, 6, 7, 8]}
GREEDY = SamplingParams(temperature=0.0, max_tokens=4)


def rank_and_heads(worker, scale=1):
    """(the rank, its share of the first layer's attention heads x scale)."""
    return worker.rank, worker.runner.model.model.layers[0].self_attn.num_heads * scale


def fails_on_rank_1(worker):
    if worker.rank == 1:
        raise KeyError("rank 1 says no")
    return worker.rank


def head_rows(model):
    return model.model.layers[0].self_attn.qkv_proj.weight.shape[0]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_llama(str(tmp_path_factory.mktemp("tiny") / "m"), heads=4, kv_heads=2)


def test_one_process(tiny):
    llm = LLM(tiny, **SMALL)
    try:
        want = llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        assert llm.collective_rpc(rank_and_heads, kwargs={"scale": 10}) == [(0, 40)]
        assert llm.collective_rpc(lambda worker, x: x + worker.rank, args=(3,)) == [3]     # (in-process: lambdas)
        assert llm.apply_model(lambda model: type(model).__name__) == ["LlamaForCausalLM"]
        with pytest.raises(RuntimeError, match="(?s)rank 0: .*ZeroDivisionError"):
            llm.collective_rpc(lambda worker: 1 / 0)
        with pytest.raises(ValueError, match="timeout is not supported"):
            llm.collective_rpc(rank_and_heads, timeout=5.0)
        assert llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == want
    finally:
        del llm
        gc.collect()


@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2}, {"data_parallel_size": 2}])
def test_every_rank_or_replica(tiny, layout):
    """tp=2: each rank's half of the heads; dp=2: each replica's one rank. An error on one rank
    raises with its traceback and the ranks go on; a lambda cannot reach a spawned process."""
    llm = LLM(tiny, **SMALL, **layout)
    try:
        want = llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        if "tensor_parallel_size" in layout:
            assert llm.collective_rpc(rank_and_heads) == [(0, 2), (1, 2)]
            assert llm.apply_model(head_rows) == [(2 + 1 + 1) * 16] * 2       # q, k, v rows of each shard
            with pytest.raises(RuntimeError, match="(?s)rank 1: .*rank 1 says no"):
                llm.collective_rpc(fails_on_rank_1)
        else:
            assert llm.collective_rpc(rank_and_heads) == [(0, 4), (0, 4)]
        with pytest.raises(Exception, match="pickle"):
            llm.collective_rpc(lambda worker: worker.rank)
        assert llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == want
    finally:
        del llm
        gc.collect()


class WeightSync:
    """A worker extension as RL frameworks write them for vLLM (``self.model_runner.model``)."""

    def update_weights(self, folder: str) -> int:
        return len(self.model_runner.model.load_weights(iter_safetensors(folder)))

    def zero_final_norm(self) -> list[str]:
        hidden = self.model_runner.model.config.hidden_size
        return sorted(self.model_runner.model.load_weights([("model.norm.weight", torch.zeros(hidden))]))

    def weights_sum(self) -> float:
        return float(sum(p.double().sum() for p in self.model_runner.model.parameters()))


@pytest.mark.parametrize("layout", [{}, {"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}])
def test_worker_extension_updates_the_weights(tmp_path, tiny, layout):
    """Another checkpoint's weights loaded into a running engine (each rank its shard, each
    stage its layers) give that checkpoint's tokens; a partial update changes its tensor alone."""
    other = write_tiny_llama(str(tmp_path / "other"), heads=4, kv_heads=2, seed=1)
    reference = LLM(other, **SMALL)
    try:
        want = reference.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    finally:
        del reference
        gc.collect()
    llm = LLM(tiny, worker_extension_cls="tests.test_collective_rpc.WeightSync", **SMALL, **layout)
    try:
        assert llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids != want
        assert all(n > 0 for n in llm.collective_rpc("update_weights", args=(other,)))
        llm.reset_prefix_cache()
        assert llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == want
        before = llm.collective_rpc("weights_sum")
        holds = [False, True] if "pipeline_parallel_size" in layout else [True] * len(before)   # the final norm
        assert llm.collective_rpc("zero_final_norm") == [["model.norm.weight"] if h else [] for h in holds]
        norm = float(safe_open(f"{other}/model.safetensors", "pt").get_tensor("model.norm.weight").double().sum())
        after = llm.collective_rpc("weights_sum")
        assert after == [pytest.approx(b - norm) if h else b for b, h in zip(before, holds)]
    finally:
        del llm
        gc.collect()
    with pytest.raises(ValueError, match="worker_extension_cls='tests.nowhere.Nothing' is not an importable"):
        LLM(tiny, worker_extension_cls="tests.nowhere.Nothing", **SMALL)
