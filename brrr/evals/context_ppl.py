"""Perplexity at fixed context lengths: the tokens cut into non-overlapping windows of exactly L tokens (the tail
that fills no window dropped), each window scored on all its tokens but the first, so a length's count is
windows x (L - 1) and every scored token has its window's earlier tokens as context (on average L / 2). Longer
windows give later tokens more context: the perplexity falls with L while the model uses it, and rises past the
length its RoPE (with its scaling: YaRN, NTK, llama3, read from the config or --rope-scaling) carries.

`engine_context_perplexity` scores the same windows through the serving engine (brrr.LLM, prompt log-probs): what
its KV cache holds is what the scores see, so an fp8 cache or StreamingLLM eviction shows its cost in perplexity
beside the memory it keeps.
"""
from __future__ import annotations

import json
import math
import re
import sysconfig
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

from brrr.analysis.model import kv_elements_per_token
from brrr.config import COMPACTING_EVICTIONS, ModelConfig
from brrr.errors import BrrrError
from brrr.kernels import AttnMeta
from brrr.kernels.attention.kv_quant import cache_dtype
from brrr.sampling_params import SamplingParams

LOGIT_ROWS = 1024  # the LM head's rows per chunk: a 32k window's [tokens, vocab] logits never exist whole


def parse_contexts(spec: str) -> list[int]:
    """'4k,8k,16k,32k' (k = 1024) or plain token counts -> lengths, in the order given."""
    out = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*([kK]?)\s*", part)
        if not m or int(m.group(1)) == 0:
            raise BrrrError(f"--context takes comma-separated lengths such as 4k,8k or 512,1024; got {part!r}")
        n = int(m.group(1)) * (1024 if m.group(2) else 1)
        if n < 2:
            raise BrrrError(f"--context lengths must be >= 2 tokens, got {n}")
        out.append(n)
    return out


def _rope_spec(spec: str):
    """--rope-scaling's value as config.json's rope_scaling: a dict, or None for 'none'."""
    if spec.strip().lower() == "none":
        return None
    try:
        value = json.loads(spec)
    except json.JSONDecodeError as e:
        raise BrrrError(f"--rope-scaling must be 'none' or a JSON object like "
                        f"'{{\"rope_type\": \"yarn\", \"factor\": 4, \"original_max_position_embeddings\": 1024}}': "
                        f"{e}") from None
    if not isinstance(value, dict):
        raise BrrrError(f"--rope-scaling must be a JSON object, got {spec!r}")
    return value


def model_dir_with_rope(path: Path, spec: str, out: Path) -> Path:
    """A model directory at `out` that is `path` (its files linked) with config.json's RoPE scaling replaced by
    --rope-scaling's `spec`, and max_position_embeddings raised to what YaRN / llama3 scaling is made for, so the
    engine (brrr.LLM) takes such contexts. Checked by parsing, so a bad spec fails here by name."""
    raw = json.loads((path / "config.json").read_text())
    raw.pop("rope_parameters", None)
    raw["rope_scaling"] = _rope_spec(spec)
    raw["max_position_embeddings"] = scaled_context(ModelConfig.from_hf(raw, source="--rope-scaling"))
    out.mkdir(parents=True, exist_ok=True)
    for f in path.iterdir():
        if f.name != "config.json":
            (out / f.name).symlink_to(f.resolve())
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    return out


def with_rope_scaling(model, spec: str | None) -> ModelConfig:
    """The model with its RoPE scaling replaced by `spec` (a JSON object as config.json's rope_scaling, or
    'none': plain RoPE); None keeps the config's. Returns the config in effect."""
    cfg = model.config
    if spec is None:
        return cfg
    raw = cfg.to_hf()
    raw.pop("rope_parameters", None)
    raw["rope_scaling"] = _rope_spec(spec)
    new = ModelConfig.from_hf(raw, source="--rope-scaling")
    new = replace(cfg, rope=new.rope)
    model.config = new
    rotary = model.model.rotary_emb
    rotary.cfg, rotary._cache = new, {}  # the frequencies are derived again from the new scaling
    return new


def scaled_context(cfg: ModelConfig) -> int:
    """The context the RoPE scaling is made for: max_position_embeddings, or factor x the original length for
    YaRN and llama3 scaling when that is longer (configs differ on whether they wrote the stretched length), or the
    dynamic-NTK stretch (ModelConfig.max_context)."""
    params = cfg.rope.params
    if cfg.rope.type in ("yarn", "llama3") and params.get("original_max_position_embeddings"):
        return max(cfg.max_position_embeddings, int(params["factor"] * params["original_max_position_embeddings"]))
    return cfg.max_context


