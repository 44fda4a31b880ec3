"""The ``pagoda`` command: ``pagoda generate`` (batch, offline), ``pagoda chat``
(interactive, streaming) and ``pagoda serve`` (the OpenAI-compatible server)."""
import argparse
import json
import sys
import time
from dataclasses import asdict

from pagoda.sampling_params import RequestOutputKind, SamplingParams


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model folder, .gguf file or cached hub name "
                   "(default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", default=None,
                   help="gptq or awq (found in a quantized checkpoint's config without it)")
    p.add_argument("--load-format", default="auto", help="auto, safetensors, gguf, or dummy (random weights)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split the model over this many processes (GPUs on CUDA)")
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                   help="split the model's layers over this many stages (times -tp processes)")
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="run this many engine replicas, each with the whole model (or its -tp x -pp split)")
    p.add_argument("--enable-expert-parallel", "-ep", action="store_true",
                   help="a mixture of experts' experts shared out whole over the -tp ranks, instead of every "
                        "expert split over them")
    p.add_argument("--distributed-executor-backend", choices=["mp", "ray"], default=None,
                   help="where ranks 1..N-1 of -tp x -pp run: processes of this node (mp, the default) or the "
                        "actors of a Ray cluster (ray: several nodes)")
    p.add_argument("--data-parallel-backend", choices=["mp", "ray"], default="mp",
                   help="where the -dp replicas run: processes of this node (mp, the default) or Ray actors on "
                        "the cluster's nodes (ray: `pagoda generate` / `chat` only; the server's replicas run here)")
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="the KV cache's storage: the model's dtype (auto), or one byte an element (fp8 or "
                        "fp8_e4m3: E4M3; fp8_e5m2)")
    p.add_argument("--calculate-kv-scales", action="store_true",
                   help="an FP8 cache's k/v scales from the first step's keys and values (else the checkpoint's, or 1.0)")
    p.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
                   help="first come first served, or by each request's priority (lower first)")
    p.add_argument("--no-prefix-caching", action="store_true", help="turn the prefix cache off")
    p.add_argument("--disable-hybrid-kv-cache-manager", action="store_true",
                   help="every layer keeps its whole context, also where some have a sliding window (Gemma 2/3)")
    p.add_argument("--disable-sliding-window", action="store_true",
                   help="no sliding window on any layer, the context capped to the window instead")
    p.add_argument("--reasoning-parser", default=None, help="a reasoning model's thinking (<think> ... </think>): "
                   "qwen3 (Qwen3, QwQ), deepseek_r1 (DeepSeek-R1 and its distills) or granite (Granite 3.2 / "
                   "3.3's sentences); structured outputs then hold the answer after it (not granite's), and the "
                   "server returns it apart (the message's `reasoning`)")
    p.add_argument("--runner", default="auto", choices=["auto", "generate", "pooling"],
                   help="generate text, or (pooling) embed or classify prompts: the server's /v1/embeddings, "
                        "/classify, /score, /rerank (auto: pooling for a *ForSequenceClassification model)")
    p.add_argument("--task", default=None, choices=["generate", "embed", "classify", "score"],
                   help="vLLM's older name for --runner")
    p.add_argument("--hf-overrides", type=_json_object, default=None, metavar="JSON",
                   help="config.json entries to set, as a JSON object, e.g. a causal LM reranker read as a "
                        "classifier: '{\"architectures\": [\"Qwen3ForSequenceClassification\"], "
                        "\"classifier_from_token\": [\"no\", \"yes\"], \"is_original_qwen3_reranker\": true}'")
    p.add_argument("--max-logprobs", type=int, default=20,
                   help="the most logprobs (sample or prompt) a request may ask for; -1: no limit")
    p.add_argument("--generation-config", default="auto",
                   help="the requests' default sampling fields (the server's fields a request leaves unset): "
                        "auto (the model's generation_config.json), vllm (none), or a folder holding one")
    p.add_argument("--override-generation-config", type=_json_object, default=None, metavar="JSON",
                   help="entries over the generation config's, e.g. '{\"temperature\": 0.5}'")
    p.add_argument("--speculative-config", type=_json_object, default=None, metavar="JSON",
                   help="speculative decoding with n-gram drafts, e.g. '{\"method\": \"ngram\", "
                        "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4}'")
    p.add_argument("--enable-sleep-mode", action="store_true",
                   help="LLM.sleep / wake_up (the server's /sleep, /wake_up and /is_sleeping with "
                        "VLLM_SERVER_DEV_MODE=1): free the GPU between uses")
    p.add_argument("--enable-lora", action="store_true",
                   help="let requests run with LoRA adapters (the server's --lora-modules)")
    p.add_argument("--max-loras", type=int, default=1, help="the most adapters in one batch")
    p.add_argument("--max-lora-rank", type=int, default=16, help="the highest adapter rank accepted")
    p.add_argument("--max-cpu-loras", type=int, default=None, help="the most adapters kept in host memory")
    p.add_argument("--log-stats", action="store_true",
                   help="log throughput, queue, KV-cache and prefix-cache figures every 5 s (stderr)")


def _json_object(text: str) -> dict:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--top-k", type=int, default=0)


