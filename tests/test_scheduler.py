"""The scheduler on its own, with a fake model that always samples token 7."""
from pagoda.config import SchedulerConfig
from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.request import Request, RequestStatus
from pagoda.core.scheduler import Scheduler
from pagoda.core.sched_output import ModelRunnerOutput
from pagoda.sampling_params import SamplingParams


def make(budget=64, max_seqs=8, num_blocks=64, block_size=4, max_len=256, caching=True, policy="fcfs", batches=1):
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, max_model_len=max_len, policy=policy,
                          max_concurrent_batches=batches)
    return Scheduler(cfg, KVCacheManager(num_blocks, block_size, enable_caching=caching))


def req(i, n, max_tokens=4, **kw):
    # Distinct prompts, so the prefix cache stays out of these tests (it has its own below).
    return Request(f"r{i}", list(range(1000 * i + 10, 1000 * i + 10 + n)), SamplingParams(max_tokens=max_tokens, **kw),
                   eos_token_id=2, max_tokens=max_tokens)


def run_step(s: Scheduler, token=7):
    out = s.schedule()
    sampled = {}
    for rid, n in out.num_scheduled_tokens.items():
        r = s.requests[rid]
        if r.num_computed_tokens == r.num_tokens:
            sampled[rid] = token
    return out, s.update_from_output(out, ModelRunnerOutput(sampled))


def test_budget_running_first_and_chunked_prefill():
    s = make(budget=10)
    s.add_request(req(0, 6))
    s.add_request(req(1, 9))
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {"r0": 6, "r1": 4}          # r1 chunked to fit
    assert out.total_num_scheduled_tokens == 10
    out, _ = run_step(s)
    assert list(out.num_scheduled_tokens.items()) == [("r0", 1), ("r1", 5)]   # running first


def test_max_num_seqs_limits_admission():
    s = make(max_seqs=2)
    for i in range(3):
        s.add_request(req(i, 3))
    out, _ = run_step(s)
    assert set(out.num_scheduled_tokens) == {"r0", "r1"}
    assert [r.request_id for r in s.waiting] == ["r2"]


def test_finished_requests_leave_and_waiting_join():
    s = make(max_seqs=1)
    s.add_request(req(0, 3, max_tokens=2))
    s.add_request(req(1, 3, max_tokens=2))
    steps = []
    while s.has_unfinished_requests():
        out, updated = run_step(s)
        steps.append(list(out.num_scheduled_tokens))
    assert steps == [["r0"], ["r0"], ["r1"], ["r1"]]
    assert s.kv.num_free_blocks == s.kv.pool.num_usable_blocks


def test_preempts_newest_when_blocks_run_out_and_recomputes():
    # 4 usable blocks of 4 tokens: two requests of 7 prompt tokens fit, but not their growth.
    s = make(num_blocks=5, block_size=4)
    a, b = req(0, 7, max_tokens=8), req(1, 7, max_tokens=8)
    s.add_request(a)
    s.add_request(b)
    seen_preempt = False
    while s.has_unfinished_requests():
        out, _ = run_step(s)
        if b.status == RequestStatus.PREEMPTED or b.num_preemptions:
            seen_preempt = True
            assert a.status != RequestStatus.PREEMPTED or a.num_preemptions == 0
    assert seen_preempt and s.stats.num_preemptions >= 1
    assert a.num_preemptions == 0, "the oldest request is never the victim while a newer one runs"
    assert a.output_token_ids == [7] * 8 and b.output_token_ids == [7] * 8
    assert s.kv.num_free_blocks == s.kv.pool.num_usable_blocks


