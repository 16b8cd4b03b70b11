"""FLASH_ATTN's FlashAttention 2 and 3 glue, on the CPU, against stand-in modules; on an sm90
GPU with FA4, COMPOSITE_SM90's FA4 tiles and modes against REFERENCE (the rules themselves:
test_routing.py).

FA2 and FA3 cannot be installed on the H200 (FA2 is source-only on PyPI, FA3 is not on PyPI),
so ``flash_attn.flash_attn_varlen_func`` and ``flash_attn_interface.flash_attn_with_kvcache``
are replaced by stand-ins with the same call signatures that implement FlashAttention's
documented semantics -- written independently of REFERENCE (bottom-right aligned windows as
``(left, right)``, ``-1`` unbounded, LSE ``[heads, tokens]``, ALiBi ``-slope * |i - j|``) -- so
the argument mapping, layouts and metadata of our glue are really checked. Their GPU execution
is untested (README).
"""

import dataclasses
import functools
import math
import sys
import types

import pytest
import torch

from attn_ops import AttentionSpec, Platform, current_platform, get_backend_class
from attn_ops.testing import (FP8_MIN_SQNR_DB, SCENARIOS, make_case, run_backend, sqnr_db,
                              tolerance)

FLASH_ATTN = get_backend_class("FLASH_ATTN")
REFERENCE = get_backend_class("REFERENCE")
BASE = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float16)


def _fa_semantics(q, k_pages, v_pages, q_starts, kv_lens, tables, scale, causal, window,
                  softcap, alibi):
    """FlashAttention's documented math: query i of a request with sq queries and sk keys sits
    at column c = i + sk - sq; key j is visible iff j >= c - left (left >= 0) and
    j <= c + right (right >= 0; causal forces right = 0)."""
    left, right = window
    right = 0 if causal else right
    num_tokens, heads, _ = q.shape
    kv_heads, page = k_pages.shape[2], k_pages.shape[1]
    # Rows past the last request are left as garbage, as a real kernel may leave them.
    out = torch.full((num_tokens, heads, v_pages.shape[-1]), 7.0, dtype=q.dtype)
    lse = torch.full((heads, num_tokens), 7.0)
    for b, sk in enumerate(kv_lens):
        q0, q1 = q_starts[b], q_starts[b + 1]
        sq = q1 - q0
        if sq == 0:
            continue
        pages = tables[b][: math.ceil(sk / page)]
        k = k_pages[pages].reshape(-1, kv_heads, k_pages.shape[-1])[:sk].float()
        v = v_pages[pages].reshape(-1, kv_heads, v_pages.shape[-1])[:sk].float()
        k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
        s = torch.einsum("ihd,jhd->hij", q[q0:q1].float(), k) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        col = torch.arange(sq)[:, None] + sk - sq
        j = torch.arange(sk)[None, :]
        if alibi is not None:
            s = s - alibi.float()[:, None, None] * (col - j).abs()
        visible = torch.ones(sq, sk, dtype=torch.bool)
        if left >= 0:
            visible &= j >= col - left
        if right >= 0:
            visible &= j <= col + right
        s = s.masked_fill(~visible, float("-inf"))
        row_lse = torch.logsumexp(s, -1)
        out[q0:q1] = torch.einsum("hij,jhd->ihd", torch.exp(s - row_lse[..., None]), v).to(q.dtype)
        lse[:, q0:q1] = row_lse
    return out, lse


def fa2_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
               softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
               alibi_slopes=None, deterministic=False, return_attn_probs=False,
               block_table=None):
    assert block_table is not None and k.shape[1] % 256 == 0, "FA2 paged KV: pages of k x 256"
    q_starts, k_starts = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    kv_lens = [b - a for a, b in zip(k_starts, k_starts[1:])]
    assert max_seqlen_q >= max(b - a for a, b in zip(q_starts, q_starts[1:]))
    assert max_seqlen_k >= max(kv_lens)
    out, lse = _fa_semantics(q, k, v, q_starts, kv_lens, block_table.tolist(), softmax_scale,
                             causal, window_size, softcap, alibi_slopes)
    return (out, lse, None) if return_attn_probs else out


