"""torch.library.opcheck on every torch.ops.attn op (backends enrolled from the registry)."""

import pytest
import torch

from attn_ops import AttentionSpec, KVCacheDType, get_backend_class
from attn_ops.kv_cache import kv_cache_update
from attn_ops.testing import SCENARIOS, make_case, option_variants
from test_backends_matrix import BACKENDS, BASE, DEVICE, PLATFORM, block_size_for

SPECS = {
    "gqa": BASE,
    "sinks_window": BASE.with_(num_kv_heads=1, has_sinks=True, sliding_window=5),
    "alibi_softcap": BASE.with_(num_kv_heads=None, use_alibi=True, logits_soft_cap=3.0),
    "fp8_diffv": BASE.with_(head_dim_v=BASE.head_dim // 2, kv_cache_dtype=KVCacheDType.FP8_E4M3),
    "fp8": BASE.with_(kv_cache_dtype=KVCacheDType.FP8_E5M2),
    "turboquant_4bit": BASE.with_(kv_cache_dtype=KVCacheDType.TURBOQUANT_4BIT_NC),
    "turboquant_k8v4": BASE.with_(kv_cache_dtype=KVCacheDType.TURBOQUANT_K8V4),
}


def _test_utils(cache_dtype):
    # opcheck's test_schema compares tensors before/after the call with float ops that torch
    # does not implement for fp8 dtypes ("mul_cpu_reduced_float" not implemented for
    # 'Float8_e4m3fn'); the fp8 ops run every other check, and test_schema runs on the same ops
    # with non-fp8 caches.
    utils = ("test_schema", "test_autograd_registration", "test_faketensor",
             "test_aot_dispatch_dynamic")
    return utils[1:] if cache_dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else utils


def _attention_call(impl, case, with_lse):
    """(op, args) of one call of ``impl`` on ``case``."""
    spec, q = case.spec, case.query
    out = torch.empty(q.shape[0], spec.num_heads, spec.v_head_dim, dtype=q.dtype, device=DEVICE)
    lse = torch.empty(q.shape[0], spec.num_heads, device=DEVICE) if with_lse else None
    meta = impl.build_metadata(case.metadata)
    return impl.op_for(meta), impl.op_arguments(
        q, case.kv_cache, meta, out, lse=lse, sinks=case.sinks, alibi_slopes=case.alibi_slopes,
        k_scale=case.k_scale, v_scale=case.v_scale)


def _supported():
    """(backend, options, spec id, with LSE) the backend declares it can run here: only those
    are checked."""
    return [pytest.param(b, opts, sid, lse,
                         id="-".join([b, *([oid] if oid else []), sid,
                                      "lse" if lse else "no_lse"]))
            for b in BACKENDS for oid, opts in (("", {}), *option_variants(b))
            for sid, spec in SPECS.items()
            for lse in (True, False)
            if not get_backend_class(b).not_supported_reasons(spec, PLATFORM)
            and (get_backend_class(b).returns_lse(PLATFORM) or not lse)]


@pytest.mark.parametrize("backend,options,spec_id,with_lse", _supported())
def test_attention_op_opcheck(backend, options, spec_id, with_lse):
    spec = SPECS[spec_id]
    impl = get_backend_class(backend)(spec, **options)
    case = make_case(spec, SCENARIOS["contiguous_pages"],
                     block_size=block_size_for(type(impl), spec), device=DEVICE)
    op, args = _attention_call(impl, case, with_lse)
    torch.library.opcheck(op, args, test_utils=_test_utils(spec.cache_dtype))


@pytest.mark.parametrize("cache_dtype", [KVCacheDType.AUTO, KVCacheDType.FP8_E4M3,
                                         KVCacheDType.FP8_E5M2])
def test_kv_cache_update_opcheck(cache_dtype):
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=8, dtype=torch.float32,
                         kv_cache_dtype=cache_dtype)
    cache = torch.zeros(6, 2, 4, 2, 8, dtype=spec.cache_dtype)
    scale = torch.tensor([0.5]) if cache_dtype.is_fp8 else None
    key, value = torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    slots = torch.tensor([3, -1, 9, 17, 0])
    torch.library.opcheck(kv_cache_update, (key, value, cache, slots, scale, scale),
                          test_utils=_test_utils(spec.cache_dtype))


def test_kv_cache_update_writes_slots_and_skips_padding():
    cache = torch.zeros(3, 2, 4, 1, 2)
    key = torch.arange(6.0).view(3, 1, 2)
    kv_cache_update(key, -key, cache, torch.tensor([5, -1, 0]), None, None)
    assert cache[1, 0, 1, 0].tolist() == [0.0, 1.0] and cache[1, 1, 1, 0].tolist() == [0.0, -1.0]
    assert cache[0, 0, 0, 0].tolist() == [4.0, 5.0]
    assert int((cache != 0).sum()) == 6  # the -1 token was not written anywhere


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_kv_cache_update_fp8_quantizes_with_scale_and_saturates(cache_dtype):
    cache = torch.zeros(2, 2, 4, 1, 2, dtype=cache_dtype)
    key = torch.tensor([[[1.0, 1e9]]])
    kv_cache_update(key, key, cache, torch.tensor([2]), torch.tensor([0.25]), torch.tensor([2.0]))
    k = cache[0, 0, 2, 0].float()
    assert k[0].item() == 4.0  # 1.0 / 0.25
    assert k[1].item() == {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}[cache_dtype]
    assert cache[0, 1, 2, 0, 0].float().item() == 0.5  # value / v_scale


def _fp8_output_backends():
    for name in BACKENDS:
        cls = get_backend_class(name)
        if "output_scale" in {a.name for a in cls.op._schema.arguments}:
            yield name


@pytest.mark.parametrize("backend", list(_fp8_output_backends()))
def test_fp8_output_is_the_quantized_output_and_passes_opcheck(backend):
    """``output_scale`` (what the FP8-output compile pass sets): the op writes
    ``quantize_fp8(out, scale)`` into an fp8 ``out``, bit for bit."""
    from attn_ops.glue import quantize_fp8_op

    cls = get_backend_class(backend)
    case = make_case(BASE, SCENARIOS["mixed"], block_size=block_size_for(cls, BASE),
                     device=DEVICE, seed=4)
    impl = cls(BASE)
    meta = impl.build_metadata(case.metadata)
    plain = torch.zeros(case.query.shape[0], BASE.num_heads, BASE.v_head_dim,
                        dtype=case.query.dtype, device=DEVICE)
    impl.op_for(meta)(*impl.op_arguments(case.query, case.kv_cache, meta, plain))
    scale = torch.tensor([0.03], device=DEVICE)
    fp8 = torch.zeros(plain.shape, dtype=torch.float8_e4m3fn, device=DEVICE)
    args = impl.op_arguments(case.query, case.kv_cache, meta, fp8)
    impl.op_for(meta)(*args, scale)
    want = quantize_fp8_op(plain, scale, torch.float8_e4m3fn)
    assert torch.equal(fp8.view(torch.uint8), want.view(torch.uint8))
    torch.library.opcheck(impl.op_for(meta), (*args, scale),
                          test_utils=_test_utils(torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="output_scale is given but out.dtype"):
        impl.op_for(meta)(*impl.op_arguments(case.query, case.kv_cache, meta, plain), scale)
