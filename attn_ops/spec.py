"""The problem description every selector, backend, test and benchmark takes.

One frozen, typed :class:`AttentionSpec` describes one attention layer: its heads, head dims,
dtypes, KV-cache quantization and features. Adding a feature means one field here and the
backends that declare it.
"""

from __future__ import annotations

from collections.abc import Callable

import enum
import math
from dataclasses import dataclass, replace

import torch

__all__ = ["AttentionSpec", "AttentionType", "KVCacheDType", "LayerKind", "Feature",
           "TURBOQUANT_KV_DTYPES", "yarn_mscale"]


class AttentionType(enum.Enum):
    DECODER = "decoder"  # causal self-attention over the paged cache
    ENCODER_ONLY = "encoder_only"  # bidirectional self-attention (embedding models)
    ENCODER_DECODER = "encoder_decoder"  # cross-attention


class KVCacheDType(enum.Enum):
    """How K and V are stored in the paged cache. AUTO stores them in the model dtype."""

    AUTO = "auto"
    FP8_E4M3 = "fp8_e4m3"
    FP8_E5M2 = "fp8_e5m2"
    # FlashMLA's sparse MLA latent layout (DeepSeek-V3.2; vLLM's "fp8_ds_mla"): per token the
    # latent in fp8 e4m3 with one fp32 scale a 128 values, the rope part in 16 bits
    # (attn_ops.backends.mla.ds_cache documents it byte by byte); MLA specs only
    FP8_DS_MLA = "fp8_ds_mla"
    # TurboQuant (vLLM's TURBOQUANT presets): keys rotated by a Hadamard transform and
    # quantized to 3 or 4 bits on a Lloyd-Max codebook with their norm (or fp8 e4m3 keys:
    # k8v4), values to 3 or 4 bits with a scale and minimum, one byte slot a (token, KV head);
    # _nc: norm correction when read. attn_ops.backends.turboquant.format documents the bytes.
    TURBOQUANT_K8V4 = "turboquant_k8v4"
    TURBOQUANT_4BIT_NC = "turboquant_4bit_nc"
    TURBOQUANT_K3V4_NC = "turboquant_k3v4_nc"
    TURBOQUANT_3BIT_NC = "turboquant_3bit_nc"

    # Each member also carries, as plain attributes set below (read in every layer call, where
    # a property or a set lookup would hash the member in Python each time):
    #   is_fp8        -- stored in an fp8 dtype (FP8_E4M3, FP8_E5M2, FP8_DS_MLA);
    #   is_turboquant -- one of the TurboQuant presets;
    #   is_quantized  -- anything but AUTO;
    #   inline_scales -- the cache rows carry their own scales (no per-tensor ``kv_scale``):
    #                    FP8_DS_MLA and the TurboQuant presets.
    is_fp8: bool
    is_turboquant: bool
    is_quantized: bool
    inline_scales: bool

    def storage_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The dtype the cache is stored in for a model of ``model_dtype``."""
        return self._storage or model_dtype


TURBOQUANT_KV_DTYPES = frozenset({KVCacheDType.TURBOQUANT_K8V4, KVCacheDType.TURBOQUANT_4BIT_NC,
                                  KVCacheDType.TURBOQUANT_K3V4_NC,
                                  KVCacheDType.TURBOQUANT_3BIT_NC})
for _kv in KVCacheDType:
    _kv.is_turboquant = _kv in TURBOQUANT_KV_DTYPES
    _kv.is_fp8 = _kv in (KVCacheDType.FP8_E4M3, KVCacheDType.FP8_E5M2, KVCacheDType.FP8_DS_MLA)
    _kv.is_quantized = _kv is not KVCacheDType.AUTO
    _kv.inline_scales = _kv is KVCacheDType.FP8_DS_MLA or _kv.is_turboquant
    _kv._storage = torch.uint8 if _kv.is_turboquant else {
        KVCacheDType.FP8_E4M3: torch.float8_e4m3fn, KVCacheDType.FP8_E5M2: torch.float8_e5m2,
        KVCacheDType.FP8_DS_MLA: torch.float8_e4m3fn}.get(_kv)
del _kv


class LayerKind(enum.Enum):
    """The kind of a layer for per-kind backend overrides (full vs sliding-window layers, and
    each recurrent-state kind: values equal their state specs' ``kind``)."""

    FULL_ATTENTION = "full_attention"
    SLIDING_WINDOW = "sliding_window"
    ENCODER_ONLY = "encoder_only"
    CROSS_ATTENTION = "cross_attention"
    MLA = "mla"
    GATED_DELTANET = "gated_deltanet"
    MAMBA2 = "mamba2"
    MAMBA1 = "mamba1"
    SHORT_CONV = "short_conv"
    LIGHTNING = "lightning"
    DEEPSEEK_V4 = "deepseek_v4"  # (its three attention kinds: backends.deepseek_v4.spec)


class Feature(enum.Enum):
    """Optional features a spec may ask for and a backend may declare."""

    SLIDING_WINDOW = "sliding_window"
    SOFT_CAP = "logits_soft_cap"
    SINKS = "attention_sinks"
    ALIBI = "alibi"
    NON_CAUSAL = "non_causal"
    DIFF_HEAD_DIM_V = "different_v_head_dim"
    FP8_KV = "fp8_kv_cache"
    MLA = "mla"
    CROSS_ATTENTION = "cross_attention"
    CUSTOM_MODS = "custom_mask_or_score_mod"
    TREE = "tree_speculation"
    SPARSE_MLA = "sparse_mla"


_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class AttentionSpec:
    """One attention layer, as the selector and the backends see it.

    Shapes the layer will be called with (T = tokens in the batch)::

        query  [T, num_heads, head_dim]         key [T, num_kv_heads, head_dim]
        value  [T, num_kv_heads, head_dim_v]    out [T, num_heads, head_dim_v]

    ``None`` means "off" or "same as": ``num_kv_heads=None`` is MHA, ``head_dim_v=None`` equals
    ``head_dim``, ``sliding_window=None`` attends to the whole context, ``block_size=None`` lets
    the selected backend choose the page size it is fastest at.

    Example::

        spec = AttentionSpec(num_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    """

    num_heads: int
    head_dim: int
    num_kv_heads: int | None = None
    head_dim_v: int | None = None
    dtype: torch.dtype = torch.bfloat16
    kv_cache_dtype: KVCacheDType = KVCacheDType.AUTO
    block_size: int | None = None
    sliding_window: int | None = None
    logits_soft_cap: float | None = None
    has_sinks: bool = False
    use_alibi: bool = False
    attn_type: AttentionType = AttentionType.DECODER
    scale: float | None = None
    # Multi-head latent attention (DeepSeek-V2/V3): set by :meth:`mla`. The cache holds one
    # latent row per token, [kv_lora_rank | qk_rope_head_dim]; head_dim is the QK width of the
    # MHA form (qk_nope_head_dim + qk_rope_head_dim) and head_dim_v its V width; q_lora_rank is
    # the query's low-rank width (None: a plain q_proj), described for the model, unused by the
    # kernels.
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    qk_nope_head_dim: int | None = None
    q_lora_rank: int | None = None
    # Sparse MLA (DeepSeek-V3.2's DSA): each query token attends to the index_topk cached
    # tokens its lightning indexer scores highest (all visible ones when it sees no more);
    # None: dense MLA.
    index_topk: int | None = None
    # Arbitrary patterns (prefix-LM, document masking, ...), in request coordinates, written as
    # elementwise torch ops on index tensors (FlexAttention traces them; REFERENCE broadcasts):
    #   mask_mod(request, head, q_pos, kv_pos) -> bool       (and-ed with causal / window)
    #   score_mod(score, request, head, q_pos, kv_pos) -> score   (after soft-cap and ALiBi)
    mask_mod: Callable | None = None
    score_mod: Callable | None = None
    # Tree speculative decoding (EAGLE-style): the parent of each draft-tree node, in query
    # order (-1: the root, which follows the committed prefix; parents come before children).
    # A request with exactly len(spec_tree) query tokens is such a tree: each of its queries
    # sees the committed prefix and its own ancestors only. Up to 64 nodes. May also be given
    # as the ancestor mask (EAGLE's tree_mask: row i marks node i and its ancestors), a
    # square 0/1 nested sequence or tensor; it is stored as the parent array it encodes.
    spec_tree: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.kv_cache_dtype, str):
            object.__setattr__(self, "kv_cache_dtype", KVCacheDType(self.kv_cache_dtype))
        if isinstance(self.attn_type, str):
            object.__setattr__(self, "attn_type", AttentionType(self.attn_type))
        for name in ("num_heads", "head_dim"):
            _check_positive(name, getattr(self, name))
        for name in ("num_kv_heads", "head_dim_v", "block_size", "sliding_window",
                     "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "q_lora_rank",
                     "index_topk"):
            if getattr(self, name) is not None:
                _check_positive(name, getattr(self, name))
        if self.num_heads % self.kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.kv_heads}; "
                "grouped-query attention needs each KV head shared by the same number of query "
                "heads")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype={self.dtype} is not a floating model dtype; use one of "
                             f"{', '.join(str(d) for d in _DTYPES)}")
        if self.logits_soft_cap is not None and not self.logits_soft_cap > 0:
            raise ValueError(f"logits_soft_cap={self.logits_soft_cap} must be > 0; "
                             "use None to turn soft-capping off")
        if self.spec_tree is not None:
            tree = self.spec_tree.tolist() if hasattr(self.spec_tree, "tolist") else self.spec_tree
            if len(tree) and hasattr(tree[0], "__len__"):
                tree = parents_from_ancestor_mask(tree)
            object.__setattr__(self, "spec_tree", tuple(int(p) for p in tree))
            tree = self.spec_tree
            if not 1 <= len(tree) <= 64 or any(not -1 <= p < i for i, p in enumerate(tree)) \
                    or tree[0] != -1:
                raise ValueError(f"spec_tree={tree} must list 1-64 parents in query order: -1 "
                                 "for the root (first), each other parent an earlier node")
        if self.kv_lora_rank is not None or self.qk_nope_head_dim is not None:
            _check_mla(self)
        if self.kv_cache_dtype is KVCacheDType.FP8_DS_MLA:
            _check_ds_mla(self)
        if self.kv_cache_dtype.is_turboquant:
            _check_turboquant(self)
        if self.index_topk is not None:
            _check_sparse(self)
        if self.scale is not None and not (self.scale > 0 and math.isfinite(self.scale)):
            raise ValueError(f"scale={self.scale} must be a finite positive number; use None "
                             "for 1/sqrt(head_dim)")

    @classmethod
    def mla(cls, num_heads: int, *, kv_lora_rank: int = 512, qk_nope_head_dim: int = 128,
            qk_rope_head_dim: int = 64, v_head_dim: int = 128, q_lora_rank: int | None = None,
            mscale: float = 1.0, **fields) -> AttentionSpec:
        """An MLA layer (defaults: DeepSeek-V3's latent dims). The softmax scale is
        ``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5 * mscale ** 2`` -- the MHA form's QK
        width, not the absorbed form's 576 -- with ``mscale`` from :func:`yarn_mscale` under
        YaRN scaling (1 otherwise); ``scale=`` overrides it. ``fields``: ``dtype``,
        ``kv_cache_dtype``, ``block_size``, ...

        Example::

            spec = AttentionSpec.mla(128, q_lora_rank=1536, mscale=yarn_mscale(40, 1.0))
        """
        if not (isinstance(mscale, (int, float)) and mscale > 0 and math.isfinite(mscale)):
            raise ValueError(f"mscale={mscale!r} must be a finite positive number (YaRN's "
                             "yarn_mscale(factor, mscale_all_dim); 1.0 without YaRN)")
        qk = qk_nope_head_dim + qk_rope_head_dim
        fields.setdefault("scale", qk ** -0.5 * mscale * mscale)
        return cls(num_heads=num_heads, head_dim=qk, head_dim_v=v_head_dim,
                   kv_lora_rank=kv_lora_rank, qk_nope_head_dim=qk_nope_head_dim,
                   qk_rope_head_dim=qk_rope_head_dim, q_lora_rank=q_lora_rank, **fields)

    @property
    def latent_dim(self) -> int:
        """Values per token in an MLA latent cache: ``kv_lora_rank + qk_rope_head_dim``."""
        if not self.use_mla:
            raise ValueError(f"{self.describe()} is not an MLA spec (AttentionSpec.mla(...))")
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def latent_row_width(self) -> int:
        """Elements of :attr:`cache_dtype` a token takes in the latent cache: ``latent_dim``,
        or in FlashMLA's sparse layout (``FP8_DS_MLA``) its bytes: ``kv_lora_rank`` fp8
        values, 4 bytes of scale a 128 of them, 2 bytes a rope value (656 at 512 + 64)."""
        if self.kv_cache_dtype is KVCacheDType.FP8_DS_MLA:
            return self.kv_lora_rank + self.kv_lora_rank // 32 + 2 * self.qk_rope_head_dim
        return self.latent_dim

    # Resolved views of the "None means default" fields.
    @property
    def kv_heads(self) -> int:
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def v_head_dim(self) -> int:
        return self.head_dim if self.head_dim_v is None else self.head_dim_v

    @property
    def softmax_scale(self) -> float:
        return self.scale if self.scale is not None else self.head_dim ** -0.5

    @property
    def causal(self) -> bool:
        return self.attn_type is AttentionType.DECODER

    @property
    def use_mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def layer_kind(self) -> LayerKind:
        if self.use_mla:
            return LayerKind.MLA
        if self.attn_type is AttentionType.ENCODER_DECODER:
            return LayerKind.CROSS_ATTENTION
        if self.attn_type is AttentionType.ENCODER_ONLY:
            return LayerKind.ENCODER_ONLY
        if self.sliding_window is not None:
            return LayerKind.SLIDING_WINDOW
        return LayerKind.FULL_ATTENTION

    @property
    def features(self) -> frozenset[Feature]:
        """The optional features this spec asks for."""
        wanted = {
            Feature.SLIDING_WINDOW: self.sliding_window is not None,
            Feature.SOFT_CAP: self.logits_soft_cap is not None,
            Feature.SINKS: self.has_sinks,
            Feature.ALIBI: self.use_alibi,
            Feature.NON_CAUSAL: self.attn_type is AttentionType.ENCODER_ONLY,
            Feature.DIFF_HEAD_DIM_V: self.v_head_dim != self.head_dim,
            Feature.FP8_KV: self.kv_cache_dtype.is_fp8,
            Feature.MLA: self.use_mla,
            Feature.CROSS_ATTENTION: self.attn_type is AttentionType.ENCODER_DECODER,
            Feature.CUSTOM_MODS: self.mask_mod is not None or self.score_mod is not None,
            Feature.TREE: self.spec_tree is not None,
            Feature.SPARSE_MLA: self.index_topk is not None,
        }
        return frozenset(f for f, on in wanted.items() if on)

    @property
    def cache_dtype(self) -> torch.dtype:
        """The dtype the paged KV cache is stored in."""
        return self.kv_cache_dtype.storage_dtype(self.dtype)

    def with_(self, **changes) -> AttentionSpec:
        return replace(self, **changes)

    def describe(self) -> str:
        """A one-line summary used in errors and logs."""
        if self.use_mla:
            parts = [f"mla heads={self.num_heads}", f"kv_lora_rank={self.kv_lora_rank}",
                     f"qk_nope={self.qk_nope_head_dim}", f"qk_rope={self.qk_rope_head_dim}",
                     f"v_head_dim={self.v_head_dim}"]
            if self.index_topk is not None:
                parts.append(f"index_topk={self.index_topk}")
        else:
            parts = [f"heads={self.num_heads}/{self.kv_heads}", f"head_dim={self.head_dim}"]
        if self.v_head_dim != self.head_dim and not self.use_mla:
            parts.append(f"head_dim_v={self.v_head_dim}")
        parts.append(f"dtype={str(self.dtype).removeprefix('torch.')}")
        if self.kv_cache_dtype.is_quantized:
            parts.append(f"kv_cache_dtype={self.kv_cache_dtype.value}")
        if self.block_size is not None:
            parts.append(f"block_size={self.block_size}")
        if self.sliding_window is not None:
            parts.append(f"sliding_window={self.sliding_window}")
        if self.logits_soft_cap is not None:
            parts.append(f"logits_soft_cap={self.logits_soft_cap}")
        if self.has_sinks:
            parts.append("sinks")
        if self.use_alibi:
            parts.append("alibi")
        if self.attn_type is not AttentionType.DECODER:
            parts.append(f"attn_type={self.attn_type.value}")
        if self.spec_tree is not None:
            parts.append(f"spec_tree={len(self.spec_tree)} nodes")
        for name in ("mask_mod", "score_mod"):
            if (mod := getattr(self, name)) is not None:
                parts.append(f"{name}={getattr(mod, '__name__', type(mod).__name__)}")
        return "AttentionSpec(" + ", ".join(parts) + ")"


