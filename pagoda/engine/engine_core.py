"""The engine core: the loop that steps the engine for a server. Between steps it runs the
commands that came (add, abort, a call); it steps while requests exist and sleeps on its
commands when none do; each step's events go out at once. AsyncLLM runs the loop on a thread
of its own process (``EngineThread``) or, as vLLM's engine core and by default for
``pagoda serve``, in a spawned process of its own (``EngineCoreProc``): the server's event loop
and the engine loop then hold a GIL each, and neither waits for the other's Python.

Several API servers (``pagoda serve --api-server-count N``) are fronts of one engine core, each
over a pipe of its own: a request's events go to the front that added it, the engine's figures
(stats, inter-token latencies, the finished requests' latencies) to every front, so each one's
/metrics describes the whole engine.

Commands, plain tuples:  ("add", request_id, prompt, params, priority, lora_request) |
                         ("abort", [request_ids]) | ("call", call_id, name, args) |
                         ("gone", ()) (a front's pipe closed) | ("shutdown", ())
Events, a list a step:   ("out", request_id, RequestOutput, first) | ("fail", request_id, error) |
                         ("aborted", request_id) | ("reply", call_id, ok, value) |
                         ("itl", [seconds]) | ("done", [(arrival, first token, last token, tokens,
                         finish reasons)]) | ("stats", EngineStats) | ("dead", error)

Across the process boundary an output travels as a tuple of plain values (``pack_output``):
pickling a step's 256 RequestOutput dataclasses took 1.2 ms and unpickling 1.9 (this CPU),
their tuples 0.06 and 0.11. A request's prompt (its token ids) goes with its first output only."""
import logging
import pickle
import queue
import signal
import threading
from dataclasses import astuple, dataclass, field
from multiprocessing.connection import wait

from pagoda.distributed.child_procs import SPAWN_HINT, ChildProcs, picklable
from pagoda.outputs import CompletionOutput, PoolingRequestOutput, RequestMetrics, RequestOutput
from pagoda.sampling_params import RequestOutputKind

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    pass


# What a "call" command may run on the engine.
CALLS = {"prompt_token_ids": lambda engine, prompts: [engine.prompt_token_ids(p) for p in prompts],
         "start_profile": lambda engine, directory: engine.start_profile(directory),
         "stop_profile": lambda engine: engine.stop_profile(),
         "sleep": lambda engine, level: engine.sleep(level),
         "wake_up": lambda engine, tags: engine.wake_up(tags),
         "is_sleeping": lambda engine: engine.is_sleeping(),
         "reset_prefix_cache": lambda engine: engine.reset_prefix_cache(),
         "add_lora": lambda engine, lora_request: engine.add_lora(lora_request),
         "remove_lora": lambda engine, lora_id: engine.remove_lora(lora_id),
         "list_loras": lambda engine: engine.list_loras()}


@dataclass
class _Live:
    """A request in the engine, as the loop follows it."""
    front: int                     # the front that added it, which gets its events
    deltas: bool                   # its outputs are deltas (RequestOutputKind.DELTA)
    seen: bool = False             # it has had an output
    tokens: dict = field(default_factory=dict)     # sample index -> tokens so far


def run_engine_loop(engine, next_command, emit, num_fronts: int = 1) -> None:
    """Serve ``engine`` until a "shutdown" command. ``next_command(block)`` returns the next
    (front, command), or None when ``block`` is False and none is waiting; ``emit(events)``
    hands out what one round made: a list of events per front."""
    requests: dict[str, _Live] = {}
    while True:
        # Idle: block until a command comes. Busy: take what has come, then step.
        events: list[list] = [[] for _ in range(num_fronts)]
        shared, block = [], not engine.has_unfinished_requests()
        while (got := next_command(block)) is not None:
            front, cmd = got
            if cmd[0] == "shutdown":
                return
            try:
                events[front] += _command(engine, cmd, front, requests)
            except Exception:             # noqa: BLE001 - a failed abort must not end the loop
                logger.exception("An engine command failed.")
            block = False
        if engine.has_unfinished_requests():
            stepped, done = _step(engine, requests)
            for front, event in stepped:
                events[front].append(event)
            if done:
                shared.append(("done", done))
            if latencies := engine.take_inter_token_latencies():
                shared.append(("itl", latencies))
        shared.append(("stats", engine.stats))     # (after an abort too: its blocks are free)
        emit([front_events + shared for front_events in events])


