"""`--disaggregate prefill=IDS,decode=IDS`: which devices run prefill instances and which one runs the decode
instance (DistServe's split), and every check on it that needs no weights.

The ids are GPU indices on CUDA (`prefill=0,decode=1`; `prefill=0,1,decode=2` for two prefill instances). On CPU the
same spelling names instance slots, and only their count matters: a command line tried on a laptop runs unchanged
on the GPU machine, and the CPU tests exercise the same parser and checks.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from brrr.errors import BrrrError

FLAG = "--disaggregate (disaggregate)"
ROLES = ("prefill", "decode")
# (config field, flag, why it cannot be combined)
UNSUPPORTED = (
    ("tensor_parallel_size", "--tensor-parallel-size", "each instance is one GPU (tensor-parallel instances are not "
                                                      "built)"),
    ("speculative_config", "--speculative-config", "the decode instance would need the proposer's prompt state "
                                                   "(a draft model's KV) from the prefill instance"),
    ("enable_lora", "--enable-lora", "adapters would have to be loaded on every instance"),
)


@dataclass(frozen=True)
class Disaggregation:
    prefill: tuple[int, ...]
    decode: tuple[int, ...]

    def __str__(self) -> str:
        return ",".join(f"{role}={','.join(map(str, getattr(self, role)))}" for role in ROLES)


def parse_disaggregate(value) -> Disaggregation | None:
    """A Disaggregation from the flag's text ("prefill=0,decode=1"), a dict ({"prefill": [0], "decode": [1]}), or
    one already parsed; None stays None. Checks the spelling and that the two sets are disjoint."""
    if value is None or isinstance(value, Disaggregation):
        return value
    roles: dict[str, list[int]] = {}
    if isinstance(value, dict):
        items = [(k, v if isinstance(v, (list, tuple)) else [v]) for k, v in value.items()]
    elif isinstance(value, str):
        items, role = [], None
        for part in (p.strip() for p in value.split(",")):
            if "=" in part:
                role, _, part = part.partition("=")
                items.append((role.strip(), []))
            if role is None:
                raise BrrrError(f"{FLAG} takes prefill=IDS,decode=IDS (e.g. prefill=0,decode=1), got {value!r}")
            items[-1][1].append(part.strip())
    else:
        raise BrrrError(f"{FLAG} must be a string such as 'prefill=0,decode=1' or a dict, got {type(value).__name__}")
    for role, ids in items:
        if role not in ROLES:
            raise BrrrError(f"{FLAG}: unknown role {role!r}; the roles are prefill and decode "
                            "(e.g. prefill=0,decode=1)")
        if role in roles:
            raise BrrrError(f"{FLAG}: {role} is given twice")
        try:
            roles[role] = [int(i) for i in ids]
        except (TypeError, ValueError):
            got = ", ".join(map(str, ids))
            raise BrrrError(f"{FLAG}: {role} takes device ids (integers >= 0), got {got!r}") from None
        if not roles[role] or min(roles[role]) < 0:
            raise BrrrError(f"{FLAG}: {role} takes one or more device ids (integers >= 0)")
        if len(set(roles[role])) != len(roles[role]):
            raise BrrrError(f"{FLAG}: {role} lists a device twice: {roles[role]}")
    missing = [role for role in ROLES if role not in roles]
    if missing:
        raise BrrrError(f"{FLAG}: {' and '.join(missing)} missing; give both, e.g. prefill=0,decode=1")
    both = sorted(set(roles["prefill"]) & set(roles["decode"]))
    if both:
        raise BrrrError(f"{FLAG}: device {both[0]} is in both prefill and decode; the two sets must not overlap "
                        "(co-located serving is the default: leave the flag out)")
    if len(roles["decode"]) > 1:
        raise BrrrError(f"{FLAG}: decode takes one device (one decode instance), got {len(roles['decode'])}; several "
                        "prefill instances may feed it")
    return Disaggregation(tuple(roles["prefill"]), tuple(roles["decode"]))


def check_combination(config) -> None:
    """The EngineConfig options disaggregation does not support, refused naming both flags."""
    import dataclasses

    defaults = {f.name: f.default for f in dataclasses.fields(config)}
    for field, flag, why in UNSUPPORTED:
        if getattr(config, field) != defaults[field]:
            raise BrrrError(f"{FLAG} cannot be combined with {flag}: {why}")


def check_devices(d: Disaggregation, device: torch.device) -> None:
    """Before any process starts or weight loads: on CUDA the ids are GPUs of this machine, and --device names no
    GPU of its own (the ids say which)."""
    if device.type != "cuda":
        return
    if device.index is not None:
        raise BrrrError(f"{FLAG} places every instance itself: use --device cuda (not {device}) with it")
    count = torch.cuda.device_count()
    ids = d.prefill + d.decode
    if max(ids) >= count:
        raise BrrrError(f"{FLAG}: GPU {max(ids)} does not exist; this machine has {count} CUDA GPU(s), 0 to "
                        f"{count - 1}")


def instance_device(device: torch.device, index: int) -> torch.device:
    return torch.device("cuda", index) if device.type == "cuda" else device
