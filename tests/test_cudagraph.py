"""CUDA graphs: batches padded into persistent buffers (CPU: the padding is exact, stale tails
are overwritten, bad batches are refused), and on the GPU every backend that declares CUDA-graph
support captured once per size -- its op called directly and inside a compiled layer -- then
replayed with batches of changing size and lengths, checked against REFERENCE every replay."""

import math
import random

import numpy as np
import pytest
import torch

from attn_ops import (Attention, AttentionConfig, AttentionSpec, CUDAGraphSupport,
                      build_common_metadata, build_step_metadata, current_platform,
                      get_backend_class)
from attn_ops.cudagraph import CUDAGraphBatch
from attn_ops.registry import backend_family, list_backends
from attn_ops.spec import Feature
from attn_ops.testing import FEATURE_SPECS, capture_graph, random_decode_batch, tolerance

PLATFORM = current_platform()
DEVICE = PLATFORM.device_type
REFERENCE = get_backend_class("REFERENCE")
BLOCK, WIDTH, SIZES = 16, 12, (1, 4, 16)  # page size, max pages per request, capture sizes


def _random_batch(n, num_blocks, rng, device, max_len=WIDTH * BLOCK, qlen=1):
    return random_decode_batch(n, num_blocks, rng, BLOCK, max_len, qlen=qlen, device=device)


def _reference(spec, q, cache, common, **optional):
    out = torch.zeros(q.shape[0], spec.num_heads, spec.v_head_dim, dtype=torch.float64,
                      device=q.device)
    lse = torch.zeros(q.shape[0], spec.num_heads, device=q.device)
    REFERENCE(spec.with_(dtype=torch.float64)).forward(
        q.double(), cache.double(), common, out, lse=lse, **optional)
    base = torch.zeros(q.shape[0], spec.num_heads, spec.v_head_dim, dtype=q.dtype,
                       device=q.device)
    REFERENCE(spec).forward(q, cache, common, base, **optional)
    return out, lse, base


# ---------------------------------------------------------------------------------------------
# Padding (CPU and GPU)


SPEC = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32)


def test_padded_batch_gives_the_same_rows_and_zero_padding():
    rng = random.Random(0)
    graphs = CUDAGraphBatch(SIZES, WIDTH, BLOCK, DEVICE)
    cache = torch.randn(64, 2, BLOCK, 2, 16, device=DEVICE)
    common = _random_batch(3, 64, rng, DEVICE, max_len=80)
    padded = graphs.pad(common)
    assert padded.num_reqs == 4 and padded.slot_mapping.shape[0] == 4
    assert padded.slot_mapping[3].item() == -1
    q = torch.randn(4, 4, 16, device=DEVICE)
    out, lse, _ = _reference(SPEC, q, cache, padded)
    want, want_lse, _ = _reference(SPEC, q[:3], cache, common)
    torch.testing.assert_close(out[:3], want)
    torch.testing.assert_close(lse[:3], want_lse)
    assert (out[3:] == 0).all() and (lse[3:] == 0).all()


def test_a_shorter_batch_leaves_no_stale_tail_behind():
    rng = random.Random(1)
    graphs = CUDAGraphBatch(SIZES, WIDTH, BLOCK, DEVICE)
    graphs.pad(_random_batch(16, 400, rng, DEVICE))  # every row and column in use
    padded = graphs.pad(_random_batch(2, 400, rng, DEVICE, max_len=20))
    assert padded.num_reqs == 4
    assert (padded.block_table[:, 2:] == 0).all() and (padded.block_table[2:] == 0).all()
    assert (padded.seq_lens[2:] == 0).all()
    assert padded.query_start_loc.tolist() == [0, 1, 2, 2, 2]
    assert padded.query_start_loc_cpu.tolist() == [0, 1, 2, 2, 2]


