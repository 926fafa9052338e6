"""BlockManager invariants under random allocate/append/commit/fork/free sequences (hypothesis)."""
from hypothesis import given, settings
from hypothesis import strategies as st

from brrr.engine.block_manager import BlockManager
from brrr.engine.sequence import Request, Sequence
from brrr.sampling_params import SamplingParams

BLOCK = 4
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5]]


def _seq(i, tokens):
    return Sequence(i, Request(str(i), None, list(tokens), SamplingParams()), 0, list(tokens))


ops = st.lists(st.tuples(st.sampled_from(["new", "append", "compute", "fork", "free"]),
                         st.integers(0, 100), st.integers(0, 2), st.lists(st.integers(0, 9), max_size=6)),
               min_size=1, max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops, st.booleans())
def test_invariants_hold(operations, prefix_caching):
    bm = BlockManager(num_blocks=24, block_size=BLOCK, enable_prefix_caching=prefix_caching)
    live: list[Sequence] = []
    for n, (op, pick, prefix, suffix) in enumerate(operations):
        if op == "new":
            seq = _seq(n, PREFIXES[prefix] + suffix or [7])
            if bm.can_allocate(seq):
                cached = bm.allocate(seq)
                assert cached % BLOCK == 0 and cached < len(seq.token_ids)
                live.append(seq)
        elif live:
            seq = live[pick % len(live)]
            if op == "append" and seq.num_computed_tokens == len(seq.token_ids):
                seq.token_ids.append(pick % 10)
                if bm.can_append(seq):
                    copy = bm.append_slot(seq)
                    if copy:
                        assert copy[0] != copy[1]
                    assert len(seq.block_table) == bm.blocks_for(len(seq.token_ids))
                else:
                    seq.token_ids.pop()
            elif op == "compute":  # the step wrote K/V for every token: full blocks become findable
                seq.num_computed_tokens = len(seq.token_ids)
                bm.commit_computed(seq)
            elif op == "fork" and seq.num_computed_tokens == len(seq.token_ids):
                child = _seq(1000 + n, seq.token_ids)
                bm.fork(seq, child)
                live.append(child)
            elif op == "free":
                bm.free(seq)
                live.remove(seq)
        bm.check_invariants(live)
    for seq in live:
        bm.free(seq)
    bm.check_invariants([])
    assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)


def test_prefix_hit_reuses_blocks_and_leaves_last_token():
    bm = BlockManager(num_blocks=16, block_size=BLOCK)
    a = _seq(0, list(range(12)))
    assert bm.allocate(a) == 0
    a.num_computed_tokens = 12
    bm.commit_computed(a)
    b = _seq(1, list(range(12)))  # identical prompt: 2 of 3 blocks reused, the last recomputed
    assert bm.allocate(b) == 8 and b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    c = _seq(2, list(range(6)) + [99] * 6)
    assert bm.allocate(c) == 4
    assert (bm.prefix_queries, bm.prefix_hits) == (36, 12)
    for s in (a, b, c):
        bm.free(s)
    d = _seq(3, list(range(13)))  # freed blocks keep their hash until the pool needs them
    assert bm.allocate(d) == 12


def test_lru_evicts_least_recently_freed_tail_first():
    bm = BlockManager(num_blocks=3, block_size=BLOCK)
    a = _seq(0, list(range(9)))
    bm.allocate(a)
    a.num_computed_tokens = 9
    bm.commit_computed(a)
    bm.free(a)  # freed tail first: the partial block (uncached), then a's 2nd and 1st full blocks (cached)
    b, c = _seq(1, [50] * 4), _seq(2, [60] * 4)
    bm.allocate(b)  # takes the uncached block: both cached blocks survive
    assert len(bm.hash_to_block) == 2
    bm.allocate(c)  # must evict one: the least recently freed is a's 2nd block, so the shared head survives
    assert len(bm.hash_to_block) == 1
    bm.free(b), bm.free(c)
    assert bm.allocate(_seq(3, list(range(9)))) == 4



def test_reset_prefix_cache_forgets_every_hash():
    """After the KV cache was freed and reallocated (an RL engine's sleep/wake) or the weights changed, no prefix
    may hit: reset_prefix_cache drops every hash and keeps every block free."""
    bm = BlockManager(num_blocks=8, block_size=BLOCK)
    seq = _seq(0, PREFIXES[0])
    bm.allocate(seq)
    seq.num_computed_tokens = len(seq.token_ids)
    bm.commit_computed(seq)
    bm.free(seq)
    assert len(bm.hash_to_block) == 2 and bm.num_free_blocks == 8  # two full blocks cached, findable
    bm.reset_prefix_cache()
    assert bm.num_free_blocks == 8 and not bm.hash_to_block
    assert bm.allocate(_seq(1, PREFIXES[0])) == 0  # no hit
