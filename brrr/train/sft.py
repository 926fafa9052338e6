"""Supervised fine-tuning data: JSONL examples -> token ids with a loss mask -> packed rows of seq_len tokens.

An example is one JSON object per line, either OpenAI chat format `{"messages": [{"role", "content"}, ...]}`,
rendered with the model's chat template, or `{"prompt": str, "completion": str}` (the prompt encoded with the
tokenizer's special tokens, the completion after it, then the eos token). Only assistant turns (and the completion,
with its eos) are trained on: the template's text for assistant message i is what rendering messages[:i + 1] adds
to rendering messages[:i] with the generation prompt, so any template that renders a conversation as the
concatenation of its turns works, `{% generation %}` tags or not. Each piece is encoded on its own, as the prompt
and the generated tokens are at inference.

Packing: documents (input ids[:-1], next-token targets ids[1:] with -100 where untrained) are placed into rows of
seq_len tokens by best fit, longest first; a row's tail is padding (its own segment, no targets). A micro-batch is
micro_batch rows flattened into one varlen batch: `AttnMeta.causal` over the documents' lengths, so attention never
crosses a document boundary, and positions restart at 0 in every document. The order of rows in each epoch is a
function of (seed, epoch), so a data position (micro-batches consumed) is all an exact resume needs.
"""
from __future__ import annotations

import bisect
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from brrr.errors import BrrrError
from brrr.kernels import AttnMeta

IGNORE = -100
ROLES = ("system", "user", "assistant", "tool", "developer")


def read_jsonl(path) -> list[tuple[int, dict]]:
    """(line number, object) for each non-blank line; a line that is not a JSON object is a BrrrError naming it."""
    path = Path(path)
    if not path.is_file():
        raise BrrrError(f"--data {path}: file not found")
    records = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise BrrrError(f"{path}, line {lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(obj, dict):
                raise BrrrError(f"{path}, line {lineno}: expected a JSON object with \"messages\" or "
                                f"\"prompt\"/\"completion\", got {type(obj).__name__}")
            records.append((lineno, obj))
    if not records:
        raise BrrrError(f"--data {path} holds no examples")
    return records


def _check_messages(messages, where: str):
    if not isinstance(messages, list) or not messages:
        raise BrrrError(f"{where}: \"messages\" must be a non-empty list of {{\"role\", \"content\"}} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise BrrrError(f"{where}: messages[{i}] must have a \"role\" ({', '.join(ROLES)}) and a string "
                            f"\"content\"")
    if not any(m["role"] == "assistant" for m in messages):
        raise BrrrError(f"{where}: no assistant message, so nothing to train on")


def chat_pieces(tokenizer, messages: list[dict], where: str) -> list[tuple[str, bool]]:
    """The rendered conversation as (text, trained) pieces: assistant turns trained, the rest not."""
    pieces, done = [], ""
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt = tokenizer.apply_chat_template(messages[:i], add_generation_prompt=True)
        turn = tokenizer.apply_chat_template(messages[:i + 1], add_generation_prompt=False)
        if not prompt.startswith(done) or not turn.startswith(prompt):
            raise BrrrError(f"{where}: the chat template does not render this conversation turn by turn (the text "
                            f"for messages[:{i}] is not a prefix of the text for messages[:{i + 1}]), so its "
                            f"assistant tokens cannot be found; use {{\"prompt\", \"completion\"}} examples")
        pieces += [(prompt[len(done):], False), (turn[len(prompt):], True)]
        done = turn
    whole = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    if not whole.startswith(done):
        raise BrrrError(f"{where}: the chat template renders the whole conversation differently from its turns")
    pieces.append((whole[len(done):], False))
    return [(text, trained) for text, trained in pieces if text]


def encode_example(tokenizer, record: dict, where: str) -> tuple[np.ndarray, np.ndarray]:
    """(ids, trained) of one example: int64 token ids and a bool per token, True where it is a training target."""
    if "messages" in record:
        _check_messages(record["messages"], where)
        pieces = chat_pieces(tokenizer, record["messages"], where)
        ids, trained = [], []
        for text, is_trained in pieces:
            piece = tokenizer.encode(text, add_special_tokens=False)
            ids += piece
            trained += [is_trained] * len(piece)
    elif "prompt" in record or "completion" in record:
        prompt, completion = record.get("prompt"), record.get("completion")
        if not isinstance(prompt, str) or not isinstance(completion, str) or not completion:
            raise BrrrError(f"{where}: \"prompt\" and \"completion\" must both be strings (completion non-empty)")
        head = tokenizer.encode(prompt, add_special_tokens=True)
        tail = tokenizer.encode(completion, add_special_tokens=False)
        if tokenizer.eos_token_id is not None:
            tail.append(tokenizer.eos_token_id)
        ids, trained = head + tail, [False] * len(head) + [True] * len(tail)
    else:
        raise BrrrError(f"{where}: expected \"messages\" (chat) or \"prompt\" and \"completion\"; got keys "
                        f"{sorted(record)}")
    if len(ids) < 2 or not any(trained[1:]):
        raise BrrrError(f"{where}: the example encodes to no trainable tokens")
    return np.asarray(ids, dtype=np.int64), np.asarray(trained, dtype=bool)


@dataclass
class Document:
    inputs: np.ndarray  # ids[:-1]
    targets: np.ndarray  # ids[1:], IGNORE where the token is not trained


def to_document(ids: np.ndarray, trained: np.ndarray, seq_len: int) -> tuple[Document, bool]:
    """The next-token document of an example, cut to seq_len inputs; the bool says whether it was cut."""
    targets = np.where(trained[1:], ids[1:], IGNORE)
    cut = len(ids) - 1 > seq_len
    return Document(ids[:-1][:seq_len], targets[:seq_len]), cut


def pack(docs: list[Document], seq_len: int) -> list[list[int]]:
    """Rows of document indices whose lengths sum to <= seq_len: best fit, longest first (deterministic)."""
    order = sorted(range(len(docs)), key=lambda i: (-len(docs[i].inputs), i))
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, row), sorted
    for i in order:
        n = len(docs[i].inputs)
        at = bisect.bisect_left(free, (n, -1))
        if at < len(free):
            room, row = free.pop(at)
            rows[row].append(i)
            room -= n
        else:
            rows.append([i])
            row, room = len(rows) - 1, seq_len - n
        if room > 0:
            bisect.insort(free, (room, row))
    return rows


