import torch
import torch.nn.functional as F


def silu_and_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return silu_and_mul_ref(gate, up)
