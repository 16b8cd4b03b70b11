"""Bad input gets a clear ValueError naming the value; nothing crashes or writes out of bounds."""

import pytest
import torch

from attn_ops import (AttentionSpec, BlockAllocator, build_common_metadata, get_backend_class,
                      set_debug_checks)
from attn_ops.kv_cache import kv_cache_update
from attn_ops.testing import SCENARIOS, make_case
from attn_ops.backend import AttentionBackend
from test_backends_matrix import BACKENDS

# The bad-input table speaks the common paged-attention schema; backends with their own
# schema (FLASHINFER) check their inputs in their own tests.
BACKENDS = [b for b in BACKENDS
            if get_backend_class(b).op_arguments is AttentionBackend.op_arguments]

SPEC = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32)


@pytest.fixture
def case():
    return make_case(SPEC, SCENARIOS["contiguous_pages"])


def _args(case, **changes):
    meta, q = case.metadata, case.query
    args = dict(query=q, kv_cache=case.kv_cache, query_start_loc=meta.query_start_loc,
                seq_lens=meta.seq_lens, block_table=meta.block_table,
                out=torch.empty(q.shape[0], 4, 16), lse=None, sinks=None, alibi_slopes=None,
                k_scale=None, v_scale=None, scale=0.25, sliding_window=None, soft_cap=None,
                causal=True)
    args.update(changes)
    return args


@pytest.fixture
def debug_checks():
    set_debug_checks(True)
    yield
    set_debug_checks(False)


BAD = {
    "query_dtype": (lambda c: dict(query=c.query.half(), out=torch.empty(c.query.shape[0], 4, 16,
                                                                         dtype=torch.half)),
                    r"kv_cache.dtype=torch.float32 differs from query.dtype=torch.float16"),
    "out_dtype": (lambda c: dict(out=torch.empty(c.query.shape[0], 4, 16, dtype=torch.float64)),
                  r"out.dtype=torch.float64 differs from query.dtype=torch.float32"),
    "query_rank": (lambda c: dict(query=c.query.flatten(1)),
                   r"query must be \[num_tokens, num_heads, head_dim\], got shape \(\d+, 64\)"),
    "head_dim": (lambda c: dict(query=torch.randn(c.query.shape[0], 4, 8)),
                 r"query head_dim=8 differs from the KV cache's head_dim=16"),
    "heads_vs_out": (lambda c: dict(out=torch.empty(c.query.shape[0], 2, 16)),
                     r"out must be \[\d+, 4, head_dim_v\] to match query, got shape"),
    "device": (lambda c: dict(seq_lens=c.metadata.seq_lens.to("meta")),
               r"seq_lens is on meta but query is on cpu"),
    "seq_lens_short": (lambda c: dict(seq_lens=torch.ones_like(c.metadata.seq_lens)),
                       r"seq_lens\[1\]=1 is shorter than the request's query length 9"),
    "seq_lens_beyond_table": (lambda c: dict(seq_lens=c.metadata.seq_lens * 100),
                              r"seq_lens\[0\]=\d+ needs \d+ blocks but block_table has"),
    "lse_shape": (lambda c: dict(lse=torch.empty(3)), r"lse must be float32 \[\d+, 4\]"),
    "sinks_shape": (lambda c: dict(sinks=torch.zeros(2)), r"sinks must be \[num_heads=4\]"),
    "fp8_without_scales": (lambda c: dict(kv_cache=c.kv_cache.to(torch.float8_e4m3fn)),
                           r"needs k_scale and v_scale to dequantize"),
    "cache_rank": (lambda c: dict(kv_cache=c.kv_cache[:, 0]),
                   r"packed KV cache must be \[num_blocks, block_size, num_kv_heads, head_dim \+ "
                   r"head_dim_v = 32\]"),
}


@pytest.mark.parametrize("what", list(BAD))
@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_op_rejects_bad_input(backend, what, case):
    change, message = BAD[what]
    before = case.kv_cache.clone()
    with pytest.raises(ValueError, match=message):
        get_backend_class(backend).op(**_args(case, **change(case)))
    assert torch.equal(case.kv_cache.nan_to_num(), before.nan_to_num())  # (NaN-poisoned)