def parents_from_ancestor_mask(mask) -> tuple[int, ...]:
    """The parent array a draft tree's ancestor mask encodes (row ``i``: node ``i`` itself and
    its ancestors, nodes in query order). Raises naming the node when the mask is not a tree:
    a node that does not see itself, sees a later node, or whose ancestors are not exactly its
    parent's ancestors plus that parent."""
    rows = [[bool(x) for x in row] for row in mask]
    n = len(rows)
    if any(len(row) != n for row in rows):
        raise ValueError(f"spec_tree as an ancestor mask must be square; got rows of lengths "
                         f"{[len(row) for row in rows]}")
    parents: list[int] = []
    for i, row in enumerate(rows):
        seen = [j for j, on in enumerate(row) if on]
        if i not in seen or seen[-1] != i:
            raise ValueError(f"spec_tree mask row {i} must mark node {i} itself and earlier "
                             f"nodes only (its ancestors); it marks {seen}")
        parent = seen[-2] if len(seen) > 1 else -1
        expected = ([j for j, on in enumerate(rows[parent]) if on] if parent >= 0 else []) + [i]
        if seen != expected:
            raise ValueError(f"spec_tree mask row {i} marks {seen}, but a tree node sees its "
                             f"parent's ancestors plus itself: {expected} (parent {parent})")
        parents.append(parent)
    return tuple(parents)


