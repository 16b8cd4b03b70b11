"""Tuning is data: every measured constant of the backends in one frozen, typed object.

A :class:`Tuning` has one section per backend (tiles, stages, split rules, thresholds). It is
resolved per device -- :func:`resolve_tuning` returns the measured entry for a known GPU
(``MEASURED``) and the generic default elsewhere, labelled unmeasured -- passed to backends
through :class:`~attn_ops.selector.AttentionConfig` (``tuning=``), and hashed into every
metadata and planner key (:attr:`Tuning.key`), so a planner never keeps a plan made under other
settings. Environment overrides are parsed here and nowhere else (:data:`ENV_TUNING`).

Each field's comment states its rule; the measurement behind it is in ``docs/tuning.md``.
Tests and benchmarks build variants with :meth:`Tuning.with_`::

    tuning = resolve_tuning(platform).with_(triton={"fused_combine": False})
    attn = Attention(spec, AttentionConfig(tuning=tuning))
"""

from __future__ import annotations

import functools
import hashlib
import os
import types
import typing
from dataclasses import dataclass, field, fields, replace
from typing import NamedTuple

__all__ = [
    "ENV_TUNING", "CompositeTuning", "FA4Tile", "FlashAttnTuning", "FlashInferTuning",
    "FlexTuning", "MLATuning", "Tile", "TritonTuning", "Tuning", "default_tuning", "resolve_tuning",
]

ENV_TUNING = "ATTN_OPS_TUNING"


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
    # (routing.indexer_select_span). H200, 64 heads x 128, fp8 keys (docs/tuning.md): 256
    # positions a step on 4 warps over chunks of 4096, the first histogram in the select's own
    # launch (in the scoring it cost 2.5x that launch), is the fastest swept.
    index_block_n: int = 256
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
    # With an fp8 index cache at per-token scales: the scoring quantizes each query head to
    # e4m3 (its own scale, amax / 448 -- DeepSeek-V3.2 quantizes the indexer query by blocks of
    # 128 channels, one a head at head dim 128) and multiplies fp8 by fp8 on the tensor cores
    # (twice bf16's rate, no key conversion; H200: the top-k 17-20% faster from 64 rows x 32k
    # up, docs/tuning.md). Off: the query in its dtype, the keys converted to it.
    index_fp8_query: bool = True

    def __post_init__(self) -> None:
        if not 1 <= self.index_select_block < 1 << 16:
            raise ValueError(f"tuning.mla.index_select_block={self.index_select_block} must be "
                             "in [1, 65536): the select's write packs two counts of a block in "
                             "one int32 scan")
        if not 0 <= self.index_atomic_from_pass <= 4:
            raise ValueError(f"tuning.mla.index_atomic_from_pass={self.index_atomic_from_pass} "
                             "must be 0-3 (a pass of the select) or 4 (none)")


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
                          ("mamba2_contrib_block", 16), ("mamba2_contrib_warps", 1)):
            v = getattr(self, name)
            if v < low or v & (v - 1):
                raise ValueError(f"tuning.ssm.{name}={v} must be a power of two >= {low}"
                                 + (" (the chunked kernels' tensor-core tiles)" if low == 16
                                    else ""))
        for name in ("mamba2_num_stages", "gdn_state_stages"):
            if getattr(self, name) < 1:
                raise ValueError(f"tuning.ssm.{name}={getattr(self, name)} must be >= 1")
        for name in ("decode_min_programs", "gdn_state_min_programs"):
            if getattr(self, name) < 1:
                raise ValueError(f"tuning.ssm.{name}={getattr(self, name)} must be >= 1")
        k = self.mamba2_key_block
        if k and (k < 16 or k & (k - 1)):
            raise ValueError(f"tuning.ssm.mamba2_key_block={k} must be 0 (mamba2_block) or a "
                             "power of two >= 16 (the output launch's tensor-core tiles)")
        if self.mamba2_block > 64:
            raise ValueError(f"tuning.ssm.mamba2_block={self.mamba2_block} must be <= 64 "
                             "(the output launch at 128 rows failed to launch on the H200)")


_SECTIONS = ("triton", "flex", "flash_attn", "flashinfer", "composite", "mla", "ssm")


