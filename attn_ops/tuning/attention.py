"""Standard attention's tunables: TRITON_ATTN's launches, FlexAttention's, FlashAttention 4's
sm90 tiles and modes and FA3's split count, FlashInfer's split-KV decode plans, and the sm90
composite's crossovers (each field's measurement: ``docs/tuning.md``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

__all__ = ["CompositeTuning", "FA4Tile", "FlashAttnTuning", "FlashInferTuning", "FlexTuning",
           "Tile", "TritonTuning"]


class Tile(NamedTuple):
    """A Triton launch: query rows, keys per step, warps, pipeline stages."""

    rows: int
    keys: int
    warps: int
    stages: int


class FA4Tile(NamedTuple):
    """FlashAttention 4's sm90 tile arguments: ``tile_mn`` (query rows, keys),
    ``mma_pv_is_rs`` (P kept in registers for P @ V), ``intra_wg_overlap``."""

    rows: int
    keys: int
    mma_pv_is_rs: bool
    intra_wg_overlap: bool = True

    def kwargs(self) -> dict:
        return {"tile_mn": (self.rows, self.keys), "mma_pv_is_rs": self.mma_pv_is_rs,
                "intra_wg_overlap": self.intra_wg_overlap}


@dataclass(frozen=True)
class TritonTuning:
    """TRITON_ATTN's launches (``routing.triton_*``)."""

    # Split-KV decode: splits (a power of two) bring decodes x KV heads x splits closest to this
    # many programs per SM, never below min_keys_per_split keys a split, at most max_splits.
    programs_per_sm: int = 8
    max_splits: int = 64
    min_keys_per_split: int = 256
    # Prefill tiles: 16-bit and 32-bit queries at padded head dims <= 128; either past 128.
    prefill_tile_16bit: Tile = Tile(128, 128, 8, 3)
    prefill_tile_32bit: Tile = Tile(64, 64, 4, 2)
    prefill_tile_wide_heads: Tile = Tile(32, 32, 4, 2)
    # Steps whose longest context is at most short_prefill_keys take this 16-bit tile (half-wide
    # keys waste less of the causal diagonal) and launch with the KV head fastest (None: off).
    short_prefill_keys: int = 2048
    short_prefill_tile_16bit: Tile | None = Tile(128, 64, 8, 3)
    # Decode tiles at padded head dims <= 128 and past it.
    decode_tile: Tile = Tile(16, 64, 4, 2)
    decode_tile_wide_heads: Tile = Tile(16, 32, 4, 2)
    # Decodes of at most short_decode_keys keys with at least many_items_per_sm (request, KV
    # head) items per SM run unsplit in many_items_tile: 4 programs share an SM (None: off).
    many_items_per_sm: float = 3.5
    many_items_tile: Tile | None = Tile(16, 32, 4, 3)
    short_decode_keys: int = 1024
    # Split partials are combined inside the attention launch from fused_min_items (request, KV
    # head) items on (few splits each); below, by a second kernel. fused_combine forces it.
    fused_min_items: int = 256
    fused_combine: bool | None = None
    # TURBOQUANT runs these kernels with its slots dequantized in registers a key block at a
    # time (codes, centroids, value codes: several [keys, head_dim] tensors live at once), so
    # narrower key blocks than the 16-bit tiles'; its decode runs one stage: pipelining turns
    # its byte gathers into byte-wide asynchronous copies (2.5x slower on an H100).
    turboquant_decode_tile: Tile = Tile(16, 32, 4, 1)
    turboquant_prefill_tile: Tile = Tile(128, 32, 8, 2)
    # 4-bit key and value fields read as contiguous bytes, their low and high nibbles the even
    # and the odd coordinates, a tensor-core product each (backends/turboquant/read_kernels.py),
    # in place of a byte gather a coordinate. Codes gathered with a warp's lanes along a
    # slot's bytes (one cache line a load, not 32 slots) and the centroids' norms taken from
    # the tensor cores.
    turboquant_planes: bool = True
    turboquant_coalesced: bool = True
    # Uniform TurboQuant decode steps (every preset) on the CUDA kernel of
    # backends/turboquant/decode_kernels.cu (a step's slots copied into shared memory, code
    # pairs looked up in a bank-replicated table, or fp8 pairs converted, straight into the
    # tensor-core fragments; built with nvcc on first use; where it does not build, these
    # kernels, with a warning) instead of these kernels. H100, 8k contexts
    # (docs/performance.md): 2.2-3.3x the Triton read at batch 8, 4.1-17.7x at 32, faster than
    # bf16 at both. Its splits hold at least turboquant_cuda_split_keys keys (a multiple of 64:
    # a 16-key step for each of a CTA's four warps); their count fills whole waves of the
    # kernel's occupancy.
    turboquant_cuda_decode: bool = True
    turboquant_cuda_split_keys: int = 256
    # The CUDA decode's CTAs an SM its registers must allow (``__launch_bounds__(128, n)``,
    # a build of its own); 0: the compiler's choice. sm_90, head dim 128: 155 registers (three
    # CTAs an SM) at 0; at 4, 128 registers and 5-60% slower (H100).
    turboquant_cuda_min_blocks: int = 0
    # The CUDA decode's norm correction (3- and 4-bit keys) on the tensor cores, a build of its
    # own: a lane's B registers of a chunk's two key tiles are the A fragment of their
    # transpose, so two more products a chunk give each key's squared centroid norm on the
    # diagonal, where four FP32 operations a B register sum them now (sm_90, head dim 128:
    # a 16-key step 567 SASS instructions against 637, 166 registers against 157). H100:
    # within 3% at 4 bits, 2-27% slower at 3 (docs/tuning.md), so off.
    turboquant_cuda_norm_mma: bool = False
    # The CUDA decode rotates 3- and 4-bit keys' queries itself (a fast Walsh-Hadamard
    # transform of the CTA's query rows in shared memory before its first tile) instead of a
    # cast, a matmul and a cast before the launch -- three launches a step fewer (H100, 8k
    # keys: 130 -> 87 us a call at 8 requests, 250 -> 201 at 32).
    turboquant_cuda_fused_rotation: bool = True
    # TURBOQUANT's cache write: tokens (a power of two >= 16, the rotation's tensor-core rows)
    # and warps a program. The write op reads the machine's tuning (default_tuning: its
    # measured entry and ATTN_OPS_TUNING), not a layer's AttentionConfig: the op takes no
    # plan. The sm_90 builds at head dim 128 take 44-102 registers at 16 tokens on 8 warps,
    # 58-128 at 32 (the product rotation; 44-64 with the butterflies). 16 tokens on 4 warps
    # against 8 (H100, the butterflies and the search, 8192 tokens): k8v4 57.4 / 68.2 us,
    # 4bit_nc 71.5 / 75.2, k3v4_nc 114.3 / 110.5 -- no tiling wins throughout (docs/tuning.md).
    turboquant_write_tokens: int = 16
    turboquant_write_warps: int = 8
    # The write rotates 3- and 4-bit keys by a fast Walsh-Hadamard transform in fp32 (seven
    # butterfly stages at head dim 128) instead of the product with the +-1 matrix on the
    # tensor cores (the matrix made in registers, three fp16 parts of each key). sm_90, bf16,
    # head dim 128, 16 tokens on 8 warps, 4 bits: 1704 SASS instructions a thread against
    # 2520, 75 registers against 102. H100, 8192 tokens (graph replays): 4bit_nc 166.8 ->
    # 88.7 us, k3v4_nc 156.0 -> 84.5, 3bit_nc 153.7 -> 91.4.
    turboquant_write_fwht: bool = True
    # The write finds a 4-bit key's code by a binary search over the codebook's midpoints
    # (four compares, each midpoint gathered from the table) instead of counting the
    # midpoints at or below it (fifteen): the same predicates, the same bytes. H100, with the
    # butterflies: 4bit_nc 88.7 -> 75.2 us; 3-bit keys (three gathers against seven
    # compares) slower, k3v4_nc 84.5 -> 110.5, so they always count.
    turboquant_write_search: bool = True
    # The Triton write as the CUDA write computes (below): the raw key rotated, its codes read
    # from format.code_lookup's cells (one gather and one compare a coordinate), the values
    # divided by a reciprocal and Markstein steps (the same quotients as an IEEE division).
    # H100, 8192 tokens (graph replays, one run): 4bit_nc 76.7 -> 68.1 us, k3v4_nc 85.1 ->
    # 108.1, 3bit_nc 92.2 -> 105.7: faster for one preset only, so off.
    turboquant_write_lookup: bool = False
    # The write on a CUDA kernel of its own (backends/turboquant/write_kernels.cu, built with
    # nvcc on first use): 16 coordinates a lane in 16-byte loads, four of the rotation's
    # butterfly stages in the lane and the rest by shuffles, a key code from one read of a
    # cell table (format.code_lookup), values divided by a reciprocal and Markstein steps.
    # sm_90, head dim 128, bf16, 4 bits: 62 registers, 1496 SASS instructions a thread
    # (static, slow paths included) for 16 coordinates of a key and of a value -- the Triton
    # write's 1488 serve 8 of each. An entered page's tail is cleared by a vector's lanes
    # together, in 4-byte words across a row. H100, 8192 tokens (graph replays): k8v4 49.7 us
    # against the Triton write's 68.2, 4bit_nc 31.4 / 75.2, k3v4_nc 29.1 / 83.4, 3bit_nc
    # 28.0 / 91.3; its byte tests and memcheck pass. The Triton write serves where it does not
    # (another head dim than 64 / 128 / 256, unaligned rows, int32 slots) or does not build.
    turboquant_cuda_write: bool = True

    def __post_init__(self) -> None:
        for name, low in (("turboquant_write_tokens", 16), ("turboquant_write_warps", 1)):
            v = getattr(self, name)
            if v < low or v & (v - 1):
                raise ValueError(f"tuning.triton.{name}={v} must be a power of two >= {low}")
        if not 0 <= self.turboquant_cuda_min_blocks <= 8:
            raise ValueError(f"tuning.triton.turboquant_cuda_min_blocks="
                             f"{self.turboquant_cuda_min_blocks} must be 0 (the compiler's "
                             "choice) to 8")
        if self.turboquant_cuda_split_keys < 64 or self.turboquant_cuda_split_keys % 64:
            raise ValueError(f"tuning.triton.turboquant_cuda_split_keys="
                             f"{self.turboquant_cuda_split_keys} must be a positive multiple of 64")


