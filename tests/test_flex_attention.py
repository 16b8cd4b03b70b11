"""FLEX_ATTENTION: custom mask/score mods on the spec (prefix-LM, document masking, a score
bias) against REFERENCE, which applies the same mods; selection of FLEX for them; and no
recompilation when only lengths change."""

import dataclasses

import pytest
import torch

from attn_ops import AttentionSpec, current_platform, get_backend_class, select_backend
from attn_ops.metadata import build_common_metadata
from attn_ops.spec import AttentionType
from attn_ops.tuning import FlexTuning, Tuning
from attn_ops.testing import (SCENARIOS, Scenario, assert_matches_reference,
                              compiled_and_eager_layer, make_case, run_backend)

PLATFORM = current_platform()
DEVICE = PLATFORM.device_type
FLEX = get_backend_class("FLEX_ATTENTION")
REFERENCE = get_backend_class("REFERENCE")
DTYPE = torch.float16 if PLATFORM.is_gpu else torch.float32
BASE = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=16, dtype=DTYPE)
PREFIX = 12


def prefix_lm(request, head, q_pos, kv_pos):
    """Bidirectional over the first PREFIX tokens, causal after them."""
    return (kv_pos <= q_pos) | (kv_pos < PREFIX)


def documents(request, head, q_pos, kv_pos):
    """Requests packing documents of 10 tokens: attend within the query's document only."""
    return q_pos // 10 == kv_pos // 10


def distance_bias(score, request, head, q_pos, kv_pos):
    return score - 0.05 * (head + 1) * (q_pos - kv_pos).abs()


MODS = {
    "prefix_lm": BASE.with_(mask_mod=prefix_lm, attn_type=AttentionType.ENCODER_ONLY),
    "documents": BASE.with_(mask_mod=documents),
    "distance_bias": BASE.with_(score_mod=distance_bias),
    "documents_bias_window": BASE.with_(mask_mod=documents, score_mod=distance_bias,
                                        sliding_window=7),
}
MIXED = Scenario(((30, 1), (9, 1), (0, 25), (14, 9)))


def cases(all_cases, cpu_cases):
    """Every case on GPUs; on the CPU, where each compiles FlexAttention anew (seconds with a
    cold cache), the subset that still takes every code path once."""
    return list(all_cases) if PLATFORM.is_gpu else list(cpu_cases)


@pytest.mark.parametrize("scenario,block_size", cases(
    [("mixed", 32), ("mixed", 128), ("decode_only", 32), ("decode_only", 128)],
    [("mixed", 32), ("decode_only", 128)]))
def test_pages_larger_than_16(block_size, scenario):
    """Pages of 32 and 128 tokens (a BlockMask KV block is one page, so FlexAttention's key
    tile can grow with it), both layouts, with a custom mask and score mod and a window."""
    spec = MODS["documents_bias_window"]
    assert not FLEX.not_supported_reasons(spec.with_(block_size=block_size), PLATFORM)
    case = make_case(spec, SCENARIOS[scenario], block_size=block_size, device=DEVICE, seed=2)
    out, _ = run_backend(FLEX, case, with_lse=FLEX.returns_lse(PLATFORM))
    assert_matches_reference(out, case)


LONG_PREFILLS = Scenario(((300, 1), (0, 150), (40, 90)), pad_tokens=3)


def gather_tuning(threshold):
    """A tuning whose gathered-layout threshold on this device is ``threshold`` (0: always,
    None: never)."""
    side = "gpu" if PLATFORM.is_gpu else "cpu"
    return Tuning().with_(flex={f"gather_min_pairs_per_key_{side}": threshold})


@pytest.mark.parametrize("name,block_size", cases(
    [(n, b) for b in (16, 32) for n in ("plain", "documents_bias_window", "prefix_lm", "alibi")],
    [("plain", 32), ("documents_bias_window", 16), ("prefix_lm", 16), ("alibi", 16)]))
