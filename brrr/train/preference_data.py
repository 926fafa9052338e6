"""Preference data for DPO, in TRL's preference format, tokenized as TRL's DPOTrainer tokenizes it.

One JSON object per line:
- standard: {"prompt": str, "chosen": str, "rejected": str}; the eos token's text is appended to each completion
  that does not end with it, and prompt and prompt + completion are encoded with the tokenizer's special tokens;
- conversational: {"prompt": [messages], "chosen": [messages], "rejected": [messages]}, rendered with the chat
  template (the prompt with the generation prompt); or the implicit-prompt form {"chosen": [messages], "rejected":
  [messages]}, whose shared leading messages are the prompt.
The completion starts where the prompt's tokens and prompt + completion's tokens first differ (the two may not
agree at the boundary). A pair becomes two sequences, prompt + chosen and prompt + rejected, cut to max_length
tokens from the end (TRL's keep_start); a pair whose prompt alone fills max_length is left out, and counted.
A micro-batch of B pairs is one varlen batch of 2B sequences, the B chosen first, then the B rejected.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from brrr.errors import BrrrError
from brrr.kernels import AttnMeta
from brrr.train.sft import IGNORE, ROLES, read_jsonl


@dataclass
class PreferencePair:
    prompt: list[int]
    chosen: list[int]
    rejected: list[int]
    line: int  # where it came from in the file, for messages


def _is_messages(value) -> bool:
    return isinstance(value, list) and all(isinstance(m, dict) for m in value)


def _check_messages(value, where: str, key: str):
    if not isinstance(value, list) or not value:
        raise BrrrError(f"{where}: \"{key}\" must be a non-empty list of {{\"role\", \"content\"}} messages")
    for i, m in enumerate(value):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise BrrrError(f"{where}: {key}[{i}] must have a \"role\" ({', '.join(ROLES)}) and a string \"content\"")


def extract_prompt(chosen: list[dict], rejected: list[dict]) -> tuple[list[dict], list[dict], list[dict]]:
    """(prompt, chosen, rejected) of an implicit-prompt pair: the prompt is the longest run of leading messages the
    two share (TRL's extract_prompt)."""
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    return chosen[:n], chosen[n:], rejected[n:]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def encode_pair(tokenizer, record: dict, where: str) -> tuple[list[int], list[int], list[int]]:
    """(prompt ids, chosen ids, rejected ids) of one preference row."""
    for key in ("chosen", "rejected"):
        if key not in record:
            raise BrrrError(f"{where}: a preference row needs \"chosen\" and \"rejected\" (and usually \"prompt\"); "
                            f"got keys {sorted(record)}")
    chosen, rejected, prompt = record["chosen"], record["rejected"], record.get("prompt")
    if _is_messages(chosen) or _is_messages(rejected):
        _check_messages(chosen, where, "chosen")
        _check_messages(rejected, where, "rejected")
        if prompt is None:
            prompt, chosen, rejected = extract_prompt(chosen, rejected)
            if not prompt or not chosen or not rejected:
                raise BrrrError(f"{where}: \"chosen\" and \"rejected\" share no leading messages (the implicit "
                                f"prompt) or one holds nothing after them; give \"prompt\" explicitly")
        else:
            _check_messages(prompt, where, "prompt")

        def render(messages, generation_prompt):
            return tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt),
                                    add_special_tokens=False)

        prompt_ids = render(prompt, True)
        full_chosen, full_rejected = render(prompt + chosen, False), render(prompt + rejected, False)
    else:
        for key, value in (("prompt", prompt), ("chosen", chosen), ("rejected", rejected)):
            if not isinstance(value, str):
                raise BrrrError(f"{where}: \"{key}\" must be a string (or, conversational, a list of messages); got "
                                f"{type(value).__name__}")
        eos = tokenizer.special_tokens.get("eos_token") or ""
        chosen = chosen if chosen.endswith(eos) else chosen + eos
        rejected = rejected if rejected.endswith(eos) else rejected + eos
        prompt_ids = tokenizer.encode(prompt)
        full_chosen, full_rejected = tokenizer.encode(prompt + chosen), tokenizer.encode(prompt + rejected)
    n = min(common_prefix(prompt_ids, full_chosen), common_prefix(prompt_ids, full_rejected))
    if n == 0:
        raise BrrrError(f"{where}: the prompt encodes to no tokens; DPO scores a completion after a prompt")
    if len(full_chosen) == n or len(full_rejected) == n:
        raise BrrrError(f"{where}: the chosen or the rejected completion encodes to no tokens")
    return prompt_ids[:n], full_chosen[n:], full_rejected[n:]


def load_preferences(path, tokenizer, max_length: int) -> tuple[list[PreferencePair], dict]:
    """The pairs of a preference JSONL file (each sequence cut to max_length tokens), and counts."""
    pairs, dropped, cut = [], 0, 0
    for lineno, record in read_jsonl(path):
        prompt, chosen, rejected = encode_pair(tokenizer, record, f"{path}, line {lineno}")
        if len(prompt) >= max_length:
            dropped += 1
            continue
        room = max_length - len(prompt)
        cut += len(chosen) > room or len(rejected) > room
        pairs.append(PreferencePair(prompt, chosen[:room], rejected[:room], lineno))
    if not pairs:
        raise BrrrError(f"--data {path}: every pair's prompt fills --max-length {max_length}; raise it")
    return pairs, {"pairs": len(pairs), "dropped_long_prompts": dropped, "truncated_pairs": cut}


def pair_batch(pairs: list[PreferencePair], device) -> tuple:
    """(ids [N], targets [N], positions [N], AttnMeta, lengths, completion token counts [2B]) of B pairs as one
    varlen batch: the B prompt + chosen sequences, then the B prompt + rejected ones. targets[i] is the next token
    where that token is part of the completion, else IGNORE."""
    ids, targets, positions, lengths, counts = [], [], [], [], []
    for side in ("chosen", "rejected"):
        for p in pairs:
            completion = getattr(p, side)
            seq = p.prompt + completion
            tgt = [IGNORE] * (len(p.prompt) - 1) + completion + [IGNORE]
            ids += seq
            targets += tgt
            positions += range(len(seq))
            lengths.append(len(seq))
            counts.append(len(completion))
    as_tensor = [torch.as_tensor(np.asarray(a, dtype=np.int64)).to(device) for a in (ids, targets, positions)]
    return (*as_tensor, AttnMeta.causal(lengths, device), lengths, torch.as_tensor(counts, device=device))


class PreferenceBatches:
    """Micro-batches of pairs in an order drawn per epoch from (seed, epoch), as SFTBatches orders rows."""

    def __init__(self, pairs: list[PreferencePair], micro_batch: int, seed: int):
        if len(pairs) < micro_batch:
            raise BrrrError(f"--data holds {len(pairs)} usable pairs: fewer than one --micro-batch of {micro_batch}")
        self.pairs, self.batch, self.seed = pairs, micro_batch, seed
        self._epoch, self._order = -1, None

    def order(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            self._epoch, self._order = epoch, np.random.default_rng([self.seed, epoch]).permutation(len(self.pairs))
        return self._order

    def epoch(self, position: int) -> float:
        return position * self.batch / len(self.pairs)

    def indices_at(self, position: int) -> list[int]:
        n = len(self.pairs)
        return [int(self.order(i // n)[i % n]) for i in range(position * self.batch, (position + 1) * self.batch)]

    def batch_at(self, position: int, device):
        """(pair indices, the pair batch): the indices key the precomputed reference logprobs."""
        picked = self.indices_at(position)
        return (torch.as_tensor(picked), *pair_batch([self.pairs[i] for i in picked], device))