def fa3_with_kvcache(q, k_cache, v_cache, k=None, v=None, qv=None, rotary_cos=None,
                     rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                     cache_leftpad=None, page_table=None, cu_seqlens_q=None,
                     cu_seqlens_k_new=None, max_seqlen_q=None, rotary_seqlens=None,
                     q_descale=None, k_descale=None, v_descale=None, softmax_scale=None,
                     causal=False, window_size=(-1, -1), attention_chunk=0, softcap=0.0,
                     rotary_interleaved=True, scheduler_metadata=None, num_splits=0,
                     pack_gqa=None, sm_margin=0, return_softmax_lse=False):
    assert page_table is not None and cu_seqlens_q is not None and k is None
    q_starts = cu_seqlens_q.tolist()
    assert max_seqlen_q >= max(b - a for a, b in zip(q_starts, q_starts[1:]))
    out, lse = _fa_semantics(q, k_cache, v_cache, q_starts, cache_seqlens.tolist(),
                             page_table.tolist(), softmax_scale, causal, window_size, softcap,
                             None)
    return (out, lse) if return_softmax_lse else out


def vllm_fa3_varlen(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k=None,
                    seqused_k=None, q_v=None, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=None, softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False, block_table=None, return_softmax_lse=False,
                    out=None, scheduler_metadata=None, q_descale=None, k_descale=None,
                    v_descale=None, num_splits=0, output_scale=None, fa_version=2, s_aux=None,
                    cp_world_size=1, cp_rank=0, cp_tot_seqused_k=None, mask_mod=None,
                    aux_tensors=None, dynamic_causal=None):
    """vLLM's ``vllm_flash_attn.flash_attn_varlen_func`` as its FA3 path takes a paged cache:
    keys counted by ``seqused_k``, a block table, ``window_size`` as a list, the result
    written into ``out`` when given; scheduler metadata, where given, computed for this
    call's lengths and parameters; fp8 q, k and v with descales ``[batch, kv_heads]``, the
    output in bf16."""
    assert fa_version == 3 and block_table is not None and cu_seqlens_k is None
    assert isinstance(window_size, list) and len(window_size) == 2
    q_starts, kv_lens = cu_seqlens_q.tolist(), seqused_k.tolist()
    assert max_seqlen_q >= max(b - a for a, b in zip(q_starts, q_starts[1:]))
    assert max_seqlen_k >= max(kv_lens)
    if scheduler_metadata is not None:
        expected = _schedule_fields(len(kv_lens), max_seqlen_q, max_seqlen_k, q.shape[1],
                                    k.shape[2], q.dtype, k.shape[1], causal, tuple(window_size),
                                    softcap > 0, num_splits, seqused_k)
        assert scheduler_metadata.tolist() == expected, "a schedule of another call"
    q, k, v = _fp8_dequantized(q, k, v, q_starts, q_descale, k_descale, v_descale)
    o, lse = _fa_semantics(q, k, v, q_starts, kv_lens, block_table.tolist(), softmax_scale,
                           causal, tuple(window_size), softcap, None)
    if s_aux is not None:  # (a sink logit a head: mass exp(s_aux), no value; LSE unchanged)
        assert s_aux.dtype == torch.bfloat16 and s_aux.shape == (q.shape[1],)  # (vLLM's rule)
        o = (o.float() * torch.sigmoid(lse.t() - s_aux.float())[..., None]).to(o.dtype)
        SINK_CALLS.append(q.shape[0])
    if q_descale is not None:
        o = o.to(torch.bfloat16)
    if out is not None:
        assert out.dtype == o.dtype
        out.copy_(o)
        o = out
    return (o, lse) if return_softmax_lse else o


SINK_CALLS: list[int] = []  # the stand-in's calls that applied s_aux
SCHEDULES: list[list[int]] = []  # the lengths each stand-in scheduler metadata was made from


def _schedule_fields(batch, max_q, max_k, heads, kv_heads, dtype, page, causal, window,
                     has_softcap, num_splits, lens):
    return [batch, max_q, max_k, heads, kv_heads, int(dtype == torch.float8_e4m3fn), page,
            int(causal), *window, int(has_softcap), num_splits, *lens.tolist()]


