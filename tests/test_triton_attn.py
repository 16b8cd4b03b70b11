"""TRITON_ATTN beyond the registry matrix: split-KV (forced split counts), head dims that are
not powers of two, odd GQA groups, the device-side padding path of CUDA graphs, and the split
rule. CPU: Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1); GPU: the same
tests at the same small shapes on the device."""

import dataclasses

import pytest
import torch

from attn_ops import AttentionSpec, KVCacheDType, current_platform, get_backend_class
from attn_ops import routing
from attn_ops.testing import (SCENARIOS, Scenario, assert_matches_reference,
                              compiled_and_eager_layer, make_case, run_backend, sqnr_db)
from attn_ops.tuning import Tile, TritonTuning, Tuning

PLATFORM = current_platform()
DEVICE = PLATFORM.device_type
TRITON = get_backend_class("TRITON_ATTN")
REFERENCE = get_backend_class("REFERENCE")
DTYPE = torch.float16 if PLATFORM.is_gpu else torch.float32
pytestmark = pytest.mark.skipif(bool(TRITON.not_supported_reasons(
    AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=16, dtype=DTYPE), PLATFORM)),
    reason="TRITON_ATTN cannot run here (no Triton, or CPU without TRITON_INTERPRET=1)")

LONG_DECODES = Scenario(((700, 1), (33, 1), (1200, 1), (5, 1)))


class _Forced(TRITON):
    """TRITON_ATTN with the builder's split count (and token count: None = on the device
    only) overridden in its plan."""

    def __init__(self, spec, splits=None, num_tokens="real", **kw):
        super().__init__(spec, **kw)
        self.splits, self.num_tokens = splits, num_tokens

    def build_metadata(self, common):
        from attn_ops.backends.triton_attn import PLAN

        m = super().build_metadata(common)
        plan = PLAN.decode(m.plan)
        if self.splits is not None:
            plan = dataclasses.replace(plan, splits=self.splits, fused_combine=plan.num_decodes
                                       and routing.triton_fused_combine(
                                           plan.num_decodes, self.spec.kv_heads,
                                           self.tuning.triton))
        if self.num_tokens != "real":
            plan = dataclasses.replace(plan, num_tokens=self.num_tokens)
        return dataclasses.replace(m, plan=PLAN.encode(plan))


def _compare(spec, scenario, block_size=16, **forced):
    """TRITON_ATTN (``forced``: splits / num_tokens) against REFERENCE in fp64."""
    case = make_case(spec, scenario, block_size=block_size, device=DEVICE, seed=3)
    n = case.metadata.num_actual_tokens
    out, lse = run_backend(_Forced, case, **forced)
    truth, truth_lse = assert_matches_reference(out, case)
    if spec.kv_cache_dtype.is_fp8:
        exact = make_case(spec.with_(kv_cache_dtype=KVCacheDType.AUTO, dtype=torch.float64),
                          scenario, block_size=block_size, device=DEVICE, seed=3)
        ideal, _ = run_backend(REFERENCE, exact)
        assert sqnr_db(out[:n], ideal[:n]) >= 25.0
    assert (lse[:n].double() - truth_lse[:n]).abs().max().item() < 1e-3
    assert (out[n:] == 0).all() and (lse[n:] == 0).all()


BASE = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=32, dtype=DTYPE)


# each variant under both combines, each split count under both and in three variants (the
# interpreter's seconds a case: the full product was about 50 s of the CPU suite)
@pytest.mark.parametrize("variant,splits,combine", [
    ("plain", 8, "kernel"), ("plain", 2, "fused"), ("sinks_window_softcap", 4, "kernel"),
    ("sinks_window_softcap", 8, "fused"), ("fp8", 2, "kernel"), ("fp8", 4, "fused"),
    ("alibi", 8, "kernel"), ("alibi", 4, "fused")])