def _command(engine, cmd: tuple, front: int, requests: dict[str, _Live]) -> list:
    kind = cmd[0]
    if kind == "add":
        _, request_id, prompt, params, priority, lora_request = cmd
        try:
            engine.add_request(request_id, prompt, params, priority=priority, lora_request=lora_request)
        except Exception as e:            # noqa: BLE001 - a bad request: its caller's error
            return [("fail", request_id, picklable(e))]
        requests[request_id] = _Live(front, getattr(params, "output_kind", None) == RequestOutputKind.DELTA)
    elif kind == "abort":
        ids = [r for r in cmd[1] if requests.pop(r, None) is not None]
        if ids:
            engine.abort_request(ids)
            return [("aborted", r) for r in ids]
    elif kind == "gone":                  # nobody reads this front's requests any more
        ids = [r for r, live in requests.items() if live.front == front]
        for r in ids:
            del requests[r]
        if ids:
            engine.abort_request(ids)
    elif kind == "call":
        _, call_id, name, args = cmd
        try:
            return [("reply", call_id, True, CALLS[name](engine, *args))]
        except Exception as e:            # noqa: BLE001 - raised by the caller
            return [("reply", call_id, False, picklable(e))]
    else:
        raise ValueError(f"Unknown engine command {kind!r}.")
    return []


def _step(engine, requests: dict[str, _Live]) -> tuple[list, list]:
    """One step's (front, event) pairs, and its finished requests' latencies for the metrics."""
    try:
        outputs = engine.step()
    except Exception as e:                # noqa: BLE001 - fail the requests, keep serving
        logger.exception("Engine step failed; aborting %d requests.", len(requests))
        engine.abort_request(list(requests))
        error = EngineDeadError(f"The engine step failed: {e}")
        events = [(live.front, ("fail", request_id, error)) for request_id, live in requests.items()]
        requests.clear()
        return events, []
    events, done = [], []
    for out in outputs:
        live = requests.get(out.request_id)
        if live is None:                  # (aborted by then)
            continue
        first, live.seen = not live.seen, True
        if isinstance(out, RequestOutput):
            for c in out.outputs:
                live.tokens[c.index] = len(c.token_ids) + (live.tokens.get(c.index, 0) if live.deltas else 0)
        if out.finished:
            del requests[out.request_id]
            if isinstance(out, RequestOutput) and out.metrics is not None:
                m = out.metrics
                done.append((m.arrival_time, m.first_token_time, m.last_token_time, max(live.tokens.values()),
                             [c.finish_reason or "abort" for c in out.outputs]))
        events.append((live.front, ("out", out.request_id, out, first)))
    return events, done


# ---------------------------------------------------------------------- one process
class EngineThread:
    """The loop on a thread of this process (the engine object lives here)."""

    def __init__(self, engine, dispatch):
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=run_engine_loop, args=(engine, self._next, lambda e: dispatch(e[0])),
                                        name="pagoda-engine", daemon=True)
        self._thread.start()

    def _next(self, block: bool):
        try:
            return 0, self._commands.get(block=block)
        except queue.Empty:
            return None

    def send(self, cmd: tuple) -> None:
        self._commands.put(cmd)

    def shutdown(self) -> None:
        self.send(("shutdown", ()))
        self._thread.join(timeout=30)


# ---------------------------------------------------------------------- a process of its own
def pack_output(out: RequestOutput | PoolingRequestOutput, first: bool) -> tuple | PoolingRequestOutput:
    """``out`` as plain values; the prompt only with a request's first output, the metrics only
    with its last (what the server reads of them). A pooling request's one output goes as it is."""
    if isinstance(out, PoolingRequestOutput):
        return out
    completions = tuple((c.index, c.text, c.token_ids, c.cumulative_logprob, c.logprobs, c.finish_reason,
                         c.stop_reason) for c in out.outputs)
    prompt = (out.prompt, out.prompt_token_ids, out.prompt_logprobs) if first or out.finished else None
    metrics = astuple(out.metrics) if out.finished and out.metrics is not None else None
    return out.request_id, out.finished, completions, prompt, metrics, out.num_cached_tokens


def unpack_output(packed: tuple, prompts: dict) -> RequestOutput:
    """The RequestOutput ``pack_output`` packed; ``prompts`` keeps each live request's prompt."""
    if isinstance(packed, PoolingRequestOutput):
        return packed
    request_id, finished, completions, prompt, metrics, num_cached = packed
    if prompt is None:
        prompt = prompts.get(request_id, (None, [], None))
    elif not finished:
        prompts[request_id] = prompt
    if finished:
        prompts.pop(request_id, None)
    return RequestOutput(request_id, prompt[0], prompt[1], prompt[2], [CompletionOutput(*c) for c in completions],
                         finished, RequestMetrics(*metrics) if metrics is not None else None, num_cached)


