"""Reward functions for GRPO, called as TRL calls them:

    f(prompts=[...], completions=[...], completion_ids=[[...]], **fields) -> [float | None, ...]

one value per completion (None: this function does not score it). For chat prompts (a list of messages) each
completion is given as TRL gives it, [{"role": "assistant", "content": text}]; the built-ins read either form.
`fields` are the prompt rows' other
columns, each repeated per completion (`answer=[...]`, `schema=[...]`), plus `tokenizer` (brrr's). `--reward
MODULE:FUNCTION` names one (any importable module, or a file path: path/to/file.py:FUNCTION), or a built-in by
name; several are summed with `--reward-weights` (TRL's reward_weights; default 1 each). The built-ins need no
model:

    exact_match    1 where the completion, stripped, equals the row's `answer` (stripped), else 0
    regex_format   1 where the whole completion matches the row's `pattern` (Python re, DOTALL), else 0
    json_schema    1 where the completion's tokens are a complete JSON value of the row's `schema` (brrr's grammar
                   engine, brrr/engine/guided: the same check that constrains decoding), else 0
    python_syntax  1 where the completion parses as Python (ast.parse), else 0
"""
from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import math
import re
from pathlib import Path

import torch

from brrr.engine.guided.backend import compiler_for
from brrr.errors import BrrrError
from brrr.sampling_params import StructuredOutputsParams


def completion_text(completion) -> str:
    """A completion's text, from a string or TRL's conversational form (a list with one assistant message)."""
    if isinstance(completion, list):
        return "".join(m.get("content") or "" for m in completion if isinstance(m, dict))
    return completion


def _field(kwargs: dict, name: str, fn: str) -> list:
    if name not in kwargs:
        raise BrrrError(f"reward {fn} reads each prompt row's \"{name}\" field; the rows have "
                        f"{sorted(k for k in kwargs if k not in ('completion_ids', 'tokenizer'))}")
    return kwargs[name]


def exact_match(prompts, completions, **kwargs) -> list[float]:
    answers = _field(kwargs, "answer", "exact_match")
    return [float(completion_text(c).strip() == str(a).strip()) for c, a in zip(completions, answers)]


def regex_format(prompts, completions, **kwargs) -> list[float]:
    patterns = _field(kwargs, "pattern", "regex_format")
    return [float(re.fullmatch(p, completion_text(c), re.DOTALL) is not None) for c, p in zip(completions, patterns)]


def python_syntax(prompts, completions, **kwargs) -> list[float]:
    def parses(text: str) -> bool:
        try:
            ast.parse(text)
        except (SyntaxError, ValueError):  # ValueError: a null byte
            return False
        return True

    return [float(parses(completion_text(c))) for c in completions]


def json_schema(prompts, completions, completion_ids, tokenizer, **kwargs) -> list[float]:
    schemas = _field(kwargs, "schema", "json_schema")
    eos = tokenizer.eos_token_id
    compiler = compiler_for(tokenizer, tokenizer.vocab_size, (eos,) if eos is not None else ())
    out = []
    for ids, schema in zip(completion_ids, schemas):
        matcher = compiler.compile(StructuredOutputsParams(json=schema if isinstance(schema, dict)
                                                           else json.loads(schema))).deep_copy()
        ids = [t for t in ids if t != eos]
        ok = all(matcher.consume_token(t) for t in ids) and (matcher.is_accepting() or matcher.is_stopped())
        out.append(float(ok))
    return out


BUILTIN = {f.__name__: f for f in (exact_match, regex_format, json_schema, python_syntax)}


