"""Defaults a vLLM user would get: the batch budget by device (vLLM's offline defaults), the
batch sizes captured as CUDA graphs (decode and mixed steps), and the sampling fields of the
model's generation_config.json as the requests' defaults."""
import gc
import json
import os
from types import SimpleNamespace

import pytest
import torch

from pagoda.engine import arg_utils
from pagoda.runner import cuda_graph
from pagoda.runner.cuda_graph import (MAX_CAPTURE_SIZE, MAX_MIXED_CAPTURE, MAX_MIXED_REQS, CUDAGraphRunner,
                                      capture_sizes, mixed_capture_sizes)


def test_batch_defaults_follow_vllm(monkeypatch):
    assert arg_utils._batch_defaults("cpu") == (8192, 256)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    for name, gib, expected in [("NVIDIA H200", 141, (16384, 1024)), ("NVIDIA H100 80GB HBM3", 80, (16384, 1024)),
                                ("NVIDIA A100-SXM4-80GB", 80, (8192, 256)), ("NVIDIA L4", 24, (8192, 256))]:
        props = SimpleNamespace(name=name, total_memory=gib << 30)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i, p=props: p)
        assert arg_utils._batch_defaults("cuda") == expected, name


def test_capture_sizes_stop_at_the_limit():
    assert capture_sizes(1) == [1] and capture_sizes(12) == [1, 2, 4, 8, 12]
    assert capture_sizes(256)[-1] == 256 and len(capture_sizes(256)) == 3 + 32
    assert capture_sizes(1024)[-1] == MAX_CAPTURE_SIZE == capture_sizes(MAX_CAPTURE_SIZE)[-1]


def test_mixed_step_sizes_and_which_steps_take_a_graph(monkeypatch):
    ladder = [64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048]
    assert mixed_capture_sizes(16384) == ladder and ladder[-1] == MAX_MIXED_CAPTURE
    assert mixed_capture_sizes(1000) == ladder[:8] + [1000]
    assert mixed_capture_sizes(24) == [24]
    monkeypatch.setattr(cuda_graph, "MAX_MIXED_CAPTURE", 16384)   # (a benchmark knob): the ladder goes on
    assert mixed_capture_sizes(16384) == ladder + [3072, 4096, 6144, 8192, 12288, 16384]
    monkeypatch.undo()
    graphs = CUDAGraphRunner(None, None, max_num_seqs=1024, max_num_batched_tokens=16384, max_blocks=4,
                             max_model_len=64, device=torch.device("cpu"))
    assert graphs.graph_key(5, 5, 1) == ("decode", 8)
    assert graphs.graph_key(200, 200, 1) == ("decode", 200)
    assert graphs.graph_key(600, 600, 1) is None                      # more requests than MAX_MIXED_REQS
    assert graphs.graph_key(MAX_MIXED_REQS, 1000, 700) == ("mixed", 1024)
    assert graphs.graph_key(MAX_MIXED_REQS + 1, 1000, 700) is None
    assert graphs.graph_key(3, 100, 90) == ("mixed", 128)
    assert graphs.graph_key(3, 9, 5) == ("mixed", 64)                 # (no speculative decoding)
    assert graphs.graph_key(40, 2048, 2000) == ("mixed", 2048)
    assert graphs.graph_key(40, 2049, 2000) is None and graphs.graph_key(256, 16384, 64) is None    # eager
    # room for as many requests as a step of that size can hold, up to MAX_MIXED_REQS
    assert len(graphs._metadata(("mixed", 128))[0].seq_lens) == 128
    assert len(graphs._metadata(("mixed", 2048))[0].seq_lens) == MAX_MIXED_REQS
    assert graphs.spec_sizes == []
    # Speculative decoding, 4 drafts: verification steps by request count, 5 token slots each
    spec = CUDAGraphRunner(None, None, max_num_seqs=1024, max_num_batched_tokens=16384, max_blocks=4,
                           max_model_len=64, device=torch.device("cpu"), num_speculative_tokens=4)
    assert spec.spec_sizes == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert spec.graph_key(1, 5, 5) == ("spec", 1) and spec.graph_key(3, 9, 5) == ("spec", 4)
    assert spec.graph_key(3, 3, 1) == ("decode", 4)                    # no drafts this step
    assert spec.graph_key(2, 40, 30) == ("mixed", 64)                  # a prompt rides along
    (md,) = spec._metadata(("spec", 4))     # (one KV cache group)
    assert (md.num_actual_tokens, len(md.seq_lens), md.max_query_len, md.num_decodes) == (20, 4, 5, 0)
    # k = 8 with 2,048-token buffers: 227 requests of 9 slots fit, so up to 128
    assert CUDAGraphRunner(None, None, max_num_seqs=1024, max_num_batched_tokens=16384, max_blocks=4, max_model_len=64,
                           device=torch.device("cpu"), num_speculative_tokens=8).spec_sizes[-1] == 128


