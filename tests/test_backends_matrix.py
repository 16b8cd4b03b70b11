"""The registry-generated correctness matrix: every backend available here x every feature it
declares x named serving scenarios, against REFERENCE in fp64 under the tolerance policy
(attn_ops.testing). A new backend enrolls itself by being in the registry."""

import pytest
import torch

from attn_ops import AttentionSpec, KVCacheDType, current_platform, get_backend_class
from attn_ops.registry import list_backends
from attn_ops.spec import Feature
from attn_ops.testing import (FEATURE_SPECS, MIN_SQNR_DB, SCENARIOS, option_variants,
                              Scenario, make_case, run_backend, sqnr_db, tolerance)

PLATFORM = current_platform()
DEVICE = PLATFORM.device_type
# The base spec each backend of this platform is tested around: tiny fp32 on the CPU; on GPUs
# the smallest head dim and the dtype every vendor kernel takes.
if PLATFORM.is_gpu:
    BASE = AttentionSpec(num_heads=8, num_kv_heads=2, head_dim=64, dtype=torch.float16)
    BLOCK_SIZE = 16
else:
    BASE = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32)
    BLOCK_SIZE = 4
HEADS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}
# GQA groups that are not powers of two (3: Llama-3.2-3B's 24 / 8), on the steps that take
# different layouts (decode-only, prefill-only, mixed)
ODD_GROUPS = {"gqa3": (6, 2), "gqa5": (5, 1)}
ODD_GROUP_SCENARIOS = ("decode_only", "prefill_only", "mixed")
NUM_BLOCKS = 256  # cache blocks at page 4 (scaled for other page sizes): every scenario fits


def _base(cls):
    """The spec a backend is tested around: BASE, in the first KV-cache dtype it takes when it
    takes no unquantized cache (TURBOQUANT)."""
    dtypes = getattr(cls, "capabilities", None)
    dtypes = getattr(dtypes, "kv_cache_dtypes", {KVCacheDType.AUTO})
    if KVCacheDType.AUTO in dtypes:
        return BASE
    return BASE.with_(kv_cache_dtype=min(dtypes, key=lambda d: d.value))


def _available():
    names = []
    for name in list_backends():
        try:
            cls = get_backend_class(name)
        except ImportError:
            continue
        if not cls.not_supported_reasons(_base(cls), PLATFORM):
            names.append(name)
    return names


BACKENDS = _available()
REFERENCE = get_backend_class("REFERENCE")


def _variants(cls):
    """(id, spec) for the base spec, every head layout, every declared feature and every
    TurboQuant preset it takes."""
    base = _base(cls)
    out = [(f"{h}", base.with_(num_heads=q, num_kv_heads=kv)) for h, (q, kv) in HEADS.items()]
    for feature, turn_on in FEATURE_SPECS.items():
        if feature in cls.capabilities.features:
            spec = turn_on(base)
            if not cls.not_supported_reasons(spec, PLATFORM):
                out.append((feature.value, spec))
    if Feature.FP8_KV in cls.capabilities.features:
        spec = base.with_(kv_cache_dtype=KVCacheDType.FP8_E5M2)
        if not cls.not_supported_reasons(spec, PLATFORM):
            out.append(("fp8_e5m2", spec))
    for dtype in _turboquant_dtypes(cls):
        if dtype is not base.kv_cache_dtype:
            out.append((dtype.value, base.with_(kv_cache_dtype=dtype)))
    return out


def _turboquant_dtypes(cls) -> list:
    """The TurboQuant presets ``cls`` declares, in one order (a frozenset's differs between
    processes, and pytest-xdist's workers must collect alike)."""
    return sorted((d for d in cls.capabilities.kv_cache_dtypes if d.is_turboquant),
                  key=lambda d: d.value)


# FlexAttention compiles a kernel per shape and mods on the CPU (seconds each, with a cold
# cache): there its base spec runs every scenario and each other variant the two scenarios
# that take its two layouts (decode-only steps, mixed steps over permuted, NaN-poisoned
# pages); on GPUs every variant runs all.
COMPILES_PER_SHAPE = {"FLEX_ATTENTION"} if not PLATFORM.is_gpu else set()
LAYOUT_SCENARIOS = ("decode_only", "mixed")


