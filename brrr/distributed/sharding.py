"""Megatron-style tensor-parallel shards of the Llama-family model, for serving.

Each rank holds 1/N of every projection: q/k/v and gate/up split by output rows (column-parallel: no communication),
o_proj and down_proj split by input columns (row-parallel: one all-reduce each, so two per layer), the embedding and
lm_head split by vocabulary rows (the embedding's partial lookups all-reduced, the logits all-gathered). Attention
runs on the rank's own heads: its q heads and the KV heads they read (split across ranks, or one replicated head per
rank when there are fewer KV heads than ranks). The shard is the reference model built with the local head and
intermediate counts (a `ModelConfig` with those numbers), its three communicating module kinds swapped in, so
`prepare_for_serving` and the `ModelRunner` (KV cache of the local KV heads) work on it unchanged.
Weights load sharded (shard_loader.py): each rank reads only its slices of the safetensors.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from brrr.config import ModelConfig
from brrr.errors import BrrrError

FLAG = "--tensor-parallel-size (tensor_parallel_size)"


def check_tensor_parallel(cfg: ModelConfig, n: int, device: torch.device) -> None:
    """Everything about N that can be wrong, checked on the config alone: before any process starts or weight loads."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise BrrrError(f"{FLAG} must be an integer >= 1, got {n!r}")
    if not cfg.runnable or cfg.num_experts or cfg.kv_lora_rank:
        raise BrrrError(f"{FLAG}: tensor-parallel serving shards the Llama family (Llama, Mistral, Qwen2, Qwen3); "
                        f"{cfg.architecture} is not one")
    if cfg.num_heads % n:
        raise BrrrError(f"{FLAG} = {n} must divide the model's {cfg.num_heads} attention heads")
    kv = cfg.num_kv_heads
    if kv % n and n % kv:
        raise BrrrError(f"{FLAG} = {n} must divide the model's {kv} KV heads, or be a multiple of them (each rank "
                        "then holds one replicated KV head)")
    if cfg.intermediate_size % n:
        raise BrrrError(f"{FLAG} = {n} must divide the model's intermediate size {cfg.intermediate_size}")
    if device.type == "cuda":
        count, first = torch.cuda.device_count(), device.index or 0
        if first + n > count:
            raise BrrrError(f"{FLAG} = {n} exceeds the {count - first} CUDA GPU(s) from cuda:{first} on this machine "
                            "(one rank per GPU)")


