"""MLA's routing: TRITON_MLA's absorbed launch, the sparse kernel's splits, the indexer's
chunks and spans, FlashInfer's MLA kernel and its shared memory, the sm90 composite's route of
the absorbed part (FlashMLA, FlashInfer's MLA, FA3's MLA path, TRITON_MLA), the MHA form's
prefill kernel, and DeepSeek-V4's attention launch (DSV4_TRITON)."""

from __future__ import annotations

from typing import NamedTuple

from attn_ops.routing.common import Kernel, PartRoute, pow2
from attn_ops.tuning import MLATuning

__all__ = ["FLASHMLA_MAX_ROWS", "MLADecodeLaunch", "flashinfer_mla_kernel",
           "flashinfer_mla_shared_bytes", "indexer_score_chunk", "indexer_select_span",
           "dsv4_launch", "mla_absorbed_route", "mla_decode_launch", "mla_prefill_kernel",
           "sparse_mla_splits"]

class MLADecodeLaunch(NamedTuple):
    """TRITON_MLA's absorbed launch: ``splits`` of each request's keys, ``query_rows`` (a
    power of two >= the longest absorbed query) x ``heads`` rows a program, ``keys`` latent
    rows a step, warps, pipeline stages."""

    splits: int
    query_rows: int
    heads: int
    keys: int
    warps: int
    stages: int
    value_parts: int = 1