def _scenarios(name, vid, scenarios=tuple(SCENARIOS)):
    if name in COMPILES_PER_SHAPE and vid != "gqa":
        return tuple(s for s in scenarios if s in LAYOUT_SCENARIOS)
    return scenarios


def _params():
    for name in BACKENDS:
        cls = get_backend_class(name)
        for vid, spec in _variants(cls):
            for scenario in _scenarios(name, vid):
                yield pytest.param(name, spec, scenario, {}, id=f"{name}-{vid}-{scenario}")
        for vid, (q, kv) in ODD_GROUPS.items():
            spec = _base(cls).with_(num_heads=q, num_kv_heads=kv)
            if not cls.not_supported_reasons(spec, PLATFORM):
                for scenario in _scenarios(name, vid, ODD_GROUP_SCENARIOS):
                    yield pytest.param(name, spec, scenario, {}, id=f"{name}-{vid}-{scenario}")
        for oid, options in option_variants(name):  # each other kernel route, base spec
            for scenario in SCENARIOS:
                yield pytest.param(name, BASE, scenario, options, id=f"{name}-{oid}-{scenario}")
        for dtype in (torch.float16, torch.bfloat16):
            spec = _base(cls).with_(dtype=dtype)
            if dtype == BASE.dtype:
                continue
            if not cls.not_supported_reasons(spec, PLATFORM):
                for scenario in _scenarios(name, "dtype", ("mixed", "long_context")):
                    yield pytest.param(name, spec, scenario, {},
                                       id=f"{name}-{str(dtype)[6:]}-{scenario}")


def _max_err(a, b, num_tokens):
    return (a[:num_tokens].double() - b[:num_tokens].double()).abs().max().item()


def block_size_for(cls, spec):
    """The matrix's page size, or the backend's own where it cannot take that one."""
    if any(r.code == "block_size" for r in
           cls.not_supported_reasons(spec.with_(block_size=BLOCK_SIZE), PLATFORM)):
        return cls.preferred_block_size(spec)
    return BLOCK_SIZE