def test_fake_kernel_rejects_bad_shapes_at_trace_time(case):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        args = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v
                for k, v in _args(case, query=torch.randn(case.query.shape[0], 4, 8)).items()}
        with pytest.raises(ValueError, match="query head_dim=8 differs"):
            torch.ops.attn.reference_attention(**args)


def test_kv_cache_update_rejects_out_of_range_slots(debug_checks):
    cache = torch.zeros(2, 2, 4, 1, 8)
    k = torch.randn(2, 1, 8)
    for slots, bad in (([0, 8], 8), ([0, -3], -3)):
        with pytest.raises(ValueError, match=rf"slot_mapping holds slot {bad} but the cache has "
                                             r"slots 0..7 \(2 blocks x 4\)"):
            kv_cache_update(k, k, cache, torch.tensor(slots), None, None)
    assert not cache.any()


@pytest.mark.parametrize("key_shape,value_shape,message", [
    ((3, 2, 8), (3, 2, 8), r"do not match the cache's \[num_kv_heads, dim\]"),
    ((3, 1, 8), (2, 1, 8), r"equal first two dims"),
])
def test_kv_cache_update_rejects_bad_shapes(key_shape, value_shape, message):
    cache = torch.zeros(2, 2, 4, 1, 8)
    with pytest.raises(ValueError, match=message):
        kv_cache_update(torch.randn(key_shape), torch.randn(value_shape), cache,
                        torch.zeros(key_shape[0], dtype=torch.long), None, None)


def test_kv_cache_update_rejects_dtype_mismatch():
    with pytest.raises(ValueError, match=r"kv_cache.dtype=torch.float16 must equal key/value"):
        kv_cache_update(torch.randn(1, 1, 8), torch.randn(1, 1, 8),
                        torch.zeros(2, 2, 4, 1, 8, dtype=torch.half), torch.tensor([0]), None, None)


@pytest.mark.parametrize("backend", BACKENDS)
def test_block_ids_are_checked_behind_the_debug_switch(backend, case, debug_checks):
    with pytest.raises(ValueError, match=r"block_table row \d holds block 10\d\d, outside"):
        get_backend_class(backend).op(**_args(case, block_table=case.metadata.block_table + 1000))


@pytest.mark.parametrize("backend", BACKENDS)
def test_without_debug_bad_block_ids_are_absent_keys(backend, case):
    # Without the debug scan, block ids are device values the kernel never trusts: one outside
    # the cache hides its keys (never read). Every id out here: no row sees a key, all are 0.
    # (tests/test_device_indices.py: one bad id, the other requests bit-identical.)
    out = torch.full((case.query.shape[0], 4, 16), float("nan"))
    get_backend_class(backend).op(**_args(case, block_table=case.metadata.block_table + 1000,
                                          out=out))
    assert (out[:case.metadata.num_actual_tokens] == 0).all()


@pytest.mark.parametrize("kwargs,message", [
    (dict(query_lens=[2], seq_lens=[1], block_tables=[[0]]),
     r"seq_lens\[0\]=1 is shorter than query_lens\[0\]=2"),
    (dict(query_lens=[1], seq_lens=[9], block_tables=[[0, 1]]),
     r"request 0 has seq_len=9 but only 2 blocks of 4 tokens"),
    (dict(query_lens=[1], seq_lens=[3], block_tables=[[7]]),
     r"block_tables\[0\] holds block 7, outside the cache's \[0, 4\) blocks"),
    (dict(query_lens=[5, 1], seq_lens=[5, 3], block_tables=[[0, 1], [2]]),
     r"batch is not decode-first: query_lens=\[5, 1\]; reorder"),
    (dict(query_lens=[1, 1], seq_lens=[3], block_tables=[[0]]),
     r"one entry per request; got 2, 1 and 1"),
])
def test_metadata_builder_checks_host_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        build_common_metadata(block_size=4, num_blocks=4, **kwargs)


def test_allocator_out_of_blocks_is_explicit():
    alloc = BlockAllocator(2, 4)
    with pytest.raises(RuntimeError, match="out of KV-cache blocks: request 'a' needs 3 more"):
        alloc.reserve("a", 12)


