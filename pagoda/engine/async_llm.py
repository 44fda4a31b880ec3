"""AsyncLLM: the engine behind an asyncio server. The engine core's loop (``engine_core.py``)
steps the engine while requests exist, on a thread of this process (``AsyncLLM(engine)``) or,
for a server (``AsyncLLM.from_engine_args``), in a process of its own (one per data-parallel
replica: each steps on its own, none waits for another). Its events come back on
that thread (or on the thread reading the process's pipe) and go to each caller's event loop,
one wake-up of each loop a step; ``generate`` is an async iterator of RequestOutputs."""
import asyncio
import itertools
import os
from collections.abc import AsyncIterator, Callable
from functools import partial

from pagoda.engine.arg_utils import EngineArgs
from pagoda.engine.dp_replica import replica_engine, replica_env
from pagoda.engine.engine_core import CoreChannel, EngineCoreProc, EngineDeadError, EngineThread
from pagoda.engine.llm_engine import LLMEngine, load_tokenizer
from pagoda.engine.profiler import profiler_dir
from pagoda.engine.stats import EngineStats, sum_stats
from pagoda.lora.request import LoRARequest
from pagoda.outputs import PoolingRequestOutput, RequestOutput
from pagoda.pooling_params import PoolingParams
from pagoda.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["AsyncLLM", "EngineDeadError"]


class _Stream:
    """Where one request's outputs land, on the caller's event loop. Outputs the reader has not
    taken yet become one: delta outputs are merged (``RequestOutput.add``), so a reader that
    falls behind the engine (hundreds of streams on a small model) catches up in one chunk
    instead of queueing a chunk per step; a cumulative output replaces the one before it."""

    def __init__(self, loop: asyncio.AbstractEventLoop, core: int, deltas: bool):
        self.loop = loop
        self.core = core                    # the engine core that runs the request
        self.deltas = deltas                # RequestOutputKind.DELTA
        self.pending: RequestOutput | BaseException | None = None
        self.ready = asyncio.Event()

    def push(self, item) -> None:
        """On the loop's thread."""
        if self.deltas and isinstance(self.pending, RequestOutput) and isinstance(item, RequestOutput):
            self.pending.add(item)
        elif not isinstance(self.pending, BaseException):
            self.pending = item
        self.ready.set()

    async def get(self):
        await self.ready.wait()
        self.ready.clear()
        item, self.pending = self.pending, None
        return item


def _deliver(batch: list) -> None:
    for stream, item in batch:
        stream.push(item)


