"""The recurrent-state family's tunables: its Triton kernels' blocks and the chunked prefill's
thresholds (each field's measurement: ``docs/tuning.md``)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SSMTuning"]


@dataclass(frozen=True)
class SSMTuning:
    """The recurrent-state family (``backends/ssm``)."""

    # Gated DeltaNet and Mamba2 steps run chunked (tensor-core products over chunks of
    # gdn_chunk / mamba2_chunk tokens; GDN in the WY form) on GPUs when their longest request
    # has at least this many new tokens, token by token below (decodes, speculative decodes,
    # short prefills): the recurrence reads the inputs one token at a time, the chunked form a
    # chunk. GDN's chunk is the side of the WY inverse, a chain of log2(chunk) - 1 squarings
    # of [chunk, chunk] (from 64 on, two chains over the halves; H200: 32 beats 64 by
    # 1.1-1.2x either way); Mamba2's chunk sets how many [heads, P, N] states the prefill
    # writes and reads back between its launches (one a chunk; H200: 128 is slower than 256).
    # The crossover length is unmeasured.
    chunked_min_query_len: int = 64
    gdn_chunk: int = 32
    mamba2_chunk: int = 256
    # The token-by-token kernels (decodes): one program a request, head and block of state
    # columns (GDN: value columns; Mamba2: head channels), the block in registers over the
    # request's tokens. Larger blocks give each program more bytes in flight, smaller ones
    # give small batches more programs: GDN's block is decode_block_v, halved (not below 32)
    # while its launch has fewer than decode_min_programs programs. H200, 4 warps: 128
    # columns 3.50 against 3.19 TB/s (64) at batch 1024, equal at 64; 8 warps and 2 warps
    # slower; Mamba2's 32 and 64 channels equal.
    decode_block_v: int = 128
    decode_min_programs: int = 4096
    decode_block_p: int = 32
    decode_num_warps: int = 4
    # Mamba1's token-by-token kernel (decodes, speculative decodes, short prefills): channels
    # a program, each with its d_state row in registers, the grid's fastest axis over a
    # request's channel blocks (mamba1_channel_major, as mamba-ssm's selective_state_update:
    # programs running together read neighbouring blocks of a few slots, not one block of
    # many), the state read evict-first and written as a streaming store
    # (mamba1_decode_streaming); the block halves (not below 32) while the launch has fewer
    # than mamba1_min_programs programs. H100, Mamba-2.8B's state, batch 256 / 1024: 76.5 /
    # 303.2 us request-major at 64 channels, 59.1 / 250.6 with these (mamba-ssm 63.2 / 246.7).
    mamba1_block_d: int = 128
    mamba1_min_programs: int = 4096
    mamba1_decode_streaming: bool = True
    mamba1_channel_major: bool = True
    # Mamba1's chunked prefill (one launch; a program walks its request's chunks): tokens a
    # chunk, channels a program, warps. A chunk holds [chunk, channels, d_state] decays and
    # inputs in registers (each thread scans its channel and state entry over the chunk's
    # tokens), so chunk x channels is bounded by the registers. Not timed yet; sm_90 builds
    # (ptxas, d_state 16): 16 x 16 on 8 warps 76 registers a thread, 16 x 32 on 4 warps 198,
    # 16 x 64 on 4 warps spills.
    mamba1_chunk: int = 16
    mamba1_chunk_block_d: int = 16
    mamba1_chunk_warps: int = 8
    # Both Mamba1 kernels read a token's (a chunk's) inputs one step ahead, while the
    # previous step computes: their loops are dependent, so a step's reads otherwise wait out
    # their whole latency. Steps of one token a request read nothing ahead
    # (routing.mamba1_read_ahead). H100, batch 256 / 1024 decodes: 78.8 / 312.0 us with the
    # read-ahead, 76.5 / 303.2 without.
    mamba1_prefetch: bool = True
    # Mamba1's prefill token by token with each channel's d_state row unrolled into one
    # thread's registers (``mamba1_unrolled``, replacing the chunked kernel above): y = sum_n
    # h_n C_n a chain of FMAs in the thread, where the kernels above spread d_state over lanes
    # (shuffles) and repeat each channel's time step and gate on every lane of it. Channels a
    # program (two a thread at 256 on 4 warps: each B / C value read once for both), warps,
    # and the one-token-ahead reads. B / C are converted to fp32 once a launch. sm_90 builds
    # (d_state 16, bf16 inputs): 10.3 instructions a (token, channel, state) element at 256 /
    # 4 / no prefetch (128 registers), 12.3 at 128 / 4, 14.6 at 256 / 4 with prefetch (250
    # registers); the chunked kernel about 25. H100, Mamba-2.8B shapes, ms at 8 x 2k / 1 x
    # 8k: chunked 3.11 / -, one walk a request 3.27 / 13.2, with prefetch 1.70 / 6.12.
    mamba1_unrolled: bool = True
    mamba1_unrolled_block_d: int = 128
    mamba1_unrolled_warps: int = 4
    # The unrolled walks' reads ahead, at most: 0 none, 1 one token ahead (the inputs rotate
    # through registers, a move each a step), 2-4 that many tokens an iteration over as many
    # buffers (no moves). Reads past a request's end read its last row (unmasked: a masked
    # read zeroes a register first and loads B / C once a channel, not once a thread). ptxas
    # issues all of an iteration's reads at its end (docs/tuning.md), so an iteration exposes
    # about one read latency, spread over its tokens. sm_90 SASS a token a thread, 128
    # channels on 4 warps: 151 / 172 / 150.5 / 147 / 146 instructions at 0-4 (66 / 104 / 128 /
    # 168 / 255 registers: four / three / two programs an SM at 2 / 3 / 4). A step reads as
    # many ahead as fit the registers for its d_state (2 at 32, none from 64) and, of those,
    # the most whose programs run in the fewest waves (routing.mamba1_walk_read_ahead). H100,
    # Mamba-2.8B, ms at 8 x 2k / 1 x 8k / 32 x 1k: 0.898 / 0.727 / 1.426 at 2, 0.801 / 0.727 /
    # 1.524 at 3, 1.204 / 0.752 / 1.645 at 4 (every step forced to it); routed, at most 4:
    # 0.798 / 0.727 / 1.420, and 4 x 4k 1.323 (1.388 at 3).
    mamba1_unrolled_prefetch: int = 4
    # The unrolled walks' y = sum_n h_n C_n in this many interleaved partial sums (1, 2 or 4),
    # added at the end: a token's output waits on a chain of d_state / parts multiply-adds,
    # not d_state. H100, 8 x 2k: 0.976 ms at 2 against 0.961 at 1 (the walk waits on its
    # reads, not this chain: docs/tuning.md).
    mamba1_unrolled_y_parts: int = 1
    # The unrolled walks ask the x / dt / z rows this many tokens ahead into L2 at each step
    # (prefetch.global.L2; 0: not): the reads ahead (mamba1_unrolled_prefetch) still expose
    # one read latency an iteration -- DRAM's for those rows, which one program alone reads;
    # B / C, read by every program of the request, come from L2 already. Three instructions
    # and their addresses a token. H100, 8 x 2k / 1 x 8k / 32 x 1k at 8 tokens: 0.862 / 0.716 /
    # 1.457 ms two tokens ahead (0.898 / 0.727 / 1.426 without), 0.866 / 0.710 / 1.458 three
    # ahead (0.801 / 0.727 / 1.524 without).
    mamba1_unrolled_l2_ahead: int = 0
    # The unrolled prefill over segments of this many tokens (0: one walk a request): each
    # segment's state from zero, the hand-off between a request's segments (a segment's decays
    # multiply into exp(A sum dt)), then each segment's outputs -- a long request's token loops
    # side by side (one request of 8k has 20 programs of 256 channels otherwise), for 1.7
    # times the instructions (sm_90 SASS at 256 channels: 7.4 an element for the states,
    # 10.5 for the outputs). The launch holds (tokens / segment + requests) x d_state x
    # d_inner fp32 states. H100 (as above), ms at 8 x 2k / 1 x 8k: 1.54 / 0.79 at 256, 1.46 /
    # 1.32 at 512; with the prefetch 1.88 / 1.12 at 256 (it adds registers the segments'
    # parallelism no longer needs).
    mamba1_unrolled_segment: int = 256
    # A step walks its requests whole, without segments, where its programs (a request and
    # mamba1_unrolled_block_d channels) number at least this many an SM and its longest
    # request is at most twice the mean (``attn_ops.routing.mamba1_segment``): each token is
    # then stepped once, not twice. 0: always segments. H200 (two tokens ahead), ms at 8 x 2k /
    # 32 x 1k: segments of 256 1.69 / 3.27, walked whole 1.10 / 1.70 at 128 channels (2.4
    # programs an SM at 8 x 2k) and 1.22 / 1.76 at 256 (1.2 an SM).
    mamba1_walk_min_programs: int = 1
    # Lightning attention's token-by-token kernel: value columns a program, and its state
    # read evict-first / written as a streaming store (as gdn_decode_streaming). Not timed
    # yet.
    lightning_block_v: int = 64
    lightning_decode_streaming: bool = False
    # Lightning attention's chunked prefill (one launch, chunks walked in order, tensor-core
    # products): tokens a chunk (the side of its q k^T), value columns a program, warps. sm_90
    # builds (head dim 128): 64 x 32 on 8 warps 208 registers a thread, no spill; 64 x 64
    # spills on 4 and 8 warps. The chunk size and the value columns are the split's too.
    lightning_chunk: int = 64
    lightning_chunk_block_v: int = 32
    lightning_chunk_warps: int = 8
    # Lightning attention's prefill split as GDN's is (``lightning_split``): a state hand-off
    # walking the chunks with one k^T v product each, then every chunk's outputs in parallel
    # -- the walk's single launch holds the chunk's four products beside the state, one
    # program an SM. Value columns a program and warps of the two launches. sm_90 builds (head
    # dim 128, chunk 64): hand-off 64 columns 104 registers a thread on 8 warps (221 on 4),
    # outputs 64 columns 78 on 4 warps (128 columns 121). H200, MiniMax-Text-01's heads, 8 x
    # 2k: one launch 1.00 ms (0.77x fla's chunk kernel), split 0.78 (0.97x; hand-off on 32
    # columns 0.82, on 4 warps 0.78, outputs on 128 columns 0.78); H100, M tokens/s at 8 x 2k
    # / 1 x 8k: one launch 15.3 / 16.9, split 16.4 / 16.6.
    lightning_split: bool = True
    lightning_state_block_v: int = 64
    # The hand-off's key rows a program (0: the whole head dim; the state's rows are
    # independent: a scalar decay a head). Fewer: more programs walking the same chunks with
    # a smaller product each -- for few requests, whose programs are fewer than the SMs (1 x
    # 8k at 64 heads of 128: 128 programs of 128 x 64). 64 and 32 were slower on an H100
    # (docs/tuning.md).
    lightning_state_block_k: int = 0
    lightning_output_block_v: int = 64
    lightning_state_warps: int = 8
    lightning_output_warps: int = 8
    # The split's chunk (tokens; a power of two >= 16). Both launches are bound by the chunk
    # start states the hand-off writes and the outputs read back ([chunks, H, D, Dv] in the
    # inputs' dtype: at chunk 64 as many bytes as q, k and v together). Nsight Compute, H100,
    # 8 x 2k, chunk 64: hand-off 401 us, outputs 588 us, both at 82% of DRAM bandwidth.
    # Chunk 128 halves those states (sm_90: outputs 114 registers on 8 warps, 96 KB of shared
    # memory). H200, 8 x 2k / 1 x 8k: 0.759 / 0.378 ms on 128 tokens and 8 output warps
    # against fla's chunk kernel 0.760 / 0.375 (128 tokens, 4 output warps: 0.827 / 0.419;
    # outputs on 128 columns: 0.854 / 0.429).
    lightning_split_chunk: int = 128
    # A decode kernel's state read evict-first and its write a streaming store (.cs): a
    # state is read once and written once a step. H200: GDN 3.55 / 3.59 against 3.26 / 3.45
    # TB/s at batch 64 / 128; Mamba2 2-5% slower with them (3.66 / 3.50 against 3.71 / 3.68
    # at batch 64 / 256), so only GDN's are on.
    gdn_decode_streaming: bool = True
    mamba2_decode_streaming: bool = False
    # GDN's chunked prefill: value columns a program of its state hand-off (fewer: more
    # programs for few requests; more: each chunk's w and k read fewer times), halved (not
    # below 32) while the hand-off has fewer than gdn_state_min_programs programs, and of its
    # output launch (more: q k^T computed fewer times). H200, hand-off device time at 1 x 8k /
    # 8 x 2k / 64 x 512: 64 columns 0.45 / 0.36 / 0.76 ms, 32 0.41 / 0.55 / 0.97, 16 0.52 /
    # 0.78 / 1.53; outputs at 128 columns slower than 64.
    gdn_state_block_v: int = 64
    gdn_state_min_programs: int = 256
    gdn_output_block_v: int = 64
    # Warps of GDN's three chunked launches (WY factors, state hand-off, outputs): chains of
    # small [chunk, chunk] / [chunk, 128] products, bound by their latency -- fewer warps a
    # program let more programs share an SM (H200: 4 warps 1.3-1.7x faster than 8 for the WY
    # and output launches; the hand-off slower on 8).
    gdn_wy_warps: int = 4
    gdn_state_warps: int = 4
    gdn_output_warps: int = 4
    # Loads of the hand-off's next chunks issued ahead of its chain (Triton num_stages).
    gdn_state_stages: int = 2
    # Mamba2's chunked prefill: rows of a chunk an output program (at most the chunk; 16-64)
    # and its warps, head channels a program of the state hand-off (H200: 32 rows on 4 warps
    # 1.9x faster than 64 on 8; 64 channels 1.6x faster than 16 at 64 x 512).
    mamba2_block: int = 32
    mamba2_num_warps: int = 4
    mamba2_state_block_p: int = 64
    # Keys of the chunk an output program steps at a time (0: mamba2_block). H200, 64 x 512:
    # 64 with 32 rows was 1.5x slower than 32 (docs/tuning.md).
    mamba2_key_block: int = 0
    # Software-pipeline stages of the output programs' key loop (H200, 64 x 512: 1 stage
    # 0.93 ms against 1.14 at 3 (Triton's default), 1.20 at 4), and the contribution launch's
    # rows a step (16 up to the chunk) and warps (64 rows on 4 warps 0.26 ms against 0.39 for
    # 32 on 8, 0.50 for 128 on 8, 0.30 for 16 on 4).
    mamba2_num_stages: int = 1
    mamba2_contrib_block: int = 64
    mamba2_contrib_warps: int = 4

    def __post_init__(self) -> None:
        for name, low in (("gdn_chunk", 16), ("mamba2_chunk", 16), ("decode_block_v", 1),
                          ("decode_block_p", 1), ("decode_num_warps", 1),
                          ("gdn_state_block_v", 16), ("gdn_output_block_v", 16),
                          ("mamba2_block", 16), ("mamba2_num_warps", 1),
                          ("mamba2_state_block_p", 1), ("gdn_wy_warps", 1),
                          ("gdn_state_warps", 1), ("gdn_output_warps", 1),
                          ("mamba2_contrib_block", 16), ("mamba2_contrib_warps", 1),
                          ("mamba1_block_d", 1), ("mamba1_chunk", 1),
                          ("mamba1_chunk_block_d", 1), ("mamba1_chunk_warps", 1),
                          ("mamba1_unrolled_block_d", 1), ("mamba1_unrolled_warps", 1),
                          ("lightning_block_v", 1), ("lightning_chunk", 16),
                          ("lightning_split_chunk", 16),
                          ("lightning_chunk_block_v", 16), ("lightning_chunk_warps", 1),
                          ("lightning_state_block_v", 16), ("lightning_output_block_v", 16),
                          ("lightning_state_warps", 1), ("lightning_output_warps", 1)):
            v = getattr(self, name)
            if v < low or v & (v - 1):
                raise ValueError(f"tuning.ssm.{name}={v} must be a power of two >= {low}"
                                 + (" (the chunked kernels' tensor-core tiles)" if low == 16
                                    else ""))
        k = self.lightning_state_block_k
        if k and (k < 16 or k & (k - 1)):
            raise ValueError(f"tuning.ssm.lightning_state_block_k={k} must be 0 (the whole "
                             "head dim) or a power of two >= 16 (the chunked kernels' "
                             "tensor-core tiles)")
        for name in ("mamba2_num_stages", "gdn_state_stages"):
            if getattr(self, name) < 1:
                raise ValueError(f"tuning.ssm.{name}={getattr(self, name)} must be >= 1")
        for name in ("decode_min_programs", "gdn_state_min_programs", "mamba1_min_programs"):
            if getattr(self, name) < 1:
                raise ValueError(f"tuning.ssm.{name}={getattr(self, name)} must be >= 1")
        if self.mamba1_unrolled_y_parts not in (1, 2, 4):
            raise ValueError(f"tuning.ssm.mamba1_unrolled_y_parts={self.mamba1_unrolled_y_parts}"
                             " must be 1, 2 or 4 (partial sums of y)")
        if self.mamba1_unrolled_prefetch not in (0, 1, 2, 3, 4):
            raise ValueError(f"tuning.ssm.mamba1_unrolled_prefetch={self.mamba1_unrolled_prefetch}"
                             " must be 0 (no reads ahead), 1 (one token ahead) or 2-4 (that "
                             "many tokens an iteration)")
        if self.mamba1_unrolled_l2_ahead < 0:
            raise ValueError(f"tuning.ssm.mamba1_unrolled_l2_ahead={self.mamba1_unrolled_l2_ahead}"
                             " must be >= 0 (tokens ahead; 0: no L2 prefetch)")
        if self.mamba1_walk_min_programs < 0:
            raise ValueError(f"tuning.ssm.mamba1_walk_min_programs={self.mamba1_walk_min_programs}"
                             " must be >= 0 (0: always segments)")
        seg = self.mamba1_unrolled_segment
        if seg and (seg < 16 or seg & (seg - 1)):
            raise ValueError(f"tuning.ssm.mamba1_unrolled_segment={seg} must be 0 (one walk a "
                             "request) or a power of two >= 16")
        k = self.mamba2_key_block
        if k and (k < 16 or k & (k - 1)):
            raise ValueError(f"tuning.ssm.mamba2_key_block={k} must be 0 (mamba2_block) or a "
                             "power of two >= 16 (the output launch's tensor-core tiles)")
        if self.mamba2_block > 64:
            raise ValueError(f"tuning.ssm.mamba2_block={self.mamba2_block} must be <= 64 "
                             "(the output launch at 128 rows failed to launch on the H200)")
