"""The common metadata against a direct, per-token computation."""

import dataclasses
import random

import torch

from attn_ops.metadata import build_common_metadata


def test_positions_and_slots_match_a_per_token_computation():
    rng = random.Random(0)
    block = 4
    query_lens = [1, 1, 1, 7, 3]
    seq_lens = [rng.randint(1, 30) for _ in range(3)] + [7, 12]
    free = list(range(64))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-s // block))] for s in seq_lens]
    meta = build_common_metadata(query_lens, seq_lens, tables, block, 64, num_tokens_padded=16)
    positions, slots = [], []
    for q, s, table in zip(query_lens, seq_lens, tables):
        for p in range(s - q, s):
            positions.append(p)
            slots.append(table[p // block] * block + p % block)
    pad = 16 - len(positions)
    assert meta.positions.tolist() == positions + [0] * pad
    assert meta.slot_mapping.tolist() == slots + [-1] * pad
    # metadata built elsewhere (no stored positions) computes the same
    assert torch.equal(dataclasses.replace(meta, positions_tensor=None).positions, meta.positions)
    assert meta.query_start_loc.tolist() == [0, 1, 2, 3, 10, 13]
    assert meta.seq_lens.tolist() == seq_lens
