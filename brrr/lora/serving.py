"""Serving many adapters over one base model: `LoRARequest` (vLLM's), the checks an adapter passes before it is
served, and `LoraManager`, the engine's adapters: a host cache of loaded adapters and the device slots
(serving_slots.py) with least-recently-used eviction of adapters no running sequence uses.

An adapter travels with its request by id and path (the request crosses from the server process to the engine
process), so the engine loads it from the path when it first needs it, and again if it was evicted or unloaded
while the request waited."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from brrr.config import ModelConfig
from brrr.errors import BrrrError
from brrr.lora.peft_format import LoraAdapter, check_against, load_adapter
from brrr.lora.serving_slots import LoraSlots

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoRARequest:
    """Which adapter a request runs with, as vLLM names it: lora_int_id identifies the adapter (>= 1; it keys the
    slots and the prefix cache), lora_path is its PEFT directory."""
    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise BrrrError(f"LoRARequest.lora_name must be a non-empty string, got {self.lora_name!r}")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise BrrrError(f"LoRARequest.lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        object.__setattr__(self, "lora_path", str(Path(self.lora_path).expanduser()))


def projection_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """Every module name serving can adapt -> (in_features, out_features): the 7 projections of every layer."""
    q, kv, h, i = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size, \
        cfg.intermediate_size
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
              "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
    out = {}
    for layer in range(cfg.num_layers):
        for name in ATTENTION:
            out[f"model.layers.{layer}.self_attn.{name}"] = shapes[name]
        for name in MLP:
            out[f"model.layers.{layer}.mlp.{name}"] = shapes[name]
    return out


class _Shapes:
    """The projections' shapes where `check_against` expects a model (it reads named_modules' in/out features)."""

    def __init__(self, shapes: dict[str, tuple[int, int]]):
        self.shapes = shapes

    def named_modules(self):
        return ((n, SimpleNamespace(in_features=i, out_features=o)) for n, (i, o) in self.shapes.items())


def check_servable(adapter: LoraAdapter, shapes: dict[str, tuple[int, int]], max_lora_rank: int) -> None:
    """The adapter can be served on this base with these slots: plain LoRA on the projections, rank within
    max_lora_rank, every shape the base's. Errors name the adapter, the field and the limit."""
    where = adapter.path or "the adapter"
    if adapter.rank > max_lora_rank:
        raise BrrrError(f"{where}: rank r={adapter.rank} is above --max-lora-rank={max_lora_rank} (max_lora_rank); "
                        f"start the server with --max-lora-rank {adapter.rank} or more")
    if adapter.config.use_dora or adapter.magnitudes:
        raise BrrrError(f"{where}: a DoRA adapter (use_dora) cannot be served; merge it (brrr merge) and serve the "
                        "merged model")
    outside = sorted(n for n in adapter.weights if n.rsplit(".", 1)[-1] not in ATTENTION + MLP)
    if outside:
        raise BrrrError(f"{where}: adapts {outside[0]!r}; serving applies adapters to the projections only "
                        f"({', '.join(ATTENTION + MLP)})")
    check_against(adapter, _Shapes(shapes))


def load_servable(request: LoRARequest, shapes: dict[str, tuple[int, int]], max_lora_rank: int,
                  dtype: torch.dtype | None = None) -> LoraAdapter:
    adapter = load_adapter(request.lora_path, dtype=dtype)
    check_servable(adapter, shapes, max_lora_rank)
    return adapter


class LoraManager:
    """The engine's adapters. `add` loads and checks one into the host cache (max_cpu_loras, least recently used
    out first, never one a running sequence uses; an evicted one a queued request needs is read again from its
    path); `item_slots` gives each of a step's adapters a device slot (least recently used out first, never one a
    running sequence uses) and says each item's slot. The scheduler keeps the adapters of running sequences within
    the slot count, so a step always finds its slots."""

    def __init__(self, slots: LoraSlots, shapes: dict[str, tuple[int, int]], max_lora_rank: int, max_cpu_loras: int,
                 in_use: Callable[[], set[int]]):
        self.slots, self.shapes, self.max_lora_rank, self.max_cpu_loras = slots, shapes, max_lora_rank, max_cpu_loras
        self.in_use = in_use  # adapter ids of running sequences
        self.cpu: OrderedDict[int, LoraAdapter] = OrderedDict()
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot; first = least recently used
        self.loads = 0  # adapters copied into a slot (tests, stats)

    def shard(self, partition, journal: bool) -> None:
        """Serve a tensor-parallel shard: adapters are checked against the whole model's shapes, and the slots hold
        this rank's slices (`LoraSlots.shard`)."""
        self.shapes = projection_shapes(partition.cfg)
        self.slots.shard(partition, journal)

    @property
    def max_loras(self) -> int:
        return self.slots.num_slots

    def add(self, request: LoRARequest) -> LoraAdapter:
        adapter = self.cpu.get(request.lora_int_id)
        if adapter is not None:
            if adapter.path is not None and adapter.path != Path(request.lora_path):
                raise BrrrError(f"lora_int_id {request.lora_int_id} is already the adapter at {adapter.path}; "
                                f"{request.lora_name!r} ({request.lora_path}) needs an id of its own")
            self.cpu.move_to_end(request.lora_int_id)
            return adapter
        adapter = load_servable(request, self.shapes, self.max_lora_rank, self.slots.dtype)
        self.cpu[request.lora_int_id] = adapter
        busy = self.in_use()
        if request.lora_int_id in self.slot_of and request.lora_int_id not in busy:
            del self.slot_of[request.lora_int_id]  # read from its path again: the slot gets what the path holds now
        if len(self.cpu) > self.max_cpu_loras:
            busy = busy | {request.lora_int_id}
            victim = next((i for i in self.cpu if i not in busy), None)
            if victim is not None:
                del self.cpu[victim]
        return adapter

    def remove(self, lora_id: int) -> bool:
        """Forget the adapter: its host copy, and its slot unless a running sequence reads it (that one finishes on
        it; a queued one loads it again from its path)."""
        known = self.cpu.pop(lora_id, None) is not None
        if lora_id in self.slot_of and lora_id not in self.in_use():
            del self.slot_of[lora_id]
            known = True
        return known

    def list_loras(self) -> list[int]:
        return list(self.cpu)

    def _slot_for(self, request: LoRARequest, step: set[int]) -> int:
        slot = self.slot_of.get(request.lora_int_id)
        if slot is not None:
            self.slot_of.move_to_end(request.lora_int_id)
            return slot
        adapter = self.add(request)  # a host copy first (it may have been evicted or removed while it waited)
        taken = set(self.slot_of.values())
        free = next((s for s in range(self.max_loras) if s not in taken), None)
        if free is None:
            keep = step | self.in_use()
            victim = next((i for i in self.slot_of if i not in keep), None)
            if victim is None:
                raise BrrrError(f"a step needs more than max_loras={self.max_loras} adapters")
            free = self.slot_of.pop(victim)
        self.slots.write(free, adapter)
        self.slot_of[request.lora_int_id] = free
        self.loads += 1
        return free

    def item_slots(self, loras: Iterable[LoRARequest | None]) -> np.ndarray:
        """Slots for a step's adapters, one per item (loading any adapter that has none); returns each item's slot
        (int32, -1: the base model)."""
        loras = list(loras)
        step = {lr.lora_int_id for lr in loras if lr is not None}
        return np.array([-1 if lr is None else self._slot_for(lr, step) for lr in loras], dtype=np.int32)