@dataclass(frozen=True)
class FlexTuning:
    """FLEX_ATTENTION's layouts and kernel options (``routing.flex_*``)."""

    # Steps with prefills copy their pages into GATHER_PAGE-key pages first when their (query,
    # key) pairs are at least this many times the keys copied (None: never). The CPU has no
    # key-tile problem: off there.
    gather_min_pairs_per_key_gpu: float | None = 128.0
    gather_min_pairs_per_key_cpu: float | None = None
    # Pipeline stages of FlexAttention's decoding kernel, as many as fit decode_stage_bytes of
    # shared memory (None: FlexAttention's default).
    decode_stages: int | None = 6
    decode_stage_bytes: int = 200 << 10
    # Decode-layout steps with fewer (request, KV head) pairs than this many per SM split each
    # request's pages so that about that many programs run (None: FlexAttention's own split).
    decode_programs_per_sm: int | None = 4
    # SMs that split rule spreads the programs over (None: the device's; set it where the
    # step runs on part of a GPU, as under MPS or green contexts).
    decode_num_sms: int | None = None
    # Extra FlexAttention kernel options on GPUs, merged over the rules' (for experiments).
    gpu_kernel_options: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class FlashAttnTuning:
    """FlashAttention 4's sm90 tiles and modes (``routing.fa4_*``) and FA3's split count."""

    # Single-row decodes in a 64-row tile where the GQA group divides its rows (None: FA4's).
    decode_tile: FA4Tile | None = FA4Tile(64, 128, True)
    # Prefills of at least tall_tile_min_query rows (batch mode: _batch) in a 192-row tile
    # where the GQA group divides its rows (None: FA4's tile).
    tall_tile: FA4Tile | None = FA4Tile(192, 128, False)
    tall_tile_min_query: int = 1024
    tall_tile_min_query_batch: int = 512
    # Prefill parts of one query length of at least this many rows run in FA4's batch mode
    # (its LPT scheduler, no cu_seqlens_q); None: always varlen.
    batch_mode_min_query: int | None = 256
    # FA3's split-KV count of every call (0: its heuristic, per step on the device from the
    # lengths; vLLM bounds it for CUDA graphs only to size a persistent buffer, which FA3's
    # graph-captured allocation does not need here).
    fa3_num_splits: int = 0


