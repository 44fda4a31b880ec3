"""The runner's LoRA adapters: ``max_loras`` slots in every adapted layer (lora/layers.py), which
adapters hold them, and the step's tokens by slot.

Each step the runner asks for the slots of its requests' adapters. The scheduler never puts
more than ``max_loras`` adapters in one step, so they all fit: one already in a slot stays
there, another takes a free slot or the one used longest ago, loaded from the host's copies
(up to ``max_cpu_loras`` adapters, least recently used dropped) or read from its folder. Every
rank decides alike from the same step, so tensor-parallel ranks agree without talking.
"""
from collections import OrderedDict

import numpy as np
import torch
from torch import nn

from pagoda.config import LoRAConfig
from pagoda.lora.adapter import FUSED, LoRAAdapter, load_adapter
from pagoda.lora.layers import LoRALinear
from pagoda.lora.request import LoRARequest
from pagoda.model.layers.linear import RowParallelLinear


class LoRAManager:
    def __init__(self, model, config: LoRAConfig, max_num_tokens: int, dtype: torch.dtype, device: torch.device):
        self.config, self.arch = config, model.config
        # The step's tokens by slot (-1: none), which every adapted layer reads
        self.token_slots = torch.full((max_num_tokens,), -1, dtype=torch.int32, device=device)
        decoder = model.model
        self.layers: dict[tuple[int, str], nn.Module] = {}     # the adapted linear layers
        for index, layer in zip(range(decoder.start_layer, decoder.end_layer), decoder.local_layers):
            for fused, shard_ids in FUSED.items():
                linear = layer.get_submodule(fused)
                linear.lora = LoRALinear(linear, shard_ids, config.max_loras, config.max_lora_rank, self.token_slots,
                                         dtype, isinstance(linear, RowParallelLinear))
                self.layers[index, fused] = linear
        self.slots: list[int | None] = [None] * config.max_loras     # the lora_int_id in each
        self.last_used = [0] * config.max_loras
        self.num_steps = 0
        self.requests: dict[int, LoRARequest] = {}
        self.on_host: OrderedDict[int, LoRAAdapter] = OrderedDict()

    def add(self, request: LoRARequest) -> None:
        """A request's adapter, loaded when a step first needs it. (A known id with another
        folder: the adapter was replaced, e.g. unloaded and loaded again by the server.)"""
        known = self.requests.get(request.lora_int_id)
        if known is not None and known.lora_path != request.lora_path:
            self.remove(request.lora_int_id)
        self.requests[request.lora_int_id] = request

    def remove(self, lora_id: int) -> None:
        self.requests.pop(lora_id, None)
        self.on_host.pop(lora_id, None)
        if lora_id in self.slots:
            self.slots[self.slots.index(lora_id)] = None

    def slots_for(self, lora_ids: list[int]) -> np.ndarray:
        """The slot of each of a step's requests (by lora_int_id, 0 for none; -1 for none)."""
        self.num_steps += 1
        needed = set(lora_ids) - {0}
        if len(needed) > len(self.slots):
            raise RuntimeError(f"A step with {len(needed)} LoRA adapters, above max_loras={len(self.slots)} "
                               "(the scheduler should never make one).")
        for lora_id in needed:
            if lora_id not in self.slots:
                free = [s for s, held in enumerate(self.slots) if held not in needed]
                slot = min(free, key=lambda s: (self.slots[s] is not None, self.last_used[s]))
                self._load(slot, lora_id)
        where = {lora_id: self.slots.index(lora_id) for lora_id in needed}
        for slot in where.values():
            self.last_used[slot] = self.num_steps
        return np.array([where.get(i, -1) for i in lora_ids], dtype=np.int32)

    def _load(self, slot: int, lora_id: int) -> None:
        adapter = self.on_host.pop(lora_id, None)
        if adapter is None:
            adapter = load_adapter(self.requests[lora_id], self.arch, self.config.max_lora_rank)
        self.on_host[lora_id] = adapter
        while len(self.on_host) > self.config.max_cpu_loras:
            self.on_host.popitem(last=False)
        self.slots[slot] = None          # (half-loaded if this raises)
        for (index, fused), linear in self.layers.items():
            linear.lora.set_slot(linear, slot, adapter.slices(index, fused))
        self.slots[slot] = lora_id

    def set_token_slots(self, token_slots: torch.Tensor) -> None:
        """The step's tokens by slot (-1: no adapter), for every layer to read. (A padded CUDA
        graph's rows past them keep older slots: their outputs are dropped.)"""
        self.token_slots[:token_slots.shape[0]].copy_(token_slots)