def test_priority_policy_admits_lowest_first_and_preempts_the_last():
    """scheduling_policy="priority": the queue in (priority, arrival) order, lowest first; when
    blocks run out, the running request last in that order is preempted, also one the step had
    already scheduled (its tokens and budget are taken back), and it waits in its place."""
    s = make(max_seqs=1, policy="priority")
    for i, prio in enumerate([2, 0, 1, 0]):
        r = req(i, 3, max_tokens=1)
        r.priority = prio
        s.add_request(r)
    order = []
    while s.has_unfinished_requests():
        out, _ = run_step(s)
        order += [rid for rid in out.num_scheduled_tokens if rid not in order]
    assert order == ["r1", "r3", "r2", "r0"]
    # 4 usable blocks of 4: an urgent request admitted after a lax one (newest: first come first
    # served would preempt it) is not the victim; the lax one is, though the step had scheduled
    # it already (its decode fit its blocks; the urgent one's needed a new block)
    s = make(num_blocks=5, block_size=4, policy="priority")
    lax, urgent = req(0, 6, max_tokens=8), req(1, 8, max_tokens=8)
    lax.priority, urgent.priority = 5, 0
    s.add_request(lax)
    run_step(s)
    s.add_request(urgent)
    while s.has_unfinished_requests():
        out, _ = run_step(s)
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
        assert {c.req_id for c in out.cached_reqs} <= set(out.num_scheduled_tokens)
    assert urgent.num_preemptions == 0 and lax.num_preemptions >= 1
    assert urgent.output_token_ids == [7] * 8 and lax.output_token_ids == [7] * 8
    assert s.kv.num_free_blocks == s.kv.pool.num_usable_blocks


def test_stop_rules():
    s = make()
    r_eos = req(0, 3, max_tokens=10)
    r_ignore = req(1, 3, max_tokens=3, ignore_eos=True)
    r_stop_id = req(2, 3, max_tokens=10, stop_token_ids=[2, 9])
    r_min = req(3, 3, max_tokens=10, min_tokens=2)
    for r in (r_eos, r_ignore, r_stop_id, r_min):
        s.add_request(r)
    run_step(s, token=2)
    assert r_eos.status == RequestStatus.FINISHED_STOPPED and r_eos.stop_reason is None
    assert r_stop_id.status == RequestStatus.FINISHED_STOPPED and r_stop_id.stop_reason is None  # EOS first
    assert r_ignore.status == RequestStatus.RUNNING
    assert r_min.status == RequestStatus.RUNNING       # min_tokens holds the stop back
    run_step(s, token=9)
    run_step(s, token=2)
    assert r_min.status == RequestStatus.FINISHED_STOPPED
    assert r_ignore.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert r_ignore.num_output_tokens == 3


def test_max_model_len_caps_generation():
    s = make(max_len=10)
    r = req(0, 8, max_tokens=100)
    s.add_request(r)
    while s.has_unfinished_requests():
        run_step(s)
    assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED and r.num_tokens == 10


def test_abort_frees_blocks_of_running_and_waiting():
    s = make(max_seqs=1)
    s.add_request(req(0, 5))
    s.add_request(req(1, 5))
    run_step(s)
    s.finish_requests(["r0", "r1"], RequestStatus.FINISHED_ABORTED)
    assert not s.has_unfinished_requests()
    assert s.kv.num_free_blocks == s.kv.pool.num_usable_blocks
    out = s.schedule()
    assert out.is_empty and out.finished_req_ids == {"r0", "r1"}


def shared(i, n, max_tokens=4, **kw):
    """Requests whose prompts are the same tokens: the prefix cache's case."""
    return Request(f"s{i}", list(range(10, 10 + n)), SamplingParams(max_tokens=max_tokens, **kw),
                   eos_token_id=2, max_tokens=max_tokens)


def test_prefix_cache_hit_computes_only_the_rest():
    s = make(block_size=4)
    first = shared(0, 18, max_tokens=1)
    s.add_request(first)
    while s.has_unfinished_requests():
        run_step(s)
    again = shared(1, 18)
    s.add_request(again)
    out, _ = run_step(s)
    # 4 full blocks (16 tokens) cached; the last 2 prompt tokens are computed.
    assert out.num_scheduled_tokens == {"s1": 2} and out.new_reqs[0].num_computed_tokens == 16
    assert out.new_reqs[0].block_ids[0][:4] == s.kv.get_block_ids(again)[0][:4]
    assert s.stats.prefix_cache_queries == 36 and s.stats.prefix_cache_hits == 16
    assert s.stats.num_prompt_tokens_computed == 18 + 2


def test_same_step_requests_share_the_prefix_being_computed():
    s = make(block_size=4)
    a, b = shared(0, 10), shared(1, 10)
    s.add_request(a)
    s.add_request(b)
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {"s0": 10, "s1": 2}          # b reads a's two full blocks
    assert s.kv.get_block_ids(a)[0][:2] == s.kv.get_block_ids(b)[0][:2]
    assert s.kv.get_block_ids(a)[0][2] != s.kv.get_block_ids(b)[0][2]


