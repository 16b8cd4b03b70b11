"""The MLA family: spec and selection, the latent cache write, the LSE merge, the layer's two
forms against a naive dense fp64 MLA computed from the weights (every scenario, NaN-poisoned
pages, fp8 latents), opcheck and torch.compile."""

from __future__ import annotations

import dataclasses
import math
import sys
import types

import pytest
import torch

from attn_ops import (AttentionConfig, AttentionSpec, BlockAllocator, MLAAttention,
                      build_batch, build_step_metadata, get_backend_class, select_backend)
from attn_ops.backends.mla.common import PLAN, context_chunks, merge_attn_states, mla_cache_update
from attn_ops.platforms import Platform, PlatformKind, current_platform
from attn_ops.registry import MLA_BACKENDS
from attn_ops.selector import BackendNotSupportedError, candidates_for
from attn_ops.spec import KVCacheDType, yarn_mscale
from attn_ops.tuning import Tuning

SPEC = AttentionSpec.mla(4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                         v_head_dim=12, dtype=torch.float64, block_size=4,
                         mscale=yarn_mscale(4.0, 1.0))
NUM_BLOCKS = 64
PLATFORM = current_platform()
CPU = Platform(PlatformKind.CPU, "cpu")  # for the fp64 oracle cases, whatever this machine has
DEVICE = PLATFORM.device_type  # the small cases run where the backends' kernels do
TOLERANCE = {torch.float64: 1e-10, torch.float32: 2e-5}


def _spec_for(backend: str) -> AttentionSpec | None:
    """SPEC in the widest dtype ``backend`` runs here (None: it runs none of them)."""
    for dtype in TOLERANCE:
        spec = SPEC.with_(dtype=dtype)
        if not get_backend_class(backend).not_supported_reasons(spec, PLATFORM):
            return spec
    return None


# every MLA backend that runs on this machine, with its spec: a new one enrolls itself
MLA_HERE = {b.value: s for b in sorted(MLA_BACKENDS, key=lambda b: b.value)
            if (s := _spec_for(b.value)) is not None}
# small split thresholds, so TRITON_MLA's split-KV path runs at these contexts
SPLITTING = {"min_keys_per_split": 4, "programs_per_sm": 8, "decode_keys": 16}


# --- spec and selection -----------------------------------------------------------------------

def test_mla_spec_takes_the_mha_forms_qk_width_and_yarns_mscale_in_its_scale():
    spec = AttentionSpec.mla(128, q_lora_rank=1536, mscale=yarn_mscale(40.0, 1.0))
    assert (spec.head_dim, spec.v_head_dim, spec.latent_dim) == (192, 128, 576)
    assert spec.softmax_scale == pytest.approx(192 ** -0.5 * (0.1 * math.log(40) + 1) ** 2)
    with pytest.raises(ValueError, match="head_dim=100 must be qk_nope_head_dim"):
        AttentionSpec(num_heads=4, head_dim=100, kv_lora_rank=32, qk_nope_head_dim=16,
                      qk_rope_head_dim=8)
    with pytest.raises(ValueError, match="num_kv_heads=2 must be None for MLA"):
        AttentionSpec.mla(4, num_kv_heads=2)
    with pytest.raises(ValueError, match="mscale=0 must be a finite positive"):
        AttentionSpec.mla(4, mscale=0)


def test_mla_specs_are_offered_mla_backends_only_and_others_never_are():
    table = select_backend(SPEC, CPU).table()
    assert "REFERENCE_MLA" in table and "CPU_ATTN" not in table and "FLASHINFER " not in table
    assert "MLA" not in select_backend(SPEC.with_(kv_lora_rank=None, qk_nope_head_dim=None,
                                                  qk_rope_head_dim=None, head_dim_v=None,
                                                  scale=None), CPU).table()
    with pytest.raises(BackendNotSupportedError, match="serves MLA layers only"):
        select_backend(AttentionSpec(num_heads=4, head_dim=16),
                       config=AttentionConfig(backend="REFERENCE_MLA"))


@pytest.fixture
def no_providers(monkeypatch):
    """No provider of FlashMLA or FlashAttention 3 importable (whatever this machine has)."""
    from attn_ops.providers import FA3, FLASHMLA

    for provider in (*FLASHMLA.providers, *FA3.providers):
        monkeypatch.setitem(sys.modules, provider.module, None)


def test_an_h200_user_sees_each_vendor_mla_backend_with_its_exact_cause(no_providers):
    h200 = dataclasses.replace(Platform.parse("cuda:9.0"), assume_packages=True)
    spec = AttentionSpec.mla(128, block_size=64)
    by_name = {c.name: c for c in candidates_for(spec, h200)}
    assert [n for n in by_name][:5] == ["COMPOSITE_MLA_SM90", "FLASHINFER_MLA", "FLASHMLA",
                                        "FLASH_ATTN_MLA", "TRITON_MLA"]
    assert by_name["FLASHMLA"].ok  # (its packages assumed; ranked after FLASHINFER_MLA)
    assert any("compute capability 9.0 is below the minimum 10.0" in str(r)
               for r in by_name["CUTLASS_MLA"].reasons)
    assert by_name["FLASH_ATTN_MLA"].ok  # (FA3 assumed; ranked after FLASHINFER_MLA)
    # Without the packages assumed, the reasons say which provider of the kernel was looked
    # for and why none serves here.
    bare = {c.name: c for c in candidates_for(spec, Platform.parse("cuda:9.0"))}
    assert any(str(r).startswith("no provider of FlashMLA is usable here (DeepSeek's flash_mla:")
               for r in bare["FLASHMLA"].reasons)
    assert any(str(r).startswith("no provider of FlashAttention 3 is usable here")
               for r in bare["FLASH_ATTN_MLA"].reasons)
    assert any(str(r).startswith("no provider of FlashMLA is usable here")
               for r in bare["COMPOSITE_MLA_SM90"].reasons)
    # the composite of the three first, then FlashInfer's MLA, then ours; REFERENCE_MLA runs
    # anywhere but is not in a GPU's priority list (a silent 100x slowdown)
    assert [c.name for c in by_name.values() if c.ok] == [
        "COMPOSITE_MLA_SM90", "FLASHINFER_MLA", "FLASHMLA", "FLASH_ATTN_MLA", "TRITON_MLA",
        "REFERENCE_MLA"]
    fp8 = {c.name: c for c in candidates_for(spec.with_(kv_cache_dtype=KVCacheDType.FP8_E4M3),
                                             h200)}
    assert [n for n, c in fp8.items() if c.ok][0] == "TRITON_MLA"
    assert any("kv_cache_dtype" in str(r) or "fp8" in str(r)
               for r in fp8["FLASHINFER_MLA"].reasons)
    assert by_name["REFERENCE_MLA"].priority is None


@pytest.mark.parametrize("index_topk", [None, 2048], ids=["dense", "sparse"])
def test_a_latent_width_flashinfers_block_cannot_hold_is_refused_naming_its_shared_memory(
        index_topk):
    """FlashInfer's fa3 MLA block at 512 + 128 needs 246,624 bytes of shared memory, more than
    an H200 block's 232,448 (FlashInfer refuses that plan at the first step): the selector
    rejects it with the bytes and picks TRITON_MLA; 512 + 64 and 256 + 128 fit."""
    h200 = dataclasses.replace(Platform.parse("cuda:9.0"), assume_packages=True)
    fi = "FLASHINFER_MLA" if index_topk is None else "FLASHINFER_MLA_SPARSE"
    wide = AttentionSpec.mla(16, qk_rope_head_dim=128, dtype=torch.bfloat16, block_size=64,
                             index_topk=index_topk)
    reasons = {c.name: c for c in candidates_for(wide, h200)}[fi].reasons
    assert [r.code for r in reasons] == ["shared_memory"]
    assert "needs 246,624 bytes of shared memory a block at kv_lora_rank=512 + " \
        "qk_rope_head_dim=128; sm90 gives a block 232,448" in str(reasons[0])
    assert select_backend(wide, h200).backend.startswith("TRITON_MLA")
    for rank, rope in ((512, 64), (256, 128)):
        fits = wide.with_(kv_lora_rank=rank, qk_rope_head_dim=rope,
                          head_dim=128 + rope)
        # (512 + 64 dense: the composite of FlashMLA, FlashInfer's MLA and TRITON_MLA first)
        composite = index_topk is None and (rank, rope) == (512, 64)
        assert select_backend(fits, h200).backend == ("COMPOSITE_MLA_SM90" if composite
                                                      else fi)


# --- the latent cache write -------------------------------------------------------------------

