"""LoRA rows: many adapters over one base model in one batch. A plug-in feature of the engine step (core/feature.py):
it owns the engine's adapters (`LoraManager`, brrr/lora/serving.py: the host cache and the device slots, least
recently used out first) and in each step's plan gives every scheduled item its adapter's slot
(`plan.batch.row_values`, -1: the base model), loading the adapter into a slot first when it has none. The runner
stages those as the model's per-row input (`SlotInput`, a staging.RowInput), which every LoRA module reads; a
sharded runner's loads travel with the step to every rank. Built only with enable_lora; in a step only while a live
request names an adapter."""
from __future__ import annotations

import functools
from collections.abc import Callable

from brrr.config import EngineConfig
from brrr.engine.core.feature import Feature
from brrr.engine.core.plan import StepPlan
from brrr.engine.sequence import Request
from brrr.lora.serving import LoraManager, projection_shapes
from brrr.lora.serving_slots import LoraSlots
from brrr.serving_form import prepare_for_serving


class SlotInput:
    """The slots as the runner's row input (staging.RowInput): each row's slot, grouped on the device by `begin`
    for every LoRA module; the updates are the loads rank 0 of a shard queued (slot, adapter)."""

    def __init__(self, slots: LoraSlots):
        self.slots, self.buffer = slots, slots.row_slots

    def begin(self, num_rows: int) -> None:
        self.slots.begin(num_rows)

    def end(self) -> None:
        self.slots.end()

    def take_updates(self) -> list:
        return self.slots.take_journal()

    def apply(self, update) -> None:
        self.slots.copy_in(*update)

    def for_workers(self):
        return functools.partial(worker_slots, self.slots.num_slots, self.slots.rank, self.buffer.shape[0])


def worker_slots(num_slots: int, rank: int, max_rows: int, model, pack_projections: bool | None):
    """A tensor-parallel worker's (model, row input): slots shaped as rank 0's, each holding this rank's slices of
    its adapter (`LoraSlots.shard`). Rank 0 picks the slots; its loads arrive with the steps."""
    p = next(model.parameters())
    slots = LoraSlots(num_slots, rank, max_rows, p.device, p.dtype)
    model = prepare_for_serving(model, EngineConfig(pack_projections=pack_projections), slots)
    slots.shard(model.tp_partition, journal=False)
    return model, SlotInput(slots)


class AdapterRows(Feature):
    name = "lora"
    per_request = True

    def __init__(self, manager: LoraManager):
        self.manager, self.row_input = manager, SlotInput(manager.slots)

    @classmethod
    def build(cls, model, config: EngineConfig, in_use: Callable[[], set[int]]) -> "AdapterRows":
        """The adapters an engine of `config` serves over `model`, whose projections prepare_for_serving then wraps
        around `slots`. in_use: the adapter ids of the running sequences (their slots are never taken)."""
        p = next(model.parameters())
        max_rows = max(config.max_num_batched_tokens, config.max_num_seqs)
        slots = LoraSlots(config.max_loras, config.max_lora_rank, max_rows, p.device, p.dtype)
        manager = LoraManager(slots, projection_shapes(model.config), config.max_lora_rank,
                              config.max_cpu_loras or config.max_loras, in_use)
        partition = getattr(model, "tp_partition", None)
        if partition is not None:  # each rank holds its slices of every adapter; rank 0's loads go with the steps
            manager.shard(partition, journal=getattr(model, "tp_group", None) is not None)
        return cls(manager)

    @property
    def slots(self) -> LoraSlots:
        return self.manager.slots

    def wants(self, request: Request) -> bool:
        return request.lora_request is not None

    def model_inputs(self, plan: StepPlan) -> None:
        plan.batch.row_values = self.manager.item_slots(seq.request.lora_request for seq in plan.sequences)