def fa3_scheduler_metadata(batch_size, max_seqlen_q, max_seqlen_k, num_heads_q, num_heads_kv,
                           headdim, cache_seqlens, qkv_dtype=torch.bfloat16, headdim_v=None,
                           cu_seqlens_q=None, cu_seqlens_k_new=None, cache_leftpad=None,
                           page_size=None, max_seqlen_k_new=0, causal=False,
                           window_size=(-1, -1), has_softcap=False, num_splits=0,
                           pack_gqa=None, sm_margin=0):
    """vLLM's ``get_scheduler_metadata`` as a record of what it was computed for."""
    assert cache_seqlens.shape == (batch_size,) and page_size is not None
    SCHEDULES.append(cache_seqlens.tolist())
    return torch.tensor(_schedule_fields(batch_size, max_seqlen_q, max_seqlen_k, num_heads_q,
                                         num_heads_kv, qkv_dtype, page_size, causal,
                                         tuple(window_size), has_softcap, num_splits,
                                         cache_seqlens))


def _fp8_dequantized(q, k, v, q_starts, q_descale, k_descale, v_descale):
    """FA3's fp8 inputs in fp32: each token's query heads by its request's descale, the
    pages by the (batch-uniform) K / V descales of their KV head."""
    if q.dtype != torch.float8_e4m3fn:
        assert q_descale is None and k_descale is None and v_descale is None
        return q, k, v
    assert k.dtype == v.dtype == torch.float8_e4m3fn
    batch, kv_heads = len(q_starts) - 1, k.shape[2]
    group = q.shape[1] // kv_heads
    for d in (q_descale, k_descale, v_descale):
        assert d.dtype == torch.float32 and d.shape == (batch, kv_heads)
    req = torch.repeat_interleave(torch.arange(batch), torch.tensor(q_starts).diff())
    qd = q_descale.float()[req].repeat_interleave(group, 1)  # [tokens, heads]
    qd = torch.nn.functional.pad(qd, (0, 0, 0, q.shape[0] - qd.shape[0]))  # (padding rows)
    assert (k_descale == k_descale[:1]).all() and (v_descale == v_descale[:1]).all()
    return (q.float() * qd[..., None], k.float() * k_descale[0][:, None],
            v.float() * v_descale[0][:, None])


@pytest.fixture
def vllm_fa3(monkeypatch):
    """vLLM's FA3 as the only FA3 provider: a minimal ``vllm`` package (no distribution
    metadata, as the kernels packed without the engine)."""
    vllm, fa = types.ModuleType("vllm"), types.ModuleType("vllm.vllm_flash_attn")
    vllm.vllm_flash_attn = fa
    fa.flash_attn_varlen_func, fa.FA3_AVAILABLE = vllm_fa3_varlen, True
    fa.get_scheduler_metadata = fa3_scheduler_metadata
    SCHEDULES.clear()
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.vllm_flash_attn", fa)
    monkeypatch.setitem(sys.modules, "flash_attn_interface", None)  # (not importable)


@pytest.fixture
def stand_ins(monkeypatch):
    fa2 = types.ModuleType("flash_attn")
    fa2.flash_attn_varlen_func = fa2_varlen
    fa3 = types.ModuleType("flash_attn_interface")
    fa3.flash_attn_with_kvcache = fa3_with_kvcache
    monkeypatch.setitem(sys.modules, "flash_attn", fa2)
    monkeypatch.setitem(sys.modules, "flash_attn_interface", fa3)


VARIANTS = {
    "gqa": BASE,
    "window": BASE.with_(sliding_window=7),
    "softcap": BASE.with_(logits_soft_cap=5.0),
    "sinks": BASE.with_(has_sinks=True),
    "non_causal": BASE.with_(attn_type="encoder_only"),
    "non_causal_window": BASE.with_(attn_type="encoder_only", sliding_window=6),
    "alibi": BASE.with_(use_alibi=True),
}


def _params():
    for version, block_size in ((2, 256), (3, 16)):
        for vid, spec in VARIANTS.items():
            if vid == "alibi" and version != 2:
                continue
            for scenario in ("decode_only", "mixed", "long_context", "prefill_only",
                             "padded_batch", "spec_decodes"):
                yield pytest.param(version, block_size, spec, scenario,
                                   id=f"fa{version}-{vid}-{scenario}")