def engine_args_from(args):
    """The engine arguments that ``add_engine_args`` parsed, as EngineArgs."""
    from pagoda.engine.arg_utils import EngineArgs
    if args.log_stats:
        import logging
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    return EngineArgs(model=args.model, dtype=args.dtype, quantization=args.quantization, load_format=args.load_format,
                      max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                      max_num_batched_tokens=args.max_num_batched_tokens, seed=args.seed,
                      tensor_parallel_size=args.tensor_parallel_size,
                      pipeline_parallel_size=args.pipeline_parallel_size,
                      data_parallel_size=args.data_parallel_size,
                      enable_expert_parallel=args.enable_expert_parallel,
                      distributed_executor_backend=args.distributed_executor_backend,
                      data_parallel_backend=args.data_parallel_backend,
                      kv_cache_dtype=args.kv_cache_dtype, calculate_kv_scales=args.calculate_kv_scales,
                      scheduling_policy=args.scheduling_policy,
                      enable_prefix_caching=not args.no_prefix_caching, disable_log_stats=not args.log_stats,
                      runner=args.runner, task=args.task, hf_overrides=args.hf_overrides,
                      generation_config=args.generation_config,
                      override_generation_config=args.override_generation_config,
                      speculative_config=args.speculative_config, enable_sleep_mode=args.enable_sleep_mode,
                      enable_lora=args.enable_lora, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
                      max_cpu_loras=args.max_cpu_loras, reasoning_parser=args.reasoning_parser,
                      max_logprobs=args.max_logprobs,
                      disable_hybrid_kv_cache_manager=args.disable_hybrid_kv_cache_manager,
                      disable_sliding_window=args.disable_sliding_window)


def _make_llm(args):
    from pagoda.llm import LLM
    return LLM(**asdict(engine_args_from(args)))


def _params(args, **extra) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, **extra)


def cmd_generate(args) -> int:
    prompts = list(args.prompts)
    if args.file:
        with open(args.file, encoding="utf-8") as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    if not prompts:
        print("pagoda generate: give prompts as arguments or with --file.", file=sys.stderr)
        return 2
    t0 = time.time()
    llm = _make_llm(args)
    print(f"# model loaded in {time.time() - t0:.1f} s", file=sys.stderr)
    params = _params(args)
    outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params) if args.chat \
        else llm.generate(prompts, params)
    for prompt, out in zip(prompts, outputs):
        print(f"### Prompt: {prompt!r}")
        print(out.outputs[0].text)
        print(f"### ({len(out.outputs[0].token_ids)} tokens, finish_reason={out.outputs[0].finish_reason})\n")
    return 0


def cmd_chat(args) -> int:
    llm = _make_llm(args)
    engine, tok = llm.llm_engine, llm.get_tokenizer()
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("pagoda chat: type a message; an empty line or Ctrl-D quits.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        req_id = engine.add_request(None, tok.chat_prompt(messages, add_generation_prompt=True),
                                    _params(args, output_kind=RequestOutputKind.DELTA))
        reply = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id == req_id:
                    delta = out.outputs[0].text
                    reply.append(delta)
                    print(delta, end="", flush=True)
        print()
        messages.append({"role": "assistant", "content": "".join(reply)})
    return 0


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="the name(s) the API answers to (default: --model, or the embedded model's name)")
    p.add_argument("--api-key", default=None, help="require this key as `Authorization: Bearer KEY`")
    p.add_argument("--uvicorn-log-level", default="info")
    p.add_argument("--api-server-count", "-asc", type=int, default=1,
                   help="API server processes, each with its own event loop, on one port and over the same "
                        "engine (for request rates one event loop cannot keep up with)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='parse tool calls out of chat answers when a request has tools (tool_choice "auto")')
    p.add_argument("--tool-call-parser", default=None, help="the tool-call format of the model: hermes (Qwen2.5/3), "
                   "llama3_json (Llama 3.1-3.3), mistral, pythonic (Llama 3.2/4), qwen3_coder (Qwen3-Coder), "
                   "granite (Granite 3), phi4_mini_json (Phi-4-mini), internlm (InternLM2.5/3)")
    p.add_argument("--lora-modules", nargs="+", type=_lora_module, default=None, metavar="NAME=PATH",
                   help="LoRA adapters (with --enable-lora) that requests name as their model: NAME=PATH, or JSON "
                        "'{\"name\": \"sql\", \"path\": \"/adapters/sql\", \"base_model_name\": \"...\"}'")


def _lora_module(text: str):
    """One --lora-modules entry, in either of vLLM's forms."""
    from pagoda.entrypoints.openai.serving_models import LoRAModulePath
    if text.lstrip().startswith("{"):
        try:
            return LoRAModulePath(**_json_object(text))
        except (TypeError, json.JSONDecodeError) as e:
            raise argparse.ArgumentTypeError(f"expected a JSON object with \"name\" and \"path\" (and optionally "
                                             f"\"base_model_name\"), got {text!r} ({e})") from None
    name, _, path = text.partition("=")
    if not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH or a JSON object, got {text!r}")
    return LoRAModulePath(name, path)


def cmd_serve(args) -> int:
    try:
        from pagoda.entrypoints.openai.api_server import run_server
    except ImportError as e:
        raise ValueError(f"the server needs its extra dependencies ({e.name} is missing): "
                         "pip install 'pagoda-llm[serve]'") from None
    args.model = args.model_tag or args.model
    run_server(args)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="pagoda", description="pagoda LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate completions for prompts (offline, batched)")
    g.add_argument("prompts", nargs="*", help="prompts (also see --file)")
    g.add_argument("--file", help="a text file with one prompt per line")
    g.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    add_engine_args(g)
    _sampling_args(g)
    g.set_defaults(func=cmd_generate)
    c = sub.add_parser("chat", help="interactive chat, streaming to the terminal")
    c.add_argument("--system", default=None, help="system prompt")
    add_engine_args(c)
    _sampling_args(c)
    c.set_defaults(func=cmd_chat)
    v = sub.add_parser("serve", help="the OpenAI-compatible HTTP server")
    v.add_argument("model_tag", nargs="?", default=None, help="the model (same as --model)")
    add_serve_args(v)
    add_engine_args(v)
    v.set_defaults(func=cmd_serve)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, NotImplementedError) as e:
        # Bad input is the user's to fix: say what, without a traceback.
        print(f"pagoda: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
