"""The engine core (``pagoda.engine.engine_core``): its loop's commands and failures, outputs
across the process boundary, and a server's AsyncLLM when the engine's process dies."""
import asyncio
import os
import signal
import time

import pytest

from pagoda.engine.async_llm import AsyncLLM
from pagoda.engine.engine_core import EngineDeadError, pack_output, run_engine_loop, unpack_output
from pagoda.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pagoda.sampling_params import RequestOutputKind, SamplingParams
from tests.stub_engine import StubEngine


def _delta(**kwargs) -> SamplingParams:
    """The stub's outputs are deltas, as a server asks for them."""
    return SamplingParams(output_kind=RequestOutputKind.DELTA, **kwargs)


def _run_loop(engine, commands: list, num_fronts: int = 1) -> list:
    """Run the loop over ``commands`` (a None: step until the engine is idle; an int: step that
    many times; (front, command) from a front but the first), then shut down; returns every
    event emitted, a list per front with several."""
    pending, events = list(commands) + [("shutdown", ())], [[] for _ in range(num_fronts)]
    steps_left = [0]

    def next_command(block):
        if steps_left[0]:
            steps_left[0] -= 1
            return None
        if pending and (pending[0] is not None or not engine.has_unfinished_requests()):
            cmd = pending.pop(0)
            if isinstance(cmd, int):
                steps_left[0] = cmd - 1
                return None
            if cmd is None:
                return next_command(block)
            return cmd if isinstance(cmd[0], int) else (0, cmd)
        assert not block, "the loop blocked while commands were waiting"
        return None

    def emit(per_front):
        for front, got in zip(events, per_front):
            front += got

    run_engine_loop(engine, next_command, emit, num_fronts)
    return events[0] if num_fronts == 1 else events


def test_engine_loop_commands_and_failures():
    engine = StubEngine(fail_at=4)
    params = SamplingParams(max_tokens=2)
    events = _run_loop(engine, [
        ("add", "a", [1, 2], params, 0, None), ("add", "bad", [], params, 0, None), ("call", 7, "prompt_token_ids", ([[4, 5]],)),
        None,                                       # a: two steps, then done
        ("add", "b", [3], SamplingParams(max_tokens=9), 0, None), ("add", "c", [3], SamplingParams(max_tokens=9), 0, None),
        ("abort", ["c", "never-added"]), None])     # b: one step, then the fourth fails
    kinds = [e[0] for e in events]
    assert ("fail", "bad") in [(e[0], e[1]) for e in events]
    assert isinstance(next(e for e in events if e[:2] == ("fail", "bad"))[2], ValueError)
    assert ("reply", 7, True, [[4, 5]]) in events
    outs = [e for e in events if e[0] == "out"]
    assert [(e[1], e[2].outputs[0].token_ids, e[3]) for e in outs] == [("a", [1], True), ("a", [2], False),
                                                                       ("b", [1], True)]
    assert engine.aborted == ["c", "b"]             # the abort, then the failed step's live requests
    fail_b = next(e for e in events if e[:2] == ("fail", "b"))
    assert isinstance(fail_b[2], EngineDeadError) and "device lost" in str(fail_b[2])
    assert ("aborted", "c") in events and ("aborted", "never-added") not in events
    assert kinds.count("stats") >= 3 and events[-1][0] == "stats" and not engine.running


def test_engine_loop_routes_each_front_its_requests():
    """Several API servers over one engine core: a request's outputs (and a call's reply) go to
    the front that sent it; the engine's figures and every finished request's latencies to
    every front (each one's /metrics is the whole engine's); a front that is gone has its
    requests aborted, and the others go on."""
    engine = StubEngine()
    per_front = _run_loop(engine, [
        (0, ("add", "a", [1], _delta(max_tokens=2), 0, None)), (1, ("add", "b", [2], _delta(max_tokens=50), 0, None)),
        (1, ("add", "c", [3], _delta(max_tokens=3), 0, None)), (1, ("call", 4, "prompt_token_ids", ([[9]],))),
        3,                                          # a and c finish, b runs on
        (1, ("gone", ())), None], num_fronts=2)
    outs = [{e[1] for e in events if e[0] == "out"} for events in per_front]
    assert outs == [{"a"}, {"b", "c"}]
    assert ("reply", 4, True, [[9]]) in per_front[1] and not any(e[0] == "reply" for e in per_front[0])
    assert engine.aborted == ["b"] and not engine.running
    for events in per_front:
        done = sorted(d for e in events if e[0] == "done" for d in e[1])
        assert [(d[3], d[4]) for d in done] == [(2, ["length"]), (3, ["length"])]   # tokens, finish reasons
        assert all(d[0] <= d[1] <= d[2] for d in done)                           # arrival, first, last token
        assert [e[0] for e in events].count("stats") == [e[0] for e in per_front[0]].count("stats")


