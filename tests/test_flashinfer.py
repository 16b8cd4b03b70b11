"""FLASHINFER and COMPOSITE_SM90 (planned by attn_ops.backends.flashinfer_plan): host
page-table conversion, planning and the op's side of each kernel on the CPU against stand-in
kernels; compile and the composite's routes on the GPU (their correctness matrix is the
registry-generated one in test_backends_matrix.py)."""

import math
import os
import random

import pytest
import torch

from attn_ops import (Attention, AttentionConfig, AttentionSpec, Platform, build_batch,
                      get_backend_class)
from attn_ops.backends.flashinfer_plan import PART, FlashInferMetadata, paged_kv_csr
from attn_ops.kv_cache import BlockAllocator
from attn_ops.routing import DeviceFacts, Kernel, Split, SplitMode
from attn_ops.tuning import MEASURED

FLASHINFER = get_backend_class("FLASHINFER")
COMPOSITE = get_backend_class("COMPOSITE_SM90")
H200 = MEASURED["H200"]
SPEC = AttentionSpec(num_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_paged_kv_csr_matches_a_direct_computation(block_size):
    rng = random.Random(block_size)
    seq_lens = [rng.randint(0, 70) for _ in range(9)]
    width = max(-(-s // block_size) for s in seq_lens) + 2
    table = torch.randint(0, 1000, (len(seq_lens), width), dtype=torch.int32)
    indptr, indices, last = paged_kv_csr(torch.tensor(seq_lens), table, block_size)
    want_indptr, want_indices, want_last = [0], [], []
    for row, s in zip(table.tolist(), seq_lens):
        pages = -(-s // block_size)
        want_indices += row[:pages]
        want_indptr.append(want_indptr[-1] + pages)
        want_last.append(s - (pages - 1) * block_size if pages else 0)
    assert indptr.tolist() == want_indptr and indices.tolist() == want_indices
    assert last.tolist() == want_last
    assert indptr.dtype == indices.dtype == last.dtype == torch.int32


def _codes(spec, platform):
    return sorted(r.code for r in FLASHINFER.not_supported_reasons(spec, platform))


def test_reasons_on_simulated_platforms():
    sm90 = Platform.parse("cuda:9.0")
    base = [c for c in _codes(SPEC, sm90) if c.startswith("package")]  # installed or not
    assert _codes(SPEC, Platform.parse("cuda:7.5")) == \
        sorted(["compute_capability", *base])
    assert _codes(SPEC.with_(head_dim=72), sm90) == sorted(["head_dim", *base])
    assert _codes(SPEC.with_(dtype=torch.float32), sm90) == sorted(["dtype", *base])
    assert _codes(SPEC.with_(sliding_window=64, attn_type="encoder_only"), sm90) == \
        sorted(["feature:bidirectional_window", *base])
    assert _codes(SPEC.with_(use_alibi=True), sm90) == sorted(["feature:alibi", *base])
    assert "platform" in _codes(SPEC, Platform.parse("cpu"))


def test_missing_flashinfer_is_a_reason_with_the_supported_range(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    (reason,) = [r for r in FLASHINFER.not_supported_reasons(SPEC, Platform.parse("cuda:9.0"))
                 if r.code.startswith("package")]
    assert str(reason) == ("package flashinfer-python is not installed; "
                           "pip install 'flashinfer-python>=0.7.2,<0.8'")


@pytest.mark.parametrize("version,code", [("0.6.9", "package_too_old"),
                                          ("0.8.0", "package_too_new")])
def test_wrong_flashinfer_version_is_a_reason(monkeypatch, version, code):
    import importlib.util

    from attn_ops import capabilities

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(capabilities, "package_version", lambda dist: version)
    codes = _codes(SPEC, Platform.parse("cuda:9.0"))
    assert codes == [code]


@pytest.mark.gpu
def test_compiled_layer_with_plans_made_outside_the_graph_matches_eager():
    spec = SPEC.with_(sliding_window=100, has_sinks=True)
    attn = Attention(spec, AttentionConfig(backend="FLASHINFER")).cuda()
    with torch.no_grad():
        attn.sinks.copy_(torch.randn(32))
    cache = attn.allocate_kv_cache(256)
    alloc = BlockAllocator(256, attn.block_size, shuffle=True)
    meta = build_batch(alloc, [0, 1, 2], [300, 17, 0], [1, 1, 45], device="cuda")
    t = meta.num_actual_tokens
    q = torch.randn(t, 32, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(t, 8, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    plans = attn.impl.build_metadata(meta)
    assert isinstance(plans, FlashInferMetadata)
    torch._dynamo.reset()
    eager = attn(q, k, v, cache, plans)
    compiled = torch.compile(attn, fullgraph=True)(q, k, v, cache, plans)
    torch.testing.assert_close(compiled, eager)


@pytest.mark.gpu
def test_decodes_past_the_split_budget_keep_their_plan_and_stay_right():
    """More decodes than FlashInfer's split budget (two CTAs per SM), then a prefill: the
    decode part is planned without a split, and the next step -- every request a page longer
    -- keeps that plan (no FlashInfer call); both steps against REFERENCE."""
    from attn_ops.backends import flashinfer as fi
    from attn_ops.testing import Scenario, assert_matches_reference, make_case, run_backend

    spec = AttentionSpec(num_heads=8, num_kv_heads=2, head_dim=128, dtype=torch.float16,
                         block_size=16)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    n = 2 * sms // spec.kv_heads + 3
    rng = random.Random(0)
    ctx = [rng.randint(1, 40) for _ in range(n)]
    plans = []
    for step in range(2):
        lens = [c + 16 * step for c in ctx]
        case = make_case(spec, Scenario(tuple((c, 1) for c in lens) + ((3, 9),)),
                         block_size=16, device="cuda", seed=step)
        out, _ = run_backend(FLASHINFER, case, with_lse=False)
        assert_matches_reference(out, case)
        plans.append(FLASHINFER(spec).build_metadata(case.metadata).decode_plan)
    assert PART.decode(plans[0]).library_plan == PART.decode(plans[1]).library_plan  # kept
    planner = fi._EAGER_PLANNERS[FLASHINFER(spec).metadata_key(), case.metadata.seq_lens.device]
    assert planner.decode_ws.last[0][1:3] == (b"", Split(SplitMode.NONE))  # (no page counts)


@pytest.mark.gpu
@pytest.mark.parametrize("feature", [None, "SLIDING_WINDOW", "SINKS"])
def test_short_decodes_that_fill_the_sms_run_tritons_kernel_and_stay_right(feature):
    """COMPOSITE_SM90 (H200 tuning): a step of short decodes with 3.5 (request, KV head) items
    per SM runs TRITON_ATTN's decode kernel, followed by a prefill through FA4: against
    REFERENCE, LSE included."""
    from attn_ops.testing import (FEATURE_SPECS, Scenario, assert_matches_reference, make_case,
                                  run_backend, tolerance)
    from attn_ops.spec import Feature

    if COMPOSITE.not_supported_reasons(SPEC, Platform.parse("cuda:9.0")) or \
            torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("COMPOSITE_SM90 needs sm90, FlashInfer and flash-attn-4")
    MANY_ITEMS_PER_SM = H200.triton.many_items_per_sm
    spec = AttentionSpec(num_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16,
                         block_size=16)
    if feature is not None:
        spec = FEATURE_SPECS[Feature[feature]](spec)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    n = -(-int(MANY_ITEMS_PER_SM * sms) // spec.kv_heads)
    rng = random.Random(1)
    scen = Scenario(tuple((rng.randint(0, 1023), 1) for _ in range(n)) + ((5, 40),))
    case = make_case(spec, scen, block_size=16, device="cuda", seed=0)
    out, lse = run_backend(COMPOSITE, case, tuning=H200)
    _, truth_lse = assert_matches_reference(out, case)
    _, base_lse = run_backend(get_backend_class("REFERENCE"), case)  # at the test's precision
    t = case.metadata.num_actual_tokens

    def err(x):
        return (x[:t].double() - truth_lse[:t].double()).abs().max().item()

    assert err(lse) <= tolerance(err(base_lse), spec.dtype)
    plan = COMPOSITE(spec, tuning=H200).build_metadata(case.metadata).decode_plan
    assert PART.decode(plan).kernel is Kernel.TRITON


def test_layers_that_need_different_plans_get_different_step_metadata_keys():
    full, windowed = FLASHINFER(SPEC), FLASHINFER(SPEC.with_(sliding_window=128))
    assert full.metadata_key() == FLASHINFER(SPEC).metadata_key()
    assert full.metadata_key() != windowed.metadata_key()


def test_build_step_metadata_builds_once_per_key():
    from attn_ops import build_step_metadata
    from attn_ops.models.llama import ModelConfig, TinyLlama

    cfg = ModelConfig(num_layers=4, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                      intermediate_size=64, vocab_size=32, sliding_window=8,
                      sliding_window_every=2)
    model = TinyLlama(cfg, AttentionConfig(backend="REFERENCE"))
    alloc = BlockAllocator(16, model.block_size)
    meta = build_batch(alloc, [0], [0], [5])
    step = build_step_metadata(model, meta)
    key = model.layers[0].attn.impl.metadata_key()
    assert list(step) == [key] and step[key] is meta and key[0] == "REFERENCE"


def test_step_backends_are_the_model_layers_distinct_keys():
    """What an engine computes once instead of walking the modules every step: one backend
    per distinct metadata key, in layer order, building what the model itself builds."""
    from attn_ops import build_step_metadata, step_backends

    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32)
    model = torch.nn.ModuleList([Attention(spec, AttentionConfig(backend=b)) for b in (
        "REFERENCE", "FLEX_ATTENTION", "REFERENCE", "FLEX_ATTENTION")])
    backends = step_backends(model)
    assert backends == [(model[0].impl.metadata_key(), model[0].impl),
                        (model[1].impl.metadata_key(), model[1].impl)]
    alloc = BlockAllocator(16, 16)
    meta = build_batch(alloc, [0], [0], [5])
    assert list(build_step_metadata(backends, meta)) == list(build_step_metadata(model, meta))


def _attend(q, k_cache, v_cache, pages, kv_len, scale, cap, causal, window_left):
    """One request's attention in fp64, as FlashInfer and FlashAttention define it: its
    ``kv_len`` keys in ``pages``, queries bottom-right aligned, ``window_left`` keys left of
    each query (None: unbounded). Returns the output rows and the LSE ``[heads, rows]``
    (natural log)."""
    group = q.shape[1] // k_cache.shape[2]
    k = k_cache[pages].flatten(0, 1)[:kv_len].repeat_interleave(group, 1).double()
    v = v_cache[pages].flatten(0, 1)[:kv_len].repeat_interleave(group, 1).double()
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    if cap:
        s = cap * torch.tanh(s / cap)
    qpos = torch.arange(kv_len - q.shape[0], kv_len)[:, None]
    kpos = torch.arange(kv_len)[None, :]
    masked = (kpos > qpos) if causal else torch.zeros_like(kpos > qpos)
    if window_left is not None:
        masked |= kpos < qpos - window_left
    s = s.masked_fill(masked, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v), s.logsumexp(-1)


def _paged_run_standin(float_ws, int_ws, plan, q, k_cache, v_cache, qo_indptr, kv_indptr,
                       kv_indices, last_page_len, out, lse, causal, layout, window_left,
                       enable_pdl, *rest):
    """FlashInfer's ``paged_run`` (FA2/FA3 module, NHD cache) in plain torch, with its
    semantics: request ``i``'s queries are rows ``qo_indptr[i]:qo_indptr[i+1]`` of ``q``, its
    keys the pages ``kv_indices[kv_indptr[i]:kv_indptr[i+1]]`` of which the last holds
    ``last_page_len[i]`` tokens; window ``window_left`` keys left of the query (-1: none); the
    LSE in base 2; a request without pages (CUDA-graph padding) gets zero rows and LSE -inf.
    (The arguments after ``enable_pdl``: six optional tensors, the soft cap, the scale, ...)"""
    cap, scale = rest[6], rest[7]
    page = k_cache.shape[1]
    for i in range(qo_indptr.shape[0] - 1):
        q0, q1 = int(qo_indptr[i]), int(qo_indptr[i + 1])
        pages = kv_indices[int(kv_indptr[i]):int(kv_indptr[i + 1])].long()
        kv_len = (pages.shape[0] - 1) * page + int(last_page_len[i]) if pages.numel() else 0
        o, row_lse = _attend(q[q0:q1], k_cache, v_cache, pages, kv_len, scale, cap, causal,
                             window_left if window_left >= 0 else None)
        out[q0:q1] = o.to(out.dtype)
        if lse is not None:
            lse[q0:q1] = (row_lse / math.log(2)).t().to(lse.dtype)


def _fa4_standin(q, k_cache, v_cache, *, seqused_k, page_table, softmax_scale, causal,
                 softcap, window_size_left, window_size_right, num_splits, return_lse, out, lse,
                 cu_seqlens_q=None, max_seqlen_q=None, max_seqlen_k=None):
    """FlashAttention 4's ``_flash_attn_fwd`` over a paged cache in plain torch, with its
    semantics: request ``b``'s queries are rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``, its
    ``seqused_k[b]`` keys in pages ``page_table[b]``, bottom-right aligned; LSE ``[heads,
    tokens]`` in natural log. Without ``cu_seqlens_q`` (batch mode) ``q`` and ``out`` are
    ``[B, S, heads, D]``, request ``b``'s queries ``q[b]``, and the LSE is ``[B, heads, S]``
    (FA4's shapes; checked)."""
    page = k_cache.shape[1]
    if cu_seqlens_q is None:
        assert q.dim() == 4 and out.shape[:3] == q.shape[:3] and max_seqlen_q is None
        assert not return_lse or lse.shape == (q.shape[0], q.shape[2], q.shape[1])
        parts = [(q[b], out[b], lse[b] if return_lse else None) for b in range(q.shape[0])]
    else:
        starts = cu_seqlens_q.tolist()
        parts = [(q[q0:q1], out[q0:q1], lse[:, q0:q1] if return_lse else None)
                 for q0, q1 in zip(starts, starts[1:])]
        # FA4 sizes its grid from the bounds: rows or keys past them would go uncomputed
        longest_q = max(q1 - q0 for q0, q1 in zip(starts, starts[1:]))
        assert max_seqlen_q >= longest_q, f"max_seqlen_q={max_seqlen_q} < {longest_q} rows"
        assert max_seqlen_k >= int(seqused_k.max()), f"max_seqlen_k={max_seqlen_k}"
    for b, (q_b, out_b, lse_b) in enumerate(parts):  # (views: writes land in out and lse)
        kv_len = int(seqused_k[b])
        pages = page_table[b, :-(-kv_len // page)].long()
        o, row_lse = _attend(q_b, k_cache, v_cache, pages, kv_len, softmax_scale, softcap,
                             causal, window_size_left)
        out_b.copy_(o)
        if lse_b is not None:
            lse_b.copy_(row_lse)


@pytest.fixture
def standin_flashinfer(monkeypatch):
    """FlashInfer's module and the CUDA bits replaced by stand-ins, so the planner runs on the
    CPU; returns the list of the stand-in plan calls' ``(kv_indptr, fixed_split_size,
    disable_split_kv, num_colocated_ctas)``."""
    from attn_ops.backends import flashinfer as fi
    from attn_ops.backends import flashinfer_plan as fp

    calls = []

    class Module:
        def plan(self, float_ws, int_ws, host, qo, kv_indptr, *rest):
            calls.append((kv_indptr.tolist(), *rest[-4:-1]))
            return [len(calls), 7]

        paged_run = staticmethod(_paged_run_standin)

    class Event:
        def record(self):
            pass

        def synchronize(self):
            pass

    real_empty = torch.empty
    for module in (fi, fp):  # (the planner plans with it, the op runs it)
        monkeypatch.setattr(module, "flashinfer_module", lambda *a: Module())
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **k: real_empty(*a, **k))
    return calls


def _planner(spec, sms=132, tuning=H200):
    """FLASHINFER's eager planner on the CPU, for a GPU of ``sms`` SMs."""
    from attn_ops.backends import flashinfer_plan as fp
    from attn_ops.routing import PartRoute, flashinfer_decode_split

    def route(requests, max_pages, block_size, rows):
        return PartRoute(Kernel.FLASHINFER_FA2, flashinfer_decode_split(
            requests, spec.kv_heads, max_pages, block_size, sms, tuning.flashinfer))

    return fp.Planner(spec, torch.device("cpu"), tuning, route, Kernel.FLASHINFER_FA2,
                      facts=DeviceFacts(sms, (9, 0)))


def _graph_planner(spec, graphs, sms=132, tuning=H200):
    from attn_ops.backends import flashinfer_plan as fp

    return fp.GraphPlanner(spec, graphs, tuning, facts=DeviceFacts(sms, (9, 0)))


def test_planner_reuses_the_plan_in_the_workspace_while_page_counts_stay(standin_flashinfer):
    """FA2's plan reads only query and page-count offsets: a decode step in which no request
    entered a new page keeps the previous plan (no FlashInfer call); one that did replans.
    (FlashInfer's module and the CUDA bits are stand-ins: this checks the planner's logic.)"""
    from attn_ops.metadata import build_common_metadata

    calls = standin_flashinfer
    spec = AttentionSpec(num_heads=8, num_kv_heads=2, head_dim=64, dtype=torch.float16)
    planner = _planner(spec)

    def step(lens, tables=([0, 1, 5], [2, 3, 4])):
        return planner(build_common_metadata([1, 1], lens, tables, 16, 8))

    first = step([20, 40])
    again = step([21, 41])  # one token more each, same pages
    assert len(calls) == 1 and torch.equal(again.decode_plan, first.decode_plan)
    moved = step([33, 41])  # request 0 enters its third page
    assert len(calls) == 2 and calls[-1] == ([0, 3, 6], 1, False, 0)  # (chunks of 1 page)
    assert PART.decode(moved.decode_plan).library_plan == (2, 7)  # the new plan


def test_planner_keeps_a_plan_without_split_while_the_requests_stay(standin_flashinfer):
    """Past FlashInfer's split budget (two CTAs per SM: here 2 * 132 // 8 = 33 requests) its
    rule cannot split, so the planner asks for no split outright -- and such a plan does not
    depend on the lengths: it is kept while requests enter new pages, and made again only when
    the batch changes."""
    from attn_ops.backends import flashinfer_plan as fp
    from attn_ops.metadata import build_common_metadata

    calls = standin_flashinfer
    spec = AttentionSpec(num_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    planner = _planner(spec)

    def step(lens):
        tables = [[r * 4 + i for i in range(-(-n // 16))] for r, n in enumerate(lens)]
        return planner(build_common_metadata([1] * len(lens), lens, tables, 16, 4 * len(lens)))

    first = step([16] * 34)
    moved = step([17] * 34)  # every request enters its second page
    assert calls == [([i for i in range(35)], -1, True, 0)]
    assert PART.decode(moved.decode_plan).library_plan == \
        PART.decode(first.decode_plan).library_plan
    qo, kv_indptr, last, kv_indices = fp.part_tables(
        moved.tables, moved.seq_lens, moved.block_table, PART.decode(moved.decode_plan))
    assert qo.tolist() == list(range(35)) and kv_indptr.tolist() == list(range(0, 70, 2))
    assert last.tolist() == [1] * 34
    assert kv_indices.tolist() == [r * 4 + i for r in range(34) for i in range(2)]
    step([17] * 33)  # fewer requests: FlashInfer's rule again
    assert len(calls) == 2 and calls[-1][1:] == (-1, False, 0)
    common = build_common_metadata([1, 1], [5, 9], [[0, 1], [2, 3, 4]], 4, 8)
    assert planner(common).tables is common.device_tables.buffer  # (the builder copies nothing)


def test_graph_plans_past_the_split_budget_are_made_once(standin_flashinfer, monkeypatch):
    """CUDA-graph decode batches: within FlashInfer's split budget a split is replanned every
    step; past it, a capture size is planned without a split once and replayed on that plan
    while lengths and pages change."""
    from attn_ops.backends import flashinfer_plan as fp
    from attn_ops.cudagraph import CUDAGraphBatch
    from attn_ops.metadata import build_common_metadata

    calls = standin_flashinfer
    plan = fp.flashinfer_module().plan
    # (in CUDA-graph mode FlashInfer's plan vector is the same at every step of a size)
    monkeypatch.setattr(fp, "flashinfer_module", lambda *a: type("M", (), {
        "plan": staticmethod(lambda *args: plan(*args) and [3, 7])})())
    spec = AttentionSpec(num_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    graphs = CUDAGraphBatch((8, 40), 4, 16, "cpu")  # budget: 2 * 132 // 8 = 33 requests
    planner = _graph_planner(spec, graphs)

    def step(n, length):
        tables = [[r * 4 + i for i in range(-(-length // 16))] for r in range(n)]
        return planner(graphs.pad(build_common_metadata([1] * n, [length] * n, tables, 16,
                                                        4 * n)))

    step(38, 20)
    step(36, 40)  # fewer requests (padded to 40), every one a page longer
    assert calls == [([0] + [2 * i for i in range(1, 39)] + [76] * 2, -1, True, 0)]
    step(8, 20)
    step(8, 40)
    # within the budget, every step: 64 items, 2 CTAs a request on 2 * 64 of the 264
    assert len(calls) == 3 and calls[-1][1:] == (-1, False, 264 - 128)


def test_small_graph_batches_split_on_one_cta_per_sm(standin_flashinfer, monkeypatch):
    """A CUDA-graph decode batch of fewer (request, KV head) items than SMs is planned with
    FlashInfer's rule (planned again every step: the chunk size lives in the device workspace)
    under a budget of one CTA per SM, ``size * (SMs // items)`` per KV head: the rest of its
    two per SM declared taken. From one item per SM, or with ``GRAPH_ONE_CTA_PER_SM`` off: its
    whole budget."""
    from attn_ops.backends import flashinfer_plan as fp
    from attn_ops.cudagraph import CUDAGraphBatch
    from attn_ops.metadata import build_common_metadata

    calls = standin_flashinfer
    plan = fp.flashinfer_module().plan
    monkeypatch.setattr(fp, "flashinfer_module", lambda *a: type("M", (), {
        "plan": staticmethod(lambda *args: plan(*args) and [3, 7])})())
    spec = AttentionSpec(num_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    graphs = CUDAGraphBatch((1, 4, 20), 256, 16, "cpu")
    planner = _graph_planner(spec, graphs)

    def colocated(n, length, planner=planner):  # the step's num_colocated_ctas
        tables = [[r * 256 + i for i in range(-(-length // 16))] for r in range(n)]
        planner(graphs.pad(build_common_metadata([1] * n, [length] * n, tables, 16, 5120)))
        assert calls[-1][1:3] == (-1, False)  # FlashInfer's rule, always a split
        return calls[-1][3]

    # 132 SMs, 264 CTAs: 1 request (8 items) 16 CTAs per KV head; 4 (3 padded to 4): 4 each
    assert [colocated(1, 4096), colocated(1, 16), colocated(4, 1024), colocated(3, 64)] == [
        264 - 128] * 4
    assert colocated(20, 1024) == 0  # 160 items
    off = H200.with_(flashinfer={"graph_one_cta_per_sm": False})
    assert colocated(1, 4096, planner=_graph_planner(spec, graphs, tuning=off)) == 0


def test_a_graph_plan_that_changes_between_replays_is_refused(standin_flashinfer):
    """FlashInfer's CUDA-graph plans must give the same host vector at every step of a capture
    size (the captured grid depends on it); the stand-in's plan changes at every call."""
    from attn_ops.cudagraph import CUDAGraphBatch
    from attn_ops.metadata import build_common_metadata

    spec = AttentionSpec(num_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    graphs = CUDAGraphBatch((8,), 4, 16, "cpu")
    planner = _graph_planner(spec, graphs)
    tables = [[r * 4, r * 4 + 1] for r in range(8)]
    planner(graphs.pad(build_common_metadata([1] * 8, [5] * 8, tables, 16, 32)))
    with pytest.raises(RuntimeError, match="plan for capture size 8 changed"):  # (new pages)
        planner(graphs.pad(build_common_metadata([1] * 8, [17] * 8, tables, 16, 32)))


@pytest.mark.parametrize("size", [8, 24])  # within and past the split budget (2 * 8 // 2)
def test_graph_batches_against_a_standin_kernel(standin_flashinfer, monkeypatch, size):
    """A decode batch padded to a CUDA-graph size and planned by the graph planner: the real
    rows as REFERENCE computes them unpadded, the padding rows (requests without pages) zero
    -- the op's side of FlashInfer's CUDA-graph mode, on the CPU with the stand-in kernel."""
    from attn_ops.backends import flashinfer as fi
    from attn_ops.cudagraph import CUDAGraphBatch
    from attn_ops.testing import Scenario, assert_matches_reference, make_case

    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32)
    n = size - 3
    case = make_case(spec, Scenario(tuple((7 * i % 40, 1) for i in range(n))))
    graphs = CUDAGraphBatch((size,), 16, 4, "cpu")
    meta = _graph_planner(spec, graphs, sms=8)(graphs.pad(case.metadata))
    q = torch.cat([case.query, torch.randn(3, 4, 16)])
    out, lse = torch.full((size, 4, 16), float("nan")), torch.full((size, 4), float("nan"))
    fi._flashinfer_attention(*FLASHINFER(spec).op_arguments(q, case.kv_cache, meta, out,
                                                            lse=lse))
    assert_matches_reference(out, case)
    assert (out[n:] == 0).all() and (lse[n:] == 0).all()


def test_graph_metadata_advances_on_the_device_as_planning_the_step_again(standin_flashinfer):
    """A decode batch advanced by ``CUDAGraphBatch.advance`` (one more token a request, none
    entering a page): FLASHINFER's graph metadata of the step before, handed to
    ``advance_graph_metadata``, is kept with its last-page lengths advanced on the device, and
    its tables then hold what planning that step afresh writes -- step after step, padding rows
    untouched. Metadata the planner's tables no longer hold is not advanced."""
    from attn_ops.cudagraph import CUDAGraphBatch
    from attn_ops.metadata import build_common_metadata

    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32)
    backend, size, page = FLASHINFER(spec, tuning=H200), 8, 4
    graphs = CUDAGraphBatch((size,), 16, page, "cpu")
    planner = graphs.backend_state[backend._key] = _graph_planner(spec, graphs, sms=8)
    seq = [5, 9, 21, 33, 13]  # (the next token of each at a page's second row: three steps)
    tables = [[10 * r + i for i in range(16)] for r in range(len(seq))]

    def step(lens):
        return build_common_metadata([1] * len(lens), lens, tables, page, 64)

    padded = graphs.pad(step(seq))
    meta = planner(padded)
    for _ in range(3):
        seq = [n + 1 for n in seq]
        padded = graphs.advance(padded)
        assert backend.advance_graph_metadata(meta, padded, graphs) is meta
        fresh = CUDAGraphBatch((size,), 16, page, "cpu")
        want = _graph_planner(spec, fresh, sms=8)
        want(fresh.pad(step(seq)))
        assert torch.equal(planner.tables, want.tables), seq
    # (the tables now hold another batch, of the same pages: the same plan)
    other = planner(graphs.pad(step([n - 1 for n in seq])))
    assert not planner.advance(meta, len(seq)) and planner.advance(other, len(seq))


VARIANTS = {"flashinfer": ("FLASHINFER", H200), "composite_generic": ("COMPOSITE_SM90", None),
            "composite_h200": ("COMPOSITE_SM90", H200)}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("feature", [None, "SLIDING_WINDOW", "SOFT_CAP", "SINKS"])
@pytest.mark.parametrize("scenario", ["mixed", "long_context", "many_decodes", "one_wave",
                                      "fills_the_sms", "uniform_prefills", "spec_decodes",
                                      "spec_decodes_only"])
def test_op_arguments_against_a_standin_kernel(standin_flashinfer, monkeypatch, scenario,
                                               feature, variant):
    """The op's side of each part's kernel -- plan vectors, each part's views of the step's
    one table tensor (or, for FA4 and TRITON_ATTN parts, of the common metadata's rows),
    query/output rows, LSE, windows, soft cap, sinks -- checked on the CPU (8 SMs):
    FlashInfer's ``paged_run`` and FA4's forward are replaced by plain-torch attention with
    their semantics, TRITON_ATTN's kernel runs in Triton's interpreter, and the op's results
    must match REFERENCE. FLASHINFER; COMPOSITE_SM90 with the generic tuning (FA4 prefills,
    FlashInfer decodes) and with the H200's (also FA4 decodes near one wave -- ``one_wave`` --
    and TRITON_ATTN for short decodes that fill the SMs -- ``fills_the_sms``). ``many_decodes``:
    past the split budget, the plan kept by the no-split rule; ``uniform_prefills``: prefills of
    one length, which FA4 runs in batch mode; ``spec_decodes``: decodes of up to 4 query rows
    -- FA4 must be told their longest, which the stand-in checks."""
    import sys
    import types

    from attn_ops.backends import flashinfer as fi
    from attn_ops.testing import (FEATURE_SPECS, SCENARIOS, Scenario, assert_matches_reference,
                                  make_case)
    from attn_ops.spec import Feature
    from attn_ops.tuning import GENERIC

    backend, tuning = VARIANTS[variant]
    tuning = tuning or GENERIC
    # The case's tensors are CPU tensors: TRITON_ATTN's kernel runs on them only in Triton's
    # interpreter, which the test session turns on where there is no GPU.
    if (scenario == "fills_the_sms" and variant == "composite_h200"
            and os.environ.get("TRITON_INTERPRET") != "1"):
        pytest.skip("TRITON_ATTN's kernel on CPU tensors needs Triton's interpreter (CPU CI)")
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32)
    if feature is not None:
        spec = FEATURE_SPECS[Feature[feature]](spec)
    for name in ("flash_attn", "flash_attn.cute", "flash_attn.cute.interface"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    batch_calls = []  # per FA4 call: batch mode?

    def fa4(*args, **kwargs):
        batch_calls.append(kwargs.get("cu_seqlens_q") is None)
        return _fa4_standin(*args, **kwargs)

    sys.modules["flash_attn.cute.interface"]._flash_attn_fwd = fa4
    uniform = tuning.flash_attn.batch_mode_min_query
    scen = {"many_decodes": Scenario(tuple((c, 1) for c in range(3, 60, 5)) + ((4, 6),)),
            "one_wave": Scenario(((40, 1), (9, 1), (30, 1), (0, 7))),
            "fills_the_sms": Scenario(tuple((c, 1) for c in range(3, 115, 7)) + ((4, 6),)),
            "uniform_prefills": Scenario(((12, 1), (40, 1), (0, uniform), (30, uniform),
                                          (100, uniform))),
            # about one wave of decodes of up to 4 query rows (speculative decoding)
            "spec_decodes": Scenario(((21, 4), (9, 1), (30, 3), (0, 10)), decode_threshold=4),
            }.get(scenario) or SCENARIOS[scenario]
    impl = get_backend_class(backend)(spec, tuning=tuning)
    composite = backend == "COMPOSITE_SM90"
    for seed in range(2):  # (the second step keeps the no-split plan of the first)
        case = make_case(spec, scen, seed=seed)
        meta = impl.build_metadata(case.metadata)
        q = case.query
        out = torch.full((q.shape[0], 4, 16), float("nan"))
        lse = torch.full(q.shape[:2], float("nan"))
        run = impl.op_for(meta) if composite else fi._flashinfer_attention
        args = impl.op_arguments(q, case.kv_cache, meta, out, lse=lse, sinks=case.sinks)
        if composite and seed == 0 and feature is None and scenario in ("mixed", "one_wave"):
            torch.library.opcheck(run, args)  # (its op runs on the CPU too)
        run(*args)
        decode = PART.decode(meta.decode_plan).kernel
        assert (decode is Kernel.TRITON) == (variant == "composite_h200"
                                             and scenario == "fills_the_sms")
        assert (decode is Kernel.FA4) == (variant == "composite_h200"
                                          and scenario in ("one_wave", "spec_decodes",
                                                           "spec_decodes_only"))
        assert any(batch_calls) == (composite and scenario == "uniform_prefills")
        truth, truth_lse = assert_matches_reference(out, case)
        n = case.metadata.num_actual_tokens
        torch.testing.assert_close(lse[:n].double(), truth_lse[:n].double(), atol=1e-4, rtol=1e-4)
        assert (out[n:] == 0).all() and (lse[n:] == 0).all()  # padding rows


@pytest.mark.parametrize("backend", ["FLASHINFER", "COMPOSITE_SM90"])
def test_one_graph_serves_every_batch_composition(standin_flashinfer, backend):
    """Parts with no request or one request make plans and tables of sizes 0 and 1, on which
    Dynamo would specialize (a mixed-batch model hit its recompile limit on the H200): the
    planner's tensors are marked so that one graph serves decodes only, prefills only, one of
    each and many of each. (The graph is not run: the op needs FlashInfer on a GPU.)"""
    from attn_ops.metadata import build_common_metadata

    spec = AttentionSpec(num_heads=8, num_kv_heads=2, head_dim=64, dtype=torch.float16)
    impl = get_backend_class(backend)(spec, tuning=H200)
    planner = impl.make_planner(torch.device("cpu"))
    graphs = []

    def backend_fn(gm, example_inputs):
        graphs.append(gm)
        return lambda *args: None

    def layer(q, out, m):
        impl.op(q, q.new_zeros(4, 2, 16, 2, 64), out, None, m.float_workspace, m.tables,
                m.seq_lens, m.block_table, m.decode_workspace, m.decode_plan, m.prefill_workspace,
                m.prefill_plan, None, None, None, 0.125, None, None, True)

    compiled = torch.compile(layer, backend=backend_fn, fullgraph=True)
    torch._dynamo.reset()
    for qlens, lens in (([1, 1, 1], [20, 40, 9]), ([1], [5]), ([7], [7]), ([1, 5], [30, 5]),
                        ([1, 1, 3, 9], [17, 33, 3, 40]), ([2, 2], [2, 20])):
        tables = [[r * 3 + i for i in range(-(-n // 16))] for r, n in enumerate(lens)]
        m = planner(build_common_metadata(qlens, lens, tables, 16, 64,
                                          max_blocks_per_req=4))  # (a fixed width, as engines)
        q = torch.zeros(16, 8, 64, dtype=torch.float16)  # (tokens padded, as in piecewise graphs)
        compiled(q, torch.empty_like(q), m)
    assert len(graphs) == 1