def _glue_lse_errors(version, block_size, spec, scenario, seed):
    """FLASH_ATTN's FA``version`` glue on a ``scenario`` step: its output within the dtype's
    tolerance of fp64 REFERENCE's and its padding rows zero (asserted); returns the LSE's
    error and REFERENCE's own in the dtype, both against fp64."""
    case = make_case(spec, SCENARIOS[scenario], block_size=block_size, seed=seed)
    n = case.metadata.num_actual_tokens
    out, lse = run_backend(lambda s: FLASH_ATTN(s, version=version), case)
    truth, truth_lse = run_backend(REFERENCE, case.to(torch.float64))
    base, base_lse = run_backend(REFERENCE, case)

    def err(a, b):
        return (a[:n].double() - b[:n].double()).abs().max().item()

    assert err(out, truth) <= tolerance(err(base, truth), spec.dtype)
    assert (out[n:] == 0).all() and (lse[n:] == 0).all()
    return err(lse, truth_lse), err(base_lse, truth_lse)


@pytest.mark.parametrize("version,block_size,spec,scenario", list(_params()))
def test_glue_matches_reference(stand_ins, version, block_size, spec, scenario):
    lse_err, base_lse_err = _glue_lse_errors(version, block_size, spec, scenario, 3)
    assert lse_err <= tolerance(base_lse_err, spec.dtype)


@pytest.mark.parametrize("scenario", ["decode_only", "mixed", "padded_batch", "spec_decodes"])
@pytest.mark.parametrize("vid", ["gqa", "window", "softcap", "sinks", "non_causal_window"])
def test_fa3_from_vllm_matches_reference(vllm_fa3, vid, scenario):
    from attn_ops.providers import FA3

    assert FA3.found().distribution == "vllm"
    lse_err, _ = _glue_lse_errors(3, 16, VARIANTS[vid], scenario, 5)
    assert lse_err <= 1e-3


@pytest.mark.parametrize("scenario", ["decode_only", "mixed", "padded_batch"])
def test_vllm_fa3_applies_sinks_in_its_kernel_where_no_lse_is_asked_for(vllm_fa3, scenario):
    """Through vLLM's FA3 the sinks go to the kernel as ``s_aux`` (no LSE pass after it)
    where the caller asks for no LSE; with an LSE asked for they are applied from it."""
    spec = VARIANTS["sinks"]
    case = make_case(spec, SCENARIOS[scenario], block_size=16, seed=2)
    case = dataclasses.replace(case, sinks=case.sinks.to(torch.bfloat16))  # (a model's sinks)
    n = case.metadata.num_actual_tokens
    SINK_CALLS.clear()
    run_backend(lambda s: FLASH_ATTN(s, version=3),
                dataclasses.replace(case, sinks=case.sinks.float()), with_lse=False)
    assert not SINK_CALLS, "fp32 sinks: applied from the LSE (the kernel takes bf16 only)"
    out, _ = run_backend(lambda s: FLASH_ATTN(s, version=3), case, with_lse=False)
    assert SINK_CALLS, "the sinks must reach the kernel as s_aux"
    truth, _ = run_backend(REFERENCE, case.to(torch.float64))
    base, _ = run_backend(REFERENCE, case)
    err = lambda a, b: (a[:n].double() - b[:n].double()).abs().max().item()  # noqa: E731
    assert err(out, truth) <= tolerance(err(base, truth), spec.dtype)
    assert (out[n:] == 0).all()
    SINK_CALLS.clear()
    run_backend(lambda s: FLASH_ATTN(s, version=3), case, with_lse=True)
    assert not SINK_CALLS


def test_fa3_computes_a_steps_scheduler_metadata_once_for_its_layers(vllm_fa3):
    """FA3's scheduler metadata depends on the step's lengths and the call's shapes: the first
    layer of a step computes it, later layers of the same shapes reuse it, a layer of other
    shapes (a window) computes its own, the next step computes its own."""
    spec = VARIANTS["gqa"].with_(dtype=torch.bfloat16)
    windowed = spec.with_(sliding_window=7)
    case = make_case(spec, SCENARIOS["mixed"], block_size=16, seed=1)
    full, local = FLASH_ATTN(spec, version=3), FLASH_ATTN(windowed, version=3)
    lens = case.metadata.seq_lens.tolist()
    for step in range(2):
        meta = full.build_metadata(case.metadata)
        outs = []
        for backend in (full, full, local, full):
            out = torch.empty(case.query.shape[0], spec.num_heads, spec.head_dim,
                              dtype=spec.dtype)
            backend.forward(case.query, case.kv_cache, meta, out)
            outs.append(out)
        assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[3])
        assert SCHEDULES == [lens] * 2 * (step + 1)  # (the full layers', the windowed one's)


