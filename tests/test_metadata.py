"""The common metadata against a direct, per-token computation."""

import dataclasses
import random

import pytest
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


def test_the_allocators_slot_array_is_its_per_token_slots():
    """``slot_array`` (vectorized) and ``slots`` give the per-token answer (page of the
    position, row in it) over shuffled pages, for ranges starting and ending inside pages, at
    a page edge, and empty; a position past the request's pages is refused."""
    from attn_ops.kv_cache import BlockAllocator

    rng = random.Random(1)
    alloc = BlockAllocator(40, 8)
    for rid in range(3):
        alloc.reserve(rid, rng.randint(1, 60))
    # (free and re-reserve: the later requests' pages out of order)
    alloc.free(1)
    alloc.reserve(3, 45)
    for rid in (0, 2, 3):
        n = len(alloc.blocks(rid)) * 8
        for start, end in ((0, n), (3, n - 2), (8, 16), (5, 5), (n - 1, n), (0, 1)):
            want = [alloc.blocks(rid)[p // 8] * 8 + p % 8 for p in range(start, end)]
            got = alloc.slot_array(rid, start, end)
            assert got.dtype.name == "int64" and got.tolist() == want
            assert alloc.slots(rid, start, end) == want
        with pytest.raises(IndexError, match="is past them"):
            alloc.slot_array(rid, 0, n + 1)


def test_allocator_rows_and_the_dense_path_build_the_list_paths_metadata():
    """The allocator's numpy rows follow reserve/free/reuse; metadata built from them equals
    metadata built from the block lists."""
    from attn_ops.kv_cache import BlockAllocator

    rng = random.Random(1)
    alloc = BlockAllocator(2000, 4, shuffle=True)
    live = {}
    for step in range(60):
        if live and rng.random() < 0.3:
            alloc.free(live.pop(rng.choice(sorted(live))))
        r = f"r{step}"
        live[r] = r
        alloc.reserve(r, rng.randint(1, 9))
        for q in rng.sample(sorted(live), k=min(3, len(live))):
            alloc.reserve(q, rng.randint(1, 40) + 4 * len(alloc.blocks(q)))
        ids = sorted(live)
        table = alloc.block_table(ids)
        for row, q in zip(table, ids):
            owned = alloc.blocks(q)
            assert row[:len(owned)].tolist() == owned and not row[len(owned):].any()
    seq = [4 * len(alloc.blocks(q)) - rng.randint(0, 3) for q in ids]
    qlens = [1] * len(ids)
    lists = build_common_metadata(qlens, seq, [alloc.blocks(q) for q in ids], 4, 2000)
    dense = build_common_metadata(qlens, seq, alloc.block_table(ids, 512), 4, 2000,
                                  max_blocks_per_req=lists.block_table.shape[1])
    for name in ("block_table", "slot_mapping", "seq_lens", "query_start_loc", "positions"):
        assert torch.equal(getattr(dense, name), getattr(lists, name)), name


def test_a_dense_block_table_too_narrow_for_a_length_is_refused():
    import numpy as np
    import pytest

    with pytest.raises(ValueError, match=r"request 1 has seq_len=9, 3 blocks .* only 2 columns"):
        build_common_metadata([1, 1], [3, 9], np.zeros((2, 2), dtype=np.int32), 4, 16)


def test_block_csr_lists_the_pages_each_length_uses():
    """The CSR kept by the metadata (blocks each request's length uses, in request order) from
    block lists -- including a list reserving more blocks than its length uses and an empty
    request -- and from the allocator's dense rows, and through CUDA-graph padding; each against
    a direct computation and against the computed-on-demand fallback."""
    import numpy as np

    from attn_ops.cudagraph import CUDAGraphBatch

    block = 4
    seq_lens = [9, 0, 4, 13]
    tables = [[7, 2, 9], [], [5, 11], [0, 1, 3, 8]]  # request 2 reserved a block it does not use
    want_indptr, want = [0], []
    for s, t in zip(seq_lens, tables):
        want += t[:-(-s // block)]
        want_indptr.append(len(want))
    meta = build_common_metadata([1, 0, 1, 1], seq_lens, tables, block, 16)
    dense = np.zeros((4, 5), dtype=np.int32)
    for i, t in enumerate(tables):
        dense[i, :len(t)] = t
    from_rows = build_common_metadata([1, 0, 1, 1], seq_lens, dense, block, 16)
    for m in (meta, from_rows,
              dataclasses.replace(meta, block_indptr_cpu=None, block_indices_cpu=None)):
        indptr, indices = m.block_csr()
        assert indptr.tolist() == want_indptr and indices.tolist() == want
        assert indptr.dtype == indices.dtype == np.int32
    live = build_common_metadata([1] * 3, [9, 4, 13], [tables[0], tables[2], tables[3]],
                                 block, 16)
    padded = CUDAGraphBatch((8,), 5, block, "cpu").pad(live)
    indptr, indices = padded.block_csr()
    assert indptr.tolist() == [0, 3, 4, 8] + [8] * 5 and indices.tolist() == want


def test_the_step_is_one_buffer_and_its_device_tables_hold_the_paged_csr():
    """``build_common_metadata`` uploads the step in one copy: the device tensors are views of
    one buffer, each from a 16-byte aligned offset, and its :class:`DeviceTables` give
    FlashInfer's tables (``last_page_len`` and the prefill part's offsets from its first
    request included) -- checked against a direct computation, for a mixed batch, decodes only
    and prefills only; metadata without them (made by hand) gets the same from
    ``upload_tables``."""
    from attn_ops.metadata import upload_tables

    block = 4
    for qlens, seq_lens in (([1, 1, 5, 2], [9, 6, 5, 13]), ([1, 1], [3, 8]), ([3, 6], [3, 10])):
        tables = [[20 + 5 * r + i for i in range(-(-s // block))] for r, s in enumerate(seq_lens)]
        meta = build_common_metadata(qlens, seq_lens, tables, block, 64, num_tokens_padded=16)
        nd = meta.num_decodes
        pages = [-(-s // block) for s in seq_lens]
        indptr = [sum(pages[:i]) for i in range(len(pages) + 1)]
        qsl = meta.query_start_loc_cpu.tolist()
        want = {"query_start_loc": qsl, "block_indptr": indptr,
                "last_page_len": [s - block * (p - 1) for s, p in zip(seq_lens, pages)],
                "block_indices": [b for t in tables for b in t],
                "prefill_query_start_loc": [q - qsl[nd] for q in qsl[nd:]],
                "prefill_block_indptr": [p - indptr[nd] for p in indptr[nd:]]}
        for t in (meta.device_tables,
                  upload_tables(dataclasses.replace(meta, device_tables=None))):
            for name, values in want.items():
                at = getattr(t, name)
                assert at % 4 == 0 and t.buffer[at:at + len(values)].tolist() == values, name
        base = meta.device_tables.buffer
        for name in ("query_start_loc", "seq_lens", "block_table", "slot_mapping", "positions"):
            view = getattr(meta, name)
            assert view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr(), name
            assert (view.data_ptr() - base.data_ptr()) % 16 == 0, name