def yarn_mscale(factor: float, mscale_all_dim: float) -> float:
    """YaRN's attention-temperature factor (DeepSeek's ``yarn_get_mscale``): ``0.1 *
    mscale_all_dim * ln(factor) + 1`` for a context extension ``factor`` > 1, else 1. The
    MLA softmax scale takes it squared (:meth:`AttentionSpec.mla`)."""
    if factor <= 1 or not mscale_all_dim:
        return 1.0
    return 0.1 * mscale_all_dim * math.log(factor) + 1.0


def _check_mla(spec: AttentionSpec) -> None:
    dims = {n: getattr(spec, n) for n in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim")}
    if any(v is None for v in dims.values()):
        raise ValueError(f"an MLA spec needs kv_lora_rank, qk_nope_head_dim and "
                         f"qk_rope_head_dim, got {dims}; build it with AttentionSpec.mla(...)")
    if spec.head_dim != spec.qk_nope_head_dim + spec.qk_rope_head_dim:
        raise ValueError(f"head_dim={spec.head_dim} must be qk_nope_head_dim + qk_rope_head_dim "
                         f"= {spec.qk_nope_head_dim + spec.qk_rope_head_dim} for MLA; build it "
                         "with AttentionSpec.mla(...)")
    if spec.kv_heads != spec.num_heads:
        raise ValueError(f"num_kv_heads={spec.num_kv_heads} must be None for MLA: every head "
                         "reads the one shared latent (its MHA form has num_heads K/V heads)")
    if spec.qk_rope_head_dim % 2:
        raise ValueError(f"qk_rope_head_dim={spec.qk_rope_head_dim} must be even: RoPE rotates "
                         "pairs of channels (DeepSeek's is 64)")


def _check_ds_mla(spec: AttentionSpec) -> None:
    if not spec.use_mla or spec.kv_lora_rank % 128 or spec.dtype.itemsize != 2:
        raise ValueError(f"kv_cache_dtype=fp8_ds_mla (FlashMLA's sparse latent layout) needs an "
                         f"MLA spec with kv_lora_rank a multiple of 128 and a 16-bit dtype, got "
                         f"{spec.describe()}; use fp8_e4m3 for a per-tensor fp8 cache")


def _check_turboquant(spec: AttentionSpec) -> None:
    """TurboQuant's formats: one slot of K and V a (token, KV head), so equal K / V head dims;
    the rotated presets a power-of-two head dim (the Sylvester Hadamard matrix), 3-bit ones a
    multiple of 8 (whole 3-byte groups); standard attention layers only."""
    name = spec.kv_cache_dtype.value
    if spec.use_mla:
        raise ValueError(f"kv_cache_dtype={name} quantizes standard attention's K and V; an MLA "
                         "spec caches a latent (use auto, fp8_e4m3 or fp8_ds_mla)")
    if spec.v_head_dim != spec.head_dim:
        raise ValueError(f"kv_cache_dtype={name} stores K and V of one head dim in one slot, "
                         f"got head_dim={spec.head_dim}, head_dim_v={spec.v_head_dim}")
    d = spec.head_dim
    rotated = spec.kv_cache_dtype is not KVCacheDType.TURBOQUANT_K8V4
    if rotated and d & (d - 1):
        raise ValueError(f"kv_cache_dtype={name} rotates keys by a Sylvester Hadamard matrix, "
                         f"which needs a power-of-two head_dim, got {d}; turboquant_k8v4 (fp8 "
                         "keys, no rotation) takes any even head dim")
    if d % 8 and spec.kv_cache_dtype in (KVCacheDType.TURBOQUANT_K3V4_NC,
                                         KVCacheDType.TURBOQUANT_3BIT_NC):
        raise ValueError(f"kv_cache_dtype={name} packs 3-bit codes in groups of 8, so head_dim "
                         f"must be a multiple of 8, got {d}")
    if d % 2:
        raise ValueError(f"kv_cache_dtype={name} packs 4-bit values two a byte, so head_dim must "
                         f"be even, got {d}")


def _check_sparse(spec: AttentionSpec) -> None:
    if not spec.use_mla:
        raise ValueError(f"index_topk={spec.index_topk} needs an MLA spec: sparse attention "
                         "here is DeepSeek-V3.2's sparse MLA; build it with "
                         "AttentionSpec.mla(..., index_topk=2048)")


def _check_positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a positive int")