def _every_backend():
    from test_backends_matrix import BACKENDS as ALL
    return ALL


MISSHAPED = {  # (query, out) shapes for a spec of 4 query / 2 KV heads x 16, T tokens
    "query_heads": (lambda t: (t, 5, 16), lambda t: (t, 5, 16)),  # not k x 2 KV heads
    "query_head_dim": (lambda t: (t, 4, 8), lambda t: (t, 4, 16)),
    "out_heads": (lambda t: (t, 4, 16), lambda t: (t, 2, 16)),
    "out_head_dim": (lambda t: (t, 4, 16), lambda t: (t, 4, 8)),
    "out_tokens": (lambda t: (t, 4, 16), lambda t: (t + 1, 4, 16)),
    "query_rank": (lambda t: (t, 64), lambda t: (t, 4, 16)),
}


@pytest.mark.parametrize("what", list(MISSHAPED))
@pytest.mark.parametrize("backend", _every_backend())
def test_every_op_rejects_misshaped_query_and_out(backend, what):
    """Every backend's op, through its own schema and metadata: a query or out of the wrong
    shape is a ValueError naming the shape it got (checked from shapes alone, before any
    kernel runs)."""
    from test_backends_matrix import DEVICE, _base, block_size_for

    cls = get_backend_class(backend)
    base = _base(cls)
    case = make_case(base, SCENARIOS["mixed"], block_size=block_size_for(cls, base),
                     device=DEVICE)
    impl = cls(base)
    meta = impl.build_metadata(case.metadata)
    t = case.query.shape[0]
    q_shape, out_shape = (f(t) for f in MISSHAPED[what])
    heads, dim = base.num_heads, base.head_dim
    if (q_shape[1:], out_shape) == ((heads, dim), (t, heads, dim)):
        pytest.fail("not a mis-shaped case")
    q = torch.randn(q_shape, device=DEVICE).to(base.dtype)
    out = torch.zeros(out_shape, device=DEVICE, dtype=base.dtype)
    bad = q_shape if q_shape[1:] != (heads, dim) else out_shape
    with pytest.raises(ValueError, match=r"\(" + ", ".join(map(str, bad)) + r"\)"):
        impl.op_for(meta)(*impl.op_arguments(q, case.kv_cache, meta, out))


LAYER = AttentionSpec(num_heads=8, num_kv_heads=2, head_dim=64, dtype=torch.float32)


@pytest.mark.parametrize("q,k,v,message", [
    ((20, 16, 64), (20, 2, 64), (20, 2, 64),
     r"query must be \[num_tokens, 8, 64\] \(or \[num_tokens, 512\] flattened\) .* got shape "
     r"\(20, 16, 64\)"),
    ((20, 8, 32), (20, 2, 64), (20, 2, 64), r"query must be .* got shape \(20, 8, 32\)"),
    ((20, 8, 64), (20, 4, 32), (20, 2, 64),
     r"key must be \[20, 2, 64\] \(or \[20, 128\] flattened\) .* got shape \(20, 4, 32\)"),
    ((20, 512), (20, 128), (19, 128), r"value must be \[20, 2, 64\] .* got shape \(19, 128\)"),
    ((20, 8, 64), (20, 2, 64), None, r"pass key and value together"),
])
def test_the_layer_rejects_misshaped_qkv_instead_of_reshaping_them(q, k, v, message):
    from attn_ops import Attention, AttentionConfig, build_batch

    attn = Attention(LAYER, AttentionConfig(backend="REFERENCE"))
    cache = attn.allocate_kv_cache(16)
    meta = build_batch(BlockAllocator(16, attn.block_size), [0, 1], [0, 0], [12, 8])

    def make(shape):
        return None if shape is None else torch.randn(shape)

    with pytest.raises(ValueError, match=message):
        attn(make(q), make(k), make(v), cache, meta)
    flat = attn(torch.randn(20, 512), torch.randn(20, 128), torch.randn(20, 128), cache, meta)
    assert flat.shape == (20, 8, 64)  # (flattened heads are taken as they are)