def _hand_over(items: list[tuple[_Stream, object]]) -> set[asyncio.AbstractEventLoop]:
    """One step's outputs to their streams: one wake-up of each event loop per step, not one
    per output. Returns the loops that have closed (nobody reads their streams)."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for stream, item in items:
        by_loop.setdefault(stream.loop, []).append((stream, item))
    closed = set()
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_deliver, batch)
        except RuntimeError:
            closed.add(loop)
    return closed


class AsyncLLM:
    def __init__(self, engine: LLMEngine):
        """``engine`` stepped by a thread of this process (it shares the interpreter, and its
        GIL, with the caller's event loop)."""
        self._setup(1)
        self._describe(engine.tokenizer, engine.config.model, engine.config.scheduler.max_model_len, [engine.stats])
        self._cores = [EngineThread(engine, partial(self._dispatch, 0))]

    @classmethod
    def in_engine_process(cls, make_engines: list, make_tokenizer=None, envs: list | None = None) -> "AsyncLLM":
        """The engines ``make_engines`` build (picklable callables), each in a spawned process
        of its own, as vLLM's engine cores (with ``envs[d]`` in core d's environment); several
        are data-parallel replicas, and a request goes to the one with the fewest sequences in
        flight. ``make_tokenizer(model_config)`` loads the tokenizer here."""
        self = cls.__new__(cls)
        self._setup(len(make_engines))
        self._cores = []
        try:
            for d, make_engine in enumerate(make_engines):
                self._cores.append(EngineCoreProc(make_engine, partial(self._dispatch, d), d,
                                                  envs[d] if envs else None))
            infos = [core.wait_ready() for core in self._cores]     # the engines start side by side
            model_config, max_model_len, _ = infos[0]
            tokenizer = make_tokenizer(model_config) if make_tokenizer is not None else None
        except BaseException:
            self.shutdown()
            raise
        self._describe(tokenizer, model_config, max_model_len, [info[2] for info in infos])
        return self

    @classmethod
    def from_engine_args(cls, args: EngineArgs, engine_process: bool | None = None) -> "AsyncLLM":
        """The engine ``args`` describe, in a process of its own (with data_parallel_size D > 1,
        D processes, one a replica) unless ``engine_process`` is False (by default, unless the
        environment sets PAGODA_ENGINE_PROCESS=0; then one engine, or DPEngine's replicas, on a
        thread here)."""
        if engine_process is None:
            engine_process = os.environ.get("PAGODA_ENGINE_PROCESS", "1") != "0"
        if not engine_process:
            return cls(LLMEngine.from_engine_args(args))
        make_tokenizer = lambda model_config: load_tokenizer(args, model_config.path)   # noqa: E731
        make_engines, envs = engine_core_makers(args)
        return cls.in_engine_process(make_engines, make_tokenizer, envs)

    @classmethod
    def connect(cls, conns: list, info: tuple, tokenizer) -> "AsyncLLM":
        """A front of engine cores that run elsewhere (an API server of several: ``conns`` are
        its pipes to each core; ``info`` what the first core's ``wait_ready`` gave). Its
        shutdown only closes its pipes: the cores drop its requests and go on."""
        self = cls.__new__(cls)
        self._setup(len(conns))
        self._cores = [CoreChannel(conn, partial(self._dispatch, d), f"pagoda-engine-reader{d}")
                       for d, conn in enumerate(conns)]
        self._describe(tokenizer, info[0], info[1], [info[2]] * len(conns))
        return self

    def _setup(self, num_cores: int) -> None:
        self.dead: EngineDeadError | None = None
        self._streams: dict[str, _Stream] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._load = [0] * num_cores                # sequences in flight, per engine core
        # The servers' metrics, as the engine measures them for every request (streamed or not,
        # whichever API server it came through): the time between a request's consecutive
        # tokens, and a finished request's (arrival, first token, last token, tokens, finish reasons).
        self.itl_observers: list[Callable[[float], None]] = []
        self.done_observers: list[Callable[[tuple], None]] = []

    def _describe(self, tokenizer, model_config, max_model_len: int, stats: list[EngineStats]) -> None:
        self.tokenizer = tokenizer
        self.model_config = model_config
        self.max_model_len = max_model_len
        self._stats = stats                         # each core's, replaced after each of its steps

    @property
    def stats(self) -> EngineStats:
        """A snapshot of the engine's figures (data-parallel cores' summed)."""
        return self._stats[0] if len(self._stats) == 1 else sum_stats(self._stats)

    # ------------------------------------------------------------------ the caller's side
    async def generate(self, prompt, sampling_params: SamplingParams | PoolingParams, request_id: str,
                       lora_request: LoRARequest | None = None, priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Add the request, then yield its outputs as the engine makes them (a bad request
        raises its ValueError at the first). Leaving the loop early (the client went away, the
        task was cancelled) aborts the request, which frees its KV blocks. ``lora_request`` and
        ``priority``: see LLMEngine.add_request. (PoolingParams: see ``encode``.)"""
        if request_id in self._streams:
            raise ValueError(f"Request id {request_id!r} is already in use.")
        self._check_alive()
        core = min(range(len(self._cores)), key=self._load.__getitem__)
        deltas = getattr(sampling_params, "output_kind", None) == RequestOutputKind.DELTA
        stream = _Stream(asyncio.get_running_loop(), core, deltas)
        self._streams[request_id] = stream
        n = getattr(sampling_params, "n", 1)
        self._load[core] += n                         # (changed on the event loop's thread only)
        finished = False
        try:
            self._cores[core].send(("add", request_id, prompt, sampling_params, priority, lora_request))
            while not finished:
                out = await stream.get()
                if isinstance(out, BaseException):
                    finished = True               # (the engine has let go of it)
                    raise out
                finished = out.finished
                yield out
        finally:
            self._load[core] -= n
            if not finished:
                self.abort(request_id)

    def encode(self, prompt, pooling_params: PoolingParams, request_id: str, lora_request: LoRARequest | None = None,
               priority: int = 0) -> AsyncIterator[PoolingRequestOutput]:
        """A pooling request (an engine with the pooling runner): its one output, the prompt's
        vector, as ``generate`` yields outputs."""
        return self.generate(prompt, pooling_params, request_id, lora_request, priority)

    async def prompt_token_ids(self, prompts: list) -> list[list[int]]:
        """Each prompt's token ids as the engine reads them (tokenized by the engine)."""
        return await self._call("prompt_token_ids", prompts)

    async def start_profile(self) -> None:
        """The torch profiler on every engine core's ranks ($PAGODA_TORCH_PROFILER_DIR, as this
        process sees it), until stop_profile writes the traces."""
        await self._call_all("start_profile", profiler_dir())

    async def stop_profile(self) -> None:
        await self._call_all("stop_profile")

    async def sleep(self, level: int = 1) -> None:
        """LLMEngine.sleep on every engine core (each must be idle)."""
        await self._call_all("sleep", level)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self._call_all("wake_up", tags)

    async def is_sleeping(self) -> bool:
        return any(await self._call_all("is_sleeping"))

    async def reset_prefix_cache(self) -> bool:
        return all(await self._call_all("reset_prefix_cache"))

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """LLMEngine.add_lora on every engine core: a bad adapter raises its ValueError."""
        return all(await self._call_all("add_lora", lora_request))

    async def remove_lora(self, lora_id: int) -> bool:
        """LLMEngine.remove_lora on every engine core (a ValueError while requests use it)."""
        return any(await self._call_all("remove_lora", lora_id))

    async def list_loras(self) -> set[int]:
        return set().union(*await self._call_all("list_loras"))

    def abort(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None and self.dead is None:     # (else it has finished or failed)
            self._cores[stream.core].send(("abort", [request_id]))

    def shutdown(self) -> None:
        for core in self._cores:
            core.close() if isinstance(core, CoreChannel) else core.shutdown()

    def _check_alive(self) -> None:
        if self.dead is not None:
            raise self.dead

    async def _call_all(self, name: str, *args) -> list:
        """engine_core.CALLS[name] on every engine core in turn, their results in order."""
        return [await self._call(name, *args, core=core) for core in range(len(self._cores))]

    async def _call(self, name: str, *args, core: int = 0):
        """engine_core.CALLS[name] on an engine core (the first: what any of them answers)."""
        self._check_alive()
        call_id = next(self._call_ids)
        fut = asyncio.get_running_loop().create_future()
        self._calls[call_id] = fut
        try:
            self._cores[core].send(("call", call_id, name, args))
            return await fut
        finally:
            self._calls.pop(call_id, None)

    # ------------------------------------------------------------------ the engine's side
    def _dispatch(self, core: int, events: list) -> None:
        """One round of engine core ``core``'s events (on its thread, or its pipe's reader)."""
        items = []
        for event in events:
            kind = event[0]
            if kind == "out":
                _, request_id, out, _ = event
                stream = self._streams.get(request_id)
                if stream is not None:
                    items.append((request_id, stream, out))
                    if out.finished:
                        self._streams.pop(request_id, None)
            elif kind == "fail":
                stream = self._streams.pop(event[1], None)
                if stream is not None:
                    items.append((event[1], stream, event[2]))
            elif kind == "reply":
                _, call_id, ok, value = event
                fut = self._calls.get(call_id)
                if fut is not None:
                    fut.get_loop().call_soon_threadsafe(_set_result if ok else _set_exception, fut, value)
            elif kind == "itl":
                for observe in self.itl_observers:
                    for seconds in event[1]:
                        observe(seconds)
            elif kind == "done":
                for observe in self.done_observers:
                    for finished in event[1]:
                        observe(finished)
            elif kind == "stats":
                self._stats[core] = event[1]
            elif kind == "dead":
                self.dead = event[1]
                items += [(rid, stream, event[1]) for rid, stream in list(self._streams.items())]
                self._streams.clear()
                for fut in list(self._calls.values()):
                    fut.get_loop().call_soon_threadsafe(_set_exception, fut, event[1])
        closed = _hand_over([(stream, item) for _, stream, item in items])
        for request_id, stream, _ in items:
            if stream.loop in closed:             # nobody reads it any more
                self.abort(request_id)


def _set_result(fut: asyncio.Future, result) -> None:
    if not fut.done():
        fut.set_result(result)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)


def engine_core_makers(args: EngineArgs) -> tuple[list, list | None]:
    """(the callables that build each engine core's engine, each core's environment): one
    engine, or with data_parallel_size D, D replicas (each core's GPUs in its environment)."""
    dp = args.data_parallel_size
    if dp == 1:
        return [partial(LLMEngine.from_engine_args, args)], None
    # Only the layout here (the replicas make their engine configs: that queries the GPU,
    # which would start CUDA in the server's process).
    device = args.resolved_device()
    parallel = args.parallel_config(device, args.arch_config(args.model_path()))
    envs = [replica_env(d, dp, parallel.world_size) for d in range(dp)] if device == "cuda" else None
    return [partial(replica_engine, args, d, dp) for d in range(dp)], envs