def test_split_kv_matches_reference(splits, variant, combine):
    """Split-KV partials merged by combine_splits_kernel or, fused, by each tile's last split
    (whose counters are all back to 0 afterwards)."""
    from attn_ops.backends import triton_attn

    tuning = Tuning().with_(triton={"fused_combine": combine == "fused"})
    spec = {"plain": BASE,
            "sinks_window_softcap": BASE.with_(has_sinks=True, sliding_window=300,
                                               logits_soft_cap=4.0),
            "fp8": BASE.with_(kv_cache_dtype=KVCacheDType.FP8_E4M3),
            "alibi": BASE.with_(use_alibi=True)}[variant]
    _compare(spec, LONG_DECODES, splits=splits, tuning=tuning)
    _compare(spec, SCENARIOS["mixed"], splits=splits, tuning=tuning)  # decodes split only
    if combine == "fused":
        assert triton_attn._COUNTERS and not any(c.any() for c in triton_attn._COUNTERS.values())


def test_by_default_split_batches_fuse_the_combine_from_enough_work_items(monkeypatch):
    """Unforced, the combine is fused into the attention launch from ``fused_min_items``
    (request, KV head) items on (one launch fewer) and is a second kernel below; either way
    REFERENCE's result."""
    from attn_ops.backends import triton_attn_kernels

    t = TritonTuning()
    assert not routing.triton_fused_combine(31, 8, t) and routing.triton_fused_combine(32, 8, t)
    launches = []
    real = triton_attn_kernels.combine_splits_kernel

    class Counted:
        def __getitem__(self, grid):
            launches.append(grid)
            return real[grid]

    monkeypatch.setattr(triton_attn_kernels, "combine_splits_kernel", Counted())
    for min_items, combines in ((len(LONG_DECODES.requests) * 2, 0), (10**6, 1)):
        launches.clear()
        _compare(BASE, LONG_DECODES, splits=4,
                 tuning=Tuning().with_(triton={"fused_min_items": min_items}))
        assert len(launches) == combines


@pytest.mark.parametrize("head_dim", [8, 40, 72, 80, 96, 112, 136, 256])
def test_head_dims_that_are_not_powers_of_two(head_dim):
    _compare(BASE.with_(head_dim=head_dim), SCENARIOS["mixed"])


# Every dtype the backend declares (bf16 only on GPUs: the interpreter's bf16 tl.dot is broken),
# each with its own tiles (fp32: smaller, IEEE dots), split and unsplit, in the widest head dim.
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16]
                         + ([torch.bfloat16] if PLATFORM.is_gpu else []), ids=str)
@pytest.mark.parametrize("head_dim", [32, 256])
def test_every_dtype(dtype, head_dim):
    spec = BASE.with_(dtype=dtype, head_dim=head_dim)
    _compare(spec, SCENARIOS["mixed"])
    _compare(spec, LONG_DECODES, splits=4)


@pytest.mark.parametrize("heads", [(6, 2), (12, 4), (8, 1), (5, 5)], ids=str)
def test_gqa_groups_of_any_size(heads):
    q, kv = heads
    _compare(BASE.with_(num_heads=q, num_kv_heads=kv), SCENARIOS["mixed"], splits=2)


def test_padding_rows_found_on_the_device_as_in_cuda_graphs():
    scenario = dataclasses.replace(SCENARIOS["padded_batch"], pad_tokens=5)
    _compare(BASE.with_(has_sinks=True), scenario, num_tokens=None)


def test_page_sizes_not_multiple_of_the_key_tile():
    _compare(BASE, LONG_DECODES, block_size=5, splits=4)


def test_short_prefills_take_their_own_tile_and_both_tiles_match_reference():
    t = TritonTuning()
    short = t.short_prefill_keys
    assert routing.triton_prefill_tile(True, 2, short, t) == t.short_prefill_tile_16bit != \
        routing.triton_prefill_tile(True, 2, short + 1, t) == t.prefill_tile_16bit
    assert routing.triton_prefill_tile(True, 4, 16, t) == t.prefill_tile_32bit  # no short tile
    spec = BASE.with_(dtype=torch.float16, head_dim=64, has_sinks=True, sliding_window=100)
    for keys in (-1, short):  # every step long / every step short (and launched heads-fastest)
        _compare(spec, SCENARIOS["mixed"], tuning=Tuning().with_(
            triton={"short_prefill_keys": keys}))