@pytest.mark.parametrize("scenario", ["decode_only", "mixed", "padded_batch", "spec_decodes"])
@pytest.mark.parametrize("vid", ["gqa", "window", "sinks"])
def test_fa3_fp8_cache_matches_reference_on_its_rounded_query(vllm_fa3, vid, scenario):
    """An fp8 e4m3 cache through FA3: the query quantized at one scale (amax / 448), K and V
    descaled by the layer's scales; within the policy's tolerance of fp64 REFERENCE computing
    with the same rounded query, and within the fp8 SQNR bound of the unquantized ideal."""
    from attn_ops.backends.flash_attn_kernels import fa3_fp8_query

    spec = VARIANTS[vid].with_(dtype=torch.bfloat16, kv_cache_dtype="fp8_e4m3")
    case = make_case(spec, SCENARIOS[scenario], block_size=16, seed=6)
    n = case.metadata.num_actual_tokens
    backend = FLASH_ATTN(spec, version=3)
    q8, descale = fa3_fp8_query(case.query)
    assert q8.dtype == torch.float8_e4m3fn and q8.float().abs().max() == 448.0
    out, _ = run_backend(lambda s: FLASH_ATTN(s, version=3), case)
    oracle = dataclasses.replace(case, query=backend.kernel_query(case.query))
    truth, _ = run_backend(REFERENCE, oracle.to(torch.float64))
    base, _ = run_backend(REFERENCE, oracle)
    err = lambda a, b: (a[:n].double() - b[:n].double()).abs().max().item()  # noqa: E731
    assert err(out, truth) <= tolerance(err(base, truth), spec.dtype)
    assert (out[n:] == 0).all()
    ideal_case = make_case(spec.with_(kv_cache_dtype="auto", dtype=torch.float64),
                           SCENARIOS[scenario], block_size=16, seed=6)
    ideal, _ = run_backend(REFERENCE, ideal_case)
    assert sqnr_db(out[:n], ideal[:n]) >= FP8_MIN_SQNR_DB[spec.kv_cache_dtype]


@pytest.mark.parametrize("provider", ["vllm", "hopper"])
@pytest.mark.parametrize("vid", ["gqa", "sinks"])
def test_fa3_graph_batches_zero_the_padding_rows_fa3_leaves_unwritten(monkeypatch, vid,
                                                                       provider):
    """A CUDA-graph batch's metadata (the real token count on the device only) through FA3:
    the rows past the real tokens -- which FA3 leaves as they were -- are zero in the output
    and the LSE (and stay finite through the sinks applied from the LSE); the real rows
    match REFERENCE."""
    from attn_ops.cudagraph import CUDAGraphBatch

    if provider == "vllm":
        vllm_fa3.__wrapped__(monkeypatch)
    else:
        fa3 = types.ModuleType("flash_attn_interface")
        fa3.flash_attn_with_kvcache = fa3_with_kvcache
        monkeypatch.setitem(sys.modules, "flash_attn_interface", fa3)
    monkeypatch.setattr("attn_ops.platforms.current_platform",
                        lambda: Platform.parse("cuda:9.0"))  # (graphs on the CPU's tensors)
    spec = VARIANTS[vid].with_(dtype=torch.bfloat16)
    case = make_case(spec, SCENARIOS["decode_only"], block_size=16, seed=2)
    n, reqs = case.metadata.num_actual_tokens, case.metadata.num_reqs
    graphs = CUDAGraphBatch((reqs + 3,), 8, 16, "cpu")
    backend = FLASH_ATTN(spec, version=3)
    meta = backend.graph_metadata(graphs.pad(case.metadata), graphs)
    q = torch.nn.functional.pad(case.query[:n], (0, 0, 0, 0, 0, 3))
    out = torch.full((n + 3, spec.num_heads, spec.head_dim), float("nan"), dtype=spec.dtype)
    lse = torch.full((n + 3, spec.num_heads), float("nan"))
    backend.forward(q, case.kv_cache, meta, out, lse=lse, sinks=case.sinks)
    assert (out[n:] == 0).all() and (lse[n:] == 0).all()
    truth, _ = run_backend(REFERENCE, case.to(torch.float64))
    base, _ = run_backend(REFERENCE, case)
    err = lambda a, b: (a[:n].double() - b[:n].double()).abs().max().item()  # noqa: E731
    assert err(out, truth) <= tolerance(err(base, truth), spec.dtype)


