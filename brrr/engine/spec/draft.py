"""Draft-model proposer: a smaller model with the target's tokenizer proposes k tokens greedily, one batched step
per token, over its own paged KV cache (a ModelRunner and a BlockManager of its own, as many token slots as the
target's pool). Its cache follows each sequence's committed tokens: after a rejection it is cut back to the
positions whose tokens the target kept, so only the correction token and what follows are computed again."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from brrr.config import EngineConfig
from brrr.engine.block_manager import BlockManager
from brrr.engine.model_runner import ModelRunner, kv_bytes_per_block
from brrr.engine.sampler import SampleRow, draw, h2d
from brrr.engine.scheduler import ScheduledBatch
from brrr.engine.sequence import Sequence
from brrr.engine.spec.proposer import Proposer, SpecInput
from brrr.engine.spec.verify import DeviceDrafts
from brrr.engine.spec.verify_graphs import verify_graph_spec
from brrr.errors import BrrrError
from brrr.loader import load_model
from brrr.sampling_params import SamplingParams
from brrr.serving_form import prepare_for_serving

GREEDY = SamplingParams(temperature=0)


def load_draft(path: str, target):
    """The draft model on the target's device and dtype; BrrrError when its vocabulary is not the target's (its
    token ids would mean other tokens)."""
    if not Path(path).expanduser().is_dir():
        raise BrrrError(f"speculative_config.model: draft model directory not found: {path}")
    p = next(target.parameters())
    draft = load_model(Path(path).expanduser(), dtype=p.dtype, device=p.device)
    if draft.config.vocab_size != target.config.vocab_size:
        raise BrrrError(f"speculative_config.model: the draft's vocabulary ({draft.config.vocab_size} tokens) differs "
                        f"from the target's ({target.config.vocab_size}); a draft must share the target's tokenizer")
    return prepare_for_serving(draft, EngineConfig())


class DraftModelProposer(Proposer):
    device_drafts = True
    def __init__(self, path: str, target):
        """The draft loads now; its cache once the engine has sized the target's (`allocate_cache`)."""
        self.model = load_draft(path, target)
        self.max_len = self.model.config.max_context
        self.block_manager: BlockManager | None = None
        self.runner: ModelRunner | None = None
        self.seqs: dict[int, Sequence] = {}  # seq_id -> the draft's own view: tokens, computed positions, blocks
        self.committed: dict[int, int] = {}  # seq_id -> committed tokens at its previous propose
        # the last call's drafts while still on the device, and each sequence's row in them: its tokens end with
        # placeholders for them until `_fill_drafts`
        self.unresolved: tuple[DeviceDrafts, dict[int, int]] | None = None

    def draft_graph_steps(self) -> int | None:
        if self.runner is None:  # no cache yet
            return None
        verify = self.runner.verify_graphs
        return self.runner.decode_replays + (verify.replays if verify is not None else 0)

    def kv_bytes_per_block(self, block_size: int) -> int:
        return kv_bytes_per_block(self.model.config, block_size, next(self.model.parameters()).dtype)

    def allocate_cache(self, num_blocks: int, block_size: int, cuda_graphs: bool, max_batch: int,
                       max_num_batched_tokens: int, k: int = 1, max_model_len: int | None = None) -> None:
        """As many token slots as the target's pool (the engine counted them when it sized that pool; its runner
        takes the draft's own context, whatever k and max_model_len). With cuda_graphs (the engine's; captured on
        CUDA only) up to max_batch rows: decode graphs for the k - 1 steps of one token, and verify graphs of two
        tokens a row for the first step, which computes what the target kept since the last proposal (one token
        after a rejection, two after a fully accepted run)."""
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        self.runner = ModelRunner(self.model, block_size, num_blocks, self.max_len, cuda_graphs, max_batch,
                                  verify=verify_graph_spec(2, False, max_batch, max_num_batched_tokens))

    def propose(self, inputs: list[SpecInput], k: int) -> list[list[int]]:
        return self.propose_on_device(inputs, k).lists()

    @torch.inference_mode()
    def propose_on_device(self, inputs: list[SpecInput], k: int) -> DeviceDrafts:
        """k greedy steps over every input with room, queued back to back without waiting for the device when its
        runner has graphs: the first step (the tokens the target kept since the last call) through a verify or
        decode graph, each later one a decode graph whose ids are gathered on the device from the step before
        (the engine's launch-ahead path). Without graphs, or when a sequence's first step is its whole prompt, the
        steps that no graph takes run eagerly and are read back."""
        self._fill_drafts()
        active = [x for x in inputs if self._sync(x, k)]
        rows: list[int | None] = [None] * len(inputs)
        where = {x.seq_id: i for i, x in enumerate(inputs)}
        for r, x in enumerate(active):
            rows[where[x.seq_id]] = r
        seqs = [self.seqs[x.seq_id] for x in active]
        if not seqs:
            return DeviceDrafts(torch.zeros(0, k, dtype=torch.long, device=self.runner.device), rows)
        batch = ScheduledBatch([(s, len(s.token_ids) - s.num_computed_tokens) for s in seqs])
        sample_rows, row = [], 0
        for _, n in batch.items:
            row += n
            sample_rows.append((row - 1, SampleRow(GREEDY)))
        graphed = self.runner.can_launch(ScheduledBatch([(s, 1) for s in seqs]))  # decode graphs take the rest
        first = self.runner.launch_graphed(batch, sample_rows) if graphed else None
        if first is None:  # eager: this step's tokens on the host, then on the device for the next steps
            tokens = self.runner.execute(batch, sample_rows)[0].tokens
            if not graphed:
                return DeviceDrafts(self._eager_steps(seqs, tokens, k), rows)
            first = h2d(tokens, self.runner.device, torch.long)
        drafts = self._launch_rest(seqs, first, k)
        self.unresolved = (DeviceDrafts(drafts, rows), {s.seq_id: r for r, s in enumerate(seqs)})
        return self.unresolved[0]

    def _eager_steps(self, seqs: list[Sequence], tokens: list[int], k: int) -> torch.Tensor:
        """No graphs: the k - 1 steps after the first one at a time, each read back. The drafts [b, k]."""
        drafts = [tokens]
        for step in range(k):
            for seq, token in zip(seqs, drafts[-1]):
                seq.num_computed_tokens = len(seq.token_ids)
                seq.token_ids.append(token)
            if step == k - 1:
                break
            batch = ScheduledBatch([(s, 1) for s in seqs])
            drafts.append(self.runner.execute(batch, [(i, SampleRow(GREEDY)) for i in range(len(seqs))])[0].tokens)
        return h2d(np.array(drafts, dtype=np.int64).T.copy(), self.runner.device)

    def _launch_rest(self, seqs: list[Sequence], first: torch.Tensor, k: int) -> torch.Tensor:
        """After the first step (queued; its tokens `first` on the device), k - 1 decode-graph steps of one token
        each, every step's input the previous step's tokens gathered on the device. While a step is queued each
        sequence is recorded one token short of it (a placeholder for each token in flight but the newest), which
        is where a launch-ahead step expects it; at the end each holds placeholders for its k drafts
        (`_fill_drafts` writes their values at the next call, by when the engine has read them). The drafts
        [b, k], on the device."""
        rows = [SampleRow(GREEDY)] * len(seqs)
        batch = ScheduledBatch([(s, 1) for s in seqs])
        steps = [first]
        index = torch.arange(len(seqs), device=self.runner.device)
        for step in range(1, k):
            for seq in seqs:
                if step > 1:
                    seq.token_ids.append(0)
                seq.num_computed_tokens = len(seq.token_ids) - 1
            steps.append(draw(self.runner.launch_forward(batch, ids_from=(steps[-1], index)), rows)[0])
        for seq in seqs:
            seq.token_ids.extend([0] * min(k, 2))
            seq.num_computed_tokens = len(seq.token_ids) - 1
        return torch.stack(steps, 1)

    def _fill_drafts(self) -> None:
        """The previous call's drafts, placeholders in each sequence's tokens until now, get their values."""
        if self.unresolved is None:
            return
        drafts, rows = self.unresolved
        self.unresolved = None
        host = drafts.host()
        for seq_id, r in rows.items():
            seq = self.seqs.get(seq_id)
            if seq is not None:
                k = len(host[r])
                seq.token_ids[len(seq.token_ids) - k:] = host[r]

    def _sync(self, x: SpecInput, k: int) -> bool:
        """Bring the draft's view of x up to its committed tokens, keeping the KV of every position whose token is
        unchanged, and reserve slots for k steps. False: it sits this step out (no room), holding nothing."""
        if len(x.token_ids) + k > self.max_len:
            self.release(x.seq_id)
            return False
        seq = self.seqs.get(x.seq_id)
        if seq is None:
            seq = self.seqs[x.seq_id] = Sequence(x.seq_id, None, 0, [])
            self.committed[x.seq_id] = 0
        same = self.committed[x.seq_id]  # tokens committed before the last propose never change
        limit = min(len(seq.token_ids), len(x.token_ids))
        while same < limit and seq.token_ids[same] == x.token_ids[same]:
            same += 1
        del seq.token_ids[same:]
        seq.token_ids += x.token_ids[same:]
        seq.num_computed_tokens = min(seq.num_computed_tokens, same, len(x.token_ids) - 1)
        self.committed[x.seq_id] = len(x.token_ids)
        bm = self.block_manager
        bm.truncate(seq, seq.num_computed_tokens)
        need = bm.blocks_for(len(x.token_ids) + k - 1) - len(seq.block_table)
        if need > bm.num_free_blocks:
            self.release(x.seq_id)
            return False
        seq.block_table += [bm.allocate_block() for _ in range(need)]
        return True

    def release(self, seq_id: int) -> None:
        seq = self.seqs.pop(seq_id, None)
        self.committed.pop(seq_id, None)
        if seq is not None:
            self.block_manager.free(seq)