def test_many_items_tile_only_for_unsplit_launches_that_fill_the_gpu():
    t = TritonTuning()
    many = int(t.many_items_per_sm * 132 + 0.5)  # (request, KV head) items

    def tile(items, splits=1, kv_bytes=2, wide=True, t=t):
        return routing.triton_decode_tile(items, splits, kv_bytes, 132, wide, t)

    assert tile(many) == t.many_items_tile == (16, 32, 4, 3)
    assert tile(many - 1) == t.decode_tile  # too few programs
    assert tile(many, splits=2) == t.decode_tile
    assert tile(many, kv_bytes=4) == t.decode_tile  # fp32 K/V
    assert tile(many, kv_bytes=1) == t.many_items_tile  # fp8
    assert tile(many, t=dataclasses.replace(t, many_items_tile=None)) == t.decode_tile


def test_short_decodes_that_fill_the_gpu_are_not_split():
    t = TritonTuning()
    short = t.short_decode_keys
    assert routing.triton_num_splits(64, 8, short, 132, t) == 1  # 512 items, 3.9 per SM
    assert routing.triton_num_splits(56, 8, short, 132, t) == 2  # 448 items, 3.4 per SM
    assert routing.triton_num_splits(64, 8, short + 1, 132, t) == 2  # longer: split as before
    off = dataclasses.replace(t, many_items_tile=None)
    assert routing.triton_num_splits(64, 8, short, 132, off) == 2


def test_tiles_fit_the_devices_shared_memory():
    """The tiles measured on the H200 run there unchanged; smaller GPUs get fewer stages, then
    narrower tiles, never a launch that cannot fit."""
    t = TritonTuning()
    h200, a100, rtx = 232448, 166912, 101376  # opt-in bytes per block

    def fit(tile, smem, d=128, q_bytes=2, kv_bytes=2):
        return routing.triton_fit_tile(Tile(*tile), d, d, q_bytes, kv_bytes, smem)

    many = t.many_items_tile
    measured = [t.prefill_tile_16bit, t.short_prefill_tile_16bit, t.decode_tile, many]
    assert [fit(x, h200) for x in measured] == measured
    assert fit(many, h200, kv_bytes=1) == many  # fp8 cache
    smem_bytes = routing.attention._smem_bytes
    assert 4 * smem_bytes(*many[:2], many[3], 128, 128, 2, 2) <= 228 << 10  # 4 per SM
    assert fit(t.prefill_tile_32bit, h200, q_bytes=4, kv_bytes=4) == t.prefill_tile_32bit
    assert fit(t.prefill_tile_wide_heads, h200, d=256, q_bytes=4, kv_bytes=4) == \
        t.prefill_tile_wide_heads
    assert fit((128, 128, 8, 3), a100) == (128, 128, 8, 2)
    assert fit((128, 128, 8, 3), rtx) == (128, 64, 8, 2)
    assert fit((16, 64, 4, 4), rtx) == (16, 64, 4, 2)
    for smem in (h200, a100, rtx, 48 << 10):
        for tile in measured:
            rows, keys, warps, stages = fit(tile, smem)
            assert smem_bytes(rows, keys, stages, 128, 128, 2, 2) <= smem
            assert rows >= 16 and keys >= 16 and stages >= 2


