"""The glue ops around attention (attn_ops.glue): RoPE, the slot mapping and their fused form
with the cache write -- against the plain computations, opcheck, and their error messages."""

import dataclasses

import pytest
import torch

from attn_ops.glue import rope, rope_kv_cache_update, slot_mapping
from attn_ops.kv_cache import BlockAllocator, kv_cache_update
from attn_ops.metadata import build_batch
from attn_ops.models.llama import rope_cache

BLOCK = 4
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _batch(pad=3, block=BLOCK):
    """Three requests (a decode, a new prefill, a chunk after context); at a page of 64 the
    tokens entering pages leave 63, 58 and 58 rows to clear, spread over two grid columns."""
    alloc = BlockAllocator(24, block, shuffle=True, seed=1)
    if block == BLOCK:
        return build_batch(alloc, [0, 1, 2], [5, 0, 9], [1, 6, 3], num_tokens_padded=10 + pad)
    return build_batch(alloc, [0, 1, 2], [63, 0, 128], [2, 6, 70], num_tokens_padded=78 + pad)


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


@pytest.mark.parametrize("cache", ["fp32", "fp8_e4m3", "diff_v"])
@pytest.mark.parametrize("slots_from", ["slot_mapping", "positions"])
def test_eager_layer_fuses_its_glue_and_computes_what_the_traced_ops_do(slots_from, cache,
                                                                        monkeypatch):
    """Eagerly, ``Attention`` runs RoPE + cache write as the fused op; traced (here: told it is
    compiling) as separate ops for the passes. Same output, same cache -- fp8 caches (scales)
    and a V head dim of its own (packed cache) included."""
    from attn_ops import Attention, AttentionConfig, AttentionSpec, KVCacheDType

    meta = _batch()
    dv = 12 if cache == "diff_v" else 8
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=8, head_dim_v=dv,
                         dtype=torch.float32, block_size=BLOCK,
                         kv_cache_dtype=KVCacheDType.FP8_E4M3 if cache == "fp8_e4m3"
                         else KVCacheDType.AUTO)
    layer = Attention(spec, AttentionConfig(backend="REFERENCE")).to(DEVICE)
    if layer.k_scale is not None:
        layer.k_scale.fill_(0.5)
        layer.v_scale.fill_(0.25)
    t = meta.slot_mapping.shape[0]
    q, k, v = (torch.randn(t, h, d, device=DEVICE) for h, d in ((4, 8), (2, 8), (2, dv)))
    cos_sin = rope_cache(8, 64, 10000.0)[meta.positions.cpu()].to(DEVICE)
    positions = meta.positions.to(DEVICE) if slots_from == "positions" else None
    meta = dataclasses.replace(meta, **{f: getattr(meta, f).to(DEVICE) for f in (
        "query_start_loc", "seq_lens", "block_table", "slot_mapping")})
    runs = []
    for compiling in (False, True):
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda c=compiling: c)
        kv_cache = layer.allocate_kv_cache(24, DEVICE)
        runs.append((layer(q, k, v, kv_cache, meta, cos_sin=cos_sin, positions=positions),
                     kv_cache))
    (fused_out, fused_cache), (ops_out, ops_cache) = runs
    n = meta.num_actual_tokens
    assert fused_cache.view(torch.uint8).any()
    if DEVICE == "cpu":  # the same torch ops, bit for bit
        assert torch.equal(fused_cache.view(torch.uint8), ops_cache.view(torch.uint8))
        torch.testing.assert_close(fused_out[:n], ops_out[:n])
    else:  # the GPU kernel rounds the rotation differently (FMA): an fp8 code may move by one
        tol = dict(rtol=0.13, atol=2e-2) if cache == "fp8_e4m3" else {}
        torch.testing.assert_close(fused_cache.float(), ops_cache.float(), **tol)
        torch.testing.assert_close(fused_out[:n], ops_out[:n], **tol)