@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8_e4m3"])
def test_latent_write_stores_rows_skips_padding_and_clears_entered_pages(fp8):
    spec = SPEC.with_(dtype=torch.bfloat16,
                      kv_cache_dtype=KVCacheDType.FP8_E4M3 if fp8 else KVCacheDType.AUTO)
    cache = torch.full((8, 4, spec.latent_dim), float("nan")).to(spec.cache_dtype)
    slots = torch.tensor([9, 10, -1, 16, 17, 18, 19, 20, -1])  # page 4 entered, page 5 at row 0
    t = slots.shape[0]
    g = torch.Generator().manual_seed(0)
    grid = torch.tensor([0.0, 0.5, -1.5, 3.0, 96.0])  # exact in bf16 and e4m3 (scale 0.5)
    kv_c = grid[torch.randint(0, 5, (t, 32), generator=g)].bfloat16()
    k_pe = grid[torch.randint(0, 5, (t, 8), generator=g)].bfloat16()
    scale = torch.tensor([0.5]) if fp8 else None
    mla_cache_update(kv_c, k_pe, cache, slots, scale)
    got = cache.float() * (0.5 if fp8 else 1.0)
    rows = torch.cat([kv_c, k_pe], 1).float()
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            torch.testing.assert_close(got[s // 4, s % 4], rows[i])
    assert (got[5, 1:] == 0).all()  # entered at row 0 by one token: the rest cleared
    assert got[2, 0].isnan().all() and got[2, 3].isnan().all()  # not entered: untouched
    torch.library.opcheck(mla_cache_update, (kv_c, k_pe, cache.clone(), slots, scale),
                          test_utils=("test_faketensor", "test_autograd_registration"))


# --- the LSE merge ----------------------------------------------------------------------------

def test_merge_equals_one_softmax_over_both_key_sets_and_keeps_empty_rows_zero():
    g = torch.Generator().manual_seed(1)
    t, h, d, n1, n2 = 5, 3, 4, 6, 7
    scores = torch.randn(t, h, n1 + n2, generator=g, dtype=torch.float64) * 3
    values = torch.randn(n1 + n2, d, generator=g, dtype=torch.float64)
    scores[0, :, :n1] = float("-inf")  # row 0: prefix empty
    scores[1, :, n1:] = float("-inf")  # row 1: suffix empty
    scores[2] = float("-inf")          # row 2: both empty

    def side(s, v):
        lse = torch.logsumexp(s, -1)
        o = torch.where(lse[..., None] > -math.inf,
                        torch.softmax(s, -1).nan_to_num() @ v, 0.0)
        return o, lse.float()

    (po, pl), (so, sl) = side(scores[..., :n1], values[:n1]), side(scores[..., n1:], values[n1:])
    sl_inf = sl.clone()
    sl_inf[1] = float("inf")  # an empty side some kernels mark +inf: treated as -inf
    out, lse = torch.empty_like(po), torch.empty_like(pl)
    merge_attn_states(out, lse, po, pl, so, sl_inf)
    want_o, want_lse = side(scores, values)
    torch.testing.assert_close(out[3:], want_o[3:])
    torch.testing.assert_close(lse[3:], want_lse[3:])
    torch.testing.assert_close(out[:2], want_o[:2])
    assert (out[2] == 0).all() and (lse[2] == -math.inf).all()
    torch.library.opcheck(merge_attn_states, (torch.empty_like(po), torch.empty_like(pl), po, pl,
                                              so, sl))


@pytest.mark.skipif("TRITON_MLA" not in MLA_HERE, reason="Triton does not run here")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_merge_gpu_kernel_matches_its_torch_form(dtype):
    """merge_attn_states' one-pass GPU kernel (on the CPU in Triton's interpreter) against the
    torch form: empty sides (-inf and +inf LSEs), rows empty on both, heads that do not fill the
    kernel's head block, strided inputs, and no out_lse."""
    from attn_ops.backends.mla.common import merge_torch
    from attn_ops.glue_kernels import merge_states_triton

    device = "cuda" if PLATFORM.is_gpu else "cpu"
    g = torch.Generator().manual_seed(3)
    t, h, d = 7, 5, 24
    lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    po = torch.randn(t, h, d, generator=g).to(dtype).to(device)
    so = torch.randn(t, 2 * h, d, generator=g).to(dtype).to(device)[:, ::2]  # strided heads
    pl = (torch.randn(t, h, generator=g) * 4).to(lse_dtype).to(device)
    sl = (torch.randn(t, h, generator=g) * 4).to(lse_dtype).to(device)
    pl[0], sl[1], sl[2, 1] = -math.inf, math.inf, -math.inf
    pl[3], sl[3] = -math.inf, -math.inf
    po[0], so[1], so[3], po[3] = 0.0, 0.0, 0.0, 0.0  # (what kernels leave in empty rows)
    for with_lse in (True, False):
        want, got = torch.empty_like(po), torch.full_like(po, math.nan)
        want_lse, got_lse = torch.empty_like(pl), torch.full_like(pl, math.nan)
        merge_torch(want, want_lse if with_lse else None, po, pl, so, sl)
        merge_states_triton(got, got_lse if with_lse else None, po, pl, so, sl)
        torch.testing.assert_close(got, want)
        if with_lse:
            torch.testing.assert_close(got_lse, want_lse)
            assert (got[3] == 0).all() and (got_lse[3] == -math.inf).all()
        else:
            assert got_lse.isnan().all()


def test_context_chunks_are_taken_across_requests_in_order():
    chunks = context_chunks(torch.tensor([10, 0, 3, 60]).numpy(), 16)
    assert len(chunks) == 5  # 73 tokens in chunks of 16, whatever their distribution
    assert chunks[0].tolist() == [[0, 10], [0, 0], [0, 3], [0, 3]]
    assert chunks[4].tolist() == [[10, 10], [0, 0], [3, 3], [51, 60]]


def test_a_negative_context_length_shifts_no_other_requests_chunks():
    """A request whose length is below its new tokens has no context: its negative length
    must not enter the running offsets of the other requests' chunks."""
    import numpy as np

    for chunk in (4096, 16):
        got = context_chunks(np.array([-45, 70, 3]), chunk)
        want = context_chunks(np.array([0, 70, 3]), chunk)
        assert [c[1:].tolist() for c in got] == [c[1:].tolist() for c in want]
        assert all((c[0] == 0).all() for c in got)


# --- the layer against a naive dense MLA ------------------------------------------------------

def test_chunk_tables_from_the_host_table_equal_the_device_gather():
    import numpy as np

    from attn_ops.backends.mla.common import chunk_tables

    table = torch.randperm(40).view(4, 10).int()
    context = np.array([3, 0, 25, 9])
    host = chunk_tables(context, 7, table, table, 4)
    device = chunk_tables(context, 7, table, None, 4)
    assert len(host[0]) == 6  # 37 rows in chunks of 7
    for a, b in zip(host[0] + host[1], device[0] + device[1]):
        assert torch.equal(a, b)
    # chunk 1 holds rows 7-13 of the concatenation: request 2's positions 4-10 (request 0's 3
    # rows and request 2's first 4 came before), so it starts at request 2's page 1, row 0
    assert host[0][1][0].item() == table[2, 1].item() * 4
    assert host[0][1][-1].item() == table[2, 2].item() * 4 + 2
    assert host[1][1].tolist() == [0, 0, 0, 7, 7]


def _weights(spec, g):
    h, nope, rank, v = spec.num_heads, spec.qk_nope_head_dim, spec.kv_lora_rank, spec.v_head_dim
    return torch.randn(h * (nope + v), rank, generator=g, dtype=torch.float64) / rank ** 0.5


def _dense(spec, w, q, c, k_pe, n_new):
    """Naive MLA of one request: every key up-projected (no absorption, no chunks), causal;
    q [n, H, nope + rope] at the last n of the c/k_pe [s, ...] positions."""
    h, nope, v = spec.num_heads, spec.qk_nope_head_dim, spec.v_head_dim
    kv = (c @ w.T).view(-1, h, nope + v)
    k = torch.cat([kv[..., :nope], k_pe[:, None].expand(-1, h, -1)], -1)
    s = c.shape[0]
    score = torch.einsum("thd,jhd->htj", q, k) * spec.softmax_scale
    p = torch.arange(s - n_new, s)[:, None]
    score = score.masked_fill(torch.arange(s)[None] > p, -math.inf)
    return torch.einsum("htj,jhd->thd", torch.softmax(score, -1), kv[..., nope:])


SCENARIOS = {  # (context, new tokens) per request, decode-first
    "decode_only": [(5, 1), (17, 1), (1, 1)],
    "prefill_only": [(0, 9), (0, 30)],
    "mixed": [(7, 1), (12, 1), (0, 6), (9, 21)],
    "long_context_chunked": [(3, 1), (70, 5), (0, 1), (41, 33)],
    "speculative": [(10, 2), (6, 4), (20, 3), (0, 3)],
}


@dataclasses.dataclass
class _Case:
    """One step of ``reqs`` ((context, new tokens) per request) with its context already in a
    NaN-poisoned latent cache whose pages are in random order; fp64 tensors (``cache``: fp64,
    or the fp8 bytes for fp8 specs) on ``device``."""

    spec: AttentionSpec
    reqs: list
    w: torch.Tensor
    cache: torch.Tensor
    kv_scale: torch.Tensor | None
    meta: object
    q: torch.Tensor
    kv_c: torch.Tensor
    k_pe: torch.Tensor
    latents: dict
    q_rows: list
    total: int


def _case(spec, reqs, *, padded=0, seed=0, device=DEVICE, num_blocks=NUM_BLOCKS) -> _Case:
    g = torch.Generator().manual_seed(seed)
    rank, rope = spec.kv_lora_rank, spec.qk_rope_head_dim
    w = _weights(spec, g)
    fp8 = spec.kv_cache_dtype.is_fp8
    kv_scale = torch.full((1,), 0.05, device=device) if fp8 else None
    cache = torch.full((num_blocks, spec.block_size, spec.latent_dim), float("nan"),
                       dtype=torch.float64, device=device).to(spec.cache_dtype if fp8 else
                                                              torch.float64)
    alloc = BlockAllocator(num_blocks, spec.block_size, shuffle=True, seed=seed)
    lat = {i: torch.randn(c + n, rank + rope, generator=g, dtype=torch.float64)
           for i, (c, n) in enumerate(reqs)}
    with_ctx = [i for i, (c, _) in enumerate(reqs) if c]
    if with_ctx:
        pre = build_batch(alloc, with_ctx, [0] * len(with_ctx), [reqs[i][0] for i in with_ctx],
                          decode_threshold=0, device=device)
        rows = torch.cat([lat[i][:reqs[i][0]] for i in with_ctx]).to(device)
        mla_cache_update(rows[:, :rank], rows[:, rank:], cache, pre.slot_mapping, kv_scale)
    total = sum(n for _, n in reqs)
    meta = build_batch(alloc, list(range(len(reqs))), [c for c, _ in reqs], [n for _, n in reqs],
                       num_tokens_padded=total + padded, device=device,
                       decode_threshold=max(1, max(n for c, n in reqs if c) if with_ctx else 1))
    q_rows = [torch.randn(n, spec.num_heads, spec.head_dim, generator=g, dtype=torch.float64)
              for _, n in reqs]
    new = torch.cat([lat[i][c:] for i, (c, _) in enumerate(reqs)])
    pad = lambda x: torch.cat([x, torch.zeros(padded, *x.shape[1:], dtype=x.dtype)]).to(device)  # noqa: E731
    return _Case(spec, reqs, w, cache, kv_scale, meta, pad(torch.cat(q_rows)),
                 pad(new[:, :rank]), pad(new[:, rank:]), lat, q_rows, total)


def _run(case: _Case, backend=None, dtype=None, tuning=None, platform=None) -> torch.Tensor:
    """The step through MLAAttention on ``backend`` (None: the selected one) in ``dtype``
    (default the spec's); every row, padding included."""
    spec = case.spec if dtype is None else case.spec.with_(dtype=dtype)
    layer = MLAAttention(spec, AttentionConfig(tuning=tuning, backend=backend),
                         platform=platform).to(case.q.device)
    assert backend is None or layer.impl.name == backend
    layer.load_kv_b_proj(case.w.to(spec.dtype))
    if case.kv_scale is not None:
        layer.kv_scale.copy_(case.kv_scale)
    cache = case.cache.clone() if spec.kv_cache_dtype.is_fp8 else case.cache.to(spec.dtype)
    return layer(case.q.to(spec.dtype), case.kv_c.to(spec.dtype), case.k_pe.to(spec.dtype),
                 cache, case.meta)


def _run_scenario(spec, reqs, *, tuning=None, padded=0, seed=0, backend=None):
    """Run one step through MLAAttention; returns (ours, the naive dense MLA) over the real
    rows (padding rows checked zero)."""
    case = _case(spec, reqs, padded=padded, seed=seed)
    out = _run(case, backend, tuning=tuning)
    rank, total = spec.kv_lora_rank, case.total
    want = []
    limit = (tuning or Tuning()).mla.absorbed_max_query_len
    absorbed = True
    for i, (c, n) in enumerate(reqs):
        stored = case.latents[i]
        absorbed = absorbed and n <= limit
        if spec.kv_cache_dtype.is_fp8:  # what the fp8 cache holds: the absorbed form reads
            # every token from it, the MHA form its context (new tokens as given)
            s32 = case.kv_scale.double().cpu()  # (the float32 scale, as the op sees it)
            q8 = (stored.float() / case.kv_scale.cpu()).clamp(-448, 448).to(spec.cache_dtype) \
                .double() * s32
            stored = q8 if absorbed else torch.cat([q8[:c], stored[c:]])
        want.append(_dense(spec, case.w, case.q_rows[i], stored[:, :rank], stored[:, rank:], n))
    assert (out[total:] == 0).all()
    return out[:total], torch.cat(want)


def _close(ours, want, dtype):
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(ours.double().cpu(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("backend", MLA_HERE)
@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("chunk", [8192, 7], ids=["one_chunk", "chunks_of_7"])
def test_layer_matches_dense_mla(backend, scenario, chunk):
    spec = MLA_HERE[backend]
    tuning = Tuning().with_(mla={"context_chunk_tokens": chunk, "absorbed_max_query_len": 4,
                                 **SPLITTING})
    ours, want = _run_scenario(spec, SCENARIOS[scenario], tuning=tuning, padded=3,
                               backend=backend)
    _close(ours, want, spec.dtype)


@pytest.mark.parametrize("backend", MLA_HERE)
@pytest.mark.parametrize("absorbed_max", [0, 64], ids=["all_mha", "all_absorbed"])
def test_both_forms_agree_on_any_split(backend, absorbed_max):
    spec = MLA_HERE[backend]
    tuning = Tuning().with_(mla={"absorbed_max_query_len": absorbed_max,
                                 "context_chunk_tokens": 16, **SPLITTING})
    ours, want = _run_scenario(spec, SCENARIOS["mixed"], tuning=tuning, backend=backend)
    _close(ours, want, spec.dtype)


@pytest.mark.parametrize("backend", MLA_HERE)
def test_fp8_latent_cache_keeps_the_output_close(backend):
    spec = MLA_HERE[backend].with_(kv_cache_dtype=KVCacheDType.FP8_E4M3)
    ours, want = _run_scenario(spec, SCENARIOS["long_context_chunked"], backend=backend,
                               tuning=Tuning().with_(mla={"context_chunk_tokens": 16,
                                                          **SPLITTING}))
    _close(ours, want, spec.dtype)  # (the same fp8 rounding in both)


def test_bad_inputs_name_the_shape():
    layer = MLAAttention(SPEC, platform=CPU)
    with pytest.raises(ValueError, match=r"q must be \[3, 4, 24\]"):
        layer(torch.zeros(3, 4, 20), torch.zeros(3, 32), torch.zeros(3, 8), None, None)
    with pytest.raises(ValueError, match=r"kv_b_proj.weight must be .* \[112, 32\]"):
        layer.load_kv_b_proj(torch.zeros(100, 32))
    with pytest.raises(ValueError, match="needs an MLA spec"):
        MLAAttention(AttentionSpec(num_heads=4, head_dim=16))


@pytest.mark.parametrize("backend", MLA_HERE)
def test_inputs_of_another_dtype_page_or_token_count_are_refused_naming_them(backend):
    """What the layer is handed is checked against its spec, its cache and the step's
    metadata before any op runs: a ValueError names the argument, the expected and the
    actual value (never a torch error from inside an op, never a wrong answer)."""
    import dataclasses

    spec = MLA_HERE[backend]
    case = _case(spec, SCENARIOS["mixed"])
    layer = MLAAttention(spec, AttentionConfig(backend=backend)).to(DEVICE)
    cache = case.cache.to(spec.dtype)
    other = torch.float32 if spec.dtype == torch.float64 else torch.float64
    args = tuple(x.to(spec.dtype) for x in (case.q, case.kv_c, case.k_pe))
    with pytest.raises(ValueError, match=rf"q.dtype={other}, expected {spec.dtype}"):
        layer(case.q.to(other), *args[1:], cache, case.meta)
    with pytest.raises(ValueError, match=rf"cache.dtype={other}, expected {spec.dtype}"):
        layer(*args, cache.to(other), case.meta)
    with pytest.raises(ValueError, match=r"the metadata was built for pages of block_size=8 "
                       r"tokens but the cache has pages of 4"):
        layer(*args, cache, dataclasses.replace(case.meta, block_size=8))
    t = case.q.shape[0]
    with pytest.raises(ValueError, match=rf"the inputs have {t - 1} tokens but the metadata "
                       rf"was built for {t}"):
        layer(*(x[1:] for x in args), cache, case.meta)
    with pytest.raises(ValueError, match=r"cache must be \[num_blocks, block_size, "
                       r"kv_lora_rank \+ qk_rope_head_dim = 40\]"):
        layer(*args, cache[..., :32], case.meta)


@pytest.mark.parametrize("backend", MLA_HERE)
def test_a_zero_length_request_is_refused_in_the_mha_form_and_isolated_in_the_absorbed(
        backend):
    """seq_lens[r] = 0 (host and device copies) for a request with new tokens. In the MHA form
    its cached context would be negative, and the context chunks run across requests: it would
    move (or drop) the keys of the requests after it -- refused, naming seq_lens, as is a
    length past the block table (which has no slots for it). In the absorbed form the kernels
    read the length on the device: the request sees no key (its rows 0) and every other
    request's output is bit-identical to the clean step's."""
    spec = MLA_HERE[backend]
    tuning = Tuning().with_(mla={"context_chunk_tokens": 7, "absorbed_max_query_len": 4,
                                 **SPLITTING})
    # absorbed: request 0 (3 + 1); MHA: requests 1 (70 + 5) and 2 (41 + 33)
    case = _case(spec, [(3, 1), (70, 5), (41, 33)], padded=2)
    clean = _run(case, backend, tuning=tuning)
    qsl = case.meta.query_start_loc_cpu.tolist()
    width = case.meta.block_table.shape[1] * spec.block_size

    def with_length(r, v):
        lens, lens_cpu = case.meta.seq_lens.clone(), case.meta.seq_lens_cpu.clone()
        lens[r] = lens_cpu[r] = v
        meta = dataclasses.replace(case.meta, seq_lens=lens, seq_lens_cpu=lens_cpu,
                                   block_indptr_cpu=None, block_indices_cpu=None,
                                   device_tables=None)
        return _run(dataclasses.replace(case, meta=meta), backend, tuning=tuning)

    for r, v, match in ((1, 0, r"seq_lens\[1\]=0 is shorter than the request's query length 5"),
                        (1, width + 6, rf"seq_lens\[1\]={width + 6} needs"),
                        (2, 0, r"seq_lens\[2\]=0 is shorter")):
        with pytest.raises(ValueError, match=match):
            with_length(r, v)
    out = with_length(0, 0)
    assert (out[qsl[0]:qsl[1]] == 0).all()
    assert torch.equal(out[qsl[1]:], clean[qsl[1]:])


def test_the_host_query_start_loc_is_checked_where_the_mla_step_is_planned():
    """The builder plans the step from the host copy of query_start_loc: a copy that
    decreases or runs past the rows is refused naming it, before any op runs."""
    reqs = SCENARIOS["mixed"]
    layer = MLAAttention(SPEC, AttentionConfig(backend="REFERENCE_MLA"), platform=CPU)
    common = build_batch(BlockAllocator(NUM_BLOCKS, 4), list(range(len(reqs))),
                         [c for c, _ in reqs], [n for _, n in reqs])
    good = common.query_start_loc_cpu
    for bad, match in (([0, 1, 9, 8, 29], r"query_start_loc\[3\]=8 is below"),
                       ([0, 1, 2, 8, 30], r"query_start_loc\[4\]=30 is past num_tokens=29")):
        corrupt = dataclasses.replace(common, query_start_loc_cpu=torch.tensor(
            bad, dtype=good.dtype))
        with pytest.raises(ValueError, match=match):
            layer.impl.build_metadata(corrupt)


@pytest.mark.parametrize("backend", MLA_HERE)
def test_mla_layers_of_different_specs_in_one_step_each_get_their_own_plan(backend):
    """Two MLA layers of one model with different heads and latent ranks, one step's
    metadata built once for both: each gets a plan of its own (its metadata key holds what
    a plan is sized to) and each matches its dense MLA."""
    base = MLA_HERE[backend]
    specs = [base, base.with_(num_heads=8, kv_lora_rank=64)]
    specs = [s for s in specs if not get_backend_class(backend).not_supported_reasons(
        s, PLATFORM)]
    if len(specs) < 2:
        pytest.skip(f"{backend} runs one of the two specs here")
    tuning = Tuning().with_(mla={"absorbed_max_query_len": 4, **SPLITTING})
    reqs = SCENARIOS["mixed"]
    cases = [_case(s, reqs, seed=3) for s in specs]
    assert torch.equal(cases[0].meta.block_table, cases[1].meta.block_table)
    layers = []
    for s, c in zip(specs, cases):
        layer = MLAAttention(s, AttentionConfig(backend=backend, tuning=tuning)).to(DEVICE)
        layer.load_kv_b_proj(c.w.to(s.dtype))
        layers.append(layer)
    assert layers[0]._metadata_key != layers[1]._metadata_key
    step = build_step_metadata(torch.nn.ModuleList(layers), cases[0].meta)
    assert len(step) == 2
    for s, c, layer in zip(specs, cases, layers):
        out = layer(c.q.to(s.dtype), c.kv_c.to(s.dtype), c.k_pe.to(s.dtype), c.cache.to(s.dtype),
                    step)
        want = torch.cat([_dense(s, c.w, c.q_rows[i], c.latents[i][:, :s.kv_lora_rank],
                                 c.latents[i][:, s.kv_lora_rank:], n)
                          for i, (_, n) in enumerate(reqs)])
        _close(out[:c.total], want, s.dtype)


def _op_args(backend, reqs=SCENARIOS["mixed"]):
    spec = MLA_HERE[backend]
    g = torch.Generator().manual_seed(3)
    layer = MLAAttention(spec, AttentionConfig(backend=backend, tuning=Tuning().with_(
        mla={"context_chunk_tokens": 5, "absorbed_max_query_len": 1, **SPLITTING}))).to(DEVICE)
    layer.load_kv_b_proj(_weights(spec, g).to(spec.dtype))
    alloc = BlockAllocator(NUM_BLOCKS, 4, shuffle=True)
    meta = layer.impl.build_metadata(build_batch(alloc, list(range(len(reqs))),
                                                 [c for c, _ in reqs], [n for _, n in reqs],
                                                 device=DEVICE))
    t = sum(n for _, n in reqs)
    rand = lambda *shape: torch.randn(*shape, generator=g, dtype=spec.dtype).to(DEVICE)  # noqa: E731
    cache = rand(NUM_BLOCKS, 4, spec.latent_dim)
    return layer, meta, (rand(t, 4, 24), rand(t, 32), rand(t, 8), cache, layer.w_uk,
                         layer.w_uv, meta.query_start_loc, meta.seq_lens, meta.block_table,
                         meta.plan, meta.mha_lens_cpu, list(meta.chunk_slots),
                         list(meta.chunk_cu_k), torch.empty(t, 4, 12, dtype=spec.dtype,
                                                            device=DEVICE),
                         None, spec.softmax_scale)


@pytest.mark.parametrize("backend", MLA_HERE)
def test_mla_op_passes_opcheck(backend):
    layer, _, args = _op_args(backend)
    torch.library.opcheck(layer.impl.op, args)


def _step(layer, reqs=SCENARIOS["mixed"]):
    """(common metadata, the step dict of ``layer``) of the ``_op_args`` batch."""
    alloc = BlockAllocator(NUM_BLOCKS, 4, shuffle=True)
    common = build_batch(alloc, list(range(len(reqs))), [c for c, _ in reqs],
                         [n for _, n in reqs], device=DEVICE)
    return common, build_step_metadata([(layer._metadata_key, layer.impl)], common)


@pytest.mark.parametrize("backend", MLA_HERE)
def test_compiled_layer_equals_eager_with_no_graph_break(backend):
    layer, _, args = _op_args(backend)
    q, kv_c, k_pe, cache = args[:4]
    _, step = _step(layer)
    eager = layer(q, kv_c, k_pe, cache.clone(), step)
    torch._dynamo.reset()
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(layer, fullgraph=True, backend=capture)
    torch.testing.assert_close(compiled(q, kv_c, k_pe, cache.clone(), step), eager)
    ops = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"
           and str(n.target).startswith("attn.")]
    assert ops == ["attn.mla_cache_update.default", str(layer.impl.op)]


def test_triton_mla_launch_splits_short_batches_and_shrinks_the_split_as_the_batch_grows():
    """No small-batch cliff: one request at 32k keys takes many splits; the split count never
    rises with the batch; every launch covers its longest query with >= 16 MMA rows."""
    from attn_ops.routing import mla_decode_launch

    t = Tuning().mla
    for heads in (16, 128):
        launches = [mla_decode_launch(heads, b, 1, 32768, 132, t) for b in (1, 2, 8, 32, 64, 256)]
        splits = [launch.splits for launch in launches]
        assert splits[0] >= 8 and splits == sorted(splits, reverse=True), splits
        assert all(launch.query_rows * launch.heads >= 16 for launch in launches)
    spec_decode = mla_decode_launch(128, 4, 3, 4096, 132, t)
    assert spec_decode.query_rows == 4 and spec_decode.query_rows * spec_decode.heads <= 64
    assert mla_decode_launch(16, 64, 1, 300, 132, t).splits == 1  # short contexts: no split
    # 16-head programs take the narrow warps / stages; the stages, then the keys, shrink to fit
    # shared memory (bf16 rows of 512 + 64: 1152 bytes; fp8 ones converted to bf16)
    narrow = dataclasses.replace(t, narrow_warps=4, narrow_stages=3, decode_keys=64)
    fit = {smem: mla_decode_launch(16, 8, 1, 4096, 132, narrow, 1152, 0, smem)
           for smem in (227 << 10, 163 << 10, 99 << 10, 40 << 10)}
    assert [(la.warps, la.stages, la.keys) for la in fit.values()] == \
        [(4, 3, 64), (4, 2, 64), (4, 1, 64), (4, 1, 32)]
    assert mla_decode_launch(16, 8, 1, 4096, 132, narrow, 576, 1152, 227 << 10).stages == 3
    assert mla_decode_launch(16, 8, 1, 4096, 132, narrow, 576, 1152, 163 << 10).stages == 2
    wide = mla_decode_launch(128, 8, 1, 4096, 132, t)
    assert (wide.warps, wide.stages) == (t.decode_warps, t.decode_stages)
    # two value parts double the programs a split count is judged by; tiles under 32 wide
    # cannot be halved for the MMA
    halves = dataclasses.replace(t, value_parts=2)
    assert mla_decode_launch(128, 2, 1, 32768, 132, halves, rank_p=512).value_parts == 2
    assert mla_decode_launch(128, 2, 1, 32768, 132, halves, rank_p=512).splits * 2 == \
        mla_decode_launch(128, 2, 1, 32768, 132, t, rank_p=512).splits
    assert mla_decode_launch(4, 2, 1, 64, 132, halves, rank_p=16).value_parts == 1
    with pytest.raises(ValueError, match="value_parts=3 must be 1 or 2"):
        mla_decode_launch(4, 2, 1, 64, 132, dataclasses.replace(t, value_parts=3))


def test_the_mha_part_runs_flashinfer_for_few_requests_fa4_for_many_and_torch_on_the_cpu():
    from attn_ops.backends.mla.prefill import mha_kernel
    from attn_ops.backends.mla.reference import mha_torch
    from attn_ops.routing import Kernel, mla_prefill_kernel

    assert mla_prefill_kernel(True, True, 4, 4) is Kernel.FLASHINFER_RAGGED
    assert mla_prefill_kernel(True, True, 5, 4) is Kernel.FA4
    assert mla_prefill_kernel(True, False, 1, 4) is Kernel.FA4
    assert mla_prefill_kernel(False, True, 64, 4) is Kernel.FLASHINFER_RAGGED
    assert mla_prefill_kernel(False, False, 1, 4) is Kernel.TORCH_MHA
    assert mha_kernel(torch.device("cpu"), 192, 128, 1, 4) is mha_torch


# --- FLASHINFER_MLA's glue against a stand-in of FlashInfer's MLA wrapper ---------------------

class StandinMLAWrapper:
    """``flashinfer.mla.BatchMLAPagedAttentionWrapper`` in torch with its contract (FlashInfer
    0.7.2's ``_stage_metadata``): host int32 plan arrays; ``kv_indices`` read when ``run``
    runs -- kept by reference eagerly, copied at plan into the persistent buffers it was
    given in graph mode (the other arrays too); ``run`` reads the pages of the (strided)
    ``ckv`` / ``kpe`` caches by them, causal bottom-right; a row of a request without keys
    gets NaN (the backend must zero padding). Also the sparse glue's stand-in
    (tests/test_mla_sparse.py)."""

    def __init__(self, float_workspace, use_cuda_graph=False, qo_indptr=None, kv_indptr=None,
                 kv_indices=None, kv_len_arr=None, backend="auto"):
        assert backend in ("fa2", "fa3") and float_workspace.numel() >= 64 << 20
        self.graph = use_cuda_graph
        self.buffers = (qo_indptr, kv_indptr, kv_indices, kv_len_arr)
        assert not use_cuda_graph or all(b is not None for b in self.buffers)

    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv,
             head_dim_kpe, page_size, causal, sm_scale, q_data_type, kv_data_type):
        arrays = (qo_indptr, kv_indptr, kv_indices, kv_len_arr)
        assert all(a.dtype == torch.int32 and a.device.type == "cpu" for a in arrays)
        self.indices = kv_indices
        if self.graph:  # (same shapes as the buffers, indices within capacity)
            for buf, a in zip(self.buffers, arrays):
                assert a.shape == buf.shape or (buf is self.buffers[2] and a.numel() <= buf.numel())
                buf[:a.numel()].copy_(a.clone())  # (the glue may pass a view of the buffer)
            self.indices = self.buffers[2]
        self.lists = [a.tolist() for a in (qo_indptr, kv_indptr, kv_len_arr)]
        self.args = (num_heads, head_dim_ckv, head_dim_kpe, page_size, causal, sm_scale)

    def run(self, q_nope, q_pe, ckv_cache, kpe_cache, out=None):
        qo, kv_indptr, kv_len = self.lists
        heads, ckv, kpe, page, causal, scale = self.args
        assert q_nope.shape[1:] == (heads, ckv) and q_pe.shape[2] == kpe and out is not None
        assert ckv_cache.shape[1] == kpe_cache.shape[1] == page
        for r in range(len(kv_len)):
            q0, q1, s = qo[r], qo[r + 1], kv_len[r]
            if q1 == q0:
                continue
            if s == 0:
                out[q0:q1] = float("nan")
                continue
            pages = self.indices[kv_indptr[r]:kv_indptr[r + 1]].long()
            c = ckv_cache[pages].flatten(0, 1)[:s].double()
            pe = kpe_cache[pages].flatten(0, 1)[:s].double()
            score = (torch.einsum("thl,jl->htj", q_nope[q0:q1].double(), c)
                     + torch.einsum("thr,jr->htj", q_pe[q0:q1].double(), pe)) * scale
            if causal:
                pos = torch.arange(s - (q1 - q0), s, device=out.device)[:, None]
                score = score.masked_fill(torch.arange(s, device=out.device)[None] > pos,
                                          float("-inf"))
            out[q0:q1] = torch.einsum("htj,jl->thl", torch.softmax(score, -1), c).to(out.dtype)


def simulated_h200(monkeypatch, wrapper) -> Platform:
    """``wrapper`` as FlashInfer's MLA wrapper class, found where the backends import it
    (``flashinfer.mla``, in sys.modules: no backend global patched), and an H200-like platform
    (sm90, the packages assumed present) for the layer."""
    mla = types.ModuleType("flashinfer.mla")
    mla.BatchMLAPagedAttentionWrapper = wrapper
    monkeypatch.setitem(sys.modules, "flashinfer.mla", mla)
    return dataclasses.replace(Platform.parse("cuda:9.0"), assume_packages=True)


@pytest.fixture
def standin_flashinfer_mla(monkeypatch):
    return simulated_h200(monkeypatch, StandinMLAWrapper)


FI_SPEC = AttentionSpec.mla(4, kv_lora_rank=128, qk_nope_head_dim=16, qk_rope_head_dim=64,
                            v_head_dim=12, dtype=torch.float16, block_size=4)


@pytest.mark.parametrize("scenario", ["decode_only", "speculative", "mixed",
                                      "long_context_chunked"])
def test_flashinfer_mla_plans_on_the_host_and_runs_what_reference_mla_does(
        standin_flashinfer_mla, scenario):
    """Our side of FlashInfer's MLA (plan arrays from the step's block CSR, the strided latent
    views, causal only with multi-token rows, the MHA part) against REFERENCE_MLA."""
    tuning = Tuning().with_(mla={"absorbed_max_query_len": 4, "context_chunk_tokens": 16})
    from attn_ops.testing import tolerance

    case = _case(FI_SPEC, SCENARIOS[scenario], padded=3)
    ours = _run(case, "FLASHINFER_MLA", tuning=tuning, platform=standin_flashinfer_mla)
    truth = _run(case, "REFERENCE_MLA", torch.float64, tuning=tuning)
    base = _run(case, "REFERENCE_MLA", torch.float16, tuning=tuning).double()
    err = (ours.double() - truth).abs().max().item()
    assert err <= tolerance((base - truth).abs().max().item(), torch.float16), err


def _graphed_decodes(spec, backend, platform, monkeypatch, num_blocks, max_blocks, batches):
    """Decode batches of ``(n, contexts)`` through ``backend``'s CUDA-graph metadata run eagerly
    on ``platform`` (capture sizes 2 and 8), each checked against REFERENCE_MLA on its real rows
    and for zero padding rows; yields ``(n, capture size, the step's metadata, the layer's
    key)`` after each."""
    from attn_ops import platforms
    from attn_ops.cudagraph import CUDAGraphBatch

    # (graph support is judged on the running platform: the simulated H200's here)
    monkeypatch.setattr(platforms, "current_platform", lambda: platform)
    graphs = CUDAGraphBatch((2, 8), max_blocks, spec.block_size, "cpu")
    layer = MLAAttention(spec, AttentionConfig(backend=backend), platform=platform)
    oracle = MLAAttention(spec, AttentionConfig(backend="REFERENCE_MLA"))
    w = _weights(spec, torch.Generator().manual_seed(0)).half()
    layer.load_kv_b_proj(w)
    oracle.load_kv_b_proj(w)
    g = torch.Generator().manual_seed(4)
    cache = torch.randn(num_blocks, spec.block_size, spec.latent_dim, generator=g).half()
    alloc = BlockAllocator(num_blocks, spec.block_size, shuffle=True, seed=3)
    for n, ctx in batches:
        common = build_batch(alloc, list(range(10 * n, 11 * n)), ctx, [1] * n)
        step = build_step_metadata(layer, common, graphs)
        size = graphs.size_for(n)
        q = torch.randn(size, spec.num_heads, spec.head_dim, generator=g).half()
        kv_c = torch.randn(size, spec.kv_lora_rank, generator=g).half()
        k_pe = torch.randn(size, spec.qk_rope_head_dim, generator=g).half()
        got = layer(q, kv_c, k_pe, cache.clone(), step)
        want = oracle(q[:n], kv_c[:n], k_pe[:n], cache.clone(), common)
        torch.testing.assert_close(got[:n], want, atol=2e-3, rtol=2e-3)
        assert (got[n:] == 0).all()
        yield n, size, step, layer._metadata_key
        for r in range(n):
            alloc.free(10 * n + r)


def test_flashinfer_mla_graph_plans_cover_the_capture_size_and_zero_its_padding(
        standin_flashinfer_mla, monkeypatch):
    """The graph path's metadata, run eagerly: a wrapper per capture size over persistent
    buffers, replanned per batch with every request of the size holding its rows (padding:
    no keys, NaN from the kernel), the padding rows zeroed after it."""
    handles = {PLAN.decode(step[key].plan).library for _, _, step, key in _graphed_decodes(
        FI_SPEC, "FLASHINFER_MLA", standin_flashinfer_mla, monkeypatch, 60, 6,
        ((5, [3, 9, 1, 20, 7]), (2, [4, 11]), (7, [2] * 7)))}
    assert len(handles) == 2  # one wrapper per capture size


# --- FLASHMLA's glue against a stand-in of FlashMLA's interface -----------------------------

def standin_flashmla(current: bool) -> types.ModuleType:
    """FlashMLA's dense decode in torch with its contract (``flash_mla_interface``): q
    ``[batch, queries, heads, 576]``, the cache ``[blocks, 64, 1, 576]``, int32 block table
    and lengths, ``head_dim_v`` 512, causal bottom-right; ``current``: the interface whose
    ``get_mla_metadata()`` returns an empty ``FlashMLASchedMeta`` that the first call fills
    (one object per call here), else the older one whose ``get_mla_metadata(cache_seqlens,
    queries x heads, 1)`` returns the metadata tensors. A row without keys gets NaN."""
    mod = types.ModuleType("flash_mla")
    calls = mod.calls = []
    schedules = mod.schedules = []  # the lengths each computed schedule was made from

    @dataclasses.dataclass
    class FlashMLASchedMeta:
        lens: list | None = None

    if current:
        mod.FlashMLASchedMeta = FlashMLASchedMeta
        mod.get_mla_metadata = lambda *a, **k: (FlashMLASchedMeta(), None)
    else:
        def get_mla_metadata(cache_seqlens, num_q_tokens_per_head_k, num_heads_k):
            assert cache_seqlens.dtype == torch.int32 and num_heads_k == 1
            schedules.append(cache_seqlens.tolist())
            return FlashMLASchedMeta(cache_seqlens.tolist()), torch.zeros(
                cache_seqlens.shape[0] + 1, dtype=torch.int32)
        mod.get_mla_metadata = get_mla_metadata

    def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v,
                               tile_scheduler_metadata, num_splits=None, softmax_scale=None,
                               causal=False, is_fp8_kvcache=False, indices=None, out=None):
        b, s_q, heads, d = q.shape
        assert k_cache.shape[1:] == (64, 1, d) and d == 576 and head_dim_v == 512
        assert q.dtype == k_cache.dtype and block_table.dtype == cache_seqlens.dtype == torch.int32
        assert block_table.shape[0] == cache_seqlens.shape[0] == b
        assert isinstance(tile_scheduler_metadata, FlashMLASchedMeta)
        if current:
            assert num_splits is None
            if tile_scheduler_metadata.lens is None:  # (computed by its first call)
                tile_scheduler_metadata.lens = cache_seqlens.tolist()
                schedules.append(tile_scheduler_metadata.lens)
        else:
            assert num_splits.shape == (b + 1,)
        # a schedule is valid for the lengths it was computed from only
        assert tile_scheduler_metadata.lens == cache_seqlens.tolist()
        calls.append((b, s_q, causal))
        o = torch.full((b, s_q, heads, head_dim_v), float("nan"), dtype=q.dtype, device=q.device)
        for r in range(b):
            n = int(cache_seqlens[r])
            if n == 0:
                continue
            pages = block_table[r, :-(-n // 64)].long()
            kv = k_cache[pages, :, 0].flatten(0, 1)[:n].double()
            score = torch.einsum("qhd,jd->hqj", q[r].double(), kv) * softmax_scale
            if causal:
                pos = torch.arange(n - s_q, n, device=q.device)[:, None]
                score = score.masked_fill(torch.arange(n, device=q.device)[None] > pos,
                                          float("-inf"))
            o[r] = torch.einsum("hqj,jd->qhd", torch.softmax(score, -1),
                                kv[:, :head_dim_v]).to(q.dtype)
        if out is not None:
            assert out.shape == o.shape and out.dtype == o.dtype and out.is_contiguous()
            o = out.copy_(o)
        return o, torch.zeros(b, heads, s_q)

    mod.flash_mla_with_kvcache = flash_mla_with_kvcache
    return mod


FM_SPEC = AttentionSpec.mla(4, kv_lora_rank=512, qk_nope_head_dim=16, qk_rope_head_dim=64,
                            v_head_dim=12, dtype=torch.float16, block_size=64)


@pytest.fixture(params=[True, False], ids=["sched_meta", "metadata_tensors"])
def flashmla_h200(request, monkeypatch):
    """The stand-in as DeepSeek's ``flash_mla`` (the first FlashMLA provider), found and
    imported through the provider lookup, on an H200-like platform."""
    mod = standin_flashmla(request.param)
    monkeypatch.setitem(sys.modules, "flash_mla", mod)
    return dataclasses.replace(Platform.parse("cuda:9.0"), assume_packages=True), mod


FM_STEPS = pytest.mark.parametrize("reqs", [
    [(70, 1), (130, 1), (5, 1)],  # decodes: one query each
    [(130, 1), (64, 1), (70, 3), (5, 2), (0, 4)],  # speculative decodes, a short prefill
    [(40, 1), (3, 2), (0, 9), (100, 12)],  # with an MHA part
], ids=["decodes", "mixed_lengths", "with_mha"])


def _matches_reference_at_fm_widths(backend: str, platform: Platform, reqs,
                                    **mla_tuning) -> None:
    """``reqs`` (absorbed up to 4 new tokens) through ``backend`` at FlashMLA's widths within
    fp16's tolerance of fp64 REFERENCE_MLA, padding rows zero."""
    from attn_ops.testing import tolerance

    tuning = Tuning().with_(mla={"absorbed_max_query_len": 4, "context_chunk_tokens": 64,
                                 **mla_tuning})
    case = _case(FM_SPEC, reqs, padded=3, num_blocks=16)
    ours = _run(case, backend, tuning=tuning, platform=platform)
    truth = _run(case, "REFERENCE_MLA", torch.float64, tuning=tuning)
    base = _run(case, "REFERENCE_MLA", torch.float16, tuning=tuning).double()
    err = (ours.double() - truth).abs().max().item()
    assert err <= tolerance((base - truth).abs().max().item(), torch.float16), err
    assert (ours[case.total:] == 0).all()


@FM_STEPS
def test_flashmla_runs_what_reference_mla_does(flashmla_h200, reqs):
    """Our side of FlashMLA (the latent cache as its one-head k_cache, queries laid out
    right-aligned in [batch, longest query] where lengths differ, causal only with several,
    its scheduler metadata a step, padding rows zero) against REFERENCE_MLA."""
    platform, mod = flashmla_h200
    _matches_reference_at_fm_widths("FLASHMLA", platform, reqs)
    absorbed = [n for _, n in reqs if n <= 4]
    assert mod.calls == [(len(absorbed), max(absorbed), max(absorbed) > 1)]


def test_flashmla_graph_metadata_runs_any_batch_of_its_size_and_zeroes_padding(
        flashmla_h200, monkeypatch):
    """The graph path's metadata run eagerly: a plan fixed per capture size (every request a
    decode, padding requests without keys, NaN from the kernel), the padding rows zeroed."""
    platform, mod = flashmla_h200
    batches = ((5, [3, 90, 1, 200, 7]), (2, [64, 11]), (4, [9, 130, 2, 77]))
    for i, (_, size, _, _) in enumerate(_graphed_decodes(FM_SPEC, "FLASHMLA", platform,
                                                         monkeypatch, 24, 4, batches)):
        assert mod.calls[-1] == (size, 1, False)
        assert len(mod.schedules) == i + 1  # (a step on a capture size: its own schedule)


def test_flashmla_computes_a_steps_schedule_once_for_all_its_layers(flashmla_h200):
    """FlashMLA's tile schedule depends on the step's lengths only: the step's first layer
    computes it, the later layers reuse it, the next step computes its own."""
    platform, mod = flashmla_h200
    layer = MLAAttention(FM_SPEC, AttentionConfig(backend="FLASHMLA"), platform=platform)
    layer.load_kv_b_proj(_weights(FM_SPEC, torch.Generator().manual_seed(0)).half())
    g = torch.Generator().manual_seed(5)
    cache = torch.randn(12, 64, 576, generator=g).half()
    alloc = BlockAllocator(12, 64, shuffle=True)
    for step, ctx in enumerate(([70, 5, 130], [71, 6, 131])):
        common = build_batch(alloc, [0, 1, 2], ctx, [1, 1, 1])
        meta = build_step_metadata(layer, common)
        args = [torch.randn(3, *shape, generator=g).half()
                for shape in ((4, FM_SPEC.head_dim), (512,), (64,))]
        first, second = layer(*args, cache, meta), layer(*args, cache, meta)
        assert torch.equal(first, second)
        assert mod.schedules == [[71, 6, 131], [72, 7, 132]][:step + 1]  # (context + 1)
        for r in range(3):
            alloc.free(r)


def _opcheck_fm_spec(backend: str, platform: Platform) -> None:
    """opcheck of ``backend``'s op on a step of decodes, a speculative decode and an MHA-form
    prefill at FlashMLA's widths."""
    g = torch.Generator().manual_seed(3)
    layer = MLAAttention(FM_SPEC, AttentionConfig(backend=backend, tuning=Tuning().with_(
        mla={"absorbed_max_query_len": 4, "context_chunk_tokens": 64})), platform=platform)
    layer.load_kv_b_proj(_weights(FM_SPEC, g).half())
    reqs = [(70, 1), (5, 3), (40, 9)]
    meta = layer.impl.build_metadata(build_batch(BlockAllocator(8, 64, shuffle=True), [0, 1, 2],
                                                 [c for c, _ in reqs], [n for _, n in reqs]))
    t = sum(n for _, n in reqs)
    rand = lambda *shape: torch.randn(*shape, generator=g).half()  # noqa: E731
    torch.library.opcheck(layer.impl.op, (
        rand(t, 4, FM_SPEC.head_dim), rand(t, 512), rand(t, 64), rand(8, 64, 576), layer.w_uk,
        layer.w_uv, meta.query_start_loc, meta.seq_lens, meta.block_table, meta.plan,
        meta.mha_lens_cpu, list(meta.chunk_slots), list(meta.chunk_cu_k),
        torch.empty(t, 4, 12, dtype=torch.float16), None, FM_SPEC.softmax_scale))


def test_flashmla_op_passes_opcheck(flashmla_h200):
    _opcheck_fm_spec("FLASHMLA", flashmla_h200[0])


def standin_fa3_mla(vllm: bool) -> types.ModuleType:
    """FA3's MLA path in torch with its contract: ``q`` the rope part against ``k`` (the
    cache's rope columns), ``q_v`` the latent part against ``v`` (its latent columns), one KV
    head, varlen rows, keys counted by the lengths through an int32 block table, causal
    bottom-right; ``vllm``: vLLM's ``flash_attn_varlen_func(..., q_v=, fa_version=3)``, else
    the hopper build's ``flash_attn_with_kvcache(..., qv=)``."""
    mod = types.ModuleType("vllm.vllm_flash_attn" if vllm else "flash_attn_interface")
    calls = mod.calls = []

    def run(q, k, v, qv, qsl, lens, table, scale, causal, max_q):
        assert causal and k.shape[2] == v.shape[2] == 1 and k.shape[:2] == v.shape[:2]
        assert q.shape[2] == k.shape[3] == 64 and qv.shape[2] == v.shape[3] == 512
        assert qsl.dtype == lens.dtype == table.dtype == torch.int32
        starts = qsl.tolist()
        assert max_q >= max(b - a for a, b in zip(starts, starts[1:]))
        calls.append(len(starts) - 1)
        page = k.shape[1]
        o = torch.full((q.shape[0], q.shape[1], 512), float("nan"), dtype=q.dtype,
                       device=q.device)
        for r, n in enumerate(lens.tolist()):
            q0, q1 = starts[r], starts[r + 1]
            if n == 0 or q1 == q0:
                continue
            pages = table[r, :-(-n // page)].long()
            kr = k[pages, :, 0].flatten(0, 1)[:n].double()
            vr = v[pages, :, 0].flatten(0, 1)[:n].double()
            score = (torch.einsum("thd,jd->htj", q[q0:q1].double(), kr)
                     + torch.einsum("thd,jd->htj", qv[q0:q1].double(), vr)) * scale
            pos = torch.arange(n - (q1 - q0), n, device=q.device)[:, None]
            score = score.masked_fill(torch.arange(n, device=q.device)[None] > pos,
                                      float("-inf"))
            o[q0:q1] = torch.einsum("htj,jd->thd", torch.softmax(score, -1), vr).to(q.dtype)
        return o

    if vllm:
        def flash_attn_varlen_func(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k,
                                   cu_seqlens_k=None, seqused_k=None, q_v=None,
                                   softmax_scale=None, causal=False, block_table=None,
                                   fa_version=2, out=None, **unused):
            assert fa_version == 3 and cu_seqlens_k is None and not unused
            assert max_seqlen_k >= int(seqused_k.max())
            o = run(q, k, v, q_v, cu_seqlens_q, seqused_k, block_table, softmax_scale, causal,
                    max_seqlen_q)
            if out is None:
                return o
            rows = o[:, 0, 0].isfinite()  # (the rows of a request; the kernel writes no other)
            out[rows] = o[rows]
            return out
        mod.flash_attn_varlen_func, mod.FA3_AVAILABLE = flash_attn_varlen_func, True
    else:
        def flash_attn_with_kvcache(q, k_cache, v_cache, qv=None, cache_seqlens=None,
                                    page_table=None, cu_seqlens_q=None, max_seqlen_q=None,
                                    softmax_scale=None, causal=False):
            return run(q, k_cache, v_cache, qv, cu_seqlens_q, cache_seqlens, page_table,
                       softmax_scale, causal, max_seqlen_q)
        mod.flash_attn_with_kvcache = flash_attn_with_kvcache
    return mod


@pytest.fixture(params=[True, False], ids=["vllm", "hopper_build"])
def fa3_mla_h200(request, monkeypatch):
    mod = standin_fa3_mla(request.param)
    names = ("vllm.vllm_flash_attn", "flash_attn_interface")
    monkeypatch.setitem(sys.modules, names[0], mod if request.param else None)
    monkeypatch.setitem(sys.modules, names[1], None if request.param else mod)
    if request.param:
        monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    return dataclasses.replace(Platform.parse("cuda:9.0"), assume_packages=True), mod


@FM_STEPS
def test_fa3_mla_runs_what_reference_mla_does(fa3_mla_h200, reqs):
    """Our side of FA3's MLA path (the rope and latent columns of the cache as k and v, the
    latent query as q_v, varlen rows, causal, padding rows zero) against REFERENCE_MLA, through
    either FA3 provider."""
    platform, mod = fa3_mla_h200
    _matches_reference_at_fm_widths("FLASH_ATTN_MLA", platform, reqs)
    assert mod.calls == [sum(n <= 4 for _, n in reqs)]


def test_fa3_mla_op_passes_opcheck(fa3_mla_h200):
    _opcheck_fm_spec("FLASH_ATTN_MLA", fa3_mla_h200[0])


# each route of COMPOSITE_MLA_SM90 forced by its thresholds at these small shapes (FA3's MLA
# path where it is installed, TRITON_MLA where not)
COMPOSITE_ROUTES = {
    "FLASHINFER_MLA_FA3": {"route_small_max_rows": 0, "route_flashmla_min_requests": 1000},
    "FLASHMLA": {"route_small_max_rows": 0, "route_flashmla_min_requests": 2,
                 "route_flashmla_min_keys": 100},
    "TRITON_MLA": {"route_small_max_rows": 64, "route_triton_min_keys": 100},
    "FA3_MLA": {"route_small_max_rows": 64},
}


@pytest.mark.parametrize("route", list(COMPOSITE_ROUTES))
@pytest.mark.parametrize("reqs", [[(70, 1), (130, 1), (5, 1)], [(130, 1), (64, 2), (0, 9)]],
                         ids=["decodes", "with_spec_and_mha"])
def test_composite_mla_runs_each_route_as_reference_mla_does(monkeypatch, route, reqs):
    """COMPOSITE_MLA_SM90 on a simulated H200 (FlashMLA and FlashInfer stand-ins, TRITON_MLA's
    kernel in the interpreter): the step's absorbed part planned on the route its thresholds
    pick, run by that kernel alone, the step within tolerance of REFERENCE_MLA."""
    from attn_ops.backends.mla.composite import ROUTES
    from attn_ops.routing import Kernel

    if "TRITON_MLA" not in MLA_HERE:
        pytest.skip("TRITON_MLA does not run here")
    platform = simulated_h200(monkeypatch, StandinMLAWrapper)
    fm = standin_flashmla(True)
    monkeypatch.setitem(sys.modules, "flash_mla", fm)
    fa3 = standin_fa3_mla(vllm=False)  # (installed for the FA3 route only)
    monkeypatch.setitem(sys.modules, "flash_attn_interface",
                        fa3 if route == "FA3_MLA" else None)
    monkeypatch.setitem(sys.modules, "vllm.vllm_flash_attn", None)
    layer = MLAAttention(FM_SPEC, AttentionConfig(backend="COMPOSITE_MLA_SM90", tuning=Tuning()
                         .with_(mla={"absorbed_max_query_len": 4, **COMPOSITE_ROUTES[route]})),
                         platform=platform)
    common = build_batch(BlockAllocator(16, 64, shuffle=True), list(range(len(reqs))),
                         [c for c, _ in reqs], [n for _, n in reqs])
    assert ROUTES[PLAN.decode(layer.impl.build_metadata(common).plan).route] is Kernel[route]
    _matches_reference_at_fm_widths("COMPOSITE_MLA_SM90", platform, reqs,
                                    **COMPOSITE_ROUTES[route])
    assert bool(fm.calls) == (route == "FLASHMLA") and bool(fa3.calls) == (route == "FA3_MLA")


def test_the_route_keeps_flashmla_to_batches_its_tile_scheduler_takes():
    """FlashMLA's scheduler holds at most FLASHMLA_MAX_ROWS requests in its shared memory:
    larger absorbed parts route to FlashInfer's kernel, and FLASHMLA alone refuses them naming
    the count and the fix."""
    from attn_ops.routing import FLASHMLA_MAX_ROWS, Kernel, mla_absorbed_route

    t = Tuning().mla
    assert mla_absorbed_route(128, FLASHMLA_MAX_ROWS, 1, 32768, t).kernel is Kernel.FLASHMLA
    big = mla_absorbed_route(128, FLASHMLA_MAX_ROWS + 1, 1, 32768, t)
    assert big.kernel is Kernel.FLASHINFER_MLA_FA3


def test_flashmla_refuses_more_requests_than_its_scheduler_takes(flashmla_h200):
    """One request past the bound (the op's glue called with FLASHMLA_MAX_ROWS + 1 decode rows:
    the count is read before any other input) is refused, naming both numbers and the fix."""
    from attn_ops.backends.mla.flashmla import absorbed_flashmla
    from attn_ops.routing import FLASHMLA_MAX_ROWS

    b = FLASHMLA_MAX_ROWS + 1
    ql, q_pe = torch.zeros(b, 16, 512, dtype=torch.float16), torch.zeros(b, 16, 64,
                                                                          dtype=torch.float16)
    ones = torch.ones(b, dtype=torch.int32)
    plan = types.SimpleNamespace(absorbed_max_query_len=1)
    with pytest.raises(ValueError, match=f"{b} requests in one step's absorbed part; FlashMLA's "
                       f"tile scheduler takes at most {FLASHMLA_MAX_ROWS} .*use "
                       "COMPOSITE_MLA_SM90 / FLASHINFER_MLA"):
        absorbed_flashmla(ql, q_pe, torch.zeros(1, 64, 576, dtype=torch.float16),
                          torch.arange(b + 1, dtype=torch.int32), ones,
                          torch.zeros(b, 1, dtype=torch.int32), torch.empty_like(ql), None,
                          1.0, plan)


def test_flashmla_and_fa3_mla_are_selected_only_where_they_run_after_flashinfer_mla(
        no_providers):
    h200 = dataclasses.replace(Platform.parse("cuda:9.0"), assume_packages=True)
    ranked = [c.name for c in candidates_for(FM_SPEC.with_(dtype=torch.bfloat16), h200)
              if c.ok]
    assert ranked[:5] == ["COMPOSITE_MLA_SM90", "FLASHINFER_MLA", "FLASHMLA", "FLASH_ATTN_MLA",
                          "TRITON_MLA"]
    narrow = {c.name: c for c in candidates_for(FI_SPEC, h200)}["FLASHMLA"]
    assert any("FlashMLA's dense kernel takes latents of 512 + 64" in str(r)
               for r in narrow.reasons)
    paged = {c.name: c for c in candidates_for(FM_SPEC.with_(block_size=16), h200)}["FLASHMLA"]
    assert any(r.code == "block_size" for r in paged.reasons), paged.reasons
    bare = {c.name: c for c in candidates_for(FM_SPEC, Platform.parse("cuda:9.0"))}
    assert any(str(r).startswith("no provider of FlashMLA is usable here")
               for r in bare["FLASHMLA"].reasons)
    assert any(str(r).startswith("no provider of FlashAttention 3 is usable here")
               for r in bare["FLASH_ATTN_MLA"].reasons)
    fa3_narrow = {c.name: c for c in candidates_for(FI_SPEC, h200)}["FLASH_ATTN_MLA"]
    assert any("FlashAttention 3's MLA path takes latents of 512 + 64" in str(r)
               for r in fa3_narrow.reasons)


@pytest.mark.skipif("TRITON_MLA" not in MLA_HERE, reason="TRITON_MLA does not run here")
@pytest.mark.parametrize("qlen", [1, 2])
def test_triton_mla_graph_metadata_runs_any_batch_of_its_size_and_zeroes_padding(
        qlen, monkeypatch):
    """The graph path's metadata run eagerly (on a CPU, in the interpreter): the launch
    fixed per capture size from the graphs' longest request, padding requests with no rows
    and no keys, padding rows zero, real rows equal REFERENCE_MLA's."""
    from attn_ops import platforms
    from attn_ops.cudagraph import CUDAGraphBatch
    from attn_ops.metadata import build_common_metadata

    # (graph support is judged on the running platform: a GPU's here)
    monkeypatch.setattr(platforms, "current_platform", lambda: Platform.parse("cuda:9.0"))

    spec = MLA_HERE["TRITON_MLA"]
    graphs = CUDAGraphBatch((2, 8), 6, 4, DEVICE, uniform_query_len=qlen)
    tuning = Tuning().with_(mla=SPLITTING)
    layer = MLAAttention(spec, AttentionConfig(backend="TRITON_MLA", tuning=tuning)).to(DEVICE)
    oracle = MLAAttention(spec, AttentionConfig(backend="REFERENCE_MLA")).to(DEVICE)
    w = _weights(spec, torch.Generator().manual_seed(0)).to(spec.dtype)
    layer.load_kv_b_proj(w)
    oracle.load_kv_b_proj(w)
    g = torch.Generator().manual_seed(6)
    cache = torch.randn(60, 4, spec.latent_dim, generator=g).to(DEVICE, spec.dtype)
    launches = set()
    for n, seq in ((5, [3, 9, 2, 20, 7]), (2, [4, 11]), (7, [2, 24, 5, 5, 13, 8, 3])):
        pages = torch.randperm(59, generator=g) + 1
        tables, at = [], 0
        for length in seq:
            count = -(-length // 4)
            tables.append(pages[at:at + count].tolist())
            at += count
        common = build_common_metadata([qlen] * n, seq, tables, 4, 60, device=DEVICE)
        step = build_step_metadata(layer, common, graphs)
        rows = graphs.size_for(n) * qlen
        launches.add((graphs.size_for(n), PLAN.decode(step[layer._metadata_key].plan).decode))
        q = torch.randn(rows, spec.num_heads, spec.head_dim, generator=g).to(DEVICE, spec.dtype)
        kv_c = torch.randn(rows, spec.kv_lora_rank, generator=g).to(DEVICE, spec.dtype)
        k_pe = torch.randn(rows, spec.qk_rope_head_dim, generator=g).to(DEVICE, spec.dtype)
        got = layer(q, kv_c, k_pe, cache.clone(), step)
        want = oracle(q[:n * qlen], kv_c[:n * qlen], k_pe[:n * qlen], cache.clone(), common)
        torch.testing.assert_close(got[:n * qlen], want, atol=2e-5, rtol=2e-5)
        assert (got[n * qlen:] == 0).all()
    assert len(launches) == 2 and max(la.splits for _, la in launches) > 1


# --- real sizes on the GPU ---------------------------------------------------------------------

# decodes at 1-8k, a 3-token speculative decode, a 700-token prefill, a 300-token prefill over
# 2000 cached tokens (chunked at the default 4096: one chunk), 5 padding rows
REAL_STEP = [(4000, 1), (300, 1), (8191, 1), (1, 1), (1500, 3), (2000, 300), (0, 700)]
GPU_MLA = [b.value for b in sorted(MLA_BACKENDS, key=lambda b: b.value)
           if b.value != "REFERENCE_MLA" and PLATFORM.is_gpu
           and not get_backend_class(b.value).not_supported_reasons(
               AttentionSpec.mla(16, dtype=torch.bfloat16, block_size=64), PLATFORM)]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_MLA)
@pytest.mark.parametrize("heads", [128, 16])
@pytest.mark.parametrize("cache", ["bf16", "fp8_e4m3"])
def test_real_sizes_match_the_reference(backend, heads, cache):
    """DeepSeek dims (512 + 64 latent, 128 + 64 QK, V 128), bf16, page 64: within the policy
    of attn_ops.testing.tolerance of REFERENCE_MLA in fp64 (2 x REFERENCE_MLA's own bf16
    error, plus epsilon)."""
    from attn_ops.testing import tolerance

    spec = AttentionSpec.mla(heads, dtype=torch.bfloat16, block_size=64,
                             kv_cache_dtype=KVCacheDType.AUTO if cache == "bf16"
                             else KVCacheDType.FP8_E4M3)
    if get_backend_class(backend).not_supported_reasons(spec, PLATFORM):
        pytest.skip(f"{backend} does not take {spec.describe()} (its reasons are tested)")
    case = _case(spec, REAL_STEP, padded=5, device="cuda", num_blocks=400)
    ours = _run(case, backend)
    truth = _run(case, "REFERENCE_MLA", torch.float64)
    base = _run(case, "REFERENCE_MLA", torch.bfloat16)
    n = case.total
    err = (ours[:n].double() - truth[:n]).abs().max().item()
    allowed = tolerance((base[:n].double() - truth[:n]).abs().max().item(), torch.bfloat16)
    assert err <= allowed, f"max error {err:.3g} > allowed {allowed:.3g}"
    assert (ours[n:] == 0).all()


def _graph_backends():
    from attn_ops.capabilities import CUDAGraphSupport

    spec = AttentionSpec.mla(16, dtype=torch.bfloat16, block_size=64)
    return [b for b in GPU_MLA if get_backend_class(b).cudagraph_support(spec, PLATFORM)
            >= CUDAGraphSupport.UNIFORM_SINGLE_TOKEN_DECODE]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", _graph_backends() if PLATFORM.is_gpu else [])
@pytest.mark.parametrize("heads", [128, 16])
@pytest.mark.parametrize("qlen,mode", [(1, "op"), (1, "compiled_layer"), (2, "op")],
                         ids=["decode", "decode_compiled", "spec_decode_2"])
def test_graph_replays_of_random_decode_batches_match_eager(backend, heads, qlen, mode):
    """Capture once per size (1, 8, 32 requests), then replay 200 random batches (sizes up and
    down, lengths up to 1024, pages in random order): each replay equals the eager layer on the
    same step, its padding rows stay zero, and the eager layer equals REFERENCE_MLA."""
    import random

    from attn_ops.cudagraph import CUDAGraphBatch
    from attn_ops.testing import capture_graph, random_decode_batch, tolerance

    sizes, width, page = (1, 8, 32), 16, 64
    rng, gen = random.Random(heads + qlen), torch.Generator(device="cuda").manual_seed(heads)
    spec = AttentionSpec.mla(heads, dtype=torch.bfloat16, block_size=page)
    graphs = CUDAGraphBatch(sizes, width, page, "cuda", uniform_query_len=qlen)
    layer = MLAAttention(spec, AttentionConfig(backend=backend)).cuda()
    layer.load_kv_b_proj((_weights(spec, torch.Generator().manual_seed(0))).to(spec.dtype)
                         .cuda())
    num_blocks = sizes[-1] * width + 1
    cache = layer.allocate_cache(num_blocks, "cuda")
    cache.copy_(torch.randn(cache.shape, generator=gen, device="cuda").to(cache.dtype))
    rows_max = sizes[-1] * qlen
    q = torch.randn(rows_max, heads, spec.head_dim, generator=gen, device="cuda").to(spec.dtype)
    kv_c = torch.randn(rows_max, spec.kv_lora_rank, device="cuda").to(spec.dtype)
    k_pe = torch.randn(rows_max, spec.qk_rope_head_dim, device="cuda").to(spec.dtype)
    run = layer
    if mode == "compiled_layer":
        torch._dynamo.reset()
        run = torch.compile(layer, fullgraph=True, dynamic=False)

    def batch(n):
        return random_decode_batch(n, num_blocks, rng, page, width * page, qlen=qlen,
                                   device="cuda")

    captured, results = {}, {}
    for size in sizes:
        step = build_step_metadata(layer, batch(size), graphs)
        rows = size * qlen
        captured[size], results[size] = capture_graph(
            lambda: run(q[:rows], kv_c[:rows], k_pe[:rows], cache, step))
    oracles = {}
    for dtype in (torch.float64, torch.bfloat16):
        oracles[dtype] = MLAAttention(spec.with_(dtype=dtype),
                                      AttentionConfig(backend="REFERENCE_MLA")).cuda()
        oracles[dtype].load_kv_b_proj(_weights(spec, torch.Generator().manual_seed(0))
                                      .to(dtype).cuda())
    for i in range(200):
        n = rng.choice([1, 2, 5, 8, 13, 32, 31, 17])
        common = batch(n)
        build_step_metadata(layer, common, graphs)  # (fills the graphs' persistent tensors)
        size = graphs.size_for(n)
        q.normal_(generator=gen)
        kv_c.normal_(generator=gen)
        captured[size].replay()
        rows = n * qlen
        got = results[size]
        eager = layer(q[:rows], kv_c[:rows], k_pe[:rows], cache, common)
        assert (got[rows:size * qlen] == 0).all(), "padding rows must be zero on replay"
        if i % 25 == 0:  # the eager layer against REFERENCE_MLA, in the matrix's policy
            truth, base = (oracles[d](q[:rows].to(d), kv_c[:rows].to(d), k_pe[:rows].to(d),
                                      cache.to(d, copy=True), common).double()
                           for d in oracles)
            err = (eager.double() - truth).abs().max().item()
            assert err <= tolerance((base - truth).abs().max().item(), spec.dtype), err
        torch.testing.assert_close(got[:rows], eager, atol=1e-2, rtol=1e-2,
                                   msg=f"replay {i}: {n} requests in the graph of {size}")


# --- TRITON_MLA's kernel against the reference's absorbed form -------------------------------

@pytest.mark.skipif("TRITON_MLA" not in MLA_HERE, reason="TRITON_MLA does not run here")
@pytest.mark.parametrize("heads,rank,rope,page", [(4, 32, 16, 8), (5, 24, 8, 3), (16, 64, 16, 16)],
                         ids=["pow2", "odd_dims_and_page", "head_blocks"])
@pytest.mark.parametrize("fp8", [False, True], ids=["fp32", "fp8_e4m3"])
def test_triton_mla_kernel_matches_the_reference_in_every_launch(heads, rank, rope, page, fp8):
    """Every split count, query-row and head tile, latents and heads not powers of two, pages
    in random order with NaN in the rows no request owns: TRITON_MLA's kernel (and its split
    combine) equals REFERENCE_MLA's absorbed form."""
    from attn_ops.backends.mla.reference import absorbed_torch
    from attn_ops.backends.mla.triton_mla import absorbed_triton
    from attn_ops.routing import MLADecodeLaunch

    g = torch.Generator().manual_seed(heads)
    lens, qlens = [5, 19, 40, 1], [1, 3, 1, 1]
    blocks = sum(-(-n // page) for n in lens) + 4
    cache = torch.full((blocks, page, rank + rope), float("nan"))
    order = torch.randperm(blocks, generator=g)
    width = max(-(-n // page) for n in lens)
    table = torch.zeros(len(lens), width, dtype=torch.int32)
    used = 0
    for i, n in enumerate(lens):
        k = -(-n // page)
        table[i, :k] = order[used:used + k]
        used += k
        rows = torch.randn(n, rank + rope, generator=g)
        for j in range(n):
            cache[table[i, j // page], j % page] = rows[j]
    scale = None
    if fp8:
        scale = torch.tensor([0.02])
        cache = (cache / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
    seq = torch.tensor(lens, dtype=torch.int32)
    t = int(qsl[-1])
    ql = torch.randn(t, heads, rank, generator=g)
    q_pe = torch.randn(t, heads, rope, generator=g)
    cache, qsl, seq, table, ql, q_pe = (x.to(DEVICE) for x in (cache, qsl, seq, table, ql, q_pe))
    scale = None if scale is None else scale.to(DEVICE)
    want = torch.zeros(t, heads, rank, device=DEVICE)
    absorbed_torch(ql, q_pe, cache, qsl, seq, table, want, scale, 0.3)
    # (every split count with two tiles or more, every tile split: half the full product,
    # which Triton's interpreter takes seconds a launch for)
    for splits, (query_rows, head_rows, parts) in (
            (1, (4, 4, 1)), (8, (4, 4, 1)), (2, (4, 16, 1)), (8, (8, 2, 1)), (1, (4, 4, 2)),
            (2, (8, 2, 1)), (8, (4, 4, 2))):
        out = torch.full((t, heads, rank), float("nan"), device=DEVICE)
        absorbed_triton(ql, q_pe, cache, qsl, seq, table, out, scale, 0.3,
                        MLADecodeLaunch(splits, query_rows, head_rows, 16, 4, 1, parts))
        torch.testing.assert_close(
            out, want, atol=2e-5, rtol=2e-5,
            msg=f"splits={splits} rows={query_rows}x{head_rows} value parts={parts}")


@pytest.mark.skipif("TRITON_MLA" not in MLA_HERE, reason="TRITON_MLA does not run here")
def test_triton_mla_combines_wide_splits_a_block_at_a_time():
    """DeepSeek's 512-wide latent over 32 splits: the split combine reads the partials in
    blocks (``routing.combine_split_block``: 8 splits of 512 at a time) and still equals
    REFERENCE_MLA's absorbed form."""
    from attn_ops.backends.mla.reference import absorbed_torch
    from attn_ops.backends.mla.triton_mla import absorbed_triton
    from attn_ops.routing import MLADecodeLaunch, combine_split_block

    rank, rope, page, lens = 512, 64, 16, [70, 9]
    assert combine_split_block(32, rank) < 32  # (the blocked path is what runs)
    g = torch.Generator().manual_seed(0)
    pages = [-(-n // page) for n in lens]
    cache = torch.randn(sum(pages), page, rank + rope, generator=g)
    table = torch.zeros(len(lens), max(pages), dtype=torch.int32)
    for i, start in enumerate((0, pages[0])):
        table[i, :pages[i]] = torch.arange(start, start + pages[i])
    qsl = torch.arange(len(lens) + 1, dtype=torch.int32)
    seq = torch.tensor(lens, dtype=torch.int32)
    ql = torch.randn(len(lens), 2, rank, generator=g)
    q_pe = torch.randn(len(lens), 2, rope, generator=g)
    cache, qsl, seq, table, ql, q_pe = (x.to(DEVICE) for x in (cache, qsl, seq, table, ql, q_pe))
    want = torch.zeros(len(lens), 2, rank, device=DEVICE)
    absorbed_torch(ql, q_pe, cache, qsl, seq, table, want, None, 0.05)
    out = torch.full_like(want, float("nan"))
    absorbed_triton(ql, q_pe, cache, qsl, seq, table, out, None, 0.05,
                    MLADecodeLaunch(32, 1, 16, 16, 4, 1))
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)


def _fa4_varlen_standin(q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                        softmax_scale, causal, return_lse, out, lse):
    """FlashAttention 4's varlen ``_flash_attn_fwd`` on dense ragged K/V in plain torch, its
    LSE ``[heads, tokens]``; requests without keys get NaN (what the glue must not trust)."""
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    assert max_seqlen_q == max(b - a for a, b in zip(cq, cq[1:]))
    assert max_seqlen_k == max(b - a for a, b in zip(ck, ck[1:]))
    assert return_lse and lse.shape == (q.shape[1], q.shape[0])
    for q0, q1, k0, k1 in zip(cq, cq[1:], ck, ck[1:]):
        if k1 == k0:
            out[q0:q1], lse[:, q0:q1] = float("nan"), float("nan")
            continue
        score = torch.einsum("thd,jhd->htj", q[q0:q1], k[k0:k1]) * softmax_scale
        if causal:
            n, m = q1 - q0, k1 - k0
            mask = torch.arange(m)[None] > torch.arange(m - n, m)[:, None]
            score = score.masked_fill(mask, float("-inf"))
        lse[:, q0:q1] = torch.logsumexp(score, -1)
        out[q0:q1] = torch.einsum("htj,jhd->thd", torch.softmax(score, -1), v[k0:k1])


class _StandinRagged:
    """FlashInfer's ``BatchPrefillWithRaggedKVCacheWrapper`` in torch: host int32 offsets at
    plan, base-2 LSE, NaN for requests without keys."""

    def __init__(self, workspace, layout, backend):
        assert layout == "NHD" and backend in ("fa2", "fa3")

    def plan(self, qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim_qk, *,
             head_dim_vo, causal, sm_scale, q_data_type):
        assert qo_indptr.dtype == kv_indptr.dtype == torch.int32
        assert qo_indptr.device.type == kv_indptr.device.type == "cpu"
        self.plan_args = (qo_indptr.tolist(), kv_indptr.tolist(), causal, sm_scale)

    def run(self, q, k, v, out, lse, return_lse):
        cq, ck, causal, scale = self.plan_args
        lse_hm = torch.empty(q.shape[1], q.shape[0])
        _fa4_varlen_standin(q, k, v, cu_seqlens_q=torch.tensor(cq),
                            cu_seqlens_k=torch.tensor(ck), max_seqlen_q=max(
                                b - a for a, b in zip(cq, cq[1:])),
                            max_seqlen_k=max(b - a for a, b in zip(ck, ck[1:])),
                            softmax_scale=scale, causal=causal, return_lse=True, out=out,
                            lse=lse_hm)
        lse.copy_(lse_hm.t() / math.log(2.0))
        return out, lse


@pytest.mark.parametrize("kernel", ["fa4", "flashinfer_ragged"])
@pytest.mark.parametrize("causal", [True, False], ids=["new_tokens", "context_chunk"])
def test_mha_kernel_glue_matches_the_reference_mha(monkeypatch, causal, kernel):
    """The MHA part's FA4 / FlashInfer ragged calls (arguments, bounds, LSE layout and base,
    requests a chunk gives no keys) against REFERENCE_MLA's torch MHA, the libraries replaced
    by stand-ins with their semantics."""
    import sys
    import types

    from attn_ops.backends.mla import prefill
    from attn_ops.backends.mla.reference import mha_torch

    module = types.ModuleType("flash_attn.cute.interface")
    module._flash_attn_fwd = _fa4_varlen_standin
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", module)
    monkeypatch.setattr(prefill, "_RAGGED", {torch.device("cpu"): _StandinRagged(None, "NHD",
                                                                                  "fa2")})
    glue = prefill.mha_fa4 if kernel == "fa4" else prefill.mha_flashinfer
    g = torch.Generator().manual_seed(1)
    lens_q = [3, 5, 2]
    lens_k = lens_q if causal else [7, 0, 4]
    cu_q = [0, *torch.tensor(lens_q).cumsum(0).tolist()]
    cu_k = [0, *torch.tensor(lens_k).cumsum(0).tolist()]
    q = torch.randn(cu_q[-1], 4, 24, generator=g)
    k = torch.randn(cu_k[-1], 4, 24, generator=g)
    v = torch.randn(cu_k[-1], 4, 12, generator=g)
    results = []
    for run in (glue, mha_torch):
        out, lse = torch.empty(cu_q[-1], 4, 12), torch.empty(cu_q[-1], 4)
        run(q, k, v, torch.tensor(cu_q, dtype=torch.int32),
            torch.tensor(cu_k, dtype=torch.int32), cu_q, cu_k, out, lse, 0.2, causal)
        results.append((out, lse))
    torch.testing.assert_close(results[0], results[1])
    if not causal:
        assert (results[0][0][3:8] == 0).all() and (results[0][1][3:8] == float("-inf")).all()


def test_fa4_gets_the_mha_parts_query_offsets_from_the_host_copy(monkeypatch):
    """The MHA part's FA4 calls index q and out with offsets from the metadata's host copy
    (what the step was planned and checked with), whatever the device query_start_loc holds:
    a device copy that disagrees -- here running into the padding rows, past the MHA part's
    rows -- reaches no kernel, and the step equals the clean one."""
    import sys
    import types

    from attn_ops.backends.mla.common import run_mla
    from attn_ops.backends.mla.prefill import mha_fa4
    from attn_ops.backends.mla.reference import absorbed_torch

    calls = []

    def bounded_fa4(q, k, v, *, cu_seqlens_q, cu_seqlens_k, **kw):
        # FA4 reads rows [cu[i], cu[i + 1]) of q / k and writes them to out, unchecked
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        calls.append(cq)
        for cu, x in ((cq, q), (ck, k)):
            assert cu[0] == 0 and all(a <= b for a, b in zip(cu, cu[1:])) \
                and cu[-1] <= x.shape[0], f"offsets {cu} outside the {x.shape[0]} rows"
        _fa4_varlen_standin(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                            **kw)

    module = types.ModuleType("flash_attn.cute.interface")
    module._flash_attn_fwd = bounded_fa4
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", module)
    spec = SPEC.with_(dtype=torch.float32)
    layer = MLAAttention(spec, AttentionConfig(backend="REFERENCE_MLA", tuning=Tuning().with_(
        mla={"absorbed_max_query_len": 1, "context_chunk_tokens": 7})), platform=CPU)
    case = _case(spec, SCENARIOS["mixed"], padded=3, device="cpu")
    layer.load_kv_b_proj(case.w.float())
    meta = layer.impl.build_metadata(case.meta)
    cache = case.cache.float()
    q, kv_c, k_pe = case.q.float(), case.kv_c.float(), case.k_pe.float()
    mla_cache_update(kv_c, k_pe, cache, meta.slot_mapping, None)

    def step(query_start_loc):
        out = torch.full((q.shape[0], 4, 12), float("nan"))
        run_mla(q, kv_c, k_pe, cache, layer.w_uk, layer.w_uv, query_start_loc, meta.seq_lens,
                meta.block_table, meta.plan, meta.mha_lens_cpu, list(meta.chunk_slots),
                list(meta.chunk_cu_k), out, None, spec.softmax_scale, absorbed=absorbed_torch,
                mha=mha_fa4)
        return out

    clean = step(meta.query_start_loc)
    assert calls and all(c == [0, 6, 27] for c in calls)
    calls.clear()
    device_copy = meta.query_start_loc.clone()
    device_copy[-1] = q.shape[0]  # (monotone, inside the rows: only the host copy can tell)
    assert torch.equal(step(device_copy), clean)
    assert calls and all(c == [0, 6, 27] for c in calls)


# --- RoPE of the rope parts, fused with the latent write ----------------------------------------

def _rope_case(fp8=False, device="cpu", dtype=torch.float32):
    """A decode, a prefill and 2 padding rows; NaN-poisoned pages; q [T, 4, 16 + 8]."""
    from attn_ops.models.llama import rope_cache

    alloc = BlockAllocator(NUM_BLOCKS, 4, shuffle=True, seed=1)
    meta = build_batch(alloc, [0, 1], [5, 0], [1, 6], num_tokens_padded=9, device=device)
    g = torch.Generator().manual_seed(2)
    t = meta.slot_mapping.shape[0]
    rand = lambda *shape: torch.randn(*shape, generator=g).to(device, dtype)  # noqa: E731
    cache = torch.full((NUM_BLOCKS, 4, 40), float("nan"), device=device)
    scale = torch.tensor([0.05], device=device) if fp8 else None
    cache = cache.to(torch.float8_e4m3fn) if fp8 else cache.to(dtype)
    cos_sin = rope_cache(8, 64, 10000.0)[meta.positions.cpu()].to(device)
    return rand(t, 4, 24), rand(t, 32), rand(t, 8), cos_sin, cache, meta.slot_mapping, scale


def test_mla_rope_rotates_the_rope_parts_only_and_the_fused_op_writes_what_the_write_does():
    from attn_ops.backends.mla.rope import mla_rope, mla_rope_cache_update
    from attn_ops.glue import rope

    for fp8 in (False, True):
        q, kv_c, k_pe, cos_sin, cache, slots, scale = _rope_case(fp8)
        q_rot, k_rot = mla_rope(q, k_pe, cos_sin)
        assert torch.equal(q_rot[..., :16], q[..., :16])
        torch.testing.assert_close(q_rot[..., 16:], rope(q[..., 16:].contiguous(), cos_sin))
        torch.testing.assert_close(k_rot, rope(k_pe[:, None], cos_sin)[:, 0])
        want = cache.clone()
        mla_cache_update(kv_c, k_rot, want, slots, scale)
        got_q, got_k = mla_rope_cache_update(q, kv_c, k_pe, cos_sin, cache, slots, scale)
        assert torch.equal(got_q, q_rot) and torch.equal(got_k, k_rot)
        assert torch.equal(cache.view(torch.uint8), want.view(torch.uint8))
        torch.library.opcheck(mla_rope, (q, k_pe, cos_sin))
        if not fp8:  # (opcheck's schema test compares fp8 tensors with ops fp8 lacks)
            torch.library.opcheck(mla_rope_cache_update, (q, kv_c, k_pe, cos_sin, cache, slots,
                                                          scale))
    with pytest.raises(ValueError, match=r"cos_sin must be \[num_tokens=9, rope=8\]"):
        mla_rope(q, k_pe, cos_sin[:, :6])


@pytest.mark.skipif("TRITON_MLA" not in MLA_HERE, reason="Triton does not run here")
def test_the_fused_ops_gpu_kernel_matches_its_torch_path():
    """The one-launch GPU path of mla_rope_cache_update (the KV write's RoPE kernel with the
    query's nope dims passed through and the rotated key returned) against the torch path --
    on the CPU in Triton's interpreter -- page tails cleared, padding rows skipped."""
    from attn_ops.backends.mla.rope import _mla_rope_impl
    from attn_ops.glue_kernels import rope_write_paged

    device = "cuda" if PLATFORM.is_gpu else "cpu"
    q, kv_c, k_pe, cos_sin, cache, slots, scale = _rope_case(device=device)
    want = cache.clone()
    want_q, want_k = _mla_rope_impl(q, k_pe, cos_sin)
    mla_cache_update(kv_c, want_k, want, slots, scale)
    got_q, got_k = rope_write_paged(q, k_pe[:, None], kv_c[:, None], cos_sin,
                                    cache[:, :, None, 32:], cache[:, :, None, :32], slots, None,
                                    None, None, scale, scale, nope=16, key_out=True)
    torch.testing.assert_close(got_q, want_q)
    torch.testing.assert_close(got_k[:, 0], want_k)
    torch.testing.assert_close(cache, want, equal_nan=True)


@pytest.mark.parametrize("backend", MLA_HERE)
def test_compiled_layer_fuses_rope_into_the_latent_write(backend):
    """With our passes, a layer given cos_sin compiles to two attn ops -- the fused RoPE +
    latent write and the attention -- and equals the eager layer."""
    import torch._inductor.config as inductor_config

    import expecttest

    from attn_ops.compile_passes import fusion_passes
    from attn_ops.compile_passes.base import attn_ops_in, graph_text
    from attn_ops.compile_passes.manager import AttnPassManager
    from attn_ops.models.llama import rope_cache

    layer, _, args = _op_args(backend)
    q, kv_c, k_pe, cache = args[:4]
    common, step = _step(layer)
    cos_sin = rope_cache(8, 128, 10000.0)[common.positions.cpu()].to(q.device, q.dtype)
    eager_cache = cache.clone()
    eager = layer(q, kv_c, k_pe, eager_cache, step, cos_sin)
    seen = {}

    def snap(name):
        return lambda graph: seen.setdefault(name, (attn_ops_in(graph), graph_text(graph)))

    torch._dynamo.reset()
    with inductor_config.patch(post_grad_custom_post_pass=AttnPassManager(
            [snap("before"), *fusion_passes(), snap("after")]), fx_graph_cache=False):
        compiled = torch.compile(layer, fullgraph=True)(q, kv_c, k_pe, cache, step, cos_sin)
    attention = layer.impl.op._schema.name.split("::")[1]
    assert seen["before"][0] == ["mla_rope", "mla_cache_update", attention]
    assert seen["after"][0] == ["mla_rope_cache_update", attention]
    if backend == "REFERENCE_MLA":  # the graph's attn ops and their inputs, after the passes
        expecttest.assert_expected_inline(seen["after"][1], """\
mla_rope_cache_update0 = mla_rope_cache_update(q=in0, kv_c=in1, k_pe=in2, cos_sin=in4, slot_mapping=in5) (functionalized)
reference_mla_attention0 = reference_mla_attention(q=mla_rope_cache_update0[0], kv_c=in1, k_pe=mla_rope_cache_update0[1], latent_cache=mla_rope_cache_update0[2], w_uk=in6, w_uv=in7, query_start_loc=in8, seq_lens=in9, block_table=in10, plan=in11, mha_lens=in12, chunk_slots=[in13, in14], chunk_cu_k=[in15, in16], scale=0.2646422579642267) (functionalized)""")
    tol = TOLERANCE[layer.spec.dtype]
    torch.testing.assert_close(compiled, eager, atol=tol, rtol=tol)
    torch.testing.assert_close(cache, eager_cache, atol=tol, rtol=tol)


# --- the real peer: HF transformers' DeepseekV3Attention --------------------------------------

def _hf_case(q_lora_rank):
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    cfg = transformers.DeepseekV3Config(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=q_lora_rank,
        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
        num_hidden_layers=1, rope_interleave=True, max_position_embeddings=256,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                         "original_max_position_embeddings": 64, "mscale_all_dim": 1.0,
                         "mscale": 1.0, "beta_fast": 32.0, "beta_slow": 1.0},
        attn_implementation="eager", dtype=torch.float64)
    torch.manual_seed(0)
    attn = hf.DeepseekV3Attention(cfg, 0).double().eval()
    rotary = hf.DeepseekV3RotaryEmbedding(cfg).double()
    mscale = yarn_mscale(4.0, 1.0)
    spec = AttentionSpec.mla(4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                             v_head_dim=12, q_lora_rank=q_lora_rank, mscale=mscale,
                             dtype=torch.float64, block_size=4)
    assert spec.softmax_scale == pytest.approx(attn.scaling)
    return hf, attn, rotary, spec


def _hf_projections(hf, attn, rotary, x, positions, rope_in_layer=False):
    """What a model hands our layer: HF's own projections and norm, and either HF's
    interleaved RoPE applied (``cos_sin`` None) or -- ``rope_in_layer`` -- the rope parts
    deinterleaved (dims 0, 2, 4, ..., 1, 3, 5, ...: interleaved RoPE is rotate-half RoPE
    there) with the ``cos_sin`` rows the layer rotates them by."""
    cos, sin = rotary(x[None], positions[None])
    q = attn.q_proj(x) if attn.q_lora_rank is None else \
        attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x)))
    q = q.view(x.shape[0], attn.num_heads, attn.qk_head_dim)
    q_nope, q_rot = q.split([attn.qk_nope_head_dim, attn.qk_rope_head_dim], -1)
    kv_c, k_rot = attn.kv_a_proj_with_mqa(x).split([attn.kv_lora_rank, attn.qk_rope_head_dim],
                                                   -1)
    if rope_in_layer:
        half = attn.qk_rope_head_dim // 2
        deinterleave = lambda t: t.unflatten(-1, (half, 2)).transpose(-1, -2).flatten(-2)  # noqa: E731
        cos_sin = torch.cat([cos[0, :, :half], sin[0, :, :half]], -1)
        return (torch.cat([q_nope, deinterleave(q_rot)], -1), attn.kv_a_layernorm(kv_c),
                deinterleave(k_rot), cos_sin)
    q_rot, k_rot = hf.apply_rotary_pos_emb_interleave(q_rot.transpose(0, 1)[None],
                                                      k_rot[None, None], cos, sin)
    q = torch.cat([q_nope, q_rot[0].transpose(0, 1)], -1)
    return q, attn.kv_a_layernorm(kv_c), k_rot[0, 0], None


@pytest.mark.parametrize("rope_in_layer", [False, True], ids=["rope_by_model", "rope_in_layer"])
@pytest.mark.parametrize("q_lora_rank", [24, None], ids=["v3", "v2_lite_no_q_lora"])
def test_layer_reproduces_hf_deepseek_v3_attention(q_lora_rank, rope_in_layer):
    """Two requests through our paged cache over three steps -- a prefill, a chunked prefill
    over that context (MHA form, context chunks of 5), then a decode and a 3-token speculative
    step (absorbed form) -- against HF's eager attention over each whole sequence; RoPE
    applied by the model (HF's interleaved function) or by the layer from ``cos_sin``."""
    hf, attn, rotary, spec = _hf_case(q_lora_rank)
    g = torch.Generator().manual_seed(1)
    lengths = [(13, 9, 1), (6, 17, 3)]  # per request: new tokens in steps 1, 2, 3
    xs = [torch.randn(sum(n), 64, generator=g, dtype=torch.float64) * 2 for n in lengths]
    want = []
    with torch.no_grad():
        for x in xs:
            s = x.shape[0]
            cos, sin = rotary(x[None], torch.arange(s)[None])
            mask = torch.full((s, s), -math.inf, dtype=torch.float64).triu(1)[None, None]
            want.append(attn(x[None], (cos, sin), mask)[0][0])
        layer = MLAAttention(spec, AttentionConfig(tuning=Tuning().with_(
            mla={"context_chunk_tokens": 5, "absorbed_max_query_len": 4})), platform=CPU)
        layer.load_kv_b_proj(attn.kv_b_proj.weight)
        cache = torch.full((NUM_BLOCKS, 4, spec.latent_dim), math.nan, dtype=torch.float64)
        alloc = BlockAllocator(NUM_BLOCKS, 4, shuffle=True, seed=2)
        done = [0, 0]
        for step in range(3):
            ctx = list(done)
            new = [lengths[r][step] for r in range(2)]
            order = sorted(range(2), key=lambda r: new[r])  # decode-first
            meta = build_batch(alloc, order, [ctx[r] for r in order], [new[r] for r in order],
                               decode_threshold=4)
            parts = [_hf_projections(hf, attn, rotary, xs[r][ctx[r]:ctx[r] + new[r]],
                                     torch.arange(ctx[r], ctx[r] + new[r]), rope_in_layer)
                     for r in order]
            q, kv_c, k_pe = (torch.cat([p[i] for p in parts]) for i in range(3))
            cos_sin = torch.cat([p[3] for p in parts]) if rope_in_layer else None
            out = attn.o_proj(layer(q, kv_c, k_pe, cache, meta, cos_sin).flatten(1))
            at = 0
            for r in order:
                # (HF's eager attention takes its softmax in float32, even for float64 inputs)
                torch.testing.assert_close(out[at:at + new[r]], want[r][ctx[r]:ctx[r] + new[r]],
                                           atol=1e-6, rtol=1e-6)
                at += new[r]
                done[r] += new[r]


@pytest.mark.parametrize("q_lora_rank", [24, None], ids=["v3", "v2_lite_no_q_lora"])
def test_tiny_deepseek_reproduces_hf_deepseek_v3_for_causal_lm(q_lora_rank):
    """The whole decoder: HF's DeepseekV3ForCausalLM (dense MLPs, interleaved RoPE) loaded
    into TinyDeepseek; a prefill of two requests, then two decode steps through our paged
    latent caches, against HF's logits over each whole sequence."""
    transformers = pytest.importorskip("transformers")
    from attn_ops.models.deepseek import MLAModelConfig, TinyDeepseek, load_hf_deepseek

    hf_cfg = transformers.DeepseekV3Config(
        vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=q_lora_rank,
        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
        first_k_dense_replace=2, rope_interleave=True, max_position_embeddings=64,
        attn_implementation="eager", dtype=torch.float32)
    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(hf_cfg).eval()
    cfg = MLAModelConfig(vocab_size=96, hidden_size=64, num_layers=2, num_heads=4,
                         q_lora_rank=q_lora_rank, kv_lora_rank=32, qk_nope_head_dim=16,
                         qk_rope_head_dim=8, v_head_dim=12, intermediate_size=80,
                         max_position=64, rms_norm_eps=hf_cfg.rms_norm_eps)
    model = TinyDeepseek(cfg, AttentionConfig(backend="REFERENCE_MLA")).eval()
    load_hf_deepseek(model, hf)
    device = PLATFORM.device_type  # (HF on the host, ours on this machine's device)
    model.to(device)
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, 96, (n,), generator=g) for n in (9, 14)]
    with torch.no_grad():
        want = [hf(s[None]).logits[0] for s in seqs]
        alloc = BlockAllocator(NUM_BLOCKS, model.block_size, shuffle=True, seed=1)
        caches = model.allocate_kv_caches(NUM_BLOCKS)
        for cache in caches:
            cache.fill_(float("nan"))
        for start, stop in ((0, 7), (7, 8), (8, 9)):  # a prefill, then two decode steps
            meta = build_batch(alloc, [0, 1], [start, start], [stop - start] * 2, device=device)
            ids = torch.cat([s[start:stop] for s in seqs]).to(device)
            logits = model(ids, meta.positions, caches, meta).cpu()
            n = stop - start
            for r in range(2):
                torch.testing.assert_close(logits[r * n:(r + 1) * n], want[r][start:stop],
                                           atol=2e-4, rtol=2e-4)