def test_split_rule_never_jumps_up_with_the_batch():
    t = TritonTuning()
    for ctx in (1024, 8192, 32768):
        splits = [routing.triton_num_splits(b, 8, ctx, 132, t) for b in range(1, 257)]
        assert all(a >= b for a, b in zip(splits, splits[1:])), splits
        assert splits[0] == min(t.max_splits, ctx // 256)  # batch 1: as many as keys allow
        assert splits[-1] == 1
    assert routing.triton_num_splits(1, 8, 300, 132, t) == 1  # too short to split
    assert routing.triton_num_splits(0, 8, 32768, 132, t) == 1


def test_compiled_layer_matches_eager():
    got, expected = compiled_and_eager_layer(BASE.with_(sliding_window=50, has_sinks=True),
                                             "TRITON_ATTN", SCENARIOS["mixed"], device=DEVICE)
    torch.testing.assert_close(got, expected)


def test_every_triton_kernel_keeps_to_what_compiled_triton_accepts():
    """Compiled Triton refuses a kernel that reads a plain module-level number (only
    ``tl.constexpr`` globals are allowed), and passes a defaulted argument of a nested
    ``@triton.jit`` call as a bare Python value (a defaulted ``tl.constexpr`` string fails to
    compile); the interpreter these CPU tests run accepts both, so this checks every
    ``@triton.jit`` function of the package for them."""
    import importlib
    import inspect
    import pkgutil

    import triton

    import attn_ops
    import attn_ops.backends

    from triton.runtime.interpreter import InterpretedFunction

    bad, seen = [], 0
    for pkg in (attn_ops, attn_ops.backends):
        for module in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
            if not module.name.endswith("_kernels"):
                continue
            for name, obj in vars(importlib.import_module(module.name)).items():
                # (under TRITON_INTERPRET=1 @triton.jit makes InterpretedFunctions)
                if isinstance(obj, (triton.runtime.JITFunction, InterpretedFunction)):
                    seen += 1
                    fn = obj.fn
                    bad += [f"{module.name}.{name} reads {g}: declare it tl.constexpr(...)"
                            for g in fn.__code__.co_names
                            if type(fn.__globals__.get(g)) in (int, float)]
                    bad += [f"{module.name}.{name} defaults {p.name}: pass it at every call"
                            for p in inspect.signature(fn).parameters.values()
                            if p.default is not inspect.Parameter.empty]
    assert seen > 50, f"found {seen} @triton.jit functions: the scan misses the kernels"
    assert not bad, bad


def test_an_advanced_steps_graph_metadata_is_the_step_befores(monkeypatch):
    """TRITON_ATTN's graph metadata reads the padded buffers and a plan fixed per capture
    size, so the step before's serves a step advanced in place (``CUDAGraphBatch.advance``)
    as it is: the same tensors, values and plan a fresh ``graph_metadata`` of that step gives."""
    from attn_ops import CUDAGraphSupport, build_common_metadata
    from attn_ops.cudagraph import CUDAGraphBatch

    monkeypatch.setattr(TRITON, "cudagraph_support", classmethod(
        lambda cls, spec, platform: CUDAGraphSupport.UNIFORM_SINGLE_TOKEN_DECODE))
    backend = TRITON(BASE)
    graphs = CUDAGraphBatch((8,), 16, 4, DEVICE)
    tables = [[10 * r + i for i in range(16)] for r in range(5)]
    seq = [5, 9, 21, 33, 13]  # (the next token of each at a page's second row: three steps)

    def step(lens):
        return build_common_metadata([1] * 5, lens, tables, 4, 64, device=DEVICE)

    padded = graphs.pad(step(seq))
    meta = backend.graph_metadata(padded, graphs)
    for _ in range(3):
        seq = [n + 1 for n in seq]
        padded = graphs.advance(padded)
        assert backend.advance_graph_metadata(meta, padded, graphs) is meta
        again = CUDAGraphBatch((8,), 16, 4, DEVICE)
        fresh = backend.graph_metadata(again.pad(step(seq)), again)
        for field in dataclasses.fields(fresh):
            got, want = getattr(meta, field.name), getattr(fresh, field.name)
            assert (torch.equal(got, want) if isinstance(want, torch.Tensor) else got == want), \
                field.name