def test_gathered_layout_matches_reference(block_size, name, monkeypatch):
    """Steps with prefills in the gathered layout (forced here: a threshold of 0):
    each request's pages copied into pages of GATHER_PAGE keys, over NaN-poisoned unused
    pages, against REFERENCE; the op passes opcheck."""
    from attn_ops.backends import flex_attention as fa

    tuning = gather_tuning(0)
    spec = {"plain": BASE, "alibi": BASE.with_(use_alibi=True)}.get(name) or MODS[name]
    scenario = SCENARIOS["prefill_only"] if name == "prefix_lm" else LONG_PREFILLS
    case = make_case(spec, scenario, block_size=block_size, device=DEVICE, seed=4)
    impl = FLEX(spec, tuning=tuning)
    meta = impl.build_metadata(case.metadata)
    assert meta.page_map is not None and meta.page_map.shape[1] == fa.GATHER_PAGE // block_size
    assert impl.op_for(meta) is torch.ops.attn.flex_attention_gathered.default
    out, _ = run_backend(FLEX, case, with_lse=FLEX.returns_lse(PLATFORM), tuning=tuning)
    assert_matches_reference(out, case)
    torch.library.opcheck(impl.op_for(meta), impl.op_arguments(
        case.query, case.kv_cache, meta, torch.zeros_like(out),
        alibi_slopes=case.alibi_slopes))
    bad = impl.op_arguments(case.query, case.kv_cache, dataclasses.replace(
        meta, page_map=meta.page_map.float()), torch.zeros_like(out),
        alibi_slopes=case.alibi_slopes)
    with pytest.raises(ValueError, match="page_map must be an integer .* got torch.float32"):
        impl.op_for(meta)(*bad)


@pytest.mark.parametrize("gather", [False, True])
def test_padding_rows_beside_one_request_see_no_key(gather, monkeypatch):
    """A query block of one chunked prefill's rows and padding rows (a CUDA-graph-padded batch)
    has full KV blocks, which skip mask_mod; the padding rows must still see no key: the op
    copies FlexAttention's rows as they are, and a row that sees no key is zeros."""
    tuning = gather_tuning(0 if gather else None)
    case = make_case(BASE, Scenario(((200, 50),), pad_tokens=5), block_size=16, device=DEVICE,
                     seed=5)
    meta = FLEX(BASE, tuning=tuning).build_metadata(case.metadata)
    assert (meta.page_map is not None) == gather
    out, _ = run_backend(FLEX, case, with_lse=FLEX.returns_lse(PLATFORM), tuning=tuning)
    assert (out[case.metadata.num_actual_tokens:] == 0).all()
    assert_matches_reference(out, case)
    assert meta.tables[8].sum() == 0  # (full_num: the only query block holds padding rows)
    unpadded = make_case(BASE, Scenario(((200, 50),)), block_size=16, device=DEVICE, seed=5)
    assert FLEX(BASE, tuning=tuning).build_metadata(unpadded.metadata).tables[8].sum() > 0


@pytest.mark.parametrize("gather", cases([False, True], [False]))  # (CPUs never gather)
def test_new_token_counts_in_one_shape_bucket_compile_once(gather, monkeypatch):
    """A serving loop's steps change their token and request counts every step: query blocks
    and gathered pages are padded to shape buckets, decode batches to powers of two, so steps
    within one bucket reuse FlexAttention's compiled kernel (here steps of 141-250 tokens: 2
    query blocks; 3-4 requests: 4 gathered pages; 300 and 400 tokens: 3 and 4 query blocks,
    both padded to 4; then 3 and 4 decodes: a batch of 4)."""
    from torch._dynamo.utils import counters

    cache = torch.randn(40, 2, 16, 2, 16, device=DEVICE).to(DTYPE)
    impl = FLEX(BASE, tuning=gather_tuning(0 if gather else None))

    def step(query_lens, seq_lens):
        tables = [[1 + 8 * i + j for j in range(8)] for i in range(len(seq_lens))]
        meta = build_common_metadata(query_lens, seq_lens, tables, 16, 40, device=DEVICE)
        q = torch.randn(sum(query_lens), 4, 16, device=DEVICE).to(DTYPE)
        out = torch.empty_like(q)
        impl.forward(q, cache, impl.build_metadata(meta), out)
        return out

    step([1, 70, 70], [9, 70, 100])  # compiles
    before = counters["stats"]["unique_graphs"]
    step([1, 1, 100, 98], [40, 9, 100, 120])
    step([50, 100], [60, 100])  # (2 requests: 2 gathered pages, another bucket when gathering)
    step([1, 1, 120, 128], [5, 6, 128, 128])
    grew = counters["stats"]["unique_graphs"] - before
    assert grew == (1 if gather else 0), f"{grew} new graphs"
    step([1, 100, 100, 99], [9, 100, 128, 99])  # 300 tokens: 3 query blocks, padded to 4
    before = counters["stats"]["unique_graphs"]
    step([100, 100, 100, 100], [100, 128, 110, 100])  # 400 tokens: 4 query blocks
    assert counters["stats"]["unique_graphs"] == before, "4 query blocks compiled again"
    step([1, 1, 1], [5, 9, 30])  # compiles the decode layout
    before = counters["stats"]["unique_graphs"]
    step([1, 1, 1, 1], [5, 9, 30, 77])
    assert counters["stats"]["unique_graphs"] == before, "a decode batch of 4 compiled again"


