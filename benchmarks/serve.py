"""W3 serving (DESIGN.md): the OpenAI server under Poisson arrivals at several request rates.

  python benchmarks/serve.py --model-config ../shared/models/qwen3-0.6b.json --request-rates 4 16 64 inf
  python benchmarks/serve.py --cpu --num-prompts 8 --request-rates 2 inf        # SmolLM2 on this CPU
  python benchmarks/serve.py --base-url http://host:8000 --served-model-name M   # any running server (vLLM too)
  python benchmarks/serve.py --fake-step-ms 6 --prompt-len 10 20 --output-len 200 300 --request-rates inf
                                       # the server's own cost per token, over a stand-in engine (no GPU)

Starts `pagoda serve` as a subprocess (the client must not share the server's GIL) unless
--base-url names a server. Random token-id prompts, ignore_eos, streamed /v1/completions; each
rate sends the same requests, arrival gaps drawn from an exponential (inf: all at once). Per
rate: TTFT, TPOT ((end - first token) / (tokens - 1)), ITL (gaps between streamed chunks) at
P50/P95/P99, request and token throughput, and goodput (requests/s meeting --slo-ttft-ms and
--slo-tpot-ms). Prints a table, writes JSON and a plot to --out.
"""
import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
import urllib.parse

import numpy as np

from common import PAGODA_ROOT, add_word_tokenizer, bar_chart, dummy_model_dir
from throughput import random_token_ids, requests_for, vocab_for

PERCENTILES = (50, 95, 99)