def _core_main(make_engine, fronts: list, conn) -> None:
    """The engine core process: build the engine, then run the loop until told to stop or the
    server's process is gone. Its requests come over ``conn`` from the server's process, or,
    with several API servers, over ``fronts`` (a pipe from each), ``conn`` then only its control."""
    # Ctrl-C reaches the whole process group: the server shuts this process down itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn.send(("started", None))
    try:
        engine = make_engine()
        conn.send(("ok", (engine.config.model, engine.config.scheduler.max_model_len, engine.stats)))
    except Exception as e:                # noqa: BLE001 - raised by the server's AsyncLLM(...)
        conn.send(("raise", picklable(e)))
        conn.close()
        return
    channels = list(fronts) or [conn]     # where requests come from and their events go
    open_fronts = set(range(len(channels)))

    def next_command(block: bool):
        watched = [channels[i] for i in sorted(open_fronts)] + ([conn] if fronts else [])
        ready = wait(watched, None if block else 0)
        if not ready:
            return None
        c = ready[0]
        front = 0 if c is conn else channels.index(c)
        try:
            return front, pickle.loads(c.recv_bytes())
        except (EOFError, OSError):
            if c is conn:                 # the server's process has exited
                return 0, ("shutdown", ())
            open_fronts.discard(front)    # an API server has exited: its requests go
            return front, ("gone", ())

    def emit(events: list[list]) -> None:
        for front in sorted(open_fronts):
            packed = [("out", e[1], pack_output(e[2], e[3])) if e[0] == "out" else e for e in events[front]]
            try:
                channels[front].send_bytes(pickle.dumps(packed, protocol=pickle.HIGHEST_PROTOCOL))
            except OSError:               # (gone: next_command sees its end)
                pass

    run_engine_loop(engine, next_command, emit, len(channels))
    del engine                            # (stops its own workers or replicas now)
    conn.close()


class CoreChannel:
    """A front's pipe to an engine core: commands out, and a thread that reads the core's events
    and hands them to ``dispatch`` (the core's death too, when the pipe ends)."""

    def __init__(self, conn, dispatch, name: str, exit_code=lambda: None):
        self._conn, self._dispatch, self._exit_code = conn, dispatch, exit_code
        self._lock = threading.Lock()             # sends come from the event loop and the reader
        self._prompts: dict[str, tuple] = {}
        threading.Thread(target=self._read_events, name=name, daemon=True).start()

    def send(self, cmd: tuple) -> None:
        data = pickle.dumps(cmd, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            with self._lock:
                self._conn.send_bytes(data)
        except (OSError, ValueError) as e:
            raise EngineDeadError(f"The engine core process has stopped ({e}).") from e

    def close(self) -> None:
        """(An API server's: the core then drops this front's requests and goes on.)"""
        self._conn.close()

    def _read_events(self) -> None:
        while True:
            try:
                events = pickle.loads(self._conn.recv_bytes())
            except (EOFError, OSError):
                code = self._exit_code()
                self._dispatch([("dead", EngineDeadError("The engine core process has stopped" +
                                                         (f" (exit code {code})." if code is not None else ".")))])
                return
            for e in events:
                if e[0] in ("aborted", "fail"):   # (nothing of it comes after this on the pipe)
                    self._prompts.pop(e[1], None)
            self._dispatch([("out", e[1], unpack_output(e[2], self._prompts), False) if e[0] == "out" else e
                            for e in events])


class EngineCoreProc(ChildProcs):
    """The loop in a spawned process (the engine, its model and its GPU live there), started
    here; ``wait_ready()`` waits for its engine, then this process is its front (a CoreChannel
    over the pipe), unless ``fronts`` are given: the core ends of pipes from API servers in
    processes of their own (``pagoda serve --api-server-count``). Not daemonic: a
    data-parallel engine spawns its replicas from it."""
    child_name = "engine core"
    daemon = False

    def __init__(self, make_engine, dispatch, index: int = 0, env: dict[str, str] | None = None,
                 fronts: list = ()):
        self.first_id = index
        self._dispatch = dispatch
        self.channel: CoreChannel | None = None
        self._start_children(_core_main, lambda i: (make_engine, list(fronts)), 1, (lambda i: env) if env else None)
        self._fronts = bool(fronts)

    def wait_ready(self) -> tuple:
        """The engine's (model config, max_model_len, stats) once it has started (its tokenizer
        is not sent: the server loads its own); its start-up error raises here."""
        self._replies(SPAWN_HINT)
        (info,) = self._replies()
        if not self._fronts:
            self.channel = CoreChannel(self.conns[0], self._dispatch, f"pagoda-engine-reader{self.first_id}",
                                       lambda: self.procs[0].exitcode)
        return info

    def send(self, cmd: tuple) -> None:
        self.channel.send(cmd)