def mla_decode_launch(heads: int, requests: int, max_query_len: int, max_seq_len: int,
                      num_sms: int, t: MLATuning, latent_bytes: int = 0,
                      convert_bytes: int = 0, smem: int = 0,
                      rank_p: int = 0) -> MLADecodeLaunch:
    """A program takes ``decode_rows`` (query x head) rows of one request -- all its query
    rows, as many heads as fit, at least 16 rows for the MMA -- and one split of its keys;
    splits (a power of two) bring programs near ``programs_per_sm x SMs``, at least
    ``min_keys_per_split`` keys a split, at most ``max_splits``. The split count falls step
    by step as the batch grows: no cliff, no kernel switch. A program of fewer rows takes
    the narrow warps and stages. With ``smem`` (bytes a block may use), ``latent_bytes`` (a
    cached row as stored) and ``convert_bytes`` (that row converted for the MMA, when the
    cache is narrower), the stages, then the keys, shrink until ``stages`` loaded tiles and a
    converted one fit: a launch that does not fails. The H200's 227 KiB fit 3 stages of 64
    bf16 rows of 512 + 64. ``value_parts`` 2 halves each program's value columns (latent
    tiles ``rank_p`` >= 32 wide: halves of at least the MMA's 16)."""
    if t.value_parts not in (1, 2):
        raise ValueError(f"Tuning.mla.value_parts={t.value_parts} must be 1 or 2")
    parts = 2 if t.value_parts == 2 and rank_p >= 32 else 1
    query_rows = pow2(max(1, max_query_len))
    head_rows = min(pow2(heads), max(1, t.decode_rows // query_rows))
    head_rows = max(head_rows, 16 // min(16, query_rows))
    items = max(1, requests) * -(-heads // head_rows) * parts
    want = max(1, t.programs_per_sm * num_sms // items)
    cap = max(1, min(t.max_splits, max_seq_len // t.min_keys_per_split))
    splits = 1
    while splits * 2 <= min(want, cap):
        splits *= 2
    narrow = query_rows * head_rows < t.decode_rows
    warps, stages = (t.narrow_warps, t.narrow_stages) if narrow else (t.decode_warps,
                                                                       t.decode_stages)
    keys = t.decode_keys
    while smem and keys * (stages * latent_bytes + convert_bytes) > smem and \
            (stages > 1 or keys > 16):
        if stages > 1:
            stages -= 1
        else:
            keys //= 2
    return MLADecodeLaunch(splits, query_rows, head_rows, keys, warps, stages, parts)


def sparse_mla_splits(rows: int, heads: int, topk: int, num_sms: int, t: MLATuning) -> int:
    """TRITON_MLA_SPARSE's splits of each token's selected slots: with few tokens a program
    per (token, head block) leaves SMs idle, so the slots split (a power of two) until the
    programs near ``programs_per_sm x SMs``, each split at least ``min_keys_per_split``
    slots, at most ``max_splits``; ``Tuning.mla.sparse_splits`` > 0 fixes the count."""
    if t.sparse_splits > 0:
        return t.sparse_splits
    head_blocks = -(-heads // max(16, min(t.sparse_heads, pow2(heads))))
    want = max(1, t.programs_per_sm * num_sms // max(1, rows * head_blocks))
    cap = max(1, min(t.max_splits, topk // t.min_keys_per_split))
    splits = 1
    while splits * 2 <= min(want, cap):
        splits *= 2
    return splits


def dsv4_launch(rows: int, heads: int, max_keys: int, num_sms: int,
                t: MLATuning) -> tuple[int, int, int, int, int]:
    """DSV4_TRITON's launch: (heads a program, keys a step, warps, stages, splits). Its
    programs have TRITON_MLA_SPARSE's shape -- one query row's heads over gathered 512-wide
    rows, K = V -- so they take that kernel's tile; a row's keys (``max_keys``: the window and
    at most the top-k picks, or every compressed entry the block table reaches) split by
    :func:`sparse_mla_splits`' rule."""
    splits = sparse_mla_splits(rows, heads, max_keys, num_sms, t)
    return t.sparse_heads, t.sparse_keys, t.sparse_warps, t.sparse_stages, splits


def indexer_score_chunk(rows: int, positions: int, block_n: int, num_sms: int,
                        t: MLATuning) -> int:
    """Positions a program of the indexer's scoring covers: ``Tuning.mla.index_chunk``, halved
    (a power of two, not below 256 nor ``block_n``) while the step's programs
    (rows x chunks) stay under ``programs_per_sm x SMs`` -- few decode rows over a long
    context split their positions over the SMs, many rows keep long programs (the row's
    query heads are loaded once a program)."""
    chunk = max(block_n, pow2(t.index_chunk))
    floor = max(block_n, 256)
    want = t.programs_per_sm * num_sms
    while chunk // 2 >= floor and rows * -(-positions // chunk) < want:
        chunk //= 2
    return chunk


def indexer_select_span(rows: int, positions: int, block: int, num_sms: int,
                        t: MLATuning) -> int:
    """Positions a program of the indexer's top-k select covers (each launch runs rows x
    spans programs): ``block``, doubled while the programs exceed ``index_select_programs_per_sm
    x SMs`` (each program re-reads its row's histograms: longer spans for many rows) and the
    span is short of the positions."""
    span = block
    want = t.index_select_programs_per_sm * num_sms
    while span < positions and rows * -(-positions // span) > want:
        span *= 2
    return span


def flashinfer_mla_kernel(capability: tuple[int, int], kv_lora_rank: int) -> Kernel:
    """FLASHINFER_MLA's absorbed kernel: fa3 on sm90 for latent widths 128 / 256 / 512 (its
    templates), fa2 elsewhere. Measured on the H200 at 512 + 64: fa3 471-503 TFLOP/s at 128
    heads and batch 32-128, fa2 258-269."""
    if capability[0] == 9 and kv_lora_rank in (128, 256, 512):
        return Kernel.FLASHINFER_MLA_FA3
    return Kernel.FLASHINFER_MLA_FA2


def flashinfer_mla_shared_bytes(kernel: Kernel, rank: int, rope: int, fp8: bool,
                                shared_per_sm: int) -> int | None:
    """Shared memory one block of FlashInfer 0.7's MLA kernel takes for latent width ``rank``
    and rope width ``rope`` (its templates' storage: the query tile, the KV stages, the
    output staging), or None where the fa2 kernel has no tiling for an SM of
    ``shared_per_sm`` bytes. fa3 at 512 + 64 takes 222,048 of the H200's 232,448; at
    512 + 128 it would take 246,624, which FlashInfer refuses at plan time."""
    align16 = lambda size: -(-size // 16) * 16  # noqa: E731
    q_bytes = 64 * (rank + rope) * 2
    elem = 1 if fp8 else 2
    if kernel is Kernel.FLASHINFER_MLA_FA3:
        stage = 64 * rank * elem + max(64 * rope * elem, 64 * 64 * 2)
        repack = align16(64 * rank * 2) + align16(max(64 * rope, 1) * 2) if fp8 else 32
        return q_bytes + max(2 * stage + repack, 64 * rank * 2) + 3 * 64 * 4 + 64
    if shared_per_sm >= 221696:
        stages, tile = 2, 64
    elif shared_per_sm >= 147968:
        stages, tile = 2, 32
    elif shared_per_sm >= 92672:
        stages, tile = 1, 16
    else:
        return None
    tile = 32 if fp8 else tile
    kv_bytes = stages * tile * (rank + max(rope, 64)) * elem
    repack = align16(stages * tile * rank * 2) + align16(stages * tile * max(rope, 1) * 2) \
        if fp8 else 32
    return max(q_bytes + kv_bytes + repack + 2 * 64 * 4, 64 * rank * 2)


# FlashMLA's tile scheduler (get_decoding_sched_meta) keeps 5 ints a batch row in one block's
# shared memory: 4 * (5 * rows + 1) bytes of the 232,448 an sm90 / sm100 block may take.
FLASHMLA_MAX_ROWS = 11622


def mla_absorbed_route(heads: int, requests: int, max_query_len: int, max_seq_len: int,
                       t: MLATuning, fa3_usable: bool = False) -> PartRoute:
    """The kernel of an MLA step's absorbed part where FlashMLA, FlashInfer's MLA (fa3) and
    TRITON_MLA can run it, and FlashAttention 3's MLA path where ``fa3_usable``
    (COMPOSITE_MLA_SM90): for a handful of query rows, FA3's MLA path (it splits one request's
    keys over the SMs and its op writes in place), else TRITON_MLA's split kernel over long
    contexts; FlashMLA for many requests over long contexts; FlashInfer's fa3 kernel elsewhere
    (the fastest at short contexts and mid batches, within a few percent of the best at the
    rest). H200, 512 + 64 latents, bf16 (docs/performance.md): 16 heads x 1 request, FA3's MLA
    op 1.06-1.42x the best as vLLM runs it at 1k-32k (TRITON_MLA 0.89-1.34x, FlashInfer's
    0.99-1.02x); 64-128 requests at 32k, FlashMLA's op 1.02-1.10x FlashInfer's; FlashMLA
    0.47-0.93x FlashInfer below 32 requests, 0.89-1.00x at 8k."""
    rows = requests * max_query_len * heads
    small = f"{rows} query x head row(s) <= {t.route_small_max_rows}"
    if rows <= t.route_small_max_rows:
        if fa3_usable:
            return PartRoute(Kernel.FA3_MLA, why=small)
        if max_seq_len >= t.route_triton_min_keys:
            return PartRoute(Kernel.TRITON_MLA, why=f"{small} over >= "
                             f"{t.route_triton_min_keys} keys, FA3 not installed")
    if (t.route_flashmla_min_requests <= requests <= FLASHMLA_MAX_ROWS
            and max_seq_len >= t.route_flashmla_min_keys):
        return PartRoute(Kernel.FLASHMLA, why=f"{requests} request(s) >= "
                         f"{t.route_flashmla_min_requests} over >= {t.route_flashmla_min_keys} "
                         "keys")
    return PartRoute(Kernel.FLASHINFER_MLA_FA3, why="short contexts or few requests")


def mla_prefill_kernel(fa4_usable: bool, flashinfer_usable: bool = False, requests: int = 0,
                       flashinfer_max_requests: int = 0) -> Kernel:
    """The kernel of an MLA step's MHA part (QK nope + rope, V v_head_dim, ragged, with LSE)
    for ``requests`` MHA-form requests: FlashInfer's ragged prefill where it can run and FA4
    cannot, or for at most ``flashinfer_max_requests`` (``Tuning.mla.
    flashinfer_prefill_max_requests``: its host plan at each call costs little against few
    long requests and much against many short ones); else FlashAttention 4 where it can run
    (CUDA, installed, the head dims); else PyTorch, slow, for the CPU and tests."""
    if flashinfer_usable and (not fa4_usable or requests <= flashinfer_max_requests):
        return Kernel.FLASHINFER_RAGGED
    return Kernel.FA4 if fa4_usable else Kernel.TORCH_MHA
