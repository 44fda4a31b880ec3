"""What the engine reports about itself: a snapshot of its counters and gauges, and the
periodic log line (vLLM's, with ``disable_log_stats=False``)."""
import logging
import time
from dataclasses import astuple, dataclass

logger = logging.getLogger("pagoda.engine")


@dataclass
class EngineStats:
    # Counters since the engine started.
    num_steps: int = 0
    num_prompt_tokens: int = 0           # prompt tokens admitted (a prompt with n samples counts n times)
    num_generation_tokens: int = 0
    num_prompt_tokens_computed: int = 0  # prompt positions the model ran on; the rest were reused
    prefix_cache_queries: int = 0        # tokens looked up in the prefix cache
    prefix_cache_hits: int = 0           # of which were found there
    num_forked_tokens: int = 0           # prompt tokens parallel samples shared with their first
    num_preemptions: int = 0
    num_drafts: int = 0                  # speculative decoding: a request's steps with drafts
    num_draft_tokens: int = 0            # draft tokens checked
    num_accepted_tokens: int = 0         # of which were kept
    # Gauges, now.
    num_running: int = 0
    num_waiting: int = 0
    num_kv_blocks: int = 0               # usable blocks (the null block left out)
    kv_blocks_in_use: int = 0
    kv_blocks_cached: int = 0            # in the prefix-cache index, in use or not
    kv_blocks_free: int = 0              # allocatable, cached-but-unreferenced ones included

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def kv_cache_usage(self) -> float:
        return self.kv_blocks_in_use / self.num_kv_blocks if self.num_kv_blocks else 0.0


def sum_stats(stats: list[EngineStats]) -> EngineStats:
    """Several engines' (data-parallel replicas') figures as one: every field is a count, so
    each is the sum (num_steps: the replicas' steps, which run side by side)."""
    return EngineStats(*map(sum, zip(*map(astuple, stats))))


class StatLogger:
    """Logs throughput, queue and cache figures at most every ``interval`` seconds."""

    def __init__(self, interval: float = 5.0):
        self.interval = interval
        self.last_time = time.monotonic()
        self.last: EngineStats | None = None

    def maybe_log(self, stats: EngineStats) -> None:
        now = time.monotonic()
        if now - self.last_time < self.interval:
            return
        last = self.last or EngineStats()
        dt = now - self.last_time
        queries = stats.prefix_cache_queries - last.prefix_cache_queries
        hits = stats.prefix_cache_hits - last.prefix_cache_hits
        logger.info(
            "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, Running: %d reqs, "
            "Waiting: %d reqs, KV cache usage: %.1f%% (%d blocks in use, %d cached, %d free), "
            "Prefix cache hit rate: %.1f%%",
            (stats.num_prompt_tokens_computed - last.num_prompt_tokens_computed) / dt,
            (stats.num_generation_tokens - last.num_generation_tokens) / dt,
            stats.num_running, stats.num_waiting, 100 * stats.kv_cache_usage, stats.kv_blocks_in_use,
            stats.kv_blocks_cached, stats.kv_blocks_free, 100 * hits / queries if queries else 0.0)
        drafts = stats.num_draft_tokens - last.num_draft_tokens
        if drafts:
            logger.info("Speculative decoding: %d draft tokens, %.1f%% accepted, %.2f tokens a step with drafts",
                        drafts, 100 * (stats.num_accepted_tokens - last.num_accepted_tokens) / drafts,
                        1 + (stats.num_accepted_tokens - last.num_accepted_tokens)
                        / max(1, stats.num_drafts - last.num_drafts))
        self.last_time, self.last = now, stats