def test_a_preferred_provider_imported_after_the_first_call_serves_the_next(monkeypatch):
    """The provider a kernel call resolved is reused only while no provider's module changed:
    FlashAttention's hopper build imported after vLLM's FA3 served a call serves the next."""
    from attn_ops.providers import FA3

    vllm_fa3.__wrapped__(monkeypatch)
    assert FA3.require("FLASH_ATTN")[0].distribution == "vllm"
    hopper = types.ModuleType("flash_attn_interface")
    monkeypatch.setitem(sys.modules, "flash_attn_interface", hopper)
    assert FA3.require("FLASH_ATTN") == (FA3.providers[0], hopper)


def test_fp8_caches_are_fa3s_only():
    """fp8 e4m3 only through FA3 and a bf16 model; e5m2 nowhere; the reasons say so."""
    sm90 = dataclasses.replace(Platform.parse("cuda:9.0"), assume_packages=True)
    fp8 = BASE.with_(dtype=torch.bfloat16, kv_cache_dtype="fp8_e4m3")
    assert not FLASH_ATTN.not_supported_reasons(fp8, sm90, version=3)
    for version in (2, 4):
        codes = [r.code for r in FLASH_ATTN.not_supported_reasons(fp8, sm90, version=version)]
        assert "kv_cache_dtype" in codes
    codes = [r.code for r in FLASH_ATTN.not_supported_reasons(
        fp8.with_(dtype=torch.float16), sm90, version=3)]
    assert "dtype" in codes
    codes = [r.code for r in FLASH_ATTN.not_supported_reasons(
        fp8.with_(kv_cache_dtype="fp8_e5m2"), sm90, version=3)]
    assert codes


def test_fa3_provider_reasons_name_each_provider_and_how_to_get_one(monkeypatch):
    from attn_ops.providers import FA3

    monkeypatch.setitem(sys.modules, "flash_attn_interface", None)
    monkeypatch.setitem(sys.modules, "vllm.vllm_flash_attn", None)
    reason = FA3.reason("FLASH_ATTN")
    assert reason.code == "package_missing"
    assert str(reason).startswith(
        "no provider of FlashAttention 3 is usable here (flash-attn-3 (FlashAttention's hopper "
        "build): flash_attn_interface is not installed; vLLM's vllm_flash_attn: "
        "vllm.vllm_flash_attn is not installed)")
    assert "vLLM's wheel built for this torch" in reason.hint
    assumed = dataclasses.replace(Platform.parse("cuda:9.0"), assume_packages=True)
    assert FA3.reason("FLASH_ATTN", assumed) is None


def test_a_provider_built_for_another_torch_is_a_reason_not_a_crash(monkeypatch):
    import importlib.metadata

    from attn_ops import capabilities
    from attn_ops.providers import FLASHMLA

    vllm = FLASHMLA.providers[1]
    monkeypatch.setitem(sys.modules, "flash_mla", None)
    monkeypatch.setitem(sys.modules, vllm.module, types.ModuleType(vllm.module))
    monkeypatch.setattr(capabilities, "package_version",
                        lambda d: "0.26.0" if d == "vllm" else None)
    monkeypatch.setattr(importlib.metadata, "requires",
                        lambda d: ["torch==1.0.0", "numpy"] if d == "vllm" else [])
    assert vllm.problem() == f"vllm==0.26.0 is built for torch 1.0.0, this is torch " \
        f"{torch.__version__}"
    assert FLASHMLA.found() is None
    # A copy without metadata is judged by its import: an undefined symbol is the reason.
    monkeypatch.setattr(capabilities, "package_version", lambda d: None)
    monkeypatch.delitem(sys.modules, vllm.module)
    real_find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name: object() if name == vllm.module else real_find(name))

    def broken(name, *args):
        raise ImportError("vllm/_flashmla_C.abi3.so: undefined symbol: _ZN3c10")

    monkeypatch.setattr(importlib, "import_module", broken)
    problem = vllm.problem()
    assert problem.startswith(f"{vllm.module} fails to import (ImportError: vllm/_flashmla_C"
                              ".abi3.so: undefined symbol")
    assert problem.endswith(f"a compiled build must match torch {torch.__version__}")