@dataclass(frozen=True)
class Tuning:
    """Every backend's tunables. ``device`` names the entry; ``measured`` says whether its
    values were measured on that device (False: the generic default)."""

    device: str = "generic"
    measured: bool = False
    triton: TritonTuning = field(default_factory=TritonTuning)
    flex: FlexTuning = field(default_factory=FlexTuning)
    flash_attn: FlashAttnTuning = field(default_factory=FlashAttnTuning)
    flashinfer: FlashInferTuning = field(default_factory=FlashInferTuning)
    composite: CompositeTuning = field(default_factory=CompositeTuning)
    mla: MLATuning = field(default_factory=MLATuning)
    ssm: SSMTuning = field(default_factory=SSMTuning)

    @functools.cached_property
    def key(self) -> str:
        """A short hash of every value: part of every metadata and planner key."""
        return hashlib.sha1(repr(self).encode()).hexdigest()[:12]

    def with_(self, **sections: dict | object) -> Tuning:
        """A copy with fields of sections changed: ``with_(triton={"max_splits": 8})`` (or a
        whole section object)."""
        changes = {}
        for name, value in sections.items():
            if name not in _SECTIONS:
                raise ValueError(f"tuning has no section {name!r}; sections: "
                                 f"{', '.join(_SECTIONS)}")
            current = getattr(self, name)
            if isinstance(value, dict):
                unknown = set(value) - {f.name for f in fields(current)}
                if unknown:
                    raise ValueError(f"tuning.{name} has no field {sorted(unknown)[0]!r}; "
                                     f"fields: {', '.join(f.name for f in fields(current))}")
                value = replace(current, **value)
            changes[name] = value
        return replace(self, **changes)

    def describe(self) -> str:
        """One line for ``info``: which entry, measured or not."""
        return (f"{self.device} (measured)" if self.measured
                else f"{self.device} (unmeasured defaults)")



# The generic default keeps the rules that follow from a kernel's own structure (tiles fitted
# to shared memory at run time, splits relative to the SM count) and leaves out the decode
# crossovers between kernels that were fitted to one GPU's bandwidth: COMPOSITE_SM90 then
# decodes with FlashInfer's split decode everywhere (no cliff) and prefills with FA4.
GENERIC = Tuning(composite=CompositeTuning(triton_max_items_per_sm=None, fa4_min_waves=None,
                                           plain_fa4_min_waves=None, graph_fa4_waves=None))

# Measured entries, by a substring of the device name (docs/tuning.md has the measurements).
MEASURED: dict[str, Tuning] = {
    "H200": Tuning(device="NVIDIA H200", measured=True),
}


def resolve_tuning(platform=None) -> Tuning:
    """The tuning for ``platform`` (default: this machine's): its measured entry, else the
    generic default; then the environment's overrides (:data:`ENV_TUNING`)."""
    if platform is None:
        from attn_ops.platforms import current_platform

        platform = current_platform()
    base = next((t for sub, t in MEASURED.items() if sub in platform.device_name), GENERIC)
    return apply_overrides(base, os.environ.get(ENV_TUNING, ""))


@functools.cache
def _default(env: str) -> Tuning:
    return resolve_tuning()


def default_tuning() -> Tuning:
    """:func:`resolve_tuning` for this machine, with the environment as it is now."""
    return _default(os.environ.get(ENV_TUNING, ""))


def apply_overrides(tuning: Tuning, text: str) -> Tuning:
    """``tuning`` with ``section.field=value`` overrides, comma-separated (the format of
    :data:`ENV_TUNING`): ``triton.fused_combine=false,flex.decode_stages=none``. Values are
    parsed by the field's type (int, float, bool, None, a tuple as ``a/b/c``)."""
    changes: dict[str, dict] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        section, dot, field_name = name.strip().partition(".")
        if not sep or not dot:
            raise ValueError(f"{ENV_TUNING}: {item!r} is not section.field=value (e.g. "
                             "triton.max_splits=16)")
        if section not in _SECTIONS:
            raise ValueError(f"{ENV_TUNING}: {item!r}: no section {section!r}; sections: "
                             f"{', '.join(_SECTIONS)}")
        owner = type(getattr(tuning, section))
        hints = typing.get_type_hints(owner)
        if field_name not in hints:
            raise ValueError(f"{ENV_TUNING}: {item!r}: tuning.{section} has no field "
                             f"{field_name!r}; fields: "
                             f"{', '.join(f.name for f in fields(owner))}")
        changes.setdefault(section, {})[field_name] = _parse(hints[field_name], value.strip(),
                                                             item)
    return tuning.with_(**changes) if changes else tuning


def _parse(hint, text: str, item: str):
    options = typing.get_args(hint) if _is_union(hint) else (hint,)
    if text.lower() == "none":
        if type(None) in options:
            return None
        raise ValueError(f"{ENV_TUNING}: {item!r}: this field cannot be None")
    for kind in options:
        if kind is type(None):
            continue
        try:
            return _parse_one(kind, text)
        except (TypeError, ValueError):
            continue
    raise ValueError(f"{ENV_TUNING}: {item!r}: {text!r} is not a {hint}")


def _is_union(hint) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


def _parse_one(kind, text: str):
    if kind is bool:
        if text.lower() in ("1", "true", "on", "yes"):
            return True
        if text.lower() in ("0", "false", "off", "no"):
            return False
        raise ValueError(text)
    if kind in (int, float):
        return kind(text)
    if isinstance(kind, type) and issubclass(kind, tuple) and hasattr(kind, "_fields"):
        hints = typing.get_type_hints(kind)
        parts = text.split("/")
        return kind(*(_parse_one(hints[n], p) for n, p in zip(kind._fields, parts)))
    if typing.get_origin(kind) is tuple:
        args = typing.get_args(kind)
        parts = text.split("/")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_parse_one(args[0], p) for p in parts)
        return tuple(_parse_one(a, p) for a, p in zip(args, parts))
    raise TypeError(kind)