def test_gathered_layout_in_a_compiled_layer(monkeypatch):
    """The builder's rule and tables traced into a fullgraph-compiled layer."""
    from attn_ops.backends import flex_attention as fa

    gathers = []
    real = fa.gather_pages
    monkeypatch.setattr(fa, "gather_pages", lambda *a: gathers.append(1) or real(*a))
    got, expected = compiled_and_eager_layer(MODS["documents"], "FLEX_ATTENTION", LONG_PREFILLS,
                                             device=DEVICE,
                                             tuning=gather_tuning(0))
    torch.testing.assert_close(got, expected)
    assert len(gathers) == 2  # (eager, then compiled)


def test_key_tile_divides_the_page_and_stays_within_flex_defaults():
    from attn_ops.backends.flex_attention import _key_tile

    bf16 = torch.bfloat16
    assert [_key_tile(bs, 128, bf16) for bs in (16, 32, 48, 64, 128, 256)] == \
        [16, 32, 16, 64, 64, 64]
    assert (_key_tile(128, 64, bf16), _key_tile(128, 256, bf16)) == (128, 32)
    assert (_key_tile(128, 128, torch.float32), _key_tile(128, 64, torch.float32)) == (64, 32)


def test_gpu_kernel_options_deepen_the_decode_pipeline_within_shared_memory():
    from attn_ops.backends import flex_attention as fa

    bf16, f32, h200, rtx = torch.bfloat16, torch.float32, 227 << 10, 99 << 10

    def options(bs, d, dtype, smem=h200, decode=True, tuning=FlexTuning()):
        return fa._gpu_kernel_options(bs, d, d, dtype, decode, smem, None, tuning)

    assert options(16, 128, bf16, decode=False) == {"BLOCK_N": 16}
    assert options(16, 128, bf16) == {"BLOCK_N": 16, "num_stages": 6}
    # 64 keys x (128 + 128) x 4 bytes = 64 KiB a stage: 3 fit in 200 KiB; fp32 head dim 256
    # (32 keys x 512 x 4) too
    assert options(128, 128, f32)["num_stages"] == options(128, 256, f32)["num_stages"] == 3
    # 99 KiB per block (consumer GPUs): bf16 page 128, 32 KiB a stage, 2 fit -- left to
    # FlexAttention; pages of 16 (8 KiB) still take 6
    assert "num_stages" not in options(128, 128, bf16, rtx)
    assert options(16, 128, bf16, rtx)["num_stages"] == 6
    custom = FlexTuning(decode_stages=None, gpu_kernel_options=(("num_warps", 8),))
    assert options(16, 128, bf16, tuning=custom) == {"BLOCK_N": 16, "num_warps": 8}