@dataclass(frozen=True)
class FlashInferTuning:
    """FlashInfer's split-KV decode plans (``routing.flashinfer_*``)."""

    # A decode part with fewer (request, KV head) items than SMs is cut into fixed chunks of
    # about one CTA per SM -- until a chunk would hold at least own_rule_min_chunk_keys keys,
    # where FlashInfer's own rule is as good. None: FlashInfer's own rule always.
    own_rule_min_chunk_keys: int | None = 4096
    # CUDA-graph decode batches of fewer items than SMs plan on a budget of one CTA per SM
    # (FlashInfer's own graph rule aims at two, one-page chunks).
    graph_one_cta_per_sm: bool = True


@dataclass(frozen=True)
class CompositeTuning:
    """COMPOSITE_SM90's choice between FlashInfer, FA4 and TRITON_ATTN per decode part
    (``routing.composite_decode_route``). Waves: (request, KV head) items per SM."""

    # TRITON_ATTN's unsplit decode for decodes short enough for its many-items tile
    # (TritonTuning), up to this many items per SM (None: never).
    triton_max_items_per_sm: float | None = 8.0
    # FA4 in its decode tile (FlashAttnTuning.decode_tile): from fa4_min_waves to one wave at
    # up to fa4_max_keys_below_wave keys, or at any length from fa4_any_keys_from_waves; from
    # fa4_many_waves on at fa4_many_waves_min_keys keys or more. None: never.
    fa4_min_waves: float | None = 0.4
    fa4_max_keys_below_wave: int = 8192
    fa4_any_keys_from_waves: float = 0.9
    fa4_many_waves: float = 2.0
    fa4_many_waves_min_keys: int = 16384
    # FA4 in its own tile (no decode tile for the spec): above plain_fa4_min_waves, below one
    # wave, at up to plain_fa4_max_keys keys (None: never).
    plain_fa4_min_waves: float | None = 0.7
    plain_fa4_max_keys: int = 4096
    # CUDA-graph decode sizes whose items are within these waves run FA4 in its decode tile
    # instead of FlashInfer's graph decode (None: never).
    graph_fa4_waves: tuple[float, float] | None = (0.7, 2.0)
