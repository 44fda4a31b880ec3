"""Speculative decoding with a draft model, the scheduler's side. The runner runs the draft
model after each step (runner/draft_model.py) and reports each sampling request's drafts in
ModelRunnerOutput.draft_token_ids; they wait here until the request is scheduled again, and
are used if its tokens are still those they were proposed after. The same interface as the
n-gram proposer's, so the scheduler treats both alike."""
from pagoda.config import SpeculativeConfig


class ModelDrafts:
    def __init__(self, config: SpeculativeConfig):
        self.k = config.num_speculative_tokens
        self.drafts: dict[str, tuple[int, list[int]]] = {}     # req_id -> (its num_tokens, drafts)

    def receive(self, req_id: str, num_tokens: int, drafts: list[int]) -> None:
        self.drafts[req_id] = (num_tokens, drafts)

    def propose(self, req_id: str, token_ids: list[int], k: int) -> list[int]:
        """At most ``min(k, num_speculative_tokens)`` of the drafts proposed after ``token_ids``."""
        num_tokens, drafts = self.drafts.pop(req_id, (-1, []))
        if num_tokens != len(token_ids):
            return []
        return drafts[:max(0, min(k, self.k))]

    def forget(self, req_id: str) -> None:
        self.drafts.pop(req_id, None)