def test_generation_reasons_on_simulated_platforms(monkeypatch):
    from attn_ops import capabilities
    import importlib.util

    installed = {"flash-attn": "2.8.3"}
    monkeypatch.setattr(capabilities, "package_version", lambda d: installed.get(d))
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name: object() if name == "flash_attn" else None)
    sm80 = Platform.parse("cuda:8.0")
    assert FLASH_ATTN.generation(sm80) == 2
    codes = [r.code for r in FLASH_ATTN.not_supported_reasons(BASE.with_(block_size=16), sm80)]
    assert codes == ["block_size"]
    assert not FLASH_ATTN.not_supported_reasons(BASE.with_(use_alibi=True), sm80)
    installed = {"flash-attn-3": "3.0.0b1"}
    monkeypatch.setattr(capabilities, "package_version", lambda d: installed.get(d))
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name: object() if name == "flash_attn_interface" else None)
    assert FLASH_ATTN.generation(Platform.parse("cuda:9.0")) == 3
    assert FLASH_ATTN.generation(sm80) is None  # FA3 is sm90-only
    (alibi,) = FLASH_ATTN.not_supported_reasons(BASE.with_(use_alibi=True),
                                                Platform.parse("cuda:9.0"))
    assert str(alibi) == ("alibi is not supported by FlashAttention 3; FlashAttention 2 takes "
                          "ALiBi slopes")
    assert [r.code for r in FLASH_ATTN.not_supported_reasons(BASE, sm80)] == ["package_missing"]


def test_unknown_version_is_an_error():
    with pytest.raises(ValueError, match="version=5 is not a FlashAttention generation"):
        FLASH_ATTN(BASE, version=5)


@pytest.mark.gpu
@pytest.mark.parametrize("feature", [None, "SLIDING_WINDOW", "SOFT_CAP", "SINKS"])
@pytest.mark.parametrize("mode", ["tall", "batch", "decode"])
def test_fa4_sm90_modes_stay_right(monkeypatch, mode, feature):
    """COMPOSITE_SM90 on sm90 with FA4 (H200 tuning): prefills of >= tall_tile_min_query rows
    run with 192-row tiles (P through shared memory) -- ``tall`` (batch mode off); prefills of
    one length run in FA4's batch mode -- ``batch``; 12 decodes (96 items at 8 KV heads) run
    in FA4's 64-row tile -- ``decode``. Against REFERENCE, LSE included, with cached contexts,
    a window, a soft cap or sinks, decodes and prefills in the same step."""
    from attn_ops.spec import Feature
    from attn_ops.testing import FEATURE_SPECS, Scenario, assert_matches_reference
    from attn_ops.tuning import MEASURED

    composite = get_backend_class("COMPOSITE_SM90")

    fa4 = pytest.importorskip("flash_attn.cute.interface", reason="FA4 is not installed")
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("sm90 rules")
    calls, real = [], fa4._flash_attn_fwd

    @functools.wraps(real)  # (with its compile cache, which FA4 looks up on the module's name)
    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(fa4, "_flash_attn_fwd", spy)
    tuning = MEASURED["H200"]
    if mode == "tall":
        tuning = tuning.with_(flash_attn={"batch_mode_min_query": None})
    spec = AttentionSpec(num_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16,
                         block_size=128)
    if composite.not_supported_reasons(spec, current_platform()):
        pytest.skip("COMPOSITE_SM90 cannot run here (FlashInfer and flash-attn-4 on sm90)")
    if feature is not None:
        spec = FEATURE_SPECS[Feature[feature]](spec)
    decodes = ((700, 1), (5, 1))
    if mode == "decode":
        decodes = tuple((c, 1) for c in (3000, 5, 130, 2048, 77, 1500, 900, 256, 4000, 1, 640,
                                         129))
    prefills = {"tall": ((0, 1100), (300, 1030)), "batch": ((0, 300), (120, 300), (64, 300)),
                "decode": ((50, 40),)}[mode]
    case = make_case(spec, Scenario(decodes + prefills), block_size=128,
                     device="cuda", seed=0)
    out, lse = run_backend(composite, case, tuning=tuning)
    _, truth_lse = assert_matches_reference(out, case)
    _, base_lse = run_backend(REFERENCE, case)  # at the test's precision
    n = case.metadata.num_actual_tokens

    def err(x):
        return (x[:n].double() - truth_lse[:n].double()).abs().max().item()

    assert err(lse) <= tolerance(err(base_lse), spec.dtype)
    tiles = [kw.get("tile_mn") for kw in calls]
    t = tuning.flash_attn
    if mode == "tall":
        assert (t.tall_tile.rows, t.tall_tile.keys) in tiles
    elif mode == "batch":
        assert any(kw.get("cu_seqlens_q") is None for kw in calls)
    else:  # the decode part
        assert tiles.count((t.decode_tile.rows, t.decode_tile.keys)) == 1, tiles