def test_gathered_layout_rule():
    """Off on the CPU by default, on on GPUs; with a threshold, a long prefill gathers and a
    decode step or a batch of long decodes with one short prefill does not; pages of
    GATHER_PAGE never do."""
    def layout(scenario, block_size=16, tuning=None):
        case = make_case(BASE, scenario, block_size=block_size, device=DEVICE, seed=1)
        return FLEX(BASE, tuning=tuning).build_metadata(case.metadata).page_map is not None

    t = FlexTuning()
    assert t.gather_min_pairs_per_key_cpu is None and t.gather_min_pairs_per_key_gpu > 0
    if DEVICE == "cpu":
        assert not layout(Scenario(((0, 200),)))
    tuning = gather_tuning(16)
    assert layout(Scenario(((0, 200),)), tuning=tuning)
    assert not layout(Scenario(((300, 1), (500, 1), (0, 4))), tuning=tuning)
    assert not layout(Scenario(((0, 200),)), block_size=128, tuning=tuning)


def test_gather_map_copies_each_request_own_pages_in_order():
    from attn_ops.backends.flex_attention_gather import GATHER_PAGE, gather_map, gather_pages

    bs, f = 16, GATHER_PAGE // 16
    table = torch.tensor([[7, 3, 9, 0, 0, 0, 0, 0, 0, 0], [1, 2, 4, 5, 6, 8, 10, 11, 12, 13]])
    seq = torch.tensor([40, 150])  # 3 and 10 pages
    vtable, page_map = gather_map(table, seq, bs)
    assert vtable.tolist() == [[0, 1], [2, 3]] and page_map.shape == (4, f)
    assert page_map[0].tolist() == [7, 3, 9] + [7] * (f - 3)  # past the last page: the first
    assert page_map[1].tolist() == [7] * f
    assert page_map[2].tolist() == [1, 2, 4, 5, 6, 8, 10, 11]
    assert page_map[3].tolist() == [12, 13] + [1] * (f - 2)
    # interleaved [blocks, 2, block_size, heads, dim] -> head-major [2, heads, V * 128, dim]
    cache = torch.randn(14, 2, bs, 2, 8)
    big = gather_pages(cache, page_map, 4)
    assert big.shape == (2, 2, 4 * GATHER_PAGE, 8) and big.is_contiguous()
    first = 2 * GATHER_PAGE + 16 * 3  # request 1's 4th page (physical page 5)
    for part in (0, 1):  # K, V
        assert torch.equal(big[part, :, first:first + 16], cache[5, part].transpose(0, 1))
    packed = torch.randn(14, bs, 2, 24)  # [blocks, block_size, heads, head_dim + head_dim_v]
    big = gather_pages(packed, page_map, 4)
    assert big.shape == (1, 2, 4 * GATHER_PAGE, 24)
    first = 3 * GATHER_PAGE + 16  # request 1's 10th page (physical page 13)
    assert torch.equal(big[0, :, first:first + 16], packed[13].transpose(0, 1))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_gather_kernel_copies_like_torch_ops(dtype):
    """gather_pages_kernel (the copy on GPUs; Triton's interpreter here) against the same copy
    in torch ops: an interleaved cache, and a packed one whose slot (3 heads x 24) is no power
    of two."""
    from attn_ops.backends.flex_attention_gather import (_copy_with_kernel, gather_map,
                                                         gather_pages_torch, gathered_shape,
                                                         slot_major)

    table = torch.tensor([[7, 3, 9, 0, 0, 0, 0, 0, 0, 0], [1, 2, 4, 5, 6, 8, 10, 11, 12, 13],
                          [0, 2, 0, 0, 0, 0, 0, 0, 0, 0]])
    _, page_map = gather_map(table, torch.tensor([40, 150, 20]), 16)
    page_map = page_map.to(DEVICE)  # (6 virtual pages: the cache has room for 8)
    for cache in (torch.randn(14, 2, 16, 2, 8), torch.randn(14, 16, 3, 24)):
        cache = cache.to(DEVICE, dtype)
        slots = slot_major(cache)
        got = slots.new_empty(gathered_shape(slots, page_map, 8))
        _copy_with_kernel(slots, page_map, got)
        copied = page_map.numel() * 16  # (the slots past them are never read)
        assert torch.equal(got[:, :, :copied],
                           gather_pages_torch(cache, page_map, 8)[:, :, :copied])


