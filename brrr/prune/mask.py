"""Which weights a pruning method keeps, given its score of each weight (higher: more important).

Every method compares weights within one output row, so each row ends at exactly the requested sparsity: either
`round(sparsity * in_features)` zeros anywhere in the row, or an N:M pattern (at most N nonzeros in every M
consecutive inputs of a row; 2:4 is what sparse tensor cores run)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from brrr.errors import BrrrError


@dataclass(frozen=True)
class Pattern:
    """What is pruned: `sparsity` of each row (n == 0), or all but n of every m consecutive inputs (n:m)."""
    sparsity: float
    n: int = 0
    m: int = 0

    @property
    def structured(self) -> bool:
        return self.n > 0

    def name(self) -> str:
        return f"{self.n}:{self.m}" if self.structured else "unstructured"

    def pruned_per_row(self, columns: int) -> int:
        return columns - columns // self.m * self.n if self.structured else round(self.sparsity * columns)

    def check(self, name: str, columns: int):
        if self.structured and columns % self.m:
            raise BrrrError(f"--pattern {self.n}:{self.m}: {name} has {columns} input features, not a multiple of "
                            f"{self.m}")


def parse_pattern(sparsity: float | None, pattern: str | None) -> Pattern:
    """--sparsity S (a fraction in [0, 1)) or --pattern N:M (0 < N < M; its sparsity is 1 - N/M)."""
    if pattern:
        try:
            n, m = (int(p) for p in pattern.split(":"))
        except ValueError:
            raise BrrrError(f"--pattern must be N:M (e.g. 2:4); got {pattern!r}") from None
        if not 0 < n < m <= 64:
            raise BrrrError(f"--pattern N:M needs 0 < N < M <= 64; got {pattern!r}")
        if sparsity is not None and abs(sparsity - (1 - n / m)) > 1e-9:
            raise BrrrError(f"--sparsity {sparsity} contradicts --pattern {pattern} (which prunes {1 - n / m:g} of "
                            "each row); pass one of them")
        return Pattern(1 - n / m, n, m)
    if sparsity is None:
        raise BrrrError("pass --sparsity (a fraction, e.g. 0.5) or --pattern N:M (e.g. 2:4)")
    if not 0 <= sparsity < 1:
        raise BrrrError(f"--sparsity must be in [0, 1); got {sparsity}")
    return Pattern(sparsity)


def keep_mask(score: torch.Tensor, pattern: Pattern) -> torch.Tensor:
    """[out, in] bool: True where a weight stays. Ties go to the lower input index (torch.topk's order)."""
    out, columns = score.shape
    if pattern.structured:
        groups = score.reshape(out, columns // pattern.m, pattern.m)
        keep = torch.zeros_like(groups, dtype=torch.bool)
        keep.scatter_(2, groups.topk(pattern.n, dim=2).indices, True)
        return keep.reshape(out, columns)
    pruned = pattern.pruned_per_row(columns)
    keep = torch.ones_like(score, dtype=torch.bool)
    if pruned:
        keep.scatter_(1, score.topk(pruned, dim=1, largest=False).indices, False)
    return keep


def sparsity(w: torch.Tensor) -> float:
    """The fraction of exact zeros."""
    return (w == 0).sum().item() / w.numel()


def is_n_m(w: torch.Tensor, n: int, m: int) -> bool:
    """Whether every m consecutive inputs of every row hold at most n nonzeros."""
    out, columns = w.shape
    return columns % m == 0 and bool(((w != 0).reshape(out, -1, m).sum(-1) <= n).all())