def test_device_slots_need_metadata_with_the_common_tables():
    """``positions=`` (slots computed on the device) with a backend's own metadata that lacks
    ``query_start_loc`` (FLASHINFER's has a block table, not that) is refused by name."""
    import types

    from attn_ops import Attention, AttentionConfig, AttentionSpec

    meta = _batch()
    layer = Attention(AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=8,
                                    dtype=torch.float32, block_size=BLOCK),
                      AttentionConfig(backend="REFERENCE"))
    own = types.SimpleNamespace(slot_mapping=meta.slot_mapping, block_table=meta.block_table)
    t = meta.slot_mapping.shape[0]
    q, k, v = torch.randn(t, 4, 8), torch.randn(t, 2, 8), torch.randn(t, 2, 8)
    with pytest.raises(ValueError, match=r"positions= .*needs the common metadata's "
                                         r"query_start_loc and block_table"):
        layer(q, k, v, layer.allocate_kv_cache(24, "cpu"), own,
              cos_sin=rope_cache(8, 64, 10000.0)[meta.positions], positions=meta.positions)


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


@pytest.mark.parametrize("block", [BLOCK, 64])
@pytest.mark.parametrize("case", ["fp32_slots", "fp32_positions", "fp16_packed_diffv",
                                  "fp64", "fp8_e4m3", "fp8_e5m2"])
def test_fused_triton_kernel_matches_the_torch_implementation(case, block):
    """The GPU kernel of rope_kv_cache_update against its torch implementation, padding rows
    included: on the GPU at random values; on the CPU in Triton's interpreter, whose fp8
    conversion rounds wrongly at binade edges (31.9 -> 16 in e4m3), so there the fp8 cases
    use values exact in fp8 after scaling (and some that saturate) and no rotation. fp64
    inputs are rotated in fp64 (an oracle's precision, not fp32's)."""
    pytest.importorskip("triton")
    from attn_ops.glue import fused_torch
    from attn_ops.glue_kernels import rope_kv_cache_update_triton

    meta = _batch(pad=2, block=block)
    t = meta.slot_mapping.shape[0]
    dtype = {"fp16_packed_diffv": torch.float16, "fp64": torch.float64}.get(case, torch.float32)
    dv = 12 if case == "fp16_packed_diffv" else 8
    fp8 = case.startswith("fp8")
    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    q, k, v = rand(t, 6, 8), rand(t, 3, 8), rand(t, 3, dv)
    positions = meta.positions
    scales = (torch.tensor([0.05]), torch.tensor([0.5])) if fp8 else (None, None)
    if fp8 and DEVICE == "cpu":
        positions = torch.zeros_like(positions)  # cos 1, sin 0: no rotation
        grid = torch.tensor([0.0, 0.5, -1.5, 3.0, 20.0, -96.0, 1e9, -1e9])  # exact, saturating
        k = grid[torch.randint(0, 8, (t, 3, 8), generator=g)] * scales[0]
        v = grid[torch.randint(0, 8, (t, 3, dv), generator=g)] * scales[1]
    cos_sin = rope_cache(8, 256, 10000.0)[positions].to(dtype)
    nan = float("nan")  # (pages start poisoned: a row the kernel should clear and does not shows)
    if case == "fp16_packed_diffv":
        cache = torch.full((24, block, 3, 8 + dv), nan, dtype=dtype)
    else:
        cache = torch.full((24, 2, block, 3, 8), nan).to(
            {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}.get(case, dtype))
    slot_args = (None, meta.positions, meta.query_start_loc, meta.block_table) \
        if case == "fp32_positions" else (meta.slot_mapping, None, None, None)
    args = [x.to(DEVICE) if torch.is_tensor(x) else x
            for x in (q, k, v, cos_sin, cache, *slot_args, *scales)]
    want_cache = args[4].clone()
    want_q = fused_torch(*args[:4], want_cache, *args[5:])
    got_q = rope_kv_cache_update_triton(*args)
    tol = {"atol": 1e-12, "rtol": 1e-12} if dtype == torch.float64 else {}
    torch.testing.assert_close(got_q, want_q, **tol)
    if fp8:  # the same rounding, bit for bit
        assert torch.equal(args[4].view(torch.uint8), want_cache.view(torch.uint8))
    else:  # (on the GPU the kernel's fused multiply-adds round the rotation differently)
        torch.testing.assert_close(args[4], want_cache, equal_nan=True, **tol)


