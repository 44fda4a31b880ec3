"""Token embedding and LM head, split over the vocabulary across tensor-parallel ranks."""
import torch
import torch.nn.functional as F
from torch import nn

from pagoda.distributed.parallel_state import get_tp_rank, get_tp_size, tp_all_reduce, tp_gather
from pagoda.quant.base import dense_linear


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.tp_size, self.tp_rank = get_tp_size(), get_tp_rank()
        self.vocab_size = vocab_size
        self.shard = -(-vocab_size // self.tp_size)
        self.start = self.tp_rank * self.shard
        self.weight = nn.Parameter(torch.empty(self.shard, hidden_size), requires_grad=False)

    def weight_loader(self, param, loaded, shard_id=None):
        part = loaded[self.start:self.start + self.shard]
        param.data.zero_()
        param.data[:part.shape[0]].copy_(part)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        mask = (local >= 0) & (local < self.shard)
        out = F.embedding(local.clamp(0, self.shard - 1), self.weight) * mask[:, None]
        return tp_all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The full vocabulary's logits; with tensor parallelism only on the group's first rank
        (the one that samples), None on the others."""
        logits = dense_linear(hidden, self.weight)
        if self.tp_size == 1:
            return logits
        logits = tp_gather(logits, self.tp_size, self.tp_rank)
        return None if logits is None else logits[:, :self.vocab_size]