def test_outputs_cross_the_pipe_unchanged():
    lps = [{5: Logprob(-0.5, 1, "a"), 9: Logprob(-1.5, 2, "b")}]
    metrics = RequestMetrics(1.0, 1.5, 2.0, 3.0, 3.5, 1)

    def out(step: int, finished: bool) -> RequestOutput:
        return RequestOutput("r", "hi", [1, 2, 3], [None, {2: Logprob(-2.0, 1, "x")}],
                             [CompletionOutput(0, f"s{step}", [step], -0.5, lps, "length" if finished else None),
                              CompletionOutput(1, "", [], None, None)], finished,
                             metrics if finished else None, num_cached_tokens=2)

    prompts: dict = {}
    for step, first, finished in ((1, True, False), (2, False, False), (3, False, True)):
        sent = out(step, finished)
        got = unpack_output(pack_output(sent, first), prompts)
        if not finished:                     # the metrics travel with the last output only
            sent.metrics = None
        assert got == sent
    assert prompts == {}                     # forgotten once finished


def test_engine_process_death_fails_the_streams_and_later_requests():
    from functools import partial
    llm = AsyncLLM.in_engine_process([partial(StubEngine, step_s=0.02)])
    assert (llm.model_config.model, llm.max_model_len) == ("stub", 64)
    pid = llm._cores[0].procs[0].pid

    async def run():
        got = []
        with pytest.raises(EngineDeadError):
            async for o in llm.generate([1, 2], SamplingParams(max_tokens=10_000), "long"):
                got.append(o)
                if len(got) == 3:
                    os.kill(pid, signal.SIGKILL)
        assert len(got) >= 3
        with pytest.raises(EngineDeadError):
            await anext(llm.generate([1], SamplingParams(max_tokens=2), "after"))
        with pytest.raises(EngineDeadError):
            await llm.prompt_token_ids([[1]])

    try:
        asyncio.run(asyncio.wait_for(run(), 60))
    finally:
        llm.shutdown()


def test_engine_process_serves_and_stops():
    """Requests, a bad one's error and a call through the process; shutdown ends it."""
    from functools import partial
    llm = AsyncLLM.in_engine_process([partial(StubEngine)])

    async def run():
        tokens = [t for o in [o async for o in llm.generate([1], _delta(max_tokens=4), "r")]
                  for t in o.outputs[0].token_ids]
        with pytest.raises(ValueError, match="empty"):
            await anext(llm.generate([], SamplingParams(max_tokens=4), "bad"))
        left = llm.generate([7, 8], SamplingParams(max_tokens=1000), "left")   # abandoned after two outputs
        assert (await anext(left)).prompt_token_ids == (await anext(left)).prompt_token_ids == [7, 8]
        await left.aclose()
        return tokens, await llm.prompt_token_ids([[4, 5], [6]])

    try:
        assert asyncio.run(asyncio.wait_for(run(), 60)) == ([1, 2, 3, 4], [[4, 5], [6]])
        deadline = time.time() + 10
        while llm.stats.num_running and time.time() < deadline:
            time.sleep(0.01)
        assert llm.stats.num_running == 0
        assert llm._cores[0].channel._prompts == {}        # the abandoned request's prompt is not kept
    finally:
        llm.shutdown()
    assert not llm._cores[0].procs[0].is_alive()


def test_data_parallel_engine_cores_share_the_requests():
    """Two engine cores (data-parallel replicas): a request goes to the one with the fewest in
    flight, each streams its own requests' tokens, the stats are summed; a bad request is
    answered by the core it went to."""
    from functools import partial
    llm = AsyncLLM.in_engine_process([partial(StubEngine, step_s=0.01), partial(StubEngine, step_s=0.01)])

    async def one(i: int):
        return [t for o in [o async for o in llm.generate([i + 1], _delta(max_tokens=3 + i), f"r{i}")]
                for t in o.outputs[0].token_ids]

    async def run():
        got = await asyncio.gather(*(one(i) for i in range(4)))
        with pytest.raises(ValueError, match="empty"):
            await anext(llm.generate([], SamplingParams(max_tokens=4), "bad"))
        return got

    try:
        assert asyncio.run(asyncio.wait_for(run(), 60)) == [list(range(1, 4 + i)) for i in range(4)]
        # r0, r2 on core 0 (3 and 5 tokens), r1, r3 on core 1 (4 and 6): at least 5 and 6 steps
        steps = [s.num_steps for s in llm._stats]
        assert steps[0] >= 5 and steps[1] >= 6 and llm.stats.num_steps == sum(steps)
        assert llm._load == [0, 0]
    finally:
        llm.shutdown()
    assert not any(core.procs[0].is_alive() for core in llm._cores)