@dataclasses.dataclass(frozen=True)
class Partition:
    """Which slice of each checkpoint tensor rank `rank` of `world` holds."""
    cfg: ModelConfig
    rank: int
    world: int

    @property
    def heads(self) -> int:
        return self.cfg.num_heads // self.world

    @property
    def kv_heads(self) -> int:
        return max(1, self.cfg.num_kv_heads // self.world)

    @property
    def first_kv_head(self) -> int:
        # with fewer KV heads than ranks, rank r's q heads all read KV head r * kv // N (check_tensor_parallel
        # requires N to be a multiple of kv, so a rank's q heads never straddle two groups)
        kv = self.cfg.num_kv_heads
        return self.rank * self.kv_heads if kv >= self.world else self.rank * kv // self.world

    @property
    def intermediate(self) -> int:
        return self.cfg.intermediate_size // self.world

    @property
    def vocab_per_rank(self) -> int:
        """Rows of the vocabulary each rank holds: the vocabulary padded up to a multiple of N."""
        return -(-self.cfg.vocab_size // self.world)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_per_rank

    def local_config(self) -> ModelConfig:
        """The model as this rank runs it: its head and intermediate counts (the vocabulary stays whole: the logits
        are gathered)."""
        return dataclasses.replace(self.cfg, num_heads=self.heads, num_kv_heads=self.kv_heads,
                                   intermediate_size=self.intermediate)

    def slice_of(self, name: str) -> tuple[int, int, int] | None:
        """(dim, start, stop) of checkpoint tensor `name` this rank reads, or None: the whole tensor (norms, the
        row-parallel biases, added once after the all-reduce)."""
        d = self.cfg.head_dim
        leaf = name.rsplit(".", 2)
        proj, kind = leaf[-2], leaf[-1]
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return 0, self.vocab_start, self.vocab_start + self.vocab_per_rank
        if proj == "q_proj":
            return 0, self.rank * self.heads * d, (self.rank + 1) * self.heads * d
        if proj in ("k_proj", "v_proj"):
            return 0, self.first_kv_head * d, (self.first_kv_head + self.kv_heads) * d
        if proj in ("gate_proj", "up_proj"):
            return 0, self.rank * self.intermediate, (self.rank + 1) * self.intermediate
        if proj == "o_proj" and kind == "weight":
            return 1, self.rank * self.heads * d, (self.rank + 1) * self.heads * d
        if proj == "down_proj" and kind == "weight":
            return 1, self.rank * self.intermediate, (self.rank + 1) * self.intermediate
        return None


class Collectives:
    """The tensor-parallel group's collectives, on a process group object (gloo on CPU, NCCL on CUDA) that is not
    torch.distributed's global one, so one process may hold several engines. Every rank calls them in the same order:
    the model's forward is the schedule."""

    def __init__(self, group, rank: int, world: int, store=None, name: str = ""):
        self.group, self.rank, self.world = group, rank, world
        self.store, self.name = store, name  # the rendezvous store and a name unique to the engine (symm memory)
        # on CUDA, a OneShotAllReduce that takes the messages of up to `oneshot_bound` bytes (set_oneshot_bound)
        self.oneshot, self.oneshot_bound = None, 0

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """`t` summed over the ranks, in place: a small message through the one-shot path where it was measured
        faster, else NCCL (gloo on CPU)."""
        return self.oneshot(t) if self.routes_to_oneshot(t) else self.nccl_all_reduce(t)

    def routes_to_oneshot(self, t: torch.Tensor) -> bool:
        return (self.oneshot is not None and t.numel() * t.element_size() <= self.oneshot_bound
                and self.oneshot.supports(t))

    def nccl_all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        self.group.allreduce([t]).wait()
        return t

    def setup_oneshot(self, device: torch.device, capacity: int) -> str | None:
        """Collective: map a `capacity`-byte symmetric buffer on every rank (routing nothing to it until
        `set_oneshot_bound`). Returns why it could not be set up, or None."""
        from brrr.distributed.oneshot import OneShotAllReduce

        try:
            self.oneshot = OneShotAllReduce.create(self.group, self.store, self.rank, self.world, device, capacity,
                                                   self.name)
        except Exception as e:  # no symmetric memory in this torch, no P2P between the GPUs, ...
            first = (str(e).strip().splitlines() or [""])[0]
            return f"{type(e).__name__}: {first}"
        return None

    def set_oneshot_bound(self, bound: int) -> None:
        """Route messages of up to `bound` bytes to the one-shot path (every rank sets the same bound, decided on
        rank 0); 0 releases the buffer."""
        self.oneshot_bound = bound if self.oneshot is not None else 0
        if self.oneshot is not None and bound <= 0:
            self.oneshot.close()
            self.oneshot = None

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        """`t` as rank `src` holds it, on every rank (in place)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self.group.broadcast([t], opts).wait()
        return t

    def close(self, clean: bool = True) -> None:
        """Release the group. clean: every rank is closing after its last collective (NCCL flushes, then
        destroys); else a peer is gone, and its communicators are aborted instead of waiting on it."""
        group, self.group = self.group, None
        if group is None:
            return
        self.set_oneshot_bound(0)
        try:
            group.shutdown() if clean else group.abort()
        except Exception:  # already torn down, or a backend without the call
            pass
        del group  # destroyed here, not during interpreter exit, where NCCL's threads outlive what they use

    def all_gather_rows(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's `t` stacked along the first dimension, in rank order."""
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.world)]
        self.group.allgather([parts], [t]).wait()
        return torch.cat(parts)

    def all_gather_last(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's `t` side by side along the last dimension, in rank order."""
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.world)]
        self.group.allgather([parts], [t]).wait()
        return torch.cat(parts, -1)


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_local @ W_local^T) + b: the input features split across ranks (o_proj, down_proj); the bias,
    whole on every rank, is added once after the sum."""

    def __init__(self, in_local: int, out_features: int, bias: bool, comm: Collectives):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_local), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.in_features, self.out_features, self.comm = in_local, out_features, comm

    def partial(self, x):
        """This rank's share of the product (a LoRA update is added to it before the sum)."""
        return F.linear(x, self.weight)

    def reduce(self, y):
        y = self.comm.all_reduce(y)
        return y if self.bias is None else y + self.bias

    def forward(self, x):
        return self.reduce(self.partial(x))


class VocabParallelEmbedding(nn.Module):
    """Each rank looks up the ids in its vocabulary rows (zeros for the others); the all-reduce assembles them."""

    def __init__(self, part: Partition, hidden: int, comm: Collectives):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(part.vocab_per_rank, hidden), requires_grad=False)
        self.start, self.comm = part.vocab_start, comm

    def forward(self, ids):
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        h = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside.unsqueeze(-1), 0)
        return self.comm.all_reduce(h)


class VocabParallelHead(nn.Module):
    """lm_head over the rank's vocabulary rows, the logits gathered from every rank and the padding rows dropped."""

    def __init__(self, part: Partition, hidden: int, comm: Collectives):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(part.vocab_per_rank, hidden), requires_grad=False)
        self.vocab_size, self.comm = part.cfg.vocab_size, comm

    def forward(self, h):
        return self.comm.all_gather_last(F.linear(h, self.weight))[..., : self.vocab_size]


def build_shard(part: Partition, comm: Collectives, dtype: torch.dtype, device: torch.device):
    """This rank's model, allocated (uninitialized) on `device`: the reference model at the local sizes, with the
    row-parallel and vocabulary-parallel modules in place."""
    from brrr.models import model_class

    cfg, local = part.cfg, part.local_config()
    with torch.device("meta"):
        model = model_class(local)(local)
        m = model.model
        m.embed_fused = False  # the fused gather-and-norm reads the whole table; the shard's lookup all-reduces
        m.embed_tokens = VocabParallelEmbedding(part, cfg.hidden_size, comm)
        model.lm_head = VocabParallelHead(part, cfg.hidden_size, comm)
        for layer in m.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.o_proj = RowParallelLinear(part.heads * cfg.head_dim, cfg.hidden_size, cfg.o_proj_bias, comm)
            mlp.down_proj = RowParallelLinear(part.intermediate, cfg.hidden_size, cfg.mlp_bias, comm)
    model = model.to(dtype).to_empty(device=device)
    if cfg.tie_word_embeddings:  # to_empty breaks the tie; both hold the same vocabulary rows
        model.lm_head.weight = model.model.embed_tokens.weight
    model.full_config, model.tp_comm, model.tp_partition = cfg, comm, part
    return model
