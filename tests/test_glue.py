"""The glue ops around attention (attn_ops.glue): RoPE, the slot mapping and their fused form
with the cache write -- against the plain computations, opcheck, and their error messages."""

import pytest
import torch

from attn_ops.glue import rope, rope_kv_cache_update, slot_mapping
from attn_ops.kv_cache import BlockAllocator, kv_cache_update
from attn_ops.metadata import build_batch
from attn_ops.model import rope_cache

BLOCK = 4


def _batch(pad=3):
    alloc = BlockAllocator(24, BLOCK, shuffle=True, seed=1)
    meta = build_batch(alloc, [0, 1, 2], [5, 0, 9], [1, 6, 3], num_tokens_padded=10 + pad)
    return meta


def _rotate_half(x, cos_sin):
    half = x.shape[-1] // 2
    cos, sin = cos_sin[:, None, :half], cos_sin[:, None, half:]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def test_slot_mapping_on_the_device_equals_the_host_built_one_with_padding():
    meta = _batch()
    got = slot_mapping(meta.positions, meta.query_start_loc, meta.block_table, BLOCK)
    assert got.dtype == torch.int64
    assert got.tolist() == meta.slot_mapping.tolist()  # padding rows are -1 in both


def test_rope_matches_rotate_half_and_keeps_the_dtype():
    x = torch.randn(7, 3, 16, dtype=torch.float64)
    cos_sin = rope_cache(16, 64, 10000.0)[torch.tensor([0, 1, 5, 9, 30, 31, 63])]
    torch.testing.assert_close(rope(x, cos_sin), _rotate_half(x, cos_sin.double()))
    assert rope(x.half(), cos_sin).dtype == torch.float16


@pytest.mark.parametrize("slots_from", ["slot_mapping", "positions"])
def test_fused_op_equals_rope_then_cache_write(slots_from):
    meta = _batch(pad=0)
    t = meta.num_actual_tokens
    q, k, v = torch.randn(t, 4, 8), torch.randn(t, 2, 8), torch.randn(t, 2, 8)
    cos_sin = rope_cache(8, 64, 10000.0)[meta.positions]
    want = torch.zeros(24, 2, BLOCK, 2, 8)
    kv_cache_update(rope(k, cos_sin), v, want, meta.slot_mapping, None, None)
    got = torch.zeros_like(want)
    slot_args = (meta.slot_mapping, None, None, None) if slots_from == "slot_mapping" else \
        (None, meta.positions, meta.query_start_loc, meta.block_table)
    q_rot = rope_kv_cache_update(q, k, v, cos_sin, got, *slot_args, None, None)
    assert torch.equal(q_rot, rope(q, cos_sin)) and torch.equal(got, want)


def test_glue_ops_pass_opcheck():
    meta = _batch()
    t = meta.slot_mapping.shape[0]
    q, k, v = torch.randn(t, 4, 8), torch.randn(t, 2, 8), torch.randn(t, 2, 8)
    cos_sin = torch.randn(t, 8)
    torch.library.opcheck(rope, (q, cos_sin))
    torch.library.opcheck(slot_mapping, (meta.positions, meta.query_start_loc,
                                         meta.block_table, BLOCK))
    cache = torch.zeros(24, 2, BLOCK, 2, 8)
    for slot_args in ((meta.slot_mapping, None, None, None),
                      (None, meta.positions, meta.query_start_loc, meta.block_table)):
        torch.library.opcheck(rope_kv_cache_update, (q, k, v, cos_sin, cache, *slot_args, None,
                                                     None))


def test_bad_inputs_name_the_value_and_the_fix():
    meta = _batch()
    with pytest.raises(ValueError, match=r"cos_sin must be \[num_tokens=5, head_dim=8\]"):
        rope(torch.randn(5, 2, 8), torch.randn(5, 6))
    with pytest.raises(ValueError, match="needs rows \\+ 1"):
        slot_mapping(meta.positions, meta.query_start_loc[:-1], meta.block_table, BLOCK)
    t = 4
    with pytest.raises(ValueError, match="pass slot_mapping, or positions"):
        rope_kv_cache_update(torch.randn(t, 2, 8), torch.randn(t, 1, 8), torch.randn(t, 1, 8),
                             torch.randn(t, 8), torch.zeros(4, 2, 4, 1, 8), None, None, None,
                             None, None, None)