@pytest.mark.parametrize("name", cases(MODS, ["prefix_lm", "documents_bias_window"]))
def test_custom_mods_match_reference(name):
    spec = MODS[name]
    assert not FLEX.not_supported_reasons(spec, PLATFORM)
    case = make_case(spec, MIXED, block_size=16, device=DEVICE, seed=5)
    n = case.metadata.num_actual_tokens
    out, _ = run_backend(FLEX, case, with_lse=FLEX.returns_lse(PLATFORM))
    truth, _ = assert_matches_reference(out, case)
    exact = case.to(torch.float64)
    plain, _ = run_backend(REFERENCE, dataclasses.replace(
        exact, spec=exact.spec.with_(mask_mod=None, score_mod=None)))
    assert (plain[:n] - truth[:n]).abs().max() > 1e-3, "the mods must change the result"


def test_custom_mods_select_flex_and_say_who_else_can():
    sel = select_backend(MODS["documents"], PLATFORM)
    assert sel.backend == "FLEX_ATTENTION"
    reasons = {c.name: [str(r) for r in c.reasons] for c in sel.candidates}
    assert any(r.startswith("custom_mask_or_score_mod is not supported; supported by "
                            "FLEX_ATTENTION, REFERENCE") for r in reasons["TRITON_ATTN"]
               + reasons.get("CPU_ATTN", []))