async def sse_post(url: str, body: dict):
    """POST ``body`` as JSON on a connection of its own and yield each Server-Sent Event's data
    as it arrives. Plain asyncio streams, not an HTTP library: at hundreds of streams of one
    token a chunk, an httpx client took 5.5x the CPU (7.1-7.4 s against 1.3 s for 256 streams of
    200-300 tokens, much of it scanning its connection pool) and was what a run measured."""
    u = urllib.parse.urlsplit(url)
    reader, writer = await asyncio.open_connection(u.hostname, u.port or 80)
    try:
        payload = json.dumps(body).encode()
        writer.write(f"POST {u.path} HTTP/1.1\r\nHost: {u.netloc}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode() + payload)
        status = int((await reader.readline()).split()[1])
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {(await reader.read(200)).decode(errors='replace')}")
        assert headers.get("transfer-encoding") == "chunked", "a stream comes in chunks"
        pending = b""
        while size := int((await reader.readline()).split(b";")[0], 16):
            pending += await reader.readexactly(size)
            await reader.readexactly(2)                  # the chunk's CRLF
            *events, pending = pending.split(b"\n\n")
            for event in events:
                if event.startswith(b"data: "):
                    yield event[6:]
    finally:
        writer.close()


async def one_request(args, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": args.served_model_name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    chunk_times, tokens, error = [], 0, None
    try:
        async for data in sse_post(args.base_url + "/v1/completions", body):
            if data == b"[DONE]":
                continue
            event = json.loads(data)
            if "error" in event:
                error = event["error"]["message"]
            elif event["choices"]:
                chunk_times.append(time.perf_counter())
            elif event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    except (OSError, RuntimeError, ValueError) as e:
        return {"error": str(e)[:200]}
    if error or not chunk_times:
        return {"error": error or "no tokens"}
    ttft, e2e = chunk_times[0] - start, chunk_times[-1] - start
    return {"ttft": ttft, "e2e": e2e, "tokens": tokens, "prompt_tokens": len(prompt),
            "tpot": (e2e - ttft) / (tokens - 1) if tokens > 1 else None,
            "itl": np.diff(chunk_times).tolist()}


def fresh_token_ids(prompts: list[list[int]], vocab: int, seed: int) -> list[list[int]]:
    """The prompts' lengths with new random token ids."""
    return random_token_ids(map(len, prompts), vocab, np.random.default_rng(seed))


async def run_rate(args, rate: float, prompts, output_lens) -> dict:
    rng = np.random.default_rng(args.seed)
    tasks = []
    start = time.perf_counter()
    for prompt, n in zip(prompts, output_lens):
        tasks.append(asyncio.create_task(one_request(args, prompt, n)))
        if rate != float("inf"):
            await asyncio.sleep(rng.exponential(1.0 / rate))
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    return summarize(args, rate, results, duration)


def summarize(args, rate: float, results: list[dict], duration: float) -> dict:
    ok = [r for r in results if "error" not in r]

    def pcts(values, scale=1e3) -> dict:
        values = [v for v in values if v is not None]
        if not values:
            return {}
        return {"mean": float(np.mean(values)) * scale,
                **{f"p{p}": float(np.percentile(values, p)) * scale for p in PERCENTILES}}
    good = [r for r in ok if r["ttft"] * 1e3 <= args.slo_ttft_ms
            and (r["tpot"] is None or r["tpot"] * 1e3 <= args.slo_tpot_ms)]
    out_tokens = sum(r["tokens"] for r in ok)
    return {"request_rate": rate, "num_requests": len(results), "completed": len(ok),
            "errors": sorted({r["error"] for r in results if "error" in r})[:5], "duration_s": duration,
            "request_throughput": len(ok) / duration, "output_tok_s": out_tokens / duration,
            "total_tok_s": (out_tokens + sum(r["prompt_tokens"] for r in ok)) / duration,
            "goodput_req_s": len(good) / duration, "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms},
            "ttft_ms": pcts([r["ttft"] for r in ok]), "tpot_ms": pcts([r["tpot"] for r in ok]),
            "itl_ms": pcts([x for r in ok for x in r["itl"]]), "e2e_ms": pcts([r["e2e"] for r in ok])}


def pagoda_cli() -> list[str]:
    """The interpreter arguments that run `pagoda`'s command line from the checkout to benchmark."""
    if not os.environ.get("PAGODA_ROOT"):
        # `-m` serves the current directory's checkout: gpu_session.sh's W3 A/B runs this script
        # from inside BASE for BASE's server
        return ["-m", "pagoda.entrypoints.cli"]
    # (`-m` would put the current directory ahead of PAGODA_ROOT: a checkout there would serve instead)
    return ["-c", f"import runpy, sys; sys.path.insert(0, {PAGODA_ROOT!r}); "
                  "runpy.run_module('pagoda.entrypoints.cli', run_name='__main__', alter_sys=True)"]


def start_server(args) -> subprocess.Popen:
    """`pagoda serve` on a free port; returns once /health answers."""
    import httpx
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if args.fake_step_ms is not None:
        cmd = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "fake_engine.py"),
               str(port), str(args.fake_step_ms), args.served_model_name]
    else:
        model = args.model
        if args.model_config:
            model = dummy_model_dir(args.model_config)
            add_word_tokenizer(model)
        cmd = [sys.executable, *pagoda_cli(), "serve", "--host", "127.0.0.1", "--port", str(port),
               "--served-model-name", args.served_model_name, "--dtype", args.dtype, "--uvicorn-log-level", "warning"]
        cmd += ["--model", model] if model else []
        cmd += ["--load-format", "dummy"] if args.model_config else []
        cmd += ["--max-model-len", str(args.max_model_len)] if args.max_model_len else []
        cmd += args.server_args.split()
    proc = subprocess.Popen(cmd)
    args.base_url = f"http://127.0.0.1:{port}"
    deadline = time.time() + args.server_timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}: {' '.join(cmd)}")
        try:
            if httpx.get(args.base_url + "/health").status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise RuntimeError(f"the server did not answer /health within {args.server_timeout} s")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cpu", action="store_true", help="SmolLM2 float32, prompts 32-128, outputs 16-64")
    p.add_argument("--base-url", default=None, help="a running server; default: start `pagoda serve`")
    p.add_argument("--model", default=None, help="for the started server (default: the embedded SmolLM2)")
    p.add_argument("--model-config", default=None, help="config.json: the started server loads dummy weights")
    p.add_argument("--served-model-name", default="bench")
    p.add_argument("--fake-step-ms", type=float, default=None,
                   help="serve a stand-in engine whose steps take this long (fake_engine.py): the server's own cost")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--server-args", default="", help="more `pagoda serve` flags, one string")
    p.add_argument("--server-timeout", type=float, default=600)
    p.add_argument("--num-prompts", type=int, default=512)
    p.add_argument("--prompt-len", type=int, nargs=2, default=[100, 1024])
    p.add_argument("--output-len", type=int, nargs=2, default=[100, 1024])
    p.add_argument("--request-rates", type=float, nargs="+", default=[4, 16, 64, float("inf")],
                   help="requests/s; inf sends every request at once")
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=50.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.environ.get("OUT", "results"))
    args = p.parse_args()
    if args.cpu:
        args.prompt_len, args.output_len, args.dtype = [32, 128], [16, 64], "float32"
        args.max_model_len = args.max_model_len or 512
    prompts, output_lens = requests_for(args, args.num_prompts)
    proc = None if args.base_url else start_server(args)
    try:
        # Each run its own token ids (the same lengths): a prompt sent again would be served from
        # the prefix cache, without its prefill.
        vocab = vocab_for(args)
        runs = [fresh_token_ids(prompts, vocab, args.seed + 1 + i) for i in range(len(args.request_rates) + 1)]
        asyncio.run(run_rate(args, float("inf"), runs[0][:2], [4, 4]))      # warm-up (compiles, allocator)
        rows = [asyncio.run(run_rate(args, rate, run, output_lens)) for rate, run in zip(args.request_rates, runs[1:])]
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)
    name = os.path.splitext(os.path.basename(args.model_config or args.model or "smollm2"))[0]
    name = f"fake-engine-{args.fake_step_ms:g}ms" if args.fake_step_ms is not None else name
    result = {"workload": {"num_prompts": args.num_prompts, "prompt_len": args.prompt_len,
                           "output_len": args.output_len, "model": name, "dtype": args.dtype,
                           "base_url": args.base_url if proc is None else "pagoda serve (started)"},
              "rates": rows}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"serve_{name}.json"), "w") as f:
        json.dump(result, f, indent=2)
    print(f"{'rate':>6} {'done':>5} {'req/s':>6} {'out tok/s':>9} {'goodput':>7} "
          f"{'TTFT p50/p95/p99 ms':>22} {'TPOT p50/p95/p99 ms':>22} {'ITL p50/p95/p99 ms':>22}")
    for r in rows:
        def trio(d):
            return "/".join(f"{d.get(f'p{q}', float('nan')):.1f}" for q in PERCENTILES)
        print(f"{r['request_rate']:6g} {r['completed']:5d} {r['request_throughput']:6.2f} {r['output_tok_s']:9.1f} "
              f"{r['goodput_req_s']:7.2f} {trio(r['ttft_ms']):>22} {trio(r['tpot_ms']):>22} {trio(r['itl_ms']):>22}")
    series = {f"{m} p{q}": [r[f"{m.lower()}_ms"].get(f"p{q}") for r in rows]
              for m in ("TTFT", "TPOT") for q in (50, 99)}
    plot = os.path.join(args.out, f"serve_{name}.png")
    if bar_chart(plot, f"W3 serving, {name}", "ms", [f"{r['request_rate']:g} req/s" for r in rows], series):
        print(f"plot: {plot}")


if __name__ == "__main__":
    main()