@pytest.mark.gpu
@pytest.mark.parametrize("scenario", ["decode_only", "mixed", "spec_decodes"])
def test_vllm_fa3_sinks_in_its_kernel_match_the_reference_on_the_gpu(scenario):
    """vLLM's FA3 applying the sinks itself (``s_aux``; no LSE asked for) at real head counts
    (32 / 8 x 128, bf16, page 16, a window), within the policy's tolerance of fp64 REFERENCE."""
    from attn_ops.providers import FA3

    found = FA3.found()
    if not current_platform().is_gpu or found is None or found.distribution != "vllm":
        pytest.skip("vLLM's FA3 does not run here")
    spec = AttentionSpec(num_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16,
                         has_sinks=True, sliding_window=300, block_size=16)
    case = make_case(spec, SCENARIOS[scenario], block_size=16, device="cuda", seed=4)
    case = dataclasses.replace(case, sinks=case.sinks.to(torch.bfloat16))  # (a model's sinks)
    n = case.metadata.num_actual_tokens
    out, _ = run_backend(lambda s: FLASH_ATTN(s, version=3), case, with_lse=False)
    truth, _ = run_backend(REFERENCE, case.to(torch.float64))
    base, _ = run_backend(REFERENCE, case)
    err = lambda a, b: (a[:n].double() - b[:n].double()).abs().max().item()  # noqa: E731
    assert err(out, truth) <= tolerance(err(base, truth), spec.dtype)
    assert (out[n:] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("scenario", ["decode_only", "mixed"])
def test_fa3_fp8_on_the_gpu_is_exact_in_its_lse_and_within_the_fp8_bound(scenario):
    """FA3's fp8 kernel at real head counts (32 / 8 x 128, page 16): its LSE -- computed
    before the probabilities are rounded -- within the policy's tolerance of fp64 REFERENCE
    over the kernel's own e4m3 query; its output, whose probabilities FA3 rounds to e4m3 for
    the PV product, within the fp8 SQNR bound of the unquantized ideal."""
    from attn_ops.providers import FA3

    if not current_platform().is_gpu or FA3.found() is None:
        pytest.skip("FA3 does not run here")
    spec = AttentionSpec(num_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16,
                         kv_cache_dtype="fp8_e4m3", block_size=16)
    case = make_case(spec, SCENARIOS[scenario], block_size=16, device="cuda", seed=8)
    n = case.metadata.num_actual_tokens
    backend = FLASH_ATTN(spec, version=3)
    out, lse = run_backend(lambda s: FLASH_ATTN(s, version=3), case)
    oracle = dataclasses.replace(case, query=backend.kernel_query(case.query))
    _, truth_lse = run_backend(REFERENCE, oracle.to(torch.float64))
    _, base_lse = run_backend(REFERENCE, oracle)
    err = lambda a, b: (a[:n].double() - b[:n].double()).abs().max().item()  # noqa: E731
    assert err(lse, truth_lse) <= tolerance(err(base_lse, truth_lse), spec.dtype)
    ideal_case = make_case(spec.with_(kv_cache_dtype="auto", dtype=torch.float64),
                           SCENARIOS[scenario], block_size=16, device="cuda", seed=8)
    ideal, _ = run_backend(REFERENCE, ideal_case)
    db = sqnr_db(out[:n], ideal[:n])
    print(f"FA3 fp8 {scenario}: output SQNR {db:.1f} dB")
    assert db >= FP8_MIN_SQNR_DB[spec.kv_cache_dtype]
    assert (out[n:] == 0).all() and (lse[n:] == 0).all()