class PackedRows:
    """Packed rows of one split: flat inputs/targets/positions [rows, seq_len] and each row's segment lengths."""

    def __init__(self, docs: list[Document], seq_len: int, pad_id: int):
        self.seq_len = seq_len
        rows = pack(docs, seq_len)
        self.inputs = np.full((len(rows), seq_len), pad_id, dtype=np.int64)
        self.targets = np.full((len(rows), seq_len), IGNORE, dtype=np.int64)
        self.positions = np.zeros((len(rows), seq_len), dtype=np.int64)
        self.segments: list[list[int]] = []
        for r, row in enumerate(rows):
            at, lengths = 0, []
            for i in row:
                n = len(docs[i].inputs)
                self.inputs[r, at:at + n], self.targets[r, at:at + n] = docs[i].inputs, docs[i].targets
                self.positions[r, at:at + n] = np.arange(n)
                lengths.append(n)
                at += n
            if at < seq_len:  # padding: a segment of its own, attending only to itself, with no targets
                self.positions[r, at:] = np.arange(seq_len - at)
                lengths.append(seq_len - at)
            self.segments.append(lengths)
        self.trained_tokens = int((self.targets != IGNORE).sum())

    def __len__(self) -> int:
        return len(self.segments)

    def batch(self, rows, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttnMeta]:
        """(input ids [N], targets [N], positions [N], AttnMeta) of these rows as one flattened varlen batch."""
        rows = np.asarray(rows)
        out = [torch.from_numpy(a[rows].reshape(-1)) for a in (self.inputs, self.targets, self.positions)]
        if torch.device(device).type == "cuda":
            out = [t.pin_memory().to(device, non_blocking=True) for t in out]
        meta = AttnMeta.causal([n for r in rows for n in self.segments[r]], device)
        return (*out, meta)


class SFTBatches:
    """The training rows in an order drawn per epoch from (seed, epoch): the trainer's `windows` for SFT."""

    def __init__(self, rows: PackedRows, micro_batch: int, seed: int):
        if len(rows) < micro_batch:
            raise BrrrError(f"the training data packs into {len(rows)} rows of {rows.seq_len} tokens: fewer than "
                            f"one --micro-batch of {micro_batch}; lower --micro-batch or add data")
        self.rows, self.batch, self.seed = rows, micro_batch, seed
        self._epoch, self._order = -1, None

    def order(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            self._epoch, self._order = epoch, np.random.default_rng([self.seed, epoch]).permutation(len(self.rows))
        return self._order

    def epoch(self, position: int) -> float:
        return position * self.batch / len(self.rows)

    def batch_at(self, position: int, device):
        ids = np.arange(position * self.batch, (position + 1) * self.batch)
        picked = [int(self.order(int(i // len(self.rows)))[i % len(self.rows)]) for i in ids]
        return self.rows.batch(picked, device)


def load_sft(path, tokenizer, seq_len: int, val_fraction: float, seed: int, eval_path=None):
    """(train PackedRows, val PackedRows or None, stats). The validation split is eval_path's examples, or a
    val_fraction of the examples chosen by (seed, line number)."""
    def encode(file):
        docs, cut = [], 0
        for lineno, record in read_jsonl(file):
            ids, trained = encode_example(tokenizer, record, f"{file}, line {lineno}")
            doc, was_cut = to_document(ids, trained, seq_len)
            docs.append((lineno, doc))
            cut += was_cut
        return docs, cut

    docs, cut = encode(path)
    if eval_path is not None:
        val_docs, val_cut = encode(eval_path)
        train = [d for _, d in docs]
        val = [d for _, d in val_docs]
        cut += val_cut
    elif val_fraction > 0:
        rng = np.random.default_rng([seed, len(docs)])
        held = set(rng.permutation(len(docs))[:max(1, round(val_fraction * len(docs)))].tolist())
        if len(held) >= len(docs):
            raise BrrrError(f"--data has {len(docs)} example(s): too few to hold out a validation split "
                            f"(--val-fraction {val_fraction}); add examples, pass --eval-data, or --val-fraction 0")
        train = [d for i, (_, d) in enumerate(docs) if i not in held]
        val = [d for i, (_, d) in enumerate(docs) if i in held]
    else:
        train, val = [d for _, d in docs], []
    pad = tokenizer.token_id(tokenizer.special_tokens.get("pad_token"))
    pad = pad if pad is not None else (tokenizer.eos_token_id or 0)
    train_rows = PackedRows(train, seq_len, pad)
    val_rows = PackedRows(val, seq_len, pad) if val else None
    stats = {"train_examples": len(train), "val_examples": len(val), "truncated_examples": cut,
             "train_rows": len(train_rows), "train_trained_tokens": train_rows.trained_tokens,
             "val_trained_tokens": val_rows.trained_tokens if val_rows else 0}
    return train_rows, val_rows, stats