def load_reward(spec: str):
    """A reward function from `--reward`: a built-in's name, MODULE:FUNCTION, or path/to/file.py:FUNCTION."""
    if spec in BUILTIN:
        return BUILTIN[spec]
    module_name, sep, name = spec.rpartition(":")
    if not sep or not module_name or not name:
        raise BrrrError(f"--reward {spec!r}: expected MODULE:FUNCTION (or path/to/file.py:FUNCTION) or one of "
                        f"{', '.join(BUILTIN)}")
    if module_name.endswith(".py"):
        path = Path(module_name)
        if not path.is_file():
            raise BrrrError(f"--reward {spec!r}: {path} not found")
        loader = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(loader)
        try:
            loader.loader.exec_module(module)
        except Exception as e:
            raise BrrrError(f"--reward {spec!r}: importing {path} raised {type(e).__name__}: {e}") from None
    else:
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise BrrrError(f"--reward {spec!r}: cannot import {module_name}: {e}") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise BrrrError(f"--reward {spec!r}: {module_name} has no function {name}")
    return fn


class Rewards:
    """Several reward functions, each scoring every completion; `__call__` gives the per-function rewards
    [N, functions] (NaN where a function returned None) and their weighted sum [N] (NaN where all did)."""

    def __init__(self, specs: list[str], weights: list[float] | None = None, tokenizer=None):
        if not specs:
            raise BrrrError("--reward: give at least one reward function")
        if weights is not None and len(weights) != len(specs):
            raise BrrrError(f"--reward-weights has {len(weights)} values for {len(specs)} --reward functions")
        self.specs, self.fns = specs, [load_reward(s) if isinstance(s, str) else s for s in specs]
        self.names = [s if isinstance(s, str) else getattr(s, "__name__", repr(s)) for s in specs]
        self.weights = torch.tensor(weights if weights is not None else [1.0] * len(specs))
        self.tokenizer = tokenizer

    def __call__(self, prompts: list, completions: list[str], completion_ids: list[list[int]],
                 rows: list[dict], lines: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """rows: each completion's prompt row (its fields become the keyword arguments); lines: where each row is
        in its file (error messages)."""
        keys = [k for k in rows[0] if k not in ("prompt", "completion", "completion_ids")]
        fields = {k: [r.get(k) for r in rows] for k in keys}
        per_fn = torch.zeros(len(completions), len(self.fns))
        for j, (fn, name) in enumerate(zip(self.fns, self.names)):
            try:
                values = fn(prompts=prompts, completions=completions, completion_ids=completion_ids,
                            tokenizer=self.tokenizer, **fields)
            except BrrrError:
                raise
            except Exception as e:
                raise BrrrError(f"reward function {name} raised {type(e).__name__}: {e} -- "
                                f"{_where(fn, prompts, completions, completion_ids, self.tokenizer, fields, lines)}"
                                ) from e
            values = [v.item() if isinstance(v, torch.Tensor) else v for v in (values if values is not None else [])]
            if len(values) != len(completions):
                raise BrrrError(f"reward function {name} returned {len(values)} values for {len(completions)} "
                                f"completions (one per completion)")
            for i, v in enumerate(values):
                if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
                    raise BrrrError(f"reward function {name} returned {v!r} for completion {i}"
                                    f"{'' if lines is None else f' (prompt row at line {lines[i]})'}: expected a "
                                    f"float or None")
            per_fn[:, j] = torch.tensor([math.nan if v is None else float(v) for v in values])
        total = (per_fn * self.weights).nansum(1)
        total[torch.isnan(per_fn).all(1)] = math.nan
        return per_fn, total


def _where(fn, prompts, completions, completion_ids, tokenizer, fields, lines) -> str:
    """Which completion a failing reward function fails on (each re-run alone), for the error message."""
    for i in range(len(completions)):
        try:
            fn(prompts=prompts[i:i + 1], completions=completions[i:i + 1], completion_ids=completion_ids[i:i + 1],
               tokenizer=tokenizer, **{k: v[i:i + 1] for k, v in fields.items()})
        except Exception:
            row = f" (prompt row at line {lines[i]})" if lines is not None else ""
            return f"first on completion {i}{row}: prompt {str(prompts[i])[:60]!r}, completion " \
                f"{completion_text(completions[i])[:60]!r}"
    return "on the whole batch only"
