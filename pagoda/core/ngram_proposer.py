"""N-gram drafts for speculative decoding (prompt lookup): the tokens that followed the latest
earlier occurrence of a sequence's last n tokens, longest n first. Text that quotes or edits
its prompt (code, summaries, extraction) repeats itself, and there the drafts are often right;
elsewhere they are few and cost little."""
import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from pagoda.config import SpeculativeConfig


class NgramProposer:
    def __init__(self, config: SpeculativeConfig):
        self.k = config.num_speculative_tokens
        self.n_min, self.n_max = config.prompt_lookup_min, config.prompt_lookup_max
        # Each request's tokens as an array, grown as it grows: converting the whole list
        # every step would cost more than the search.
        self.arrays: dict[str, np.ndarray] = {}

    def propose(self, req_id: str, token_ids: list[int], k: int) -> list[int]:
        """At most ``min(k, num_speculative_tokens)`` draft tokens to follow ``token_ids``."""
        k = min(k, self.k)
        if k <= 0:
            return []
        tokens = self._array(req_id, token_ids)
        n_tokens = len(tokens)
        for n in range(min(self.n_max, n_tokens - 1), self.n_min - 1, -1):
            # Windows that start early enough to have a token after them, before the suffix.
            windows = sliding_window_view(tokens[:n_tokens - 1], n)
            hits = np.flatnonzero((windows == tokens[n_tokens - n:]).all(1))
            if len(hits):
                start = hits[-1] + n
                return tokens[start:start + k].tolist()
        return []

    def _array(self, req_id: str, token_ids: list[int]) -> np.ndarray:
        arr = self.arrays.get(req_id)
        if arr is None or len(arr) > len(token_ids):       # (new, or recomputed after preemption)
            arr = np.asarray(token_ids, dtype=np.int64)
        elif len(arr) < len(token_ids):
            arr = np.concatenate([arr, np.asarray(token_ids[len(arr):], dtype=np.int64)])
        self.arrays[req_id] = arr
        return arr

    def forget(self, req_id: str) -> None:
        self.arrays.pop(req_id, None)
