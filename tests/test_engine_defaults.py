"""Defaults a vLLM user would get: the batch budget by device (vLLM's offline defaults), and
the decode batch sizes captured as CUDA graphs."""
from types import SimpleNamespace

import torch

from pagoda.engine import arg_utils
from pagoda.runner.cuda_graph import MAX_CAPTURE_SIZE, capture_sizes


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