def test_prefix_caching_off_shares_nothing():
    s = make(caching=False)
    s.add_request(shared(0, 10))
    s.add_request(shared(1, 10))
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {"s0": 10, "s1": 10}
    assert s.stats.prefix_cache_queries == 0 and s.kv.pool.num_cached_blocks == 0


def test_parallel_samples_fork_the_first_and_copy_the_partial_block():
    for caching in (True, False):
        s = make(caching=caching)
        lead = shared(0, 10, max_tokens=3)
        kids = [Request(f"k{i}", lead.prompt_token_ids, lead.sampling_params, 2, 3, fork_parent=lead)
                for i in range(3)]
        for r in [lead] + kids:
            s.add_request(r)
        out, _ = run_step(s)
        assert out.num_scheduled_tokens == {"s0": 10}                 # samples wait for the prompt
        out, _ = run_step(s)
        # The lead decodes; each sample computes only the prompt's last token (position 9).
        assert out.num_scheduled_tokens == {"s0": 1, "k0": 1, "k1": 1, "k2": 1}
        assert all(r.num_computed_tokens == 9 for r in out.new_reqs)
        lead_blocks = s.kv.get_block_ids(lead)[0]
        for k in kids:
            assert s.kv.get_block_ids(k)[0][:2] == lead_blocks[:2]        # full blocks shared
        # Position 9 lies in the lead's third block: each sample gets a copy of it.
        copies = out.block_copies
        assert [src for src, _ in copies] == [lead_blocks[2]] * 3
        assert sorted(dst for _, dst in copies) == sorted(s.kv.get_block_ids(k)[0][2] for k in kids)
        assert s.stats.num_forked_tokens == 27 and s.stats.num_prompt_tokens_computed == 10 + 3
        while s.has_unfinished_requests():
            run_step(s)
        assert s.kv.num_free_blocks == s.kv.pool.num_usable_blocks


def test_preempted_request_resumes_from_its_own_cached_blocks():
    s = make(num_blocks=7, block_size=4)          # 6 usable blocks
    a, b = req(0, 8, max_tokens=12), req(1, 8, max_tokens=12)
    s.add_request(a)
    s.add_request(b)
    resumed = []
    while s.has_unfinished_requests():
        out, _ = run_step(s)
        resumed += [r.num_computed_tokens for r in out.new_reqs if r.req_id == "r1" and b.num_preemptions]
    assert b.num_preemptions >= 1 and resumed and resumed[0] > 0
    assert a.output_token_ids == [7] * 12 and b.output_token_ids == [7] * 12
class FakeRunner:
    """Samples like the model runner: when a request's computed tokens reach the tokens it
    knows of (the prompt plus what it sampled, in flight or not)."""

    def __init__(self):
        self.known: dict[str, int] = {}

    def execute(self, out, tokens: dict[str, list[int]]) -> ModelRunnerOutput:
        for r in out.new_reqs:
            self.known[r.req_id] = len(r.token_ids)
        computed = {r.req_id: r.num_computed_tokens for r in out.new_reqs + out.cached_reqs}
        sampled = {}
        for rid, n in out.num_scheduled_tokens.items():
            if computed[rid] + n == self.known[rid]:
                self.known[rid] += 1
                sampled[rid] = tokens[rid].pop(0) if tokens.get(rid) else 7
        return ModelRunnerOutput(sampled)


def run_async(s: Scheduler, tokens=None) -> dict[str, int]:
    """The async engine's order: schedule and run step N+1, then update from step N. Returns
    the tokens scheduled per request."""
    runner, in_flight, scheduled = FakeRunner(), None, {}
    while s.has_unfinished_requests():
        out = s.schedule()
        res = runner.execute(out, tokens or {})
        for rid, n in out.num_scheduled_tokens.items():
            scheduled[rid] = scheduled.get(rid, 0) + n
        if in_flight:
            s.update_from_output(*in_flight)
        in_flight = (out, res)
    return scheduled


