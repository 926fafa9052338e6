"""Passkey retrieval (the "needle in a haystack" of Mohtashami and Jaggi's landmark-attention paper): a random
number stated once at a chosen depth of a long filler context, then asked for. Greedy generation through
brrr.LLM; a trial retrieves when the generated text contains the number. The rate per (context length, depth)
over several random passkeys shows where in a long prompt a model (and its RoPE scaling, or a KV eviction
policy) still reads.

The prompt is built in token ids, not re-tokenized text, so its length and the needle's place are exact: an
instruction, the filler sentence repeated, the needle inserted at a sentence boundary at depth d (0: right after
the instruction, 100: just before the question), the question. Its length is the context length minus the answer's
token budget, so prompt and answer fit the context.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from brrr.errors import BrrrError
from brrr.sampling_params import SamplingParams

INSTRUCTION = ("There is an important piece of information hidden inside a lot of irrelevant text. Find it and "
               "remember it. ")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "What is the pass key? The pass key is"
ANSWER_TOKENS = 12  # greedy tokens generated: a 5-digit key and some slack


@dataclass
class NeedlePrompt:
    ids: list[int]
    key: str
    needle_start: int  # token index where the needle begins
    needle_len: int
    filler_start: int  # the haystack: [filler_start, filler_end) with the needle inside
    filler_end: int

    @property
    def depth(self) -> float:
        """The needle's actual depth in [0, 1]: the share of the haystack before it."""
        haystack = self.filler_end - self.filler_start - self.needle_len
        return (self.needle_start - self.filler_start) / haystack if haystack else 0.0


def build_prompt(encode, context: int, depth: float, key: str, answer_tokens: int = ANSWER_TOKENS) -> NeedlePrompt:
    """The prompt of `context` - answer_tokens token ids with the needle at `depth` (0..1) of the filler, at the
    nearest filler-sentence boundary. encode: text -> token ids."""
    head, sentence = encode(INSTRUCTION), encode(FILLER)
    needle, question = encode(NEEDLE.format(key=key)), encode(QUESTION)
    budget = context - answer_tokens - len(head) - len(needle) - len(question)
    if budget < len(sentence):
        fixed = context - budget + len(sentence)
        raise BrrrError(f"--context {context} is too short for the passkey prompt: it needs at least {fixed} tokens "
                        f"(instruction, one filler sentence, needle, question, {answer_tokens} answer tokens)")
    filler = (sentence * (budget // len(sentence) + 1))[:budget]
    target = depth * budget
    cut = round(target / len(sentence)) * len(sentence)  # the nearest sentence boundary (the end is one too)
    if cut > budget or budget - target < abs(cut - target):
        cut = budget
    ids = head + filler[:cut] + needle + filler[cut:] + question
    return NeedlePrompt(ids, key, len(head) + cut, len(needle), len(head), len(head) + budget + len(needle))


def parse_depths(spec: str) -> list[float]:
    """'0,25,50,75,100' (percent) -> fractions."""
    try:
        depths = [float(p) for p in spec.split(",")]
    except ValueError:
        raise BrrrError(f"--depths takes comma-separated percentages such as 0,25,50,75,100; got {spec!r}") from None
    bad = [d for d in depths if not 0 <= d <= 100]
    if bad:
        raise BrrrError(f"--depths must lie in [0, 100] percent, got {bad}")
    return [d / 100 for d in depths]


def needle_eval(llm, contexts: list[int], depths: list[float], trials: int = 3, seed: int = 0) -> dict:
    """Retrieval per (context, depth) over `trials` random 5-digit keys, greedy, through `llm` (a brrr.LLM):
    {"grid": [{context, depth, actual_depth, trials, retrieved, rate}], "rate_by_context": {L: rate}, "rate"}."""
    if trials < 1:
        raise BrrrError(f"--trials must be >= 1, got {trials}")
    max_context = llm.pretrained.model.config.max_context
    too_long = [c for c in contexts if c > max_context]
    if too_long:
        raise BrrrError(f"--context {','.join(map(str, too_long))} exceeds the model's context of {max_context} "
                        "tokens (max_position_embeddings, stretched by its rope scaling where that says so)")
    tok = llm.tokenizer
    encode = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    rng = random.Random(seed)
    cells, prompts = [], []
    for context in contexts:
        for depth in depths:
            cell = {"context": context, "depth": round(depth * 100, 4), "trials": trials, "retrieved": 0}
            for _ in range(trials):
                p = build_prompt(encode, context, depth, str(rng.randint(10000, 99999)))
                cell["actual_depth"] = round(p.depth * 100, 2)
                prompts.append((cell, p))
            cells.append(cell)
    params = SamplingParams(temperature=0.0, max_tokens=ANSWER_TOKENS)
    outputs = llm.generate([p.ids for _, p in prompts], params, use_tqdm=False)
    for (cell, p), out in zip(prompts, outputs):
        cell["retrieved"] += p.key in out.outputs[0].text
    for cell in cells:
        cell["rate"] = cell["retrieved"] / cell["trials"]
    by_context = {}
    for context in contexts:
        mine = [c for c in cells if c["context"] == context]
        by_context[str(context)] = sum(c["retrieved"] for c in mine) / sum(c["trials"] for c in mine)
    total = sum(c["retrieved"] for c in cells) / sum(c["trials"] for c in cells)
    return {"grid": cells, "rate_by_context": by_context, "rate": total}