def stdlib_tokens(tokenizer, n_tokens: int) -> torch.Tensor:
    """At least n_tokens (when there are that many) of the Python standard library's *.py files in path order, the
    kind of text the shipped default model was trained on."""
    root = Path(sysconfig.get_paths()["stdlib"])
    ids: list[int] = []
    for path in sorted(root.rglob("*.py")):
        if "test" in path.parts or "site-packages" in path.parts:
            continue
        ids += tokenizer.encode(path.read_text(errors="replace"), add_special_tokens=False)
        if len(ids) >= n_tokens:
            break
    return torch.tensor(ids[:n_tokens], dtype=torch.int64)


@torch.no_grad()
def window_nll(model, ids: torch.Tensor) -> float:
    """Summed next-token negative log-likelihood of one window (1-D ids on the model's device), its first token
    unscored."""
    n = ids.numel()
    hidden = model(ids, torch.arange(n, device=ids.device), AttnMeta.causal([n], ids.device))
    total = 0.0
    for start in range(0, n - 1, LOGIT_ROWS):
        rows = slice(start, min(start + LOGIT_ROWS, n - 1))
        logits = model.compute_logits(hidden[rows]).float()
        total += F.cross_entropy(logits, ids[rows.start + 1: rows.stop + 1], reduction="sum").item()
    return total


def window_count(tokens: torch.Tensor, length: int, max_windows: int | None) -> int:
    """How many whole windows of `length` tokens the data holds (at most max_windows); none is an error."""
    n_windows = len(tokens) // length if max_windows is None else min(len(tokens) // length, max_windows)
    if n_windows == 0:
        raise BrrrError(f"--context {length}: the data holds {len(tokens)} tokens, not one window of {length}; "
                        "pass more data (--data) or a shorter --context")
    return n_windows


def context_perplexity(model, tokens: torch.Tensor, contexts: list[int], max_windows: int | None = None,
                       advance=lambda n: None) -> list[dict]:
    """Per length L: {context, windows, tokens (scored: windows x (L - 1)), nll, ppl, beyond_max_context}."""
    device = next(model.parameters()).device
    max_context = scaled_context(model.config)
    rows = []
    for length in contexts:
        n_windows = window_count(tokens, length, max_windows)
        total = 0.0
        for w in range(n_windows):
            total += window_nll(model, tokens[w * length:(w + 1) * length].to(device))
            advance(1)
        count = n_windows * (length - 1)
        rows.append({"context": length, "windows": n_windows, "tokens": count, "nll": total / count,
                     "ppl": math.exp(total / count), "beyond_max_context": length > max_context})
    return rows


def engine_context_perplexity(llm, tokens: torch.Tensor, contexts: list[int], max_windows: int | None = None,
                              advance=lambda n: None) -> list[dict]:
    """context_perplexity's rows, each window scored by the engine `llm` (a brrr.LLM) as a prompt's log-probs
    (chunked prefill over the paged cache, with the engine's KV dtype and eviction policy), plus the KV a sequence
    keeps: kv_tokens (the window, or the eviction budget) and kv_bytes (at the cache's element size). The engine
    generates one token after the prompt, so a window is at most the engine's context less one."""
    ec, model_cfg = llm.engine.config, llm.pretrained.model.config
    if ec.kv_eviction in COMPACTING_EVICTIONS:
        raise BrrrError(f"--kv-eviction {ec.kv_eviction} compacts a prompt once its prefill ends, so a prompt's "
                        "scores see all of it; measure it with `brrr eval needle` (retrieval after the compaction)")
    limit = llm.engine.max_model_len - 1
    too_long = [c for c in contexts if c > limit]
    if too_long:
        raise BrrrError(f"--context {','.join(map(str, too_long))}: scored through the engine (a --kv-* flag), a "
                        f"window is at most {limit} tokens (the engine's context {limit + 1} less the one token "
                        "it generates)")
    itemsize = cache_dtype(ec.kv_cache_dtype, next(llm.pretrained.model.parameters()).dtype).itemsize
    per_token = kv_elements_per_token(model_cfg) * itemsize  # (MLA: its latent and rotary key)
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    rows = []
    for length in contexts:
        n_windows = window_count(tokens, length, max_windows)
        windows = [tokens[w * length:(w + 1) * length].tolist() for w in range(n_windows)]
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in windows], params, use_tqdm=False)
        total = 0.0
        for ids, out in zip(windows, outputs):
            total -= sum(scores[token] for token, scores in zip(ids[1:], out.prompt_logprobs[1:]))
        advance(n_windows)
        count = n_windows * (length - 1)
        # what the cache holds: a sliding window masks keys but its blocks stay until the sequence ends
        kept = length if ec.kv_eviction is None else min(length, ec.kv_budget)
        rows.append({"context": length, "windows": n_windows, "tokens": count, "nll": total / count,
                     "ppl": math.exp(total / count), "beyond_max_context": length > scaled_context(model_cfg),
                     "kv_tokens": kept, "kv_bytes": kept * per_token})
    return rows
