"""An EAGLE-1 draft head (Li et al., 2024): one decoder layer that extrapolates the target's features.

The head reads, at position p, the target's final hidden state f_p (the model's forward output: after the final
norm, before the LM head) and the embedding of the token that follows, t_{p+1}:
    x_p = fc([embed(t_{p+1}), f_p])      2H -> H, with a bias, as EAGLE's fc
    f'_{p+1} = decoder_layer(x_p)        brrr's LlamaDecoderLayer of the target's shape, causal over positions
and the target's own LM head turns f'_{p+1} into the distribution of t_{p+2}. Drafting runs it autoregressively:
the drafted token and the head's own feature are the next position's input. The embedding and the LM head are
the target's (frozen, shared), so a head directory holds only fc and the layer: config.json (architectures
["EagleHead"], the target's shape, and a `target` fingerprint that ties it to one model) and model.safetensors,
with EAGLE's tensor names (fc.*, layers.0.*). Unlike EAGLE-1's released heads, layer 0 keeps its input RMSNorm:
brrr's decoder layer is used unchanged.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from brrr.config import ModelConfig
from brrr.errors import BrrrError
from brrr.kernels import AttnMeta
from brrr.models.llama import LlamaDecoderLayer, RotaryEmbedding

ARCHITECTURE = "EagleHead"
FINGERPRINT_ROWS = 16  # embedding rows hashed: enough to tell two checkpoints of one shape apart


def target_fingerprint(target: nn.Module) -> dict:
    """What ties a head to its target: the shape fields the head's tensors depend on, and a hash of the first
    embedding rows rounded to bf16 (so the same checkpoint loaded in fp32 on CPU or bf16 on GPU matches)."""
    cfg = target.config
    rows = target.model.embed_tokens.weight[:FINGERPRINT_ROWS].detach().to("cpu", torch.bfloat16)
    digest = hashlib.sha256(rows.view(torch.int16).numpy().tobytes()).hexdigest()[:16]
    return {"hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size, "num_layers": cfg.num_layers,
            "embedding_sha256": digest}


class EagleHead(nn.Module):
    def __init__(self, cfg: ModelConfig, target: dict):
        """cfg: the target's shape (the layer copies it); target: the target's fingerprint."""
        super().__init__()
        self.config, self.target = cfg, target
        h = cfg.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=True)
        self.layers = nn.ModuleList([LlamaDecoderLayer(cfg, 0)])  # layer index 0: its KV cache is kv_caches[0]
        self.rotary_emb = RotaryEmbedding(cfg)

    def forward(self, embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                meta: AttnMeta) -> torch.Tensor:
        """embeds [N, H] (of t_{p+1}), features [N, H] (f_p), positions [N] (p) -> predicted features [N, H]."""
        x = self.fc(torch.cat([embeds, features.to(embeds.dtype)], dim=-1))
        cos, sin = self.rotary_emb(positions, x.dtype)
        h, residual = self.layers[0](x, cos, sin, meta)
        return h + residual

    def check_target(self, target: nn.Module, where: str = "EAGLE head") -> None:
        """BrrrError naming the first field where `target` is not the model this head was trained for."""
        have = target_fingerprint(target)
        for key, want in self.target.items():
            if have.get(key) != want:
                raise BrrrError(f"{where} was trained for another target model: its config.json says target.{key} "
                                f"= {want!r}, the target has {have.get(key)!r}")


def new_head(target: nn.Module, seed: int = 0) -> EagleHead:
    """A freshly initialised fp32 head for `target` on the target's device: N(0, 0.02) matrices, the layer's
    output projections scaled by 1/sqrt(2) (one layer, GPT-2's rule), zero biases, unit norms."""
    cfg = target.config
    device = target.model.embed_tokens.weight.device
    torch.manual_seed(seed)
    with torch.device(device):
        head = EagleHead(_layer_config(cfg), target_fingerprint(target))
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith(".bias"):
                p.zero_()
            elif p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02 / 2**0.5 if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02)
    return head


def _layer_config(cfg: ModelConfig) -> ModelConfig:
    return dataclasses.replace(cfg, num_layers=1)


def save_head(head: EagleHead, out_dir: str | Path, dtype: torch.dtype | None = None) -> None:
    """config.json + model.safetensors (fc and the layer only; the embedding and LM head stay with the target)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(dtype or v.dtype).contiguous().cpu() for k, v in head.state_dict().items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    hf = head.config.to_hf()
    hf.update(architectures=[ARCHITECTURE], target_architecture=head.config.architecture, num_hidden_layers=1,
              target=head.target, torch_dtype=str(next(iter(tensors.values())).dtype).removeprefix("torch."))
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")


def load_head(path: str | Path, target: nn.Module, dtype: torch.dtype | None = None) -> EagleHead:
    """The head in `path` on the target's device (dtype: the target's), after checking it belongs to `target`."""
    path = Path(path)
    file = path / "config.json"
    if not file.is_file():
        raise BrrrError(f"EAGLE head directory {path}: config.json not found")
    try:
        raw = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise BrrrError(f"{file} is not valid JSON: {e}") from None
    if not isinstance(raw, dict) or raw.get("architectures") != [ARCHITECTURE]:
        got = raw.get("architectures") if isinstance(raw, dict) else raw
        raise BrrrError(f"{file}: field 'architectures' is {got!r}, not [{ARCHITECTURE!r}]: not an EAGLE head "
                        "(brrr train-draft writes them)")
    fingerprint = raw.get("target")
    if not isinstance(fingerprint, dict) or not isinstance(raw.get("target_architecture"), str):
        raise BrrrError(f"{file}: fields 'target' (the target's fingerprint) and 'target_architecture' are required")
    cfg = ModelConfig.from_hf({**raw, "architectures": [raw["target_architecture"]]}, source=str(file))
    weight = target.model.embed_tokens.weight
    with torch.device("meta"):
        head = EagleHead(cfg, fingerprint)
    head.check_target(target, where=f"EAGLE head {path}")
    head = head.to(dtype or weight.dtype).to_empty(device=weight.device)
    expected = dict(head.named_parameters())
    weights = path / "model.safetensors"
    if not weights.is_file():
        raise BrrrError(f"EAGLE head directory {path}: model.safetensors not found")
    with safe_open(str(weights), framework="pt", device="cpu") as f:
        names = set(f.keys())
        if names != set(expected):
            extra, missing = sorted(names - set(expected)), sorted(set(expected) - names)
            raise BrrrError(f"{weights}: tensors do not match an EAGLE head of this shape (missing {missing[:3]}, "
                            f"unexpected {extra[:3]})")
        for name in names:
            t = f.get_tensor(name)
            if t.shape != expected[name].shape:
                raise BrrrError(f"{weights}: tensor {name!r} has shape {tuple(t.shape)}, the config implies "
                                f"{tuple(expected[name].shape)}")
            with torch.no_grad():
                expected[name].copy_(t)
    return head.requires_grad_(False).eval()


def draft_logits(target: nn.Module, features: torch.Tensor) -> torch.Tensor:
    """fp32 logits of predicted features through the target's LM head."""
    return target.compute_logits(features.to(target.model.embed_tokens.weight.dtype))