def test_lengths_changing_step_to_step_compile_once():
    from torch._dynamo.utils import counters

    spec = BASE.with_(sliding_window=9)
    cache = torch.randn(32, 2, 16, 2, 16, device=DEVICE).to(DTYPE)
    impl = FLEX(spec)
    q = torch.randn(3, 4, 16, device=DEVICE).to(DTYPE)

    def step(lens):
        tables = [[1 + 8 * i + j for j in range(-(-s // 16))] for i, s in enumerate(lens)]
        meta = build_common_metadata([1, 1, 1], lens, tables, 16, 32, device=DEVICE)
        out = torch.empty_like(q)
        impl.forward(q, cache, meta, out)
        return out

    step([5, 40, 17])  # compiles
    before = counters["stats"]["unique_graphs"]
    for lens in ([6, 41, 18], [90, 3, 120], [1, 1, 128]):
        step(lens)
    assert counters["stats"]["unique_graphs"] == before, "recompiled on new lengths"


def test_compiled_layer_matches_eager():
    got, expected = compiled_and_eager_layer(MODS["documents"], "FLEX_ATTENTION", MIXED,
                                             device=DEVICE)
    torch.testing.assert_close(got, expected)


def test_step_tables_made_once_by_the_builder_equal_those_made_in_the_op():
    """With the cache's block count in the common metadata the builder makes the step's tables
    (FlexMetadata, shared by layers); without it the op makes them in every call."""
    from attn_ops.backends.flex_attention import FlexMetadata

    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32)
    case = make_case(spec, SCENARIOS["mixed"], block_size=16, device=DEVICE, seed=2)
    impl = FLEX(spec)
    prepared = impl.build_metadata(case.metadata)
    assert isinstance(prepared, FlexMetadata) and impl.op_for(prepared) is not impl.op
    per_call = impl.build_metadata(dataclasses.replace(case.metadata, num_blocks=None))
    outs = []
    for meta in (prepared, per_call):
        out = torch.zeros(case.query.shape[0], 4, 16, device=DEVICE)
        args = impl.op_arguments(case.query, case.kv_cache, meta, out)
        impl.op_for(meta)(*args)
        torch.library.opcheck(impl.op_for(meta), args)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    with pytest.raises(ValueError, match="built for a cache of"):
        impl.op_for(prepared)(*impl.op_arguments(case.query, case.kv_cache[:-1], prepared,
                                                 outs[0]))


def test_a_gpu_cache_past_32_bit_offsets_is_refused_with_the_block_count_that_fits():
    """FlexAttention's GPU kernel offsets K and V with 32-bit integers (an illegal memory
    access on the H200 past 2^31 elements): the op refuses such a cache, naming its size and
    the most blocks that fit. (A stand-in tensor: only the device, shape and size are read.)"""
    from types import SimpleNamespace

    from attn_ops.backends.flex_attention import _check_cache_size

    per_block = 2 * 16 * 8 * 128
    big = SimpleNamespace(device=torch.device("cuda"), shape=(140 * 512 + 1, 2, 16, 8, 128),
                          numel=lambda: (140 * 512 + 1) * per_block)
    with pytest.raises(ValueError, match=rf"2348843008 elements.*at most {(2**31 - 1) // per_block}"
                                         r" blocks, or use TRITON_ATTN"):
        _check_cache_size(big)
    _check_cache_size(SimpleNamespace(device=torch.device("cuda"), shape=(100 * 512 + 1,),
                                      numel=lambda: (100 * 512 + 1) * per_block))
    big.device = torch.device("cpu")  # (measured on GPUs only)
    _check_cache_size(big)


@pytest.mark.parametrize("name", cases(["documents_bias_window", "alibi"],
                                      ["documents_bias_window"]))
def test_decode_steps_run_one_batch_element_per_request_like_the_packed_layout(name):
    """Decode-only steps get the decode layout (one FlexAttention batch element per request,
    its own pages as KV blocks, the batch padded to a power of two): REFERENCE's result with
    custom mods, window and ALiBi, equal to the packed layout the op makes per call, padding
    rows zero; the op passes opcheck."""
    from attn_ops.backends.flex_attention import FlexMetadata, decode_batch

    spec = MODS["documents_bias_window"] if name != "alibi" else BASE.with_(use_alibi=True)
    scenario = Scenario(((30, 1), (9, 1), (47, 1)), pad_tokens=2)
    case = make_case(spec, scenario, block_size=16, device=DEVICE, seed=7)
    impl = FLEX(spec)
    prepared = impl.build_metadata(case.metadata)
    assert isinstance(prepared, FlexMetadata) and prepared.decode
    assert impl.op_for(prepared) is torch.ops.attn.flex_attention_decode.default
    assert prepared.tables[0].shape[0] == decode_batch(5) == 8
    per_call = impl.build_metadata(dataclasses.replace(case.metadata, num_blocks=None))
    outs = []
    for meta in (prepared, per_call):
        out = torch.full((case.query.shape[0], 4, 16), float("nan"), device=DEVICE,
                             dtype=case.query.dtype)
        args = impl.op_arguments(case.query, case.kv_cache, meta, out,
                                 alibi_slopes=case.alibi_slopes)
        impl.op_for(meta)(*args)
        outs.append(out)
    torch.library.opcheck(impl.op_for(prepared), impl.op_arguments(
        case.query, case.kv_cache, prepared, torch.zeros_like(outs[0]),
        alibi_slopes=case.alibi_slopes))
    assert_matches_reference(outs[0], case)
    # (two compiled kernels: fp16 outputs may differ in the last bit, as seen on the H200)
    torch.testing.assert_close(outs[0], outs[1], atol=1e-3, rtol=1e-3)
    assert (outs[0][3:] == 0).all()  # the padding rows


def test_small_decode_batches_split_each_request_own_pages_without_full_blocks():
    """Decode steps of few (request, KV head) pairs on GPUs take about decode_programs_per_sm
    programs per SM in splits (FlexAttention's SPLIT_KV) and list no full KV blocks -- with
    full blocks FlexAttention cuts the whole cache's length into the splits, not each request's
    pages; the tables without full blocks still give REFERENCE's result."""
    from attn_ops.backends import flex_attention as fa
    from attn_ops.routing import flex_decode_splits

    t = FlexTuning()
    # 4 x 132 programs over batch x 8 KV heads, to a power of two; none below 2
    assert [flex_decode_splits(b, 8, 132, t) for b in (1, 2, 8, 16, 32, 64)] == \
        [64, 32, 8, 4, 2, None]
    assert flex_decode_splits(1, 8, None, t) is None  # (not a GPU)
    assert fa._gpu_kernel_options(16, 128, 128, torch.bfloat16, True, 227 << 10, 8, t) == \
        {"BLOCK_N": 16, "num_stages": 6, "SPLIT_KV": 8}
    assert flex_decode_splits(1, 8, 132, FlexTuning(decode_programs_per_sm=None)) is None

    case = make_case(BASE, Scenario(((30, 1), (9, 1), (47, 1))), block_size=16, device=DEVICE,
                     seed=5)
    full_idx = 9  # (tables: ..., kv_num, kv_idx, full_num, full_idx)
    no_splits = Tuning().with_(flex={"decode_programs_per_sm": None})
    assert FLEX(BASE, tuning=no_splits).build_metadata(
        case.metadata).tables[full_idx].shape[-1] > 0
    # 4 x 8 programs over 4 (the batch's power of two) x KV heads: splits of 2 and more
    splits = Tuning().with_(flex={"decode_num_sms": 8 * BASE.kv_heads})
    assert flex_decode_splits(4, BASE.kv_heads, None, splits.flex) >= 2
    meta = FLEX(BASE, tuning=splits).build_metadata(case.metadata)
    assert meta.decode and meta.tables[full_idx].shape[-1] == 0
    out, _ = run_backend(FLEX, case, tuning=splits, with_lse=FLEX.returns_lse(PLATFORM))
    assert_matches_reference(out, case)


def test_decode_batches_are_powers_of_two():
    from attn_ops.backends.flex_attention import decode_batch

    assert [decode_batch(n) for n in (1, 2, 3, 5, 8, 9, 64, 65, 256)] == \
        [1, 2, 4, 8, 8, 16, 64, 128, 256]


def _prefill_blocks(spec, scenario, seed):
    """FLEX on ``scenario`` (pages of 16, the paged layout: not gathered) checked against
    REFERENCE; then the partial and full KV block counts of each query block its builder
    made."""
    case = make_case(spec, scenario, block_size=16, device=DEVICE, seed=seed)
    tuning = gather_tuning(None)
    out, _ = run_backend(FLEX, case, with_lse=FLEX.returns_lse(PLATFORM), tuning=tuning)
    meta = FLEX(spec, tuning=tuning).build_metadata(case.metadata)
    assert_matches_reference(out, case)
    assert meta.page_map is None
    tables = meta.tables
    return tables[6].flatten().tolist(), tables[8].flatten().tolist()


@pytest.mark.parametrize("window", cases([None, 40], [40]))
def test_long_prefills_skip_pages_no_query_sees_and_run_whole_pages_without_the_mask(window):
    """A query block of one long prefill lists only the pages its queries can see (causal,
    window) and passes the pages all of them see in whole as full blocks (no mask_mod); the
    result is REFERENCE's. (The tables are checked too: the pruning alone could not change a
    result.)"""
    spec = BASE.with_(sliding_window=window, logits_soft_cap=5.0)
    kv_num, full_num = _prefill_blocks(spec, Scenario(((0, 300), (37, 150))), seed=11)
    # query block 1: request 0's rows 128..255 -- pages 0..7 (keys 0..127) seen in whole by all,
    # pages 8..15 in part; with a window of 40, only keys 88..255: pages 5..15, none whole
    if window is None:
        assert (full_num[1], kv_num[1]) == (8, 8)
    else:
        assert (full_num[1], kv_num[1]) == (0, 11)
    assert full_num[0] == 0  # rows 0..127 see no page in whole (each sees its own prefix)


@pytest.mark.parametrize("window", cases([None, 40], [40]))
def test_long_bidirectional_prefills_prune_and_use_full_pages_like_reference(window):
    """Encoder-only (non-causal) attention over long requests: a query block sees keys on both
    sides (within the window, if any); pruned and full pages give REFERENCE's result."""
    spec = BASE.with_(attn_type=AttentionType.ENCODER_ONLY, sliding_window=window)
    kv_num, full_num = _prefill_blocks(spec, Scenario(((0, 300), (0, 150))), seed=12)
    # query block 1: request 0's rows 128..255 of 300 keys (19 pages, the last partial)
    if window is None:  # all 19 pages visible; the 18 whole ones are full
        assert (full_num[1], kv_num[1]) == (18, 1)
    else:  # keys 89..294: pages 5..18, none seen whole by every row
        assert (full_num[1], kv_num[1]) == (0, 14)