@pytest.mark.parametrize("backend,spec,scenario,options", list(_params()))
def test_matches_reference(backend, spec, scenario, options):
    cls = get_backend_class(backend)
    # One cache size for every scenario (compiling backends then compile once per spec).
    _check(cls, spec, SCENARIOS[scenario], options, seed=len(scenario),
           num_blocks=lambda block: NUM_BLOCKS * 4 // block)


def _check(cls, spec, scenario, options, *, seed, num_blocks=lambda block: None):
    """``cls`` against REFERENCE in fp64 (and plain REFERENCE at the test's precision, which
    sets the tolerance) on one scenario."""
    block = block_size_for(cls, spec)

    def case_for(s):
        return make_case(s, scenario, block_size=block, num_blocks=num_blocks(block),
                         device=DEVICE, seed=seed)

    case = case_for(spec)
    n = case.metadata.num_actual_tokens
    with_lse = cls.returns_lse(PLATFORM)
    out, lse = run_backend(cls, case, with_lse=with_lse, **options)
    # (a TurboQuant cache: REFERENCE over the keys and values its slots read back as)
    oracle = case.read_back(torch.float64)
    truth, truth_lse = run_backend(REFERENCE, oracle)
    base, base_lse = run_backend(REFERENCE, case.read_back(case.spec.dtype))  # (test precision)
    assert not out[:n].isnan().any(), "backend read a NaN-poisoned slot or produced NaN"
    assert (out[n:] == 0).all(), "padding rows must be zeroed"
    # (a kernel computing in fp8 itself -- q and P rounded, FA3's fp8 path -- is held to the
    # fp8 SQNR bound below instead; its glue is checked exactly against stand-ins)
    in_fp8 = cls(spec, **options).computes_in_fp8()
    err, allowed = _max_err(out, truth, n), tolerance(_max_err(base, truth, n), spec.dtype)
    assert in_fp8 or err <= allowed, f"max error {err:.3g} > allowed {allowed:.3g}"
    if with_lse:  # (FLEX_ATTENTION on the CPU returns none: returns_lse)
        assert (lse[n:] == 0).all(), "padding LSE rows must be zeroed"
        lse_err = _max_err(lse, truth_lse, n)
        assert in_fp8 or lse_err <= tolerance(_max_err(base_lse, truth_lse, n), spec.dtype), \
            lse_err
    if spec.kv_cache_dtype.is_quantized:
        ideal, _ = run_backend(REFERENCE, case_for(spec.with_(kv_cache_dtype=KVCacheDType.AUTO,
                                                              dtype=torch.float64)))
        assert sqnr_db(out[:n], ideal[:n]) >= MIN_SQNR_DB[spec.kv_cache_dtype]


def test_matrix_cases_poison_every_unused_slot():
    """Every scenario starts from a cache full of NaN (page tails included), as pages reused
    from earlier requests may be; only the batch's own writes make slots finite."""
    assert all(s.poison_unused for s in SCENARIOS.values())
    case = make_case(BASE, SCENARIOS["mixed"], block_size=BLOCK_SIZE, device=DEVICE)
    k_cache = case.kv_cache[:, 0]
    owned = set().union(*(map(int, row[: -(-n // BLOCK_SIZE)]) for row, n in zip(
        case.metadata.block_table_cpu.tolist(), case.metadata.seq_lens_cpu.tolist())))
    unowned = [b for b in range(k_cache.shape[0]) if b not in owned]
    assert unowned and k_cache[unowned].isnan().all()


def _serving_isolation_params():
    for name in BACKENDS:
        cls = get_backend_class(name)
        for sid, spec in (("base", BASE), ("gqa3", BASE.with_(num_heads=6, num_kv_heads=2))):
            if not cls.not_supported_reasons(spec, PLATFORM):
                yield pytest.param(name, spec, id=f"{name}-{sid}")


@pytest.mark.parametrize("backend,spec", list(_serving_isolation_params()))
def test_a_freed_requests_nan_and_inf_never_reach_the_next_request(backend, spec):
    """Request A writes NaN and +-Inf K/V over several pages and is freed; requests B (a
    chunked prefill, then decodes) and C (a fresh prefill) get A's pages back -- the allocator
    hands freed blocks out again -- and write their own K/V through the cache-write op, ending
    mid-page. Their outputs must be finite and REFERENCE's."""
    from attn_ops.testing import assert_matches_reference, freed_pages_case

    cls = get_backend_class(backend)
    block = block_size_for(cls, spec)
    num_blocks = 64 * 4 // min(block, 4) if block <= 16 else 24
    case = freed_pages_case(spec, block, num_blocks, cls.kv_cache_layout(spec), device=DEVICE)
    out, _ = run_backend(cls, case, with_lse=cls.returns_lse(PLATFORM))
    assert out.isfinite().all(), "a freed request's NaN/Inf reached another request"
    assert_matches_reference(out, case)


def _planes_params():
    for name in BACKENDS:
        cls = get_backend_class(name)
        for sid, spec in (("base", _base(cls)), ("window", _base(cls).with_(sliding_window=7))):
            if cls.reads_kv_planes(spec) and not cls.not_supported_reasons(spec, PLATFORM):
                for scenario in ("decode_only", "mixed"):
                    yield pytest.param(name, spec, scenario, id=f"{name}-{sid}-{scenario}")


@pytest.mark.parametrize("backend,spec,scenario", list(_planes_params()))
def test_a_cache_held_as_k_and_v_planes_reads_as_the_interleaved_one(backend, spec, scenario):
    """Every backend that declares ``reads_kv_planes``: the case's NHD cache copied into K and
    V planes (``[2, blocks, page, heads, dim]``, HF's paged cache layout) gives the same rows
    and LSE as the interleaved cache, the cache write landing in the planes."""
    import dataclasses

    from attn_ops.kv_cache import kv_cache_planes, kv_cache_update

    cls = get_backend_class(backend)
    case = make_case(spec, SCENARIOS[scenario], block_size=block_size_for(cls, spec),
                     device=DEVICE, seed=5)
    planes = case.kv_cache.transpose(0, 1).contiguous()
    held = kv_cache_planes(planes)
    assert held.stride(1) != case.kv_cache.stride(1)  # (K and V a plane each, not pages apart)
    with_lse = cls.returns_lse(PLATFORM)
    want, want_lse = run_backend(cls, case, with_lse=with_lse)
    got, got_lse = run_backend(cls, dataclasses.replace(case, kv_cache=held), with_lse=with_lse)
    assert torch.equal(got, want)
    assert not with_lse or torch.equal(got_lse, want_lse)
    slots = case.metadata.slot_mapping[:3]
    k = torch.randn(3, spec.kv_heads, spec.head_dim).to(spec.dtype).to(DEVICE)
    kv_cache_update(k, k.clone(), held, slots, None, None)
    pages, at = slots // held.shape[2], slots % held.shape[2]
    assert torch.equal(planes[0, pages, at], k) and torch.equal(planes[1, pages, at], k)


# Real sizes (GPU only): Llama-3-8B attention shapes, long decodes, a 1k prefill and a chunked
# prefill in one batch, in bf16 / fp16 and each fp8 cache a backend declares.
REAL = AttentionSpec(num_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
REAL_BATCH = Scenario(((8191, 1), (4000, 1), (1, 1), (1500, 1), (0, 1024), (2000, 700)),
                      pad_tokens=5)
# 16 decodes x 8 KV heads: about one wave of work items on an H200 (FLASH_ATTN decodes with FA4)
REAL_WAVE = Scenario(tuple((300 + 250 * i, 1) for i in range(16)))


def _real_params():
    for name in BACKENDS if PLATFORM.is_gpu else ():
        cls = get_backend_class(name)
        specs = {"bf16": REAL, "fp16": REAL.with_(dtype=torch.float16),
                 "window_sinks": REAL.with_(sliding_window=1000, has_sinks=True)}
        if Feature.FP8_KV in cls.capabilities.features:
            specs.update(fp8_e4m3=REAL.with_(kv_cache_dtype=KVCacheDType.FP8_E4M3),
                         fp8_e5m2=REAL.with_(kv_cache_dtype=KVCacheDType.FP8_E5M2))
        specs.update({d.value: REAL.with_(kv_cache_dtype=d) for d in _turboquant_dtypes(cls)})
        for sid, spec in specs.items():
            if not cls.not_supported_reasons(spec, PLATFORM):
                for bid, batch in (("mixed", REAL_BATCH), ("wave", REAL_WAVE)):
                    yield pytest.param(name, spec, batch, id=f"{name}-{sid}-{bid}")


@pytest.mark.gpu
@pytest.mark.parametrize("backend,spec,batch", list(_real_params()))
def test_real_sizes_match_reference(backend, spec, batch):
    _check(get_backend_class(backend), spec, batch, {}, seed=7)


def test_matrix_is_not_empty():
    expected = {"REFERENCE", "FLASHINFER", "FLASH_ATTN"} if PLATFORM.is_gpu else \
        {"REFERENCE", "CPU_ATTN"}
    assert expected <= set(BACKENDS)


# GQA groups at real size (GPU only): 4 KV heads x 128, each group's query heads, bf16, on a
# decode-only, a prefill-only and a mixed step.
REAL_GROUPS = (1, 2, 3, 4, 5, 7, 8)
REAL_STEPS = {"decode_only": Scenario(tuple((300 + 500 * i, 1) for i in range(12))),
              "prefill_only": Scenario(((0, 700), (300, 257), (0, 1024))),
              "mixed": REAL_BATCH}


def _real_group_params():
    for name in BACKENDS if PLATFORM.is_gpu else ():
        cls = get_backend_class(name)
        for group in REAL_GROUPS:
            spec = REAL.with_(num_heads=4 * group, num_kv_heads=4)
            if not cls.not_supported_reasons(spec, PLATFORM):
                for sid in REAL_STEPS:
                    yield pytest.param(name, spec, sid, id=f"{name}-group{group}-{sid}")


@pytest.mark.gpu
@pytest.mark.parametrize("backend,spec,step", list(_real_group_params()))
def test_gqa_groups_at_real_size_match_reference(backend, spec, step):
    _check(get_backend_class(backend), spec, REAL_STEPS[step], {}, seed=11)
