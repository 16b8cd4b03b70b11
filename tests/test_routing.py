"""The routing policy (attn_ops.routing) as pure functions: each rule picks what was measured
fastest where it was measured (H200, 132 SMs; docs/tuning.md), the tuning turns routes off, and
``explain`` prints the route of every part of a step."""

import dataclasses

import pytest
import torch

from attn_ops import AttentionSpec, Platform, routing
from attn_ops.routing import DeviceFacts, Kernel, Split, SplitMode, StepShape
from attn_ops.tuning import GENERIC, MEASURED, FlashAttnTuning, Tuning

H200 = MEASURED["H200"]
SM90 = DeviceFacts(132, (9, 0))
SPEC = AttentionSpec(num_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
DECODE_TILE = FlashAttnTuning().decode_tile


def composite(batch, ctx, *, tuning=H200, triton=True, fa4_tile=DECODE_TILE, rows=1):
    """(kernel, FlashInfer split) of COMPOSITE_SM90's decode part: ``batch`` decodes of
    ``ctx`` keys, 8 KV heads, page 128."""
    r = routing.composite_decode_route(batch, 8, ctx // 128, 128, rows, SM90, tuning,
                                       triton_takes_spec=triton, fa4_decode_tile=fa4_tile)
    return r.kernel, r.split


FA2 = Kernel.FLASHINFER_FA2
OWN, NONE = Split(SplitMode.LIBRARY_RULE), Split(SplitMode.NONE)


def fixed(pages):
    return Split(SplitMode.FIXED, pages)


@pytest.mark.parametrize("batch,ctx,expected", [
    (1, 4096, fixed(2)), (1, 32768, fixed(16)), (2, 2048, fixed(2)), (4, 1024, fixed(2)),
    (8, 1024, fixed(4)), (8, 4096, fixed(16)),
    (8, 8192, OWN),  # chunks of 4k keys: FlashInfer's own rule
    (32, 1024, OWN), (33, 1024, OWN),
    (34, 1024, NONE), (256, 8192, NONE)])  # past FlashInfer's split budget
def test_flashinfer_split_rule_picks_the_measured_best(batch, ctx, expected):
    split = routing.flashinfer_decode_split(batch, 8, ctx // 128, 128, 132, H200.flashinfer)
    assert split == expected


def test_flashinfer_fixed_chunks_fill_the_sms_without_overfilling():
    for batch in range(1, 17):
        for pages in (1, 7, 64, 300):
            split = routing.flashinfer_decode_split(batch, 8, pages, 16, 132, H200.flashinfer)
            if split.mode is SplitMode.FIXED:  # never more CTAs than SMs, nor fewer than half
                ctas = batch * 8 * -(-pages // split.chunk_pages)
                assert ctas <= 132 and (ctas * 2 > 132 or split.chunk_pages == 1)
    off = H200.flashinfer.__class__(own_rule_min_chunk_keys=None)
    assert routing.flashinfer_decode_split(1, 8, 32, 128, 132, off) == OWN


@pytest.mark.parametrize("batch,ctx,expected", [
    # FA4 in its 64-row decode tile where measured fastest, TRITON_ATTN for short decodes that
    # fill the SMs, FlashInfer elsewhere
    (4, 4096, (FA2, fixed(8))), (8, 1024, (Kernel.FA4, None)), (8, 16384, (FA2, OWN)),
    (12, 4096, (Kernel.FA4, None)), (16, 32768, (Kernel.FA4, None)), (32, 16384, (FA2, OWN)),
    (64, 1024, (Kernel.TRITON, None)), (128, 1024, (Kernel.TRITON, None)),
    (256, 1024, (FA2, NONE)), (64, 2048, (FA2, NONE)), (64, 8192, (FA2, NONE)),
    (64, 16384, (Kernel.FA4, None)), (256, 32768, (Kernel.FA4, None))])
def test_composite_decode_route_picks_the_measured_best(batch, ctx, expected):
    assert composite(batch, ctx) == expected


def test_composite_without_fa4s_decode_tile_or_triton():
    # FA4's own tile near one wave of short decodes; FlashInfer past 4k keys
    assert composite(12, 4096, fa4_tile=None) == (Kernel.FA4, None)
    assert composite(16, 1024, fa4_tile=None) == (Kernel.FA4, None)
    assert composite(12, 8192, fa4_tile=None) == (FA2, OWN)
    assert composite(64, 1024, triton=False) == (FA2, NONE)
    # speculative decodes (several rows): neither TRITON_ATTN nor FA4's decode tile
    assert composite(64, 1024, rows=3)[0] is FA2 and composite(8, 1024, rows=3)[0] is FA2


def test_the_generic_tuning_decodes_with_flashinfer_only():
    for batch in (1, 8, 12, 16, 64, 128, 256):
        for ctx in (1024, 4096, 32768):
            assert composite(batch, ctx, tuning=GENERIC)[0] is FA2


@pytest.mark.parametrize("items,keys,wins", [
    (32, 4096, False),  # B=4 at 8 KV heads: FlashInfer's splits, 2x
    (64, 1024, True), (64, 8192, True), (64, 16384, False),  # B=8
    (96, 1024, True), (96, 8192, True), (96, 16384, False),  # B=12
    (128, 1024, True), (128, 32768, True),  # B=16: every length
    (256, 16384, False), (256, 32768, False),  # B=32: FlashInfer
    (512, 8192, False), (512, 16384, True), (2048, 32768, True),  # B=64, B=256
])
def test_fa4_decode_rule_picks_the_measured_best(items, keys, wins):
    assert routing.fa4_decode_wins(items, keys, 132, H200.composite) is wins


@pytest.mark.parametrize("size,fa4", [
    # the band's bounds (11/12, 33/34) and the measured sizes (8, 12, 16, 32, 64, 128)
    (8, False), (11, False), (12, True), (16, True), (32, True), (33, True), (34, False),
    (64, False), (128, False)])
def test_composite_graph_decode_band(size, fa4):
    assert routing.composite_graph_decode_runs_fa4(size, 8, SM90, H200.composite,
                                                   DECODE_TILE) is fa4
    assert not routing.composite_graph_decode_runs_fa4(size, 8, SM90, GENERIC.composite,
                                                       DECODE_TILE)


def test_graph_decode_budget_of_one_cta_per_sm():
    t = H200.flashinfer
    # 1 request (8 items): 16 CTAs per KV head, the rest of 264 declared taken
    assert routing.flashinfer_graph_colocated_ctas(1, 8, 132, t) == 264 - 128
    assert routing.flashinfer_graph_colocated_ctas(4, 8, 132, t) == 264 - 128
    assert routing.flashinfer_graph_colocated_ctas(20, 8, 132, t) == 0  # 160 items
    off = dataclasses.replace(t, graph_one_cta_per_sm=False)
    assert routing.flashinfer_graph_colocated_ctas(1, 8, 132, off) == 0


def test_fa4_tall_tile_for_long_16bit_prefills_at_head_dim_128():
    t = FlashAttnTuning()
    bf16, long = torch.bfloat16, t.tall_tile_min_query
    assert routing.fa4_tile(9, 128, 128, bf16, long, 4, t) == t.tall_tile
    assert routing.fa4_tile(9, 128, 128, torch.float16, 8192, 4, t) == t.tall_tile
    assert all(routing.fa4_tile(9, 128, 128, bf16, long, g, t) == t.tall_tile
               for g in (1, 2, 6, 8, 16))
    for args in ((9, 128, 128, bf16, long - 1, 4), (10, 128, 128, bf16, 8192, 4),
                 (9, 192, 128, bf16, 8192, 4), (9, 64, 64, bf16, 8192, 4),
                 (9, 128, 128, bf16, 8192, 5), (9, 128, 128, bf16, 8192, 7)):
        assert routing.fa4_tile(*args, t) is None, args  # FA4's own tile
    least = t.tall_tile_min_query_batch  # batch mode (no decode rows) from fewer rows
    assert routing.fa4_tile(9, 128, 128, bf16, least, 4, t, batch=True) == t.tall_tile
    assert routing.fa4_tile(9, 128, 128, bf16, least - 1, 4, t, batch=True) is None
    assert routing.fa4_tile(9, 128, 128, bf16, least, 4, t) is None
    assert routing.fa4_tile(9, 128, 128, bf16, 8192, 4, FlashAttnTuning(tall_tile=None)) is None


def test_fa4_decode_tile_for_single_row_decodes_at_head_dim_128():
    t = FlashAttnTuning()
    bf16 = torch.bfloat16
    assert all(routing.fa4_tile(9, 128, 128, dt, 1, g, t) == t.decode_tile
               for dt in (bf16, torch.float16) for g in (1, 2, 4, 8, 16, 64))
    for args in ((9, 128, 128, bf16, 2, 4), (9, 128, 128, bf16, 1, 5),
                 (9, 128, 128, bf16, 1, 128), (10, 128, 128, bf16, 1, 4),
                 (9, 64, 64, bf16, 1, 4), (9, 192, 128, bf16, 1, 4)):
        assert routing.fa4_tile(*args, t) is None, args


def test_fa4_batch_mode_for_uniform_prefill_parts_of_enough_rows():
    t = FlashAttnTuning()
    least = t.batch_mode_min_query
    assert routing.fa4_batch(3 * least, 3, least, t)
    assert not routing.fa4_batch(3 * least - 1, 3, least, t)  # lengths differ: varlen
    assert not routing.fa4_batch(3 * (least - 1), 3, least - 1, t)  # short: unmeasured
    assert not routing.fa4_batch(64, 64, 1, t)  # decodes
    assert not routing.fa4_batch(3 * least, 3, least, FlashAttnTuning(batch_mode_min_query=None))


def test_explain_prints_the_route_of_each_part():
    step = StepShape.parse("64x4096,1x8192:8192")
    lines = routing.explain("COMPOSITE_SM90", SPEC, SM90, step, H200, 128)
    assert lines == [
        "decode part: 64 request(s), 64 query rows, up to 4096 keys -> FlashInfer FA2 paged "
        "(tensor-core decode), no split (3.88 waves of (request, KV head) items)",
        "prefill part: 1 request(s), 8192 query rows, up to 8192 keys -> FlashAttention 4, "
        "batch mode, tile 192x128"]
    (line,) = routing.explain("FLASH_ATTN", SPEC, SM90, step, H200, 128)
    assert line.startswith("whole step: 65 request(s), 8256 query rows")
    short = routing.explain("COMPOSITE_SM90", SPEC, SM90, StepShape.parse("8x1024"), H200, 128)
    assert short[0].endswith("FlashAttention 4, tile 64x128 (0.48 waves at 1024 keys: FA4's "
                             "decode tile)")


def test_step_shapes_parse_and_name_what_is_wrong():
    assert StepShape.parse("1x8192:8192,64x4096").groups == ((64, 4096, 1), (1, 8192, 8192))
    for bad in ("64", "axb", "1x10:20", "0x10", ""):
        with pytest.raises(ValueError, match="--batch"):
            StepShape.parse(bad)


def test_facts_of_simulated_platforms():
    h200 = DeviceFacts.for_platform(Platform.parse("cuda:9.0"))
    assert (h200.num_sms, h200.capability) == (SM90.num_sms, SM90.capability)
    assert h200.shared_memory == (233472, 232448)
    assert DeviceFacts.for_platform(Platform.parse("cuda:8.0")).num_sms == 108


def test_tuning_overrides_parse_by_field_type_and_name_what_is_wrong():
    from attn_ops.tuning import apply_overrides

    t = apply_overrides(Tuning(), "triton.fused_combine=false, flex.decode_stages=none,"
                                  "composite.graph_fa4_waves=0.5/1.5,triton.decode_tile=8/32/4/2")
    assert t.triton.fused_combine is False and t.flex.decode_stages is None
    assert t.composite.graph_fa4_waves == (0.5, 1.5) and t.triton.decode_tile == (8, 32, 4, 2)
    assert t.key != Tuning().key and Tuning().key == Tuning().key
    for bad, message in (("triton.max_splits", "section.field=value"),
                         ("nope.x=1", "no section 'nope'"),
                         ("triton.nope=1", "has no field 'nope'"),
                         ("triton.max_splits=many", "'many' is not"),
                         ("ssm.gdn_chunk=48", r"gdn_chunk=48 must be a power of two >= 16"),
                         ("triton.turboquant_write_tokens=8",
                          r"turboquant_write_tokens=8 must be a power of two >= 16"),
                         ("triton.turboquant_cuda_min_blocks=9",
                          r"turboquant_cuda_min_blocks=9 must be 0 \(the compiler's choice\) "
                          "to 8"),
                         ("ssm.mamba2_block=128", r"mamba2_block=128 must be <= 64"),
                         ("ssm.lightning_state_block_k=8",
                          r"lightning_state_block_k=8 must be 0 \(the whole head dim\) or a "
                          "power of two >= 16"),
                         ("ssm.decode_min_programs=0", r"decode_min_programs=0 must be >= 1"),
                         ("mla.index_select_block=65536",
                          r"index_select_block=65536 must be in \[1, 65536\)"),
                         ("mla.index_atomic_from_pass=5",
                          r"index_atomic_from_pass=5 must be 0-3"),
                         ("mla.index_select_warps=3",
                          r"index_select_warps=3 must be 1, 2, 4, 8 or 16"),
                         ("mla.index_select_candidates=-1",
                          r"index_select_candidates=-1 must be >= 0"),
                         ("mla.index_overlap_groups=0", r"index_overlap_groups=0 must be >= 1")):
        with pytest.raises(ValueError, match=message):
            apply_overrides(Tuning(), bad)


def test_the_h200_entry_is_measured_and_others_get_the_generic_one():
    from attn_ops.tuning import resolve_tuning

    h200 = Platform(Platform.parse("cuda:9.0").kind, "NVIDIA H200", (9, 0))
    assert resolve_tuning(h200).measured and resolve_tuning(h200).device == "NVIDIA H200"
    other = resolve_tuning(Platform(h200.kind, "NVIDIA A100-SXM4-80GB", (8, 0)))
    assert not other.measured and other.describe() == "generic (unmeasured defaults)"


@pytest.mark.parametrize("requests,tokens,longest,blocks,expected", [
    (8, 8 * 2048, 2048, 20, 0),      # 160 programs on 132 SMs, even lengths: one walk each
    (1, 8192, 8192, 20, 256),        # 20 programs: segments
    (64, 8192 + 63 * 100, 8192, 20, 256),  # one long request among short ones: segments
    (32, 32 * 1024, 1024, 40, 0),
])
def test_mamba1_walks_whole_requests_only_where_they_fill_the_gpu(requests, tokens, longest,
                                                                  blocks, expected):
    assert routing.mamba1_segment(requests, tokens, longest, blocks, 132, 256, 1) == expected
    # (0 programs an SM: always segments; segment 0: never)
    assert routing.mamba1_segment(requests, tokens, longest, blocks, 132, 256, 0) == 256
    assert routing.mamba1_segment(requests, tokens, longest, blocks, 132, 0, 1) == 0


def test_mamba1_op_counts_its_programs_for_the_walk_rule():
    """The op's glue hands the rule its step: requests from query_start_loc, channel blocks of
    Tuning.ssm.mamba1_unrolled_block_d (the CPU "device" counts 8 SMs)."""
    from attn_ops.backends.ssm.mamba1 import _walk_plan
    from attn_ops.tuning.ssm import SSMTuning

    t = SSMTuning(mamba1_unrolled_block_d=128, mamba1_unrolled_segment=256,
                  mamba1_walk_min_programs=1)
    qsl = torch.tensor([0, 100, 200])

    def _segment(x, qsl, longest, t):
        return _walk_plan(x, torch.zeros(1, 16), qsl, longest, t)[0]

    assert _segment(torch.zeros(200, 1024), qsl, 100, t) == 0  # 2 x 8 programs on 8 SMs
    assert _segment(torch.zeros(200, 256), qsl, 100, t) == 256  # 2 x 2 programs
    assert _segment(torch.zeros(400, 1024), torch.tensor([0, 370, 380, 390, 400]), 370, t) == 256


def test_mamba1_walk_reads_ahead_only_what_fits_a_threads_registers():
    """The unrolled walk's reads ahead as asked at Mamba's d_state 16 (up to 4 tokens), fewer
    where each token's B and C rows would spill the registers: 2 at 32 (247 in the sm_90
    build), none from 64 (one token spilled there)."""
    assert [routing.mamba1_walk_read_ahead(16, p) for p in range(5)] == [0, 1, 2, 3, 4]
    assert routing.mamba1_walk_read_ahead(16, 9) == 4  # (the kernel's most)
    assert routing.mamba1_walk_read_ahead(5, 4) == 4
    assert routing.mamba1_walk_read_ahead(32, 4) == 2
    assert routing.mamba1_walk_read_ahead(64, 2) == 0
    assert routing.mamba1_walk_read_ahead(256, 2) == 0


def test_mamba1_walk_reads_ahead_by_waves_and_pace():
    """Of the read-aheads that fit, the one of the least waves x pace: at d_state 16, one
    channel a thread on 4 warps, seven / four / four / three / two programs an SM at 0-4
    tokens ahead (Mamba-2.8B, 40 programs a request, 132 SMs: 8 x 2k one wave at three, 12 x
    2k one wave only up to two, 16 x 2k two waves from one on -- one wave only without reads
    ahead, at three times the pace); two channels a thread hold twice the registers."""
    def ahead(programs, prefetch=3, channels=1, sms=132):
        return routing.mamba1_walk_read_ahead(16, prefetch, programs, sms, channels, 4)

    assert ahead(8 * 40) == 3 and ahead(4 * 40) == 3
    assert ahead(12 * 40) == 2  # (528 resident at two, 396 at three)
    assert ahead(16 * 40) == 3
    assert ahead(24 * 40) == 2 and ahead(32 * 40) == 2 and ahead(64 * 40) == 2
    assert ahead(264, prefetch=4) == 4 and ahead(265, prefetch=4) == 3
    assert ahead(8 * 40, prefetch=2) == 2 and ahead(8 * 40, prefetch=0) == 0
    assert ahead(8 * 20, channels=2) == 2  # (three would spill: 310 registers modelled)
    assert ahead(100 * 40, prefetch=0) == 0
    assert routing.mamba1_walk_read_ahead(16, 3, 0, 132) == 3  # (no launch given: the fit)


def test_lightning_split_chunk_fits_the_hand_offs_tiles_in_shared_memory():
    """The split's chunk as asked where the hand-off's three pipelined k / v tiles fit a
    block's shared memory (the H200's 232,448 bytes), halved where not (head dim 256 in bf16,
    head dim 128 in fp32), never below 16; unchanged without a CUDA device's figure."""
    h200 = 232448
    assert routing.lightning_split_chunk(128, 128, 64, 2, h200) == 128
    assert routing.lightning_split_chunk(128, 256, 64, 2, h200) == 64
    assert routing.lightning_split_chunk(128, 128, 64, 4, h200) == 64
    assert routing.lightning_split_chunk(128, 1024, 128, 4, h200) == 16
    assert routing.lightning_split_chunk(128, 256, 64, 2, None) == 128


def test_mamba1_reads_ahead_only_where_a_request_has_a_next_token():
    """A step of one token a request reads nothing ahead (every read past its end); longer
    steps read ahead as Tuning.ssm.mamba1_prefetch says."""
    assert not routing.mamba1_read_ahead(1, True)
    assert routing.mamba1_read_ahead(2, True) and routing.mamba1_read_ahead(63, True)
    assert not routing.mamba1_read_ahead(8, False)
