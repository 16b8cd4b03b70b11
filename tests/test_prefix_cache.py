"""The allocator's prefix cache: full blocks cached by their tokens through a hash chain,
shared by later requests with the same prefix, kept after their last holder is freed until
evicted least-recently-freed first; and attention over a shared prefix equal to attention
computed from scratch."""

from __future__ import annotations

import pytest
import torch

from attn_ops import Attention, AttentionSpec, BlockAllocator, build_batch


def _alloc(num_blocks=16, **kw):
    return BlockAllocator(num_blocks, 4, prefix_caching=True, **kw)


def test_a_second_request_shares_the_full_blocks_of_a_cached_prefix():
    alloc = _alloc()
    prompt = list(range(100, 110))  # 10 tokens: blocks of 4, 4, 2
    assert alloc.match_prefix("a", prompt) == 0
    a = list(alloc.reserve("a", 10, token_ids=prompt))
    assert alloc.match_prefix("b", prompt) == 8  # (two full blocks; the last token computed)
    b = alloc.reserve("b", 10, token_ids=prompt)
    assert b[:2] == a[:2] and b[2] != a[2]
    assert alloc.block_table(["a", "b"]).tolist() == [a, b]
    # exactly two blocks long: the last token is computed, so one block is shared
    assert alloc.match_prefix("c", prompt[:8]) == 4
    # the same second block after another first one: no match (the chain covers the prefix)
    assert alloc.match_prefix("d", [7, 7, 7, 7] + prompt[4:]) == 0


def test_blocks_stay_cached_after_their_holders_are_freed_until_evicted_lru():
    alloc = _alloc(num_blocks=6)
    p, q = list(range(9)), list(range(50, 59))
    for rid, tokens in (("a", p), ("b", q)):
        alloc.match_prefix(rid, tokens)
        alloc.reserve(rid, 9, token_ids=tokens)
    held = alloc.blocks("a")[:2]
    alloc.free("a")
    alloc.free("b")  # (freed later: evicted later)
    assert alloc.num_free_blocks == 6
    assert alloc.match_prefix("c", p) == 8 and alloc.blocks("c") == held
    alloc.free("c")
    # four fresh blocks: two unused ones, then the least recently freed cached ones
    # (b's, freed before c gave a's back), so a's prefix survives and b's does not
    alloc.reserve("big", 16)
    assert alloc.match_prefix("d", q) == 0
    alloc.free("d")
    assert alloc.match_prefix("e", p) == 8


def test_without_prefix_caching_nothing_is_shared_and_a_request_matches_before_it_reserves():
    plain = BlockAllocator(8, 4)
    plain.reserve("a", 8, token_ids=list(range(8)))
    assert plain.match_prefix("b", list(range(8))) == 0
    with pytest.raises(ValueError, match="request 'a' already holds blocks: match its prefix "
                                         "before its first reserve"):
        plain.match_prefix("a", list(range(8)))


def test_attention_over_a_shared_prefix_equals_attention_from_scratch():
    """Request b reuses a's cached prefix pages and computes only its own tokens; its outputs
    equal those of the same tokens prefilled from scratch in a cache of their own."""
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=8, dtype=torch.float64,
                         block_size=4)
    layer = Attention(spec)
    g = torch.Generator().manual_seed(0)
    prompt = list(range(11))  # every token's q, k, v a function of its id
    qkv = {t: (torch.randn(4, 8, generator=g, dtype=torch.float64),
               torch.randn(2, 8, generator=g, dtype=torch.float64),
               torch.randn(2, 8, generator=g, dtype=torch.float64)) for t in prompt}

    def step(alloc, cache, rid, done, tokens):
        meta = build_batch(alloc, [rid], [done], [len(tokens) - done])
        alloc.reserve(rid, len(tokens), token_ids=tokens)
        q, k, v = (torch.stack([qkv[t][i] for t in tokens[done:]]) for i in range(3))
        return layer(q, k, v, cache, meta)

    shared = BlockAllocator(16, layer.block_size, prefix_caching=True)
    cache = layer.allocate_kv_cache(16)
    shared.match_prefix("a", prompt)
    step(shared, cache, "a", 0, prompt)
    done = shared.match_prefix("b", prompt)
    assert done == (len(prompt) - 1) // layer.block_size * layer.block_size > 0
    got = step(shared, cache, "b", done, prompt)
    fresh = BlockAllocator(16, layer.block_size)
    want = step(fresh, layer.allocate_kv_cache(16), "x", 0, prompt)[done:]
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


def test_state_checkpoints_live_in_spare_slots_and_give_way_to_running_requests():
    """A hybrid model's prefix checkpoint takes a state slot only while one stays free for a
    new request, else the oldest checkpoint's; matching with checkpoints stops at the last
    checkpointed block; a request short of a slot takes a checkpoint's back (only later cache
    hits are lost)."""
    alloc = BlockAllocator(16, 4, prefix_caching=True, num_state_slots=3)
    prompt = list(range(9))
    alloc.match_prefix("a", prompt)
    alloc.reserve("a", 9, token_ids=prompt)
    first, second, partial = alloc.blocks("a")
    slot = alloc.new_checkpoint(first)
    assert slot is not None and alloc.checkpoint(first) == slot
    assert slot not in alloc.request_state_slots("a")
    assert alloc.new_checkpoint(partial) is None  # (not a cached block)
    assert alloc.new_checkpoint(first) is None  # (it has one)
    # (the last free slot stays for a request: the second checkpoint takes the first's)
    assert alloc.new_checkpoint(second) == slot and alloc.checkpoint(first) is None
    assert alloc.match_prefix("b", prompt) == 8
    alloc.free("b")
    assert alloc.match_prefix("b", prompt, with_checkpoint=True) == 8
    alloc.reserve("b", 9)
    assert alloc.checkpoint(second) == slot
    alloc.reserve("c", 1)  # (no free slot left: the checkpoint gives its slot back)
    assert alloc.checkpoint(second) is None
    assert len({*alloc.request_state_slots("a"), *alloc.request_state_slots("b"),
                *alloc.request_state_slots("c")}) == 3
    assert alloc.new_checkpoint(first) is None  # (no free slot, no checkpoint to take)


def test_checkpoints_fall_every_few_blocks_and_on_a_prompts_last_full_block():
    """Where a prefill's steps end for state checkpoints: every ``checkpoint_every``-th block
    boundary and the prompt's last full block."""
    alloc = BlockAllocator(64, 4, prefix_caching=True, num_state_slots=4, checkpoint_every=3)
    stops, done = [], 0
    while (nxt := alloc.next_checkpoint(done, 30)) is not None:
        stops.append(nxt)
        done = nxt
    assert stops == [12, 24, 28]
    assert alloc.next_checkpoint(5, 8) == 8 and alloc.next_checkpoint(8, 8) is None
    with pytest.raises(ValueError, match="checkpoint_every=0"):
        BlockAllocator(4, 4, checkpoint_every=0)
