"""The MLA family's tunables: TRITON_MLA's launches, the chunked context, the sparse kernel,
the indexer and the sm90 composite's routes (each field's measurement: ``docs/tuning.md``)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MLATuning"]


@dataclass(frozen=True)
class MLATuning:
    """The MLA family (``backends/mla``)."""

    # Requests at the front of a step with at most this many new tokens run in the absorbed
    # (MQA) form over the latent cache -- decodes, speculative decodes and short prefills;
    # the rest in the MHA form. Absorbed costs (nope + rope + 2 x rank) FLOPs per head, query
    # and cached token; MHA up-projects the context once, which pays off only for long queries.
    absorbed_max_query_len: int = 16
    # The MHA form attends the cached context in chunks of at most this many latent rows,
    # gathered and up-projected into a workspace of chunk x heads x (nope + v) values, chunks
    # taken across requests in order (a long request beside short ones does not multiply them).
    context_chunk_tokens: int = 4096
    # The MHA form runs FlashInfer's ragged prefill (planned on the host at each call) for at
    # most this many requests where both it and FA4 can run, FA4 above: H200, 128 heads, 192 /
    # 128, with its plan FlashInfer is 1-2% ahead at 1 x 8k and 4 x 4k and 17% ahead over
    # 28k of context in 4k chunks, but its plan puts it 16% behind at 16 x 1k.
    flashinfer_prefill_max_requests: int = 4
    # TRITON_MLA's absorbed launch (routing.mla_decode_launch): (query x head) rows a program,
    # latent rows a step, warps and stages of a program of decode_rows rows, and of a narrower
    # one (fewer heads x query rows: a 16-head decode); split-KV like TRITON_ATTN's decode.
    # H200, 512 + 64 latent, bf16 (docs/tuning.md): 64 rows x 64 keys in 8 warps, 2 stages, is
    # the fastest of the tiles swept at 128 heads; 16-row programs are fastest in 4 warps, 3
    # stages (a memory-bound stream).
    decode_rows: int = 64
    decode_keys: int = 64
    decode_warps: int = 8
    decode_stages: int = 2
    narrow_warps: int = 4
    narrow_stages: int = 3
    programs_per_sm: int = 2
    max_splits: int = 128
    min_keys_per_split: int = 256
    # 2: two programs per head block, each accumulating half the value columns (both compute
    # the whole score). H200: 0.5-0.6x of one part at 128 heads and at 16 (docs/tuning.md).
    value_parts: int = 1
    # COMPOSITE_MLA_SM90's absorbed-part route (routing.mla_absorbed_route): at most
    # route_small_max_rows (requests x query x heads) rows on FA3's MLA path where installed,
    # else on TRITON_MLA over at least route_triton_min_keys keys; FlashMLA from
    # route_flashmla_min_requests requests over at least route_flashmla_min_keys keys;
    # FlashInfer's MLA elsewhere. H200, 512 + 64, bf16 (docs/performance.md): at 16 heads x 1
    # request FA3's op 1.06-1.42x the best as-vLLM path at 1k-32k, TRITON_MLA's 1.34x at 32k
    # and even at 8k; FlashMLA's op 1.02-1.10x FlashInfer's at 64-128 requests x 32k over two
    # runs (32 x 32k: even at 16 heads, 1.06x at 128), behind it at 8k and less.
    route_small_max_rows: int = 16
    route_triton_min_keys: int = 8192
    route_flashmla_min_requests: int = 32
    route_flashmla_min_keys: int = 16384
    # TRITON_MLA_SPARSE: heads of one token a program, selected slots a step (each a gathered
    # latent row), warps and stages; splits of each token's slots (0: routing.
    # sparse_mla_splits, from programs_per_sm, min_keys_per_split and max_splits above).
    # H200, 128 heads, top-k 2048 (docs/tuning.md): 64 heads x 64 slots on 8 warps reads each
    # token's rows twice and is the fastest tile swept (1.25x 16 x 32 at batch 8, 2.2x at 128).
    sparse_heads: int = 64
    sparse_keys: int = 64
    sparse_warps: int = 8
    sparse_stages: int = 2
    sparse_splits: int = 0
    # The sparse indexer's scoring (backends/mla/indexer_kernels.py): positions a step of a
    # program (all index heads of one query row at once), its warps and pipeline stages, and
    # the most positions of one program
    # (routing.indexer_score_chunk shortens it so a step's programs fill
    # programs_per_sm x SMs); whether it also adds the select's first digit histogram as it
    # stores the scores (else the select's own launch reads them back for it); the top-k
    # select's scores a step, and the programs an SM its launches aim at
    # (routing.indexer_select_span). H200, 64 heads x 128, fp8 keys (docs/tuning.md): 4 warps
    # over chunks of 4096, the first histogram in the select's own launch (in the scoring it
    # cost 2.5x that launch), is the fastest swept. H100 (fp8 query, keys as rows), the
    # scoring at 8 x 256k / 1 x 256k / 128 x 32k: 110.7 / 15.7 / 215.9 us at 128 positions a
    # step, 127.7 / 20.7 / 250.5 at 256 (its [256, 64] fp32 products hold 172 registers a
    # thread: two programs an SM, 2 warps a scheduler, 0.4 of them eligible), 127.0 / 18.0 /
    # 268.5 at 64.
    index_block_n: int = 128
    index_warps: int = 4
    index_stages: int = 3
    index_chunk: int = 4096
    index_fused_histogram: bool = False
    # The scoring's product with the step's positions as its rows and the heads as its columns
    # (``keys @ q^T``): the sum over heads is then a thread's own registers and a lane quad's
    # shuffles, where ``q @ keys^T`` sums across warps through shared memory (H200: the
    # scoring 1.4x faster at 128 x 32k).
    index_keys_as_rows: bool = True
    index_select_block: int = 1024
    # The select's passes from this one on (0-3; 4: none) count each key sharing the decided
    # digits by its own atomic add instead of a block histogram (about a hundred integer
    # operations a key): from the second pass few keys share the decided digits (H200: the
    # three later passes 72 -> 38 µs at 128 x 32k); the first pass counts every key.
    index_atomic_from_pass: int = 1
    index_select_programs_per_sm: int = 8
    # The select's warps a program: each program first descends its row's digit histograms
    # (256 bins a pass, scans and reductions across the program's warps), then reads its span.
    # H100, top-k 512 (docs/tuning.md): 4 fastest, 1 warp 24% slower at 8 x 256k.
    index_select_warps: int = 4
    # Each select program reads its first tile of scores before it waits on its row's
    # histogram state (the previous launch's, from L2), and each later tile one iteration
    # ahead. H100, top-k 512 (docs/tuning.md): the select 49.0 against 44.6 us at 8 x 256k
    # (two tiles a program), 16.9 against 22.4 at 1 x 256k and 18.8 against 19.3 at 8 x 32k
    # (one tile): off, for V4's 8 x 256k.
    index_select_read_first: bool = False
    # n > 0: the select reads the scores three times, not six -- two digit passes decide the
    # top 16 bits of each row's top-k-th key, one launch sends the positions above them to
    # the output and those sharing them to n candidates a row, and a program a row finishes
    # on the candidates (the last two digits, the ties by a sort) and sorts the row (a row
    # whose candidates overflow n reads its scores again in that program). 0: the six
    # launches. H100, top-k 512: 48.5 against 49.0 us at 8 x 256k at 1024 candidates, 2-3 us
    # slower on shorter rows and slower at 4096: off.
    index_select_candidates: int = 0
    # n > 1: a step of at most 2048 rows (a decode batch) scored and selected in n groups of
    # rows, each group's select on a side stream while the next group is scored (the scoring
    # bound by memory, the select by its launches' latency; CUDA-graph capture joins the side
    # stream). 1: one group. Not yet timed on a GPU.
    index_overlap_groups: int = 1
    # With an fp8 index cache at per-token scales: the scoring quantizes each query head to
    # e4m3 (its own scale, amax / 448 -- DeepSeek-V3.2 quantizes the indexer query by blocks of
    # 128 channels, one a head at head dim 128) and multiplies fp8 by fp8 on the tensor cores
    # (twice bf16's rate, no key conversion; H200: the top-k 17-20% faster from 64 rows x 32k
    # up, docs/tuning.md). Off: the query in its dtype, the keys converted to it.
    index_fp8_query: bool = True
    # FlashMLA's decode kernel (FLASHMLA_SPARSE over fp8_ds_mla, DeepSeek-V4's layers) takes
    # every token as a batch row of its tile scheduler, which holds at most
    # routing.FLASHMLA_MAX_ROWS: a longer step (a prefill) runs in calls of this many rows (at
    # most that bound: the ops take the smaller), each with its own schedule.
    flashmla_rows_a_call: int = 8192

    def __post_init__(self) -> None:
        if self.flashmla_rows_a_call < 1:
            raise ValueError(f"tuning.mla.flashmla_rows_a_call={self.flashmla_rows_a_call} "
                             "must be >= 1")
        if not 1 <= self.index_select_block < 1 << 16:
            raise ValueError(f"tuning.mla.index_select_block={self.index_select_block} must be "
                             "in [1, 65536): the select's write packs two counts of a block in "
                             "one int32 scan")
        if self.index_select_candidates < 0:
            raise ValueError(f"tuning.mla.index_select_candidates="
                             f"{self.index_select_candidates} must be >= 0 (0: the six-launch "
                             "select)")
        if self.index_overlap_groups < 1:
            raise ValueError(f"tuning.mla.index_overlap_groups={self.index_overlap_groups} "
                             "must be >= 1 (1: one group)")
        if self.index_select_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"tuning.mla.index_select_warps={self.index_select_warps} must be "
                             "1, 2, 4, 8 or 16")
        if not 0 <= self.index_atomic_from_pass <= 4:
            raise ValueError(f"tuning.mla.index_atomic_from_pass={self.index_atomic_from_pass} "
                             "must be 0-3 (a pass of the select) or 4 (none)")