GENERATION_CONFIG = {"bos_token_id": 1, "eos_token_id": 2, "do_sample": True, "temperature": 0.3, "top_p": 0.8,
                     "top_k": 7, "repetition_penalty": 1.1, "max_new_tokens": 5}


def test_generation_config_gives_the_default_sampling_params(tmp_path):
    """vLLM's generation_config="auto": generate / chat without SamplingParams sample with the
    model's generation_config.json fields (get_default_sampling_params); override_generation_config
    over them; "vllm" and a folder without the file; the server's requests take them for the
    fields they leave unset."""
    from pagoda import LLM, SamplingParams
    from pagoda.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
    from tests.test_tensor_parallel import write_tiny_llama
    folder = write_tiny_llama(str(tmp_path / "tiny"))
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump(GENERATION_CONFIG, f)
    small = dict(dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 24, max_model_len=128)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [9, 10]}]
    llm = LLM(folder, override_generation_config={"temperature": 0.0}, **small)
    try:
        p = llm.get_default_sampling_params()
        assert (p.repetition_penalty, p.max_tokens) == (1.1, 5) and p.greedy
        want = llm.generate(prompts, SamplingParams(temperature=0.0, repetition_penalty=1.1, max_tokens=5),
                            use_tqdm=False)
        got = llm.generate(prompts, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
        assert all(len(o.outputs[0].token_ids) <= 5 for o in got)
    finally:
        del llm
        gc.collect()
    llm = LLM(folder, **small)
    try:
        p = llm.get_default_sampling_params()
        assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty, p.max_tokens) == (0.3, 0.8, 7, 1.1, 5)
    finally:
        del llm
        gc.collect()
    llm = LLM(folder, generation_config="vllm", **small)
    try:
        assert llm.get_default_sampling_params() == SamplingParams()
    finally:
        del llm
        gc.collect()
    with pytest.raises(ValueError, match="that folder has none"):
        LLM(folder, generation_config=str(tmp_path), **small)
    import argparse

    from pagoda.entrypoints.cli import add_engine_args, engine_args_from
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = engine_args_from(parser.parse_args(["--generation-config", "vllm", "--override-generation-config",
                                               '{"temperature": 0.5}']))
    assert (args.generation_config, args.override_generation_config) == ("vllm", {"temperature": 0.5})
    defaults = {"temperature": 0.3, "top_k": 7, "max_tokens": 5}
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "Hi"}], top_p=0.5).sampling_params(defaults)
    assert (chat.temperature, chat.top_p, chat.top_k, chat.max_tokens) == (0.3, 0.5, 7, 5)
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "Hi"}], temperature=1.0,
                                 max_tokens=9).sampling_params(defaults)
    assert (chat.temperature, chat.max_tokens) == (1.0, 9)
    assert CompletionRequest(prompt="Hi").sampling_params(defaults).max_tokens == 16     # (its own default)