def test_padding_writes_only_what_changed_and_matches_a_fresh_pad():
    """``pad`` skips device writes the buffers already hold (the query offsets of the same
    size, padding rows and columns already clean): batches growing and shrinking in rows and
    table width, each padded batch equal to the same batch padded into fresh buffers."""
    rng = random.Random(4)
    graphs = CUDAGraphBatch(SIZES, WIDTH, BLOCK, DEVICE)
    for n, max_len in ((16, 190), (3, 40), (4, 180), (1, 10), (16, 60), (9, 190), (9, 190),
                       (2, 190), (16, 190)):
        common = _random_batch(n, 400, rng, DEVICE, max_len=max_len)
        got, want = graphs.pad(common), CUDAGraphBatch(SIZES, WIDTH, BLOCK, DEVICE).pad(common)
        for field in ("query_start_loc", "seq_lens", "block_table", "slot_mapping",
                      "query_start_loc_cpu", "seq_lens_cpu", "block_table_cpu",
                      "block_indptr_cpu", "block_indices_cpu"):
            assert torch.equal(getattr(got, field), getattr(want, field)), (n, field)
        size = graphs.size_for(n)
        assert (graphs.block_table[:size, common.block_table.shape[1]:] == 0).all()
        assert (graphs.seq_lens[n:] == 0).all() and (graphs.block_table[n:] == 0).all()
        assert (graphs.slot_mapping[n:] == -1).all()


