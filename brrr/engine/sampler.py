"""The sampler: grammar mask and logit_bias -> penalties -> min_tokens mask -> temperature -> top-k -> top-p -> min-p
-> draw. Logprobs are read after the grammar mask and logit_bias: those of the distribution the row samples from.

Draws use the Gumbel-max trick (brrr/kernels/sampling.py): argmax(logits / T + noise), the noise a hash of the row's
key. A seeded request's key is (seed, tokens generated so far), so its tokens do not depend on what else is in the
batch; unseeded rows take fresh keys from torch's global generator. Filtering costs a vocabulary sort only for rows
that ask for top-p or min-p; top-k alone takes torch.topk; plain temperature sampling filters nothing.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from brrr.engine.guided import GuidedMatcher, apply_token_bitmask, fill_bitmask
from brrr.kernels.log_softmax import log_softmax
from brrr.kernels.sampling import greedy_argmax, gumbel_argmax, row_keys
from brrr.sampling_params import SamplingParams


@dataclass
class SampleRow:
    params: SamplingParams
    seed: int | None = None
    step: int = 0  # tokens this row has generated so far: with the seed, the key of its noise
    prompt_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    stop_ids: tuple[int, ...] = ()  # masked while len(output_ids) < min_tokens
    guide: GuidedMatcher | None = None  # the sequence's grammar state: only the tokens it allows can be drawn


@dataclass
class SampleResult:
    tokens: list[int]
    logprobs: list[dict[int, float] | None]  # per row: {token: logprob} for the sampled token and the top-k


def apply_penalties(logits: torch.Tensor, row: SampleRow) -> None:
    p = row.params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(row.prompt_ids) | set(row.output_ids)), dtype=torch.long, device=logits.device)
        if len(seen):
            vals = logits[seen]
            logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and row.output_ids:
        counts = torch.bincount(torch.tensor(row.output_ids, device=logits.device), minlength=logits.shape[-1])
        logits -= p.frequency_penalty * counts[: logits.shape[-1]] + p.presence_penalty * (counts[: logits.shape[-1]] > 0)


def constrain(logits: torch.Tensor, rows: list[SampleRow], bitmask: torch.Tensor | None = None) -> torch.Tensor:
    """The guided rows' grammar masks and every row's logit_bias applied, batch-wide: one mask upload for all guided
    rows and one scatter for all biases, nothing that waits for the device. Returns `logits` itself when no row asks
    for either (an unguided batch pays two list scans). bitmask: the guided rows' masks, filled already (host)."""
    device = logits.device
    guided = [i for i, row in enumerate(rows) if row.guide is not None]
    if guided:
        if bitmask is None:
            bitmask = fill_bitmask([rows[i].guide for i in guided], logits.shape[1], pin=device.type == "cuda")
        bitmask = h2d(bitmask, device)
        logits = apply_token_bitmask(logits, bitmask, None if len(guided) == len(rows) else h2d(guided, device))
    biased = [i for i, row in enumerate(rows) if row.params.logit_bias]
    if biased:
        where, bias = [], []
        for i in biased:
            for token, value in rows[i].params.logit_bias.items():
                where.append((i, token))
                bias.append(value)
        index = h2d(where, device, torch.long).T
        logits = logits.index_put((index[0], index[1]), h2d(bias, device, logits.dtype), accumulate=True)
    return logits


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """logits [B, V] already divided by temperature; top_k [B] (0 = off), top_p/min_p [B]. Masked -> -inf."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    drop = (top_k[:, None] > 0) & (rank >= top_k[:, None])
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = sorted_logits.softmax(-1)
    mass_before = probs.cumsum(-1) - probs
    drop |= mass_before >= top_p[:, None]  # keep the smallest head whose mass reaches top_p (always the first)
    drop |= probs < min_p[:, None] * probs[:, :1]
    drop[:, 0] = False
    return logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))


def top_k_only(logits: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    """Mask every logit below each row's k-th largest (0 = keep all): a partial top-k, not a sort of the vocabulary."""
    vocab = logits.shape[1]
    ks = [min(k, vocab) or vocab for k in top_k]
    kth = logits.topk(max(ks), dim=-1).values.gather(1, h2d(ks, logits.device)[:, None] - 1)
    return logits.masked_fill(logits < kth, float("-inf"))