def test_async_placeholders_stop_at_max_tokens_and_max_model_len():
    s = make(max_len=12)
    reqs = [req(0, 3, max_tokens=5), req(1, 6, max_tokens=1), req(2, 8, max_tokens=100)]
    for r in reqs:
        s.add_request(r)
    scheduled = run_async(s)
    assert [r.num_output_tokens for r in reqs] == [5, 1, 4]          # r2 capped by max_model_len
    # Nothing computed past the end: the last sampled token is never fed back.
    assert scheduled == {"r0": 3 + 5 - 1, "r1": 6, "r2": 11}
    assert all(r.num_output_placeholders == 0 for r in reqs)
    assert s.kv.num_free_blocks == s.kv.pool.num_usable_blocks


def test_async_eos_drops_the_token_of_the_extra_step():
    s = make()
    a, b = req(0, 3, max_tokens=10), req(1, 3, max_tokens=4)
    s.add_request(a)
    s.add_request(b)
    scheduled = run_async(s, tokens={"r0": [5, 2, 9, 9]})             # EOS (2) as r0's 2nd token
    assert a.output_token_ids == [5, 2] and a.status == RequestStatus.FINISHED_STOPPED
    assert scheduled["r0"] == 3 + 2          # one step past the EOS, whose token was dropped
    assert b.output_token_ids == [7] * 4
    assert s.kv.num_free_blocks == s.kv.pool.num_usable_blocks


def test_async_preemption_with_a_token_in_flight():
    s = make(num_blocks=5, block_size=4)
    a, b = req(0, 7, max_tokens=8), req(1, 7, max_tokens=8)
    s.add_request(a)
    s.add_request(b)
    run_async(s)
    assert s.stats.num_preemptions >= 1 and a.num_preemptions == 0
    assert a.output_token_ids == [7] * 8 and b.output_token_ids == [7] * 8
    assert s.kv.num_free_blocks == s.kv.pool.num_usable_blocks


def run_batch_queue(s: Scheduler, depth: int) -> list[list[str]]:
    """The pipeline-parallel engine's order: keep up to ``depth`` steps in flight, finish the
    oldest when the queue is full or nothing else could be scheduled. Returns each step's
    requests; asserts that no request is scheduled while a token it sampled is in flight (the
    next chunk of a prompt may be: the stages run the steps in order)."""
    runner, queue, steps = FakeRunner(), [], []
    while s.has_unfinished_requests():
        if len(queue) < depth:
            out = s.schedule()
            ids = set(out.num_scheduled_tokens)
            assert not any(ids & set(res.sampled_token_ids) for _, res in queue), "scheduled with a token in flight"
            if not out.is_empty:
                queue.append((out, runner.execute(out, {})))
                steps.append(list(out.num_scheduled_tokens))
                if len(queue) < depth:
                    continue
        s.update_from_output(*queue.pop(0))
    return steps


def test_batch_queue_splits_the_running_requests_between_steps_in_flight():
    s = make(batches=2)
    reqs = [req(i, 3, max_tokens=4) for i in range(4)]
    for r in reqs:
        s.add_request(r)
    steps = run_batch_queue(s, depth=2)
    assert steps[0] == ["r0", "r1", "r2", "r3"]                   # the prompts, all in one step
    # Then each step takes half of the running requests, while the other half is in flight.
    assert steps[1:] == [["r0", "r1"], ["r2", "r3"]] * 3
    assert all(r.output_token_ids == [7] * 4 and r.num_output_placeholders == 0 for r in reqs)
    assert s.kv.num_free_blocks == s.kv.pool.num_usable_blocks


def test_batch_queue_admits_new_requests_beside_those_in_flight_and_preempts():
    """Chunked prompts and requests admitted while others are in flight; a cache too small for
    all of them, so requests with a token in flight are preempted: every request still gets
    all its tokens, and every block comes back."""
    s = make(budget=8, num_blocks=9, block_size=4, batches=2)
    reqs = [req(i, 5 + i, max_tokens=6) for i in range(5)]
    for r in reqs:
        s.add_request(r)
    run_batch_queue(s, depth=2)
    assert s.stats.num_preemptions >= 1
    assert all(r.output_token_ids == [7] * 6 for r in reqs)
    assert s.kv.num_free_blocks == s.kv.pool.num_usable_blocks
