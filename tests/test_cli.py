"""The `pagoda` command line: batch generation and interactive chat (stdin piped in)."""
import subprocess
import sys

import pytest

CLI = [sys.executable, "-m", "pagoda.entrypoints.cli"]


def run(args, stdin=None):
    return subprocess.run(CLI + args, input=stdin, capture_output=True, text=True, timeout=300)


def test_generate_prompts_and_file(tmp_path):
    f = tmp_path / "prompts.txt"
    f.write_text("The capital of France is\n\n1, 2, 3, 4,\n", encoding="utf-8")
    r = run(["generate", "Hello, my name is", "--file", str(f), "--max-tokens", "8", "--temperature", "0",
             "--max-model-len", "256", "--log-stats", "--kv-cache-dtype", "fp8"])
    assert r.returncode == 0, r.stderr
    assert "Engine ready" in r.stderr                 # --log-stats turns the engine's log on
    assert "(KV cache dtype fp8)" in r.stderr
    assert r.stdout.count("### Prompt:") == 3
    assert "'The capital of France is'" in r.stdout and "finish_reason=length" in r.stdout


def test_generate_without_prompts_is_an_error():
    r = run(["generate", "--max-model-len", "256"])
    assert r.returncode == 2 and "give prompts" in r.stderr


def test_chat_streams_replies():
    r = run(["chat", "--max-tokens", "12", "--temperature", "0", "--max-model-len", "512"],
            stdin="What is 2+2?\nAnd 3+3?\n\n")
    assert r.returncode == 0, r.stderr
    replies = [line for line in r.stdout.splitlines() if line.strip()]
    assert len(replies) >= 2, r.stdout
    assert any(ch.isalnum() for ch in replies[0])


@pytest.mark.parametrize("bad, message", [(["generate", "x", "--temperature", "-1"], "temperature"),
                                          (["generate", "x", "--model", "/nope"], "not found"),
                                          (["generate", "x", "--quantization", "awq"], "no quantization config"),
                                          (["generate", "x", "--kv-cache-dtype", "int8"], "Unknown kv_cache_dtype"),
                                          (["generate", "x", "--runner", "pooling"], "pooling runner"),
                                          (["generate", "x", "--task", "embed"], "pooling runner"),
                                          (["generate", "x", "-dp", "2", "--distributed-executor-backend", "ray"],
                                           "set data_parallel_backend='ray'")])
def test_bad_arguments_fail_cleanly(bad, message):
    r = run(bad + ["--max-model-len", "256"])
    assert r.returncode == 1 and "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("pagoda: error:") and message in last


def test_engine_flags_reach_engine_args():
    import argparse

    from pagoda.entrypoints.cli import add_engine_args, engine_args_from
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert not engine_args_from(p.parse_args([])).disable_hybrid_kv_cache_manager
    args = engine_args_from(p.parse_args(["--disable-hybrid-kv-cache-manager", "--max-logprobs", "5",
                                          "--disable-sliding-window"]))
    assert args.disable_hybrid_kv_cache_manager and args.max_logprobs == 5 and args.disable_sliding_window
