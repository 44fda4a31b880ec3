"""Defaults a vLLM user would get: the decode batch sizes captured as CUDA graphs."""
from pagoda.runner.cuda_graph import MAX_CAPTURE_SIZE, capture_sizes


def test_capture_sizes_stop_at_the_limit():
    assert capture_sizes(1) == [1] and capture_sizes(12) == [1, 2, 4, 8, 12]
    assert capture_sizes(256)[-1] == 256 and len(capture_sizes(256)) == 3 + 32
    assert capture_sizes(1024)[-1] == MAX_CAPTURE_SIZE == capture_sizes(MAX_CAPTURE_SIZE)[-1]