@pytest.mark.parametrize("block", [BLOCK, 64])
@pytest.mark.parametrize("case", ["fp32", "fp16_diffv", "fp8_e4m3"])
def test_kv_write_kernel_matches_the_torch_write_and_clears_entered_pages(case, block):
    """kv_cache_update's GPU kernel (on the CPU in Triton's interpreter) against its torch path:
    the same rows written, padding skipped, and the unwritten rows of every page a token enters
    at row 0 zeroed -- pages start NaN-poisoned, so a missed clear shows as NaN."""
    pytest.importorskip("triton")
    from attn_ops.glue_kernels import kv_cache_update_triton
    from attn_ops.kv_cache import clear_entered_page_tails

    meta = _batch(pad=2, block=block)
    slots = meta.slot_mapping
    t = slots.shape[0]
    dtype = torch.float16 if case == "fp16_diffv" else torch.float32
    dv = 12 if case == "fp16_diffv" else 8
    g = torch.Generator().manual_seed(1)
    k = torch.randn(t, 3, 8, generator=g).to(dtype)
    v = torch.randn(t, 3, dv, generator=g).to(dtype)
    cache_dtype = torch.float8_e4m3fn if case == "fp8_e4m3" else dtype
    scales = (torch.tensor([0.5]), torch.tensor([0.25])) if case == "fp8_e4m3" else (None, None)
    if case == "fp8_e4m3":  # values exact in e4m3 after scaling (the interpreter's rounding)
        k, v = (torch.tensor([0.0, 0.5, -1.5, 3.0])[torch.randint(0, 4, x.shape, generator=g)]
                * s for x, s in ((k, scales[0]), (v, scales[1])))
    want_k = torch.full((24, block, 3, 8), float("nan"), dtype=dtype).to(cache_dtype)
    want_v = torch.full((24, block, 3, dv), float("nan"), dtype=dtype).to(cache_dtype)
    got_k, got_v = (x.clone().to(DEVICE) for x in (want_k, want_v))
    clear_entered_page_tails(slots, want_k, want_v)
    valid = (slots >= 0).nonzero().squeeze(1)
    b, o = slots[valid] // block, slots[valid] % block
    for new, cache, scale in ((k, want_k, scales[0]), (v, want_v, scales[1])):
        rows = new[valid] if scale is None else (new[valid] / scale).to(cache_dtype)
        cache.view(torch.uint8 if scale is not None else dtype)[b, o] = \
            rows.view(torch.uint8) if scale is not None else rows
    kv_cache_update_triton(*(x.to(DEVICE) if torch.is_tensor(x) else x
                             for x in (k, v, got_k, got_v, slots, *scales)))
    for got, want in ((got_k, want_k), (got_v, want_v)):
        got, want = got.cpu().float(), want.float()
        assert torch.equal(got.isnan(), want.isnan())
        torch.testing.assert_close(got.nan_to_num(), want.nan_to_num())


@pytest.mark.parametrize("seed", range(6))
def test_a_few_slots_read_as_ints_give_the_array_path_s_pages_and_rows(seed):
    """The host write's two readings of its slots (``host_slots``) -- Python ints for a write
    of at most ``FEW_SLOTS`` tokens, an int64 array above -- name the same entered pages with
    the same filled rows, and the same written rows, pages and offsets: random
    decode-and-prefill mixes with padding, slots outside the cache and runs that stop inside
    a page."""
    from attn_ops import kv_cache as kc

    g = torch.Generator().manual_seed(seed)
    page, blocks = 4, 12
    slots = []
    for _ in range(int(torch.randint(1, 5, (1,), generator=g))):
        start = int(torch.randint(0, blocks * page, (1,), generator=g))
        slots += range(start, start + int(torch.randint(1, 7, (1,), generator=g)))
        slots += [-1] * int(torch.randint(0, 2, (1,), generator=g))
    slots += [blocks * page + seed % 3] * (seed % 2)  # (outside the cache; its edge at 3)
    slots = torch.tensor(slots[:kc.FEW_SLOTS], dtype=torch.long)
    assert isinstance(kc.host_slots(slots), list)

    def read(host):
        rows, b, o = kc._written_rows(host, blocks, page)
        return kc.entered_pages(host, blocks, page), rows, b.tolist(), o.tolist()

    few, arrays = read(slots.tolist()), read(slots.numpy())
    assert few[0] == arrays[0] and few[2:] == arrays[2:]
    assert (few[1] is None) == (arrays[1] is None)
    assert few[1] is None or few[1].tolist() == arrays[1].tolist()