def test_padding_host_arrays_matches_padding_their_metadata():
    """``pad_arrays`` (a caller's own lengths, block table and slots) gives what ``pad`` of
    the same batch's metadata gives, in buffers shared with ``pad`` calls: batches growing and
    shrinking, decode steps within a page (the block table not uploaded again) and into a new
    one, the buffers' padding kept clean."""
    rng = random.Random(5)
    graphs = CUDAGraphBatch(SIZES, WIDTH, BLOCK, DEVICE)
    fields = ("query_start_loc", "seq_lens", "block_table", "slot_mapping",
              "query_start_loc_cpu", "seq_lens_cpu", "block_table_cpu")

    def arrays(common):
        return (common.seq_lens_cpu.numpy(), common.block_table_cpu.numpy(),
                common.slot_mapping.cpu().numpy())

    for n, max_len, via_pad in ((16, 190, False), (3, 40, False), (4, 180, True),
                                (1, 10, False), (16, 60, True), (9, 190, False),
                                (2, 190, False), (9, 190, True), (16, 190, False)):
        common = _random_batch(n, 400, rng, DEVICE, max_len=max_len)
        if via_pad:
            graphs.pad(common)
            continue
        seq, table, slots = arrays(common)
        for step in range(3):  # (the batch, then decode steps: one more token a request)
            if step:
                had = -(-seq // BLOCK)
                seq = seq + 1
                need = -(-seq // BLOCK)
                if need.max() > WIDTH:
                    break
                grown = np.zeros((n, max(table.shape[1], int(need.max()))), dtype=np.int32)
                grown[:, :table.shape[1]] = table
                for r in np.nonzero(need > had)[0]:
                    grown[r, need[r] - 1] = 300 + r  # (a request entering a new page)
                table = grown
                pos = seq - 1
                slots = table[np.arange(n), pos // BLOCK].astype(np.int64) * BLOCK + pos % BLOCK
                common = build_common_metadata([1] * n, seq.tolist(), table, BLOCK, 400,
                                               device=DEVICE)
            got = graphs.pad_arrays(seq, table, slots, 400)
            want = CUDAGraphBatch(SIZES, WIDTH, BLOCK, DEVICE).pad(common)
            for field in fields:
                assert torch.equal(getattr(got, field), getattr(want, field)), (n, step, field)
            for a, b in zip(got.block_csr(), want.block_csr()):
                assert np.array_equal(a, b), (n, step)
            assert (got.num_actual_tokens, got.max_seq_len, got.num_decodes) == (
                want.num_actual_tokens, want.max_seq_len, want.num_decodes)
            size = graphs.size_for(n)
            assert (graphs.block_table[:size, table.shape[1]:] == 0).all()
            assert (graphs.seq_lens[n:] == 0).all() and (graphs.block_table[n:] == 0).all()
            assert (graphs.slot_mapping[n:] == -1).all()


def test_advancing_a_decode_step_gives_what_padding_it_gives():
    """``advance`` (one more token a request, none entering a page: two adds on the device)
    gives what padding that step's metadata into fresh buffers gives -- the device tensors, the
    host arrays, the page CSR and the host ints -- step after step, from batches padded either
    way and of sizes between capture sizes; a step whose token enters a page, a batch the
    buffers no longer hold and graphs of several query tokens are refused."""
    rng = random.Random(11)
    graphs = CUDAGraphBatch(SIZES, WIDTH, BLOCK, DEVICE)
    fields = ("query_start_loc", "seq_lens", "block_table", "slot_mapping",
              "query_start_loc_cpu", "seq_lens_cpu", "block_table_cpu")
    advanced = refused = 0
    for n, via_pad in ((16, False), (3, True), (9, False), (1, True), (5, False)):
        common = _random_batch(n, 400, rng, DEVICE, max_len=WIDTH * BLOCK - 40)
        seq = common.seq_lens_cpu.numpy().copy()
        table = common.block_table_cpu.numpy().copy()
        slots = common.slot_mapping.cpu().numpy()[:n]
        padded = graphs.pad(common) if via_pad else graphs.pad_arrays(seq, table, slots, 400)
        for step in range(1, 20):
            pos = seq.copy()  # (the new token's position: the last length)
            seq = seq + 1
            if (pos % BLOCK == 0).any():  # (a request enters a page: padded again)
                with pytest.raises(ValueError, match="enters a new page"):
                    graphs.advance(padded)
                refused += 1
                grown = np.zeros((n, max(table.shape[1], int((-(-seq // BLOCK)).max()))),
                                 dtype=np.int32)
                grown[:, :table.shape[1]] = table
                for r in np.nonzero(pos % BLOCK == 0)[0]:
                    grown[r, pos[r] // BLOCK] = 300 + r
                table = grown
                slots = table[np.arange(n), pos // BLOCK].astype(np.int64) * BLOCK + pos % BLOCK
                padded = graphs.pad_arrays(seq, table, slots, 400)
                continue
            padded = graphs.advance(padded)
            advanced += 1
            want = CUDAGraphBatch(SIZES, WIDTH, BLOCK, DEVICE).pad(build_common_metadata(
                [1] * n, seq.tolist(), table, BLOCK, 400, device=DEVICE))
            for field in fields:
                assert torch.equal(getattr(padded, field), getattr(want, field)), (n, step, field)
            for a, b in zip(padded.block_csr(), want.block_csr()):
                assert np.array_equal(a, b), (n, step)
            assert (padded.num_reqs, padded.num_actual_tokens, padded.max_seq_len,
                    padded.num_decodes) == (want.num_reqs, want.num_actual_tokens,
                                            want.max_seq_len, want.num_decodes), (n, step)
            assert (graphs.seq_lens[n:] == 0).all() and (graphs.slot_mapping[n:] == -1).all()
        stale = padded
        graphs.pad(_random_batch(2, 400, rng, DEVICE))
        with pytest.raises(ValueError, match="not the one the graph buffers hold"):
            graphs.advance(stale)
    assert advanced > 50 and refused > 3
    multi = CUDAGraphBatch(SIZES, WIDTH, BLOCK, DEVICE, uniform_query_len=2)
    batch = multi.pad(_random_batch(3, 400, rng, DEVICE, qlen=2))
    with pytest.raises(ValueError, match="more than one query token"):
        multi.advance(batch)


def test_batches_a_graph_cannot_hold_are_refused_with_the_fix():
    rng = random.Random(2)
    graphs = CUDAGraphBatch(SIZES, WIDTH, BLOCK, DEVICE)
    with pytest.raises(ValueError, match="larger than the largest capture size 16"):
        graphs.pad(_random_batch(17, 400, rng, DEVICE))
    prefill = build_common_metadata([1, 5], [4, 5], [[1], [2]], BLOCK, 8, device=DEVICE)
    with pytest.raises(ValueError, match=r"query_lens=\[1, 5\] -- run it eagerly"):
        graphs.pad(prefill)
    wide = build_common_metadata([1], [13 * BLOCK], [list(range(1, 14))], BLOCK, 20,
                                 device=DEVICE)
    with pytest.raises(ValueError, match="13 blocks wide, more than max_blocks_per_req=12"):
        graphs.pad(wide)
    with pytest.raises(ValueError, match="capture_sizes"):
        CUDAGraphBatch((), WIDTH, BLOCK, DEVICE)


def test_a_backend_without_cuda_graph_support_says_so():
    graphs = CUDAGraphBatch(SIZES, WIDTH, BLOCK, DEVICE)
    padded = graphs.pad(_random_batch(2, 64, random.Random(3), DEVICE, max_len=40))
    with pytest.raises(ValueError, match="REFERENCE supports CUDA graphs at level NEVER"):
        REFERENCE(SPEC).graph_metadata(padded, graphs)


def test_declared_levels():
    levels = {name: get_backend_class(name).cudagraph_support(SPEC, PLATFORM.parse("cuda:9.0"))
              for name in ("REFERENCE", "FLASHINFER", "FLASH_ATTN", "FLASH_ATTN_DIFFKV")}
    assert levels == {"REFERENCE": CUDAGraphSupport.NEVER,
                      "FLASHINFER": CUDAGraphSupport.UNIFORM_SINGLE_TOKEN_DECODE,
                      "FLASH_ATTN": CUDAGraphSupport.UNIFORM_BATCH,
                      "FLASH_ATTN_DIFFKV": CUDAGraphSupport.UNIFORM_BATCH}
    cpu = PLATFORM.parse("cpu")
    assert get_backend_class("FLASH_ATTN_DIFFKV").cudagraph_support(SPEC, cpu) \
        is CUDAGraphSupport.NEVER


# ---------------------------------------------------------------------------------------------
# Capture and replay (GPU)


GPU_BASE = AttentionSpec(num_heads=8, num_kv_heads=2, head_dim=64, dtype=torch.float16)
# Llama-3-8B's heads: COMPOSITE_SM90's decode graphs of 16 requests (128 items) run FA4 in its
# 64-row tile, of 1 or 4 FlashInfer's graph decode (test_composite_sm90_decode_graphs_*)
GPU_GQA = AttentionSpec(num_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)


def _graph_params():
    if not PLATFORM.is_gpu:
        return
    for name in list_backends():
        try:
            cls = get_backend_class(name)
        except ImportError:
            continue
        if backend_family(name) != "attention":  # (MLA, recurrent and V4 backends: own tests)
            continue
        if cls.cudagraph_support(GPU_BASE, PLATFORM) < CUDAGraphSupport.UNIFORM_SINGLE_TOKEN_DECODE:
            continue
        specs = {"base": GPU_BASE, "window_sinks": GPU_BASE.with_(sliding_window=40,
                                                                   has_sinks=True),
                 "gqa_d128": GPU_GQA}
        if Feature.DIFF_HEAD_DIM_V in cls.capabilities.features:
            specs["diff_v"] = FEATURE_SPECS[Feature.DIFF_HEAD_DIM_V](GPU_BASE)
        for sid, spec in specs.items():
            if not cls.not_supported_reasons(spec, PLATFORM):
                for mode in ("op", "compiled_layer"):
                    yield pytest.param(name, spec, mode, 1, id=f"{name}-{sid}-{mode}")
                if cls.cudagraph_support(spec, PLATFORM) >= CUDAGraphSupport.UNIFORM_BATCH:
                    yield pytest.param(name, spec, "op", 2, id=f"{name}-{sid}-op-2_tokens")


def _check(spec, got, got_lse, q, cache, common, n, size, **optional):
    """``n`` / ``size``: real / captured rows."""
    truth, truth_lse, base = _reference(spec, q[:n], cache, common, **optional)
    err = (got[:n].double() - truth).abs().max().item()
    allowed = tolerance((base.double() - truth).abs().max().item(), spec.dtype)
    assert err <= allowed, f"replay, {n} of {size} rows: error {err:.3g} > {allowed:.3g}"
    if got_lse is not None:
        assert (got_lse[:n].double() - truth_lse).abs().max().item() < 1e-2
        assert (got_lse[n:size] == 0).all()
    assert (got[n:size] == 0).all(), "padding rows must be zeroed on replay"


@pytest.mark.gpu
@pytest.mark.parametrize("backend,spec,mode,qlen", list(_graph_params()))
def test_capture_once_per_size_then_replay_changing_batches(backend, spec, mode, qlen):
    rng, gen = random.Random(7), torch.Generator(device="cuda").manual_seed(7)
    num_blocks = SIZES[-1] * WIDTH + 1
    graphs = CUDAGraphBatch(SIZES, WIDTH, BLOCK, "cuda", uniform_query_len=qlen)
    largest, hq, hkv = SIZES[-1] * qlen, spec.num_heads, spec.kv_heads
    layer = Attention(spec.with_(block_size=BLOCK), AttentionConfig(backend=backend)).cuda()
    if layer.sinks is not None:
        with torch.no_grad():
            layer.sinks.copy_(torch.randn(hq, generator=gen, device="cuda"))
    cache = layer.allocate_kv_cache(num_blocks)
    cache.copy_(torch.randn(cache.shape, generator=gen, device="cuda").to(cache.dtype))
    q = torch.randn(largest, hq, spec.head_dim, generator=gen, device="cuda").to(spec.dtype)
    k = torch.randn(largest, hkv, spec.head_dim, generator=gen, device="cuda").to(spec.dtype)
    v = torch.randn(largest, hkv, spec.v_head_dim, generator=gen, device="cuda").to(spec.dtype)
    out = torch.zeros(largest, hq, spec.v_head_dim, dtype=spec.dtype, device="cuda")
    lse = torch.zeros(largest, hq, device="cuda")
    optional = {"sinks": layer.sinks.detach()} if layer.sinks is not None else {}
    compiled = None
    if mode == "compiled_layer":
        torch._dynamo.reset()  # one compile per capture size; other tests' compiles don't count
        compiled = torch.compile(layer, fullgraph=True, dynamic=False)
    captured, results = {}, {}

    def run(size, step):
        rows = size * qlen
        if compiled is None:
            meta = step[layer._metadata_key]
            layer.impl.forward(q[:rows], cache, meta, out[:rows], lse=lse[:rows], **optional)
            return out, lse
        return compiled(q[:rows], k[:rows], v[:rows], cache, step, return_lse=True)

    for size in SIZES:  # capture: a batch of exactly that size, warmed up on a side stream
        batch = _random_batch(size, num_blocks, rng, "cuda", qlen=qlen)
        step = build_step_metadata(layer, batch, graphs)
        captured[size], results[size] = capture_graph(lambda: run(size, step))
    for n in (3, 16, 1, 9, 2, 4, 16, 5):  # sizes up and down, lengths new every time
        common = _random_batch(n, num_blocks, rng, "cuda", qlen=qlen)
        step = build_step_metadata(layer, common, graphs)
        size = graphs.size_for(n)
        q[:largest].normal_(generator=gen)  # new queries, padding rows included
        k.normal_(generator=gen)
        v.normal_(generator=gen)
        before = cache.clone()
        captured[size].replay()
        got, got_lse = results[size]
        if compiled is not None:  # the layer wrote this step's K/V; check it landed
            slots = common.slot_mapping
            blocks, offs = slots // BLOCK, slots % BLOCK
            from attn_ops.kv_cache import split_kv_cache

            kc, vc = split_kv_cache(cache, spec.head_dim, spec.v_head_dim)
            assert torch.equal(kc[blocks, offs], k[:n * qlen])
            assert torch.equal(vc[blocks, offs], v[:n * qlen])
            unwritten = torch.ones(cache.shape[0], dtype=torch.bool, device="cuda")
            unwritten[blocks] = False
            assert torch.equal(cache[unwritten], before[unwritten]), "padding wrote the cache"
        _check(spec, got, got_lse, q, cache, common, n * qlen, size * qlen, **optional)


@pytest.mark.gpu
def test_composite_sm90_decode_graphs_run_fa4_from_0_7_to_2_waves():
    """COMPOSITE_SM90 (H200 tuning): decode graphs of 0.7 to 2 waves of (request, KV head)
    items run FA4 (FLASH_ATTN's graph metadata), others FlashInfer's graph decode. (Both are
    replayed against REFERENCE by test_capture_once_per_size_then_replay_changing_batches
    [COMPOSITE_SM90-gqa_d128-*].)"""
    from attn_ops.backends.flash_attn import FlashAttnMetadata
    from attn_ops.backends.flashinfer import FlashInferMetadata
    from attn_ops.platforms import multiprocessor_count
    from attn_ops.tuning import MEASURED

    cls = get_backend_class("COMPOSITE_SM90")
    if cls.not_supported_reasons(GPU_GQA, PLATFORM):
        pytest.skip("COMPOSITE_SM90 (FA4 with FlashInfer on sm90) cannot run here")
    low, high = MEASURED["H200"].composite.graph_fa4_waves
    wave = multiprocessor_count(torch.device("cuda")) / GPU_GQA.kv_heads  # requests
    small, big = math.ceil(low * wave) - 1, math.ceil(low * wave)
    most, too_many = math.floor(high * wave), math.floor(high * wave) + 1
    graphs = CUDAGraphBatch((small, big, most, too_many), WIDTH, BLOCK, "cuda")
    impl = cls(GPU_GQA.with_(block_size=BLOCK), tuning=MEASURED["H200"])
    rng = random.Random(0)
    for n, kind in ((small, FlashInferMetadata), (big, FlashAttnMetadata),
                    (most, FlashAttnMetadata), (too_many, FlashInferMetadata)):
        common = graphs.pad(_random_batch(n, too_many * WIDTH + 1, rng, "cuda"))
        assert isinstance(impl.graph_metadata(common, graphs), kind), n


@pytest.mark.gpu
def test_flashinfer_graphs_on_one_cta_per_sm_replay_against_reference():
    """``Tuning.flashinfer.graph_one_cta_per_sm``: small CUDA-graph decode batches split on a
    grid of one CTA per SM (a new chunk size every replay, the captured grid unchanged),
    replayed with changing sizes and lengths against REFERENCE, padding rows zero."""
    from attn_ops.tuning import Tuning

    if "FLASHINFER" not in [p.values[0] for p in _graph_params()]:
        pytest.skip("FLASHINFER cannot run here")
    tuning = Tuning().with_(flashinfer={"graph_one_cta_per_sm": True})
    rng, gen = random.Random(5), torch.Generator(device="cuda").manual_seed(5)
    sizes, width = (1, 4), 128  # up to 2k keys: chunks of several pages
    num_blocks = sizes[-1] * width + 1
    graphs = CUDAGraphBatch(sizes, width, BLOCK, "cuda")
    layer = Attention(GPU_GQA.with_(block_size=BLOCK),
                      AttentionConfig(backend="FLASHINFER", tuning=tuning)).cuda()
    cache = layer.allocate_kv_cache(num_blocks)
    cache.copy_(torch.randn(cache.shape, generator=gen, device="cuda").to(cache.dtype))
    hq, d = GPU_GQA.num_heads, GPU_GQA.head_dim
    q = torch.randn(sizes[-1], hq, d, generator=gen, device="cuda").to(GPU_GQA.dtype)
    out = torch.zeros_like(q)
    lse = torch.zeros(sizes[-1], hq, device="cuda")
    captured, colocated = {}, set()
    for n in (1, 4, 1, 3, 4, 2, 1, 4):  # the first of each size captures
        common = _random_batch(n, num_blocks, rng, "cuda", max_len=width * BLOCK)
        meta = build_step_metadata(layer, common, graphs)[layer._metadata_key]
        size = graphs.size_for(n)
        colocated.add(graphs.backend_state[layer._metadata_key].decode_ws.last[0][3])
        if size not in captured:
            captured[size], _ = capture_graph(lambda: layer.impl.forward(
                q[:size], cache, meta, out[:size], lse=lse[:size]))
        q.normal_(generator=gen)
        captured[size].replay()
        _check(GPU_GQA, out, lse, q, cache, common, n, size)
    assert min(colocated) > 0, colocated  # (the budget was cut)


@pytest.mark.gpu
def test_flashinfer_graphs_past_the_split_budget_replay_on_one_plan():
    """A capture size past FlashInfer's split budget is planned without a split (its eager
    kernel, no merge) and never planned again: replays with fewer requests and new lengths
    against REFERENCE."""
    from attn_ops.backends import flashinfer_plan as fp
    from attn_ops.routing import Split, SplitMode

    if "FLASHINFER" not in [p.values[0] for p in _graph_params()]:
        pytest.skip("FLASHINFER cannot run here")
    rng, gen = random.Random(3), torch.Generator(device="cuda").manual_seed(3)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    size = 2 * sms // GPU_BASE.kv_heads + 4
    num_blocks = size * WIDTH + 1
    graphs = CUDAGraphBatch((size,), WIDTH, BLOCK, "cuda")
    layer = Attention(GPU_BASE.with_(block_size=BLOCK),
                      AttentionConfig(backend="FLASHINFER")).cuda()
    cache = layer.allocate_kv_cache(num_blocks)
    cache.copy_(torch.randn(cache.shape, generator=gen, device="cuda").to(cache.dtype))
    q = torch.randn(size, 8, 64, generator=gen, device="cuda").to(torch.float16)
    out = torch.zeros_like(q)
    lse = torch.zeros(size, 8, device="cuda")
    plans = []
    graph = None
    for n in (size, size - 3, size - 1, size - 4):  # capture, then replays
        common = _random_batch(n, num_blocks, rng, "cuda")
        meta = build_step_metadata(layer, common, graphs)[layer._metadata_key]
        plans.append(meta.decode_plan)
        if graph is None:
            graph, _ = capture_graph(lambda: layer.impl.forward(q, cache, meta, out, lse=lse))
        q.normal_(generator=gen)
        graph.replay()
        _check(GPU_BASE, out, lse, q, cache, common, n, size)
    planner = graphs.backend_state[layer._metadata_key]
    assert isinstance(planner, fp.GraphPlanner)
    assert planner.decode_ws.last[0][1:3] == (b"", Split(SplitMode.NONE))  # no split, kept


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("slots", [[BLOCK + 5, -1, 0, -1], [-1, -1], [-1, 3, 3 + BLOCK, -1]])
def test_cache_write_skips_padding_without_a_host_sync(dtype, slots):
    """Padding slots (-1) are skipped; a token entering a page (row 0) also zeroes the rows of
    that page the write does not fill, which may hold an earlier request's leftovers."""
    from attn_ops.kv_cache import kv_cache_update

    cache = torch.randn(4, 2, BLOCK, 2, 8, device=DEVICE).to(dtype)
    key = torch.randn(len(slots), 2, 8, device=DEVICE)
    value = torch.randn(len(slots), 2, 8, device=DEVICE)
    scale = torch.ones(1, device=DEVICE) if dtype != torch.float32 else None
    want = cache.clone().view(torch.uint8) if dtype != torch.float32 else cache.clone()
    for i, s in enumerate(slots):
        if s >= 0 and s % BLOCK == 0:
            filled = 1
            while i + filled < len(slots) and slots[i + filled] == s + filled:
                filled += 1
            want[s // BLOCK, :, filled:] = 0
    for i, s in enumerate(slots):
        if s >= 0:
            b, o = divmod(s, BLOCK)
            for j, x in enumerate((key[i], value[i])):
                x = x.to(dtype)
                want[b, j, o] = x.view(torch.uint8) if dtype != torch.float32 else x
    slot_mapping = torch.tensor(slots, device=DEVICE)
    if DEVICE == "cuda":  # captured: a host sync inside would fail the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            kv_cache_update(key, value, cache, slot_mapping, scale, scale)
        graph.replay()
    else:
        kv_cache_update(key, value, cache, slot_mapping, scale, scale)
    got = cache.view(torch.uint8) if dtype != torch.float32 else cache
    assert torch.equal(got, want)


def test_a_model_runs_at_the_lowest_level_of_its_layers_and_says_which(caplog):
    import logging

    from attn_ops.cudagraph import resolve_cudagraph_support
    from attn_ops.spec import LayerKind

    cuda = PLATFORM.parse("cuda:9.0")
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=32, dtype=torch.float16)
    triton_only = AttentionConfig(backend="TRITON_ATTN")
    mixed = AttentionConfig(backend="TRITON_ATTN",
                            backend_per_kind={LayerKind.SLIDING_WINDOW: "REFERENCE"})
    model = torch.nn.ModuleList([Attention(spec, triton_only, platform=cuda),
                                 Attention(spec.with_(sliding_window=8), triton_only,
                                           platform=cuda)])
    with caplog.at_level(logging.WARNING, logger="attn_ops"):
        assert resolve_cudagraph_support(model) is CUDAGraphSupport.UNIFORM_BATCH
        assert resolve_cudagraph_support(model, CUDAGraphSupport.UNIFORM_SINGLE_TOKEN_DECODE) \
            is CUDAGraphSupport.UNIFORM_SINGLE_TOKEN_DECODE
    assert [r.getMessage() for r in caplog.records] == [
        "CUDA graphs: ALWAYS requested, running at UNIFORM_BATCH -- layer 0 uses TRITON_ATTN, "
        "which supports no more"]
    caplog.clear()
    model = torch.nn.ModuleList([Attention(spec, mixed, platform=cuda),
                                 Attention(spec.with_(sliding_window=8), mixed, platform=cuda)])
    with caplog.at_level(logging.WARNING, logger="attn_ops"):
        assert resolve_cudagraph_support(model) is CUDAGraphSupport.NEVER
    assert "layer 1 uses REFERENCE" in caplog.records[-1].getMessage()


def test_partition_ops_leave_out_what_a_graph_cannot_hold():
    """Piecewise graphs: the attention ops Inductor must partition around, per model."""
    from attn_ops.cudagraph import partition_ops
    from attn_ops.spec import LayerKind

    cuda = PLATFORM.parse("cuda:9.0")
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=32, dtype=torch.float16)
    mixed = AttentionConfig(backend="TRITON_ATTN",
                            backend_per_kind={LayerKind.SLIDING_WINDOW: "REFERENCE"})
    model = torch.nn.ModuleList([Attention(spec, mixed, platform=cuda),
                                 Attention(spec.with_(sliding_window=8), mixed, platform=cuda),
                                 Attention(spec, mixed, platform=cuda)])
    # mixed batches (ALWAYS): TRITON_ATTN replays uniform batches only, REFERENCE nothing
    assert partition_ops(model) == ["attn::triton_attention", "attn::reference_attention"]
    assert partition_ops(model, CUDAGraphSupport.UNIFORM_BATCH) == ["attn::reference_attention"]
    # ops that no graph can hold also carry Inductor's tag
    assert torch.Tag.cudagraph_unsafe in torch.ops.attn.reference_attention.default.tags
    assert torch.Tag.cudagraph_unsafe not in torch.ops.attn.triton_attention.default.tags
    import torch._inductor.config as inductor_config

    with inductor_config.patch(custom_should_partition_ops=partition_ops(model)):
        pass  # Inductor's config takes the names as they are