class _SideStreams:
    """A device's two side streams for the engine's small copies, and the one event each direction's ordering
    wait reads: a stream's wait on an event waits for the record made before the wait was queued, so every copy can
    record the same event again. (Each step's own `ready` event is not shared: it is waited on a step later.)"""

    def __init__(self, index: int):
        device = torch.device("cuda", index)
        self.up, self.down = torch.cuda.Stream(device), torch.cuda.Stream(device)
        self.uploaded, self.computed = torch.cuda.Event(), torch.cuda.Event()


_SIDE_STREAMS: dict[int, _SideStreams] = {}
# per device: events that read steps gave back (creating one per step costs a driver call)
_READY_EVENTS: dict[int, list[torch.cuda.Event]] = {}


def _side_streams(device: torch.device) -> _SideStreams | None:
    """The device's side streams, None while a CUDA graph is being captured (a capture stays on its stream)."""
    if torch.cuda.is_current_stream_capturing():
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    side = _SIDE_STREAMS.get(index)
    if side is None:
        side = _SIDE_STREAMS[index] = _SideStreams(index)
    return side


def copy_stream(kind: str, device: torch.device) -> torch.cuda.Stream | None:
    """A side stream for the engine's small host <-> device copies ("up" or "down"), or None while a CUDA graph is
    being captured. On the compute stream each copy would wait for the kernels queued before it and hold back the
    ones after, widening the gap between two decode steps."""
    side = _side_streams(device)
    return None if side is None else (side.up if kind == "up" else side.down)


def _on_stream(stream: torch.cuda.Stream, device: torch.device, fn):
    """fn() with `stream` current, the previous streams restored after (torch.cuda.stream's context, without its
    per-call device bookkeeping: this runs a few times every engine step)."""
    outer = torch.cuda.current_stream()
    main = outer if outer.device == stream.device else torch.cuda.current_stream(device)
    torch.cuda.set_stream(stream)
    try:
        return fn(), main
    finally:
        torch.cuda.set_stream(main)
        if main is not outer:
            torch.cuda.set_stream(outer)


def h2d(values, device: torch.device, dtype=None) -> torch.Tensor:
    """Host values on `device` without making the host wait: on CUDA through pinned memory (torch's caching host
    allocator keeps the buffer until the copy has run; a pageable copy would synchronize the stream), on the upload
    stream: the copy runs as soon as it is queued, and the compute stream only waits for it to have run."""
    t = torch.as_tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t.to(device)
    return upload_pinned(t.pin_memory(), device)


