"""Prompts for `brrr bench latency`: random token ids (any model, random weights), or held-out text tokenized by the
model's tokenizer, which is what a trained model and its speculative proposers must be measured on.

`random`: prompt_len random ids. `code`: a window of prompt_len tokens at a seeded offset in a held-out document
(code completion: the model continues the file). `edit`: a passage, an instruction-like marker, then the passage's
start again, so the answer restates the prompt (prompt lookup's case): from held-out text when there is some, else
from random ids (a random model's output does not copy it, but the prompt has the shape).

Held-out text comes from `--dataset-path`: a `brrr data build` directory (its validation split, whose files the
training split never holds) or a text file."""
from __future__ import annotations

import random
from pathlib import Path

from brrr.errors import BrrrError
from brrr.token_data import TokenData
from brrr.tokenizer import Tokenizer

WORKLOADS = ("random", "edit", "code")
# What an edit request says between the text and its restatement; a Python comment, so code stays code.
EDIT_MARKER = "\n\n# The same code again, unchanged:\n"


class HeldOutText:
    """Documents of held-out text in `tokenizer`'s ids, encoded on demand (a data build's files are decoded with the
    data's own tokenizer first when it is not the model's, so any model's tokenizer reads them)."""

    def __init__(self, path: str | Path, tokenizer):
        self.path, self.tokenizer = Path(path).expanduser(), tokenizer
        self._data = None
        if (self.path / "manifest.json").is_file():
            self._data = TokenData(self.path)
            data_tokenizer = Tokenizer.from_dir(self.path)
            # the data's own tokens when they are the model's (a brrr-trained model and its data): nothing to
            # decode and encode again
            self._recode = None if data_tokenizer.to_json() == tokenizer.to_json() else data_tokenizer
            offsets = self._data.documents("val")
            self._spans = [(int(a), int(b)) for a, b in zip(offsets[:-1], offsets[1:])]
            if not self._spans:
                raise BrrrError(f"--dataset-path {path}: its validation split is empty (rebuild the data with a "
                                "larger --val-fraction)")
            self.source = f"{self.path} (validation split, {len(self._spans)} held-out files)"
        elif self.path.is_file():
            try:
                text = self.path.read_text()
            except (OSError, UnicodeDecodeError) as e:
                raise BrrrError(f"--dataset-path {path}: cannot read it as text ({e})") from None
            if not text.strip():
                raise BrrrError(f"--dataset-path {path} is empty")
            self._ids = tokenizer.encode(text, add_special_tokens=False)
            self.source = f"{self.path} (text file)"
        else:
            raise BrrrError(f"--dataset-path {path} is neither a `brrr data build` directory (with manifest.json) "
                            "nor a text file")

    def documents(self, need: int, count: int, rng: random.Random) -> list[list[int]]:
        """`count` documents of at least `need` tokens, distinct while there are enough, in a seeded order."""
        if self._data is None:
            docs = [self._ids] if len(self._ids) >= need else []
        else:
            val = self._data.splits["val"]
            # the data's own token count is close to the model tokenizer's: a cheap first filter
            spans = [s for s in self._spans if s[1] - s[0] - 2 >= need // 2]
            rng.shuffle(spans)
            docs = []
            for a, b in spans:
                ids = val[a + 1: b - 1].tolist()  # inside <|bos|> ... <|eos|>
                if self._recode is not None:
                    ids = self.tokenizer.encode(self._recode.decode(ids), add_special_tokens=False)
                if len(ids) >= need:
                    docs.append(ids)
                    if len(docs) == count:
                        break
        if not docs:
            raise BrrrError(f"--dataset-path {self.path}: no held-out document has {need} tokens; lower "
                            "--prompt-len")
        return [docs[i % len(docs)] for i in range(count)]


def window(doc: list[int], length: int, rng: random.Random) -> list[int]:
    start = rng.randint(0, len(doc) - length)
    return doc[start: start + length]


def edit_prompt(passage_source, prompt_len: int, marker: list[int]) -> list[int]:
    """passage + marker + the passage's first quarter, prompt_len tokens in all: the passage is 4/5 of what the
    marker leaves, so after the restated start a fifth of the prompt's length of the passage is left to copy."""
    passage_len = max(1, (prompt_len - len(marker)) * 4 // 5)
    passage = passage_source(passage_len)
    head = max(0, prompt_len - len(marker) - passage_len)
    return (passage + marker + passage[:head])[:prompt_len]


class Workload:
    """Prompts for one benchmark run: `prompts(batch, seed)` gives `batch` prompts of prompt_len token ids."""

    def __init__(self, name: str, prompt_len: int, vocab: int, text: HeldOutText | None = None):
        if name not in WORKLOADS:
            raise BrrrError(f"--workload must be one of {', '.join(WORKLOADS)}, got {name!r}")
        if name == "code" and text is None:
            raise BrrrError("--workload code needs held-out text: --dataset-path DIR (a `brrr data build` "
                            "directory) or FILE")
        self.name, self.prompt_len, self.vocab = name, prompt_len, vocab
        self.text = text if name != "random" else None
        self.source = self.text.source if self.text else "random token ids"
        if self.text is not None:
            marker = self.text.tokenizer.encode(EDIT_MARKER, add_special_tokens=False)
            self.marker = marker if name == "edit" else []
            if name == "edit" and len(marker) * 2 >= prompt_len:
                raise BrrrError(f"--prompt-len {prompt_len} is too short for the edit workload's marker "
                                f"({len(marker)} tokens): use at least {len(marker) * 2 + 8}")

    def prompts(self, batch: int, seed: int) -> list[list[int]]:
        import torch

        rng = random.Random(seed)
        if self.text is None:
            gen = torch.Generator().manual_seed(seed)

            def random_ids(n: int) -> list[int]:
                return torch.randint(0, self.vocab, (n,), generator=gen).tolist()
            if self.name == "random":
                return [random_ids(self.prompt_len) for _ in range(batch)]
            # random ids written twice then their start: the old synthetic edit shape
            out = []
            for _ in range(batch):
                passage = random_ids(max(1, self.prompt_len * 4 // 9))
                out.append((passage * 2 + passage[: len(passage) // 4])[: self.prompt_len])
            return out
        need = self.prompt_len if self.name == "code" else max(1, (self.prompt_len - len(self.marker)) * 4 // 5)
        docs = self.text.documents(need, batch, rng)
        if self.name == "code":
            prompts = [window(doc, self.prompt_len, rng) for doc in docs]
        else:
            prompts = [edit_prompt(lambda n, d=doc: window(d, n, rng), self.prompt_len, self.marker) for doc in docs]
        for p in prompts:
            if max(p) >= self.vocab:
                raise BrrrError(f"the tokenizer gives token id {max(p)}, beyond the model's vocabulary "
                                f"({self.vocab}): the tokenizer is not this model's")
        return prompts