def upload_pinned(pinned: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A pinned host tensor on `device`, as `h2d` copies it."""
    side = _side_streams(device)
    if side is None:
        return pinned.to(device, non_blocking=True)
    out, main = _on_stream(side.up, device, lambda: pinned.to(device, non_blocking=True))
    side.uploaded.record(side.up)
    main.wait_event(side.uploaded)
    out.record_stream(main)  # allocated on the upload stream, used on the compute stream
    return out


class PendingTokens:
    """A step's sampled tokens, on their way to the host: `tokens()` waits for them (and only for them). The copy
    runs on the download stream, so the next step's kernels do not queue behind it."""

    def __init__(self, tokens: torch.Tensor):
        self.device_tokens = tokens
        if not tokens.is_cuda:
            self._host, self._ready = tokens, None
            return
        self._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        self._free = _READY_EVENTS.setdefault(tokens.device.index, [])
        self._ready = self._free.pop() if self._free else torch.cuda.Event()
        side = _side_streams(tokens.device)
        if side is None:
            self._host.copy_(tokens, non_blocking=True)
            self._ready.record()
            return
        side.computed.record(torch.cuda.current_stream(tokens.device))
        side.down.wait_event(side.computed)
        _on_stream(side.down, tokens.device, lambda: self._host.copy_(tokens, non_blocking=True))
        self._ready.record(side.down)
        tokens.record_stream(side.down)

    def tokens(self) -> list[int]:
        if self._ready is not None:
            self._ready.synchronize()
            self._free.append(self._ready)
            self._ready = None
        return self._host.tolist()


def sample(logits: torch.Tensor, rows: list[SampleRow]) -> SampleResult:
    """logits [B, V] fp32 (one row per SampleRow) -> one token per row."""
    tokens, raw_logprobs = draw(logits, rows)
    token_list = tokens.tolist()
    out_logprobs: list[dict[int, float] | None] = [None] * len(rows)
    want = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    if want:
        sub = raw_logprobs if len(want) == len(rows) else raw_logprobs.index_select(0, h2d(want, logits.device))
        entries = logprob_entries(sub, [token_list[i] for i in want], [rows[i].params.logprobs for i in want])
        for i, entry in zip(want, entries):
            out_logprobs[i] = entry
    return SampleResult(token_list, out_logprobs)


def logprob_entries(logprobs: torch.Tensor, targets: list[int], ks: list[int]) -> list[dict[int, float]]:
    """Per row of log-probs [R, V]: {target: its logprob} and the row's top-k {token: logprob}, all rows read back
    in one transfer (a read per row, or per entry, would make the host wait for the device each time)."""
    k = max(ks)
    packed = logprobs.gather(1, h2d(targets, logprobs.device, torch.long)[:, None]).double()
    if k:
        top = logprobs.topk(k)
        packed = torch.cat([packed, top.values.double(), top.indices.double()], 1)
    entries = []
    for values, target, want in zip(packed.tolist(), targets, ks):
        entry = {target: values[0]}
        if want:
            entry.update(zip(map(int, values[1 + k:1 + k + want]), values[1:1 + want]))
        entries.append(entry)
    return entries


def draw(logits: torch.Tensor, rows: list[SampleRow],
         bitmask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The tokens [B] on the device, queued without a host synchronization, and the raw log-probs when any row
    wants them. bitmask: the guided rows' masks when the caller has filled them (`constrain`)."""
    device = logits.device
    logits = constrain(logits, rows, bitmask)
    # row-invariant on every device: a trainer recomputing these logprobs with the same op gets the same bits
    raw_logprobs = log_softmax(logits) if any(r.params.logprobs is not None for r in rows) else None
    if any(r.params.has_penalties or len(r.output_ids) < r.params.min_tokens for r in rows):
        logits = logits.clone()
        for i, row in enumerate(rows):
            apply_penalties(logits[i], row)
            if len(row.output_ids) < row.params.min_tokens and row.stop_ids:
                logits[i, list(row.stop_ids)] = float("-inf")
    greedy_rows = [r.params.greedy for r in rows]
    tokens = greedy_argmax(logits) if any(greedy_rows) or not rows else None
    if not all(greedy_rows):  # decided on the host: nothing here waits for the GPU
        drawn_rows = [i for i, g in enumerate(greedy_rows) if not g]
        sub = [rows[i] for i in drawn_rows]
        drawn_logits = logits if tokens is None else logits.index_select(0, h2d(drawn_rows, device))
        temp = torch.tensor([r.params.temperature for r in sub], dtype=torch.float32)
        if any(r.params.top_p < 1 or r.params.min_p > 0 for r in sub):
            # top-p and min-p read probabilities at the temperature: filter the scaled logits, draw at T = 1
            top_k = h2d([r.params.top_k for r in sub], device)
            top_p = h2d([r.params.top_p for r in sub], device, logits.dtype)
            min_p = h2d([r.params.min_p for r in sub], device, logits.dtype)
            drawn_logits = filter_logits(drawn_logits / h2d(temp, device)[:, None], top_k, top_p, min_p)
            temp = torch.ones_like(temp)
        elif any(r.params.top_k > 0 for r in sub):
            drawn_logits = top_k_only(drawn_logits, [r.params.top_k for r in sub])
        unseeded = [r.seed is None for r in sub]
        fresh = iter(torch.randint(0, 2**62, (sum(unseeded),)).tolist())
        keys = row_keys([next(fresh) if u else r.seed for r, u in zip(sub, unseeded)], [r.step for r in sub])
        drawn = gumbel_argmax(drawn_logits, h2d(temp, device), h2d(keys, device))
        tokens = drawn if tokens is None else tokens.index_copy(0, h2d(drawn_rows, device), drawn)
    return tokens, raw_logprobs
