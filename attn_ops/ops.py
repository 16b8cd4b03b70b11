"""Op registration for the ``torch.ops.attn`` namespace, and the shared schemas.

Ops are defined with ``torch.library.Library.define`` + ``impl`` + a fake kernel rather than
``torch.library.custom_op``: on torch 2.13 (2-core CPU) the latter costs 20 us against 1.8 us
per eager call for a trivial op and 92 us against 4.3 us with the 15-argument attention schema
(``benchmarks/bench_op_overhead.py`` measures both side by side), which matters for eager and
piecewise-graph decode. Registration happens when a backend module is imported, is idempotent,
and changes no torch or Inductor setting.

Every attention backend's op takes the same semantic schema (:data:`PAGED_ATTENTION_SCHEMA`):
metadata arrives as tensors, the result is written into a preallocated ``out`` (and ``lse``),
and there are no per-layer strings, so Inductor can reuse one compiled layer for all layers.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Sequence

import torch

__all__ = [
    "PAGED_ATTENTION_SCHEMA", "apply_sinks", "check_nhd_attention_inputs",
    "check_layer_inputs", "check_paged_attention_inputs", "check_paged_attention_values",
    "check_query_start_loc",
    "debug_checks_enabled",
    "define_op", "library", "set_debug_checks", "with_fp8_output",
    "OP_MODULES", "resolve_ops_on_lookup",
]

_LIB: torch.library.Library | None = None
_DEFINED: dict[str, torch._ops.OpOverload] = {}
_DEBUG = os.environ.get("ATTN_OPS_DEBUG", "0") not in ("", "0")

DISPATCH_KEYS = ("CPU", "CUDA", "XPU")

PAGED_ATTENTION_SCHEMA = (
    "(Tensor query, Tensor kv_cache, Tensor query_start_loc, Tensor seq_lens, "
    "Tensor block_table, Tensor(a!) out, Tensor(b!)? lse, Tensor? sinks, Tensor? alibi_slopes, "
    "Tensor? k_scale, Tensor? v_scale, float scale, int? sliding_window, float? soft_cap, "
    "bool causal) -> ()"
)
"""Paged attention over a mixed batch (decodes first, then prefills).

query [T, Hq, Dqk]; kv_cache in one of the layouts of :mod:`attn_ops.kv_cache`;
query_start_loc [B+1] int32; seq_lens [B] int32 (context + new tokens); block_table
[B, max_blocks] int32; out [T, Hq, Dv] written for the first query_start_loc[-1] rows (padding
rows are zeroed); lse [T, Hq] float32, natural log, over the visible keys (sinks excluded);
sinks [Hq] float32 logits; alibi_slopes [Hq] float32; k_scale/v_scale one-element float32
tensors dequantizing an fp8 cache.
"""

PAGED_ATTENTION_MODS_SCHEMA = PAGED_ATTENTION_SCHEMA.replace(") -> ()", ", int mods) -> ()")
"""The same plus ``mods``: the id of the spec's custom mask/score mods
(:func:`register_mods`; 0 for none)."""


def library() -> torch.library.Library:
    global _LIB
    if _LIB is None:
        _LIB = torch.library.Library("attn", "FRAGMENT")
    return _LIB


def define_op(
    name: str,
    schema: str,
    impl: Callable,
    fake: Callable,
    *,
    dispatch_keys: Sequence[str] = DISPATCH_KEYS,
    tags: Sequence[torch.Tag] = (),
    fp8_output_at: int | None = None,
) -> torch._ops.OpOverload:
    """Define ``torch.ops.attn.<name>`` once; later calls return the existing overload.

    ``fp8_output_at``: the position of an attention op's ``out``. The op then takes a last,
    optional ``Tensor? output_scale`` too: given one, ``out`` may be fp8 and receives the
    result quantized with that scale (:func:`with_fp8_output`) -- what the FP8-output compile
    pass (:mod:`attn_ops.compile_passes.fp8_output`) rewrites an attention op followed by
    ``torch.ops.attn.quantize_fp8`` into."""
    if name in _DEFINED:
        return _DEFINED[name]
    if fp8_output_at is not None:
        schema = schema.replace(") -> ()", ", Tensor? output_scale=None) -> ()")
        num_args = len(torch._C.parse_schema("attn::" + name + schema).arguments)
        impl = with_fp8_output(impl, fp8_output_at, num_args, quantize=True)
        fake = with_fp8_output(fake, fp8_output_at, num_args, quantize=False)
    lib = library()
    lib.define(name + schema, tags=tuple(tags))
    for key in dispatch_keys:
        lib.impl(name, impl, key)
    torch.library.register_fake(f"attn::{name}", fake, lib=lib)
    _DEFINED[name] = getattr(torch.ops.attn, name).default
    return _DEFINED[name]


# Every op of the namespace and the module whose import defines it. ``torch.ops.attn.<name>``
# imports that module on first lookup (:func:`resolve_ops_on_lookup`), so an op resolves after
# ``import attn_ops`` alone -- in a fresh process unpickling a graph, say -- while importing the
# package still defines no op and imports no backend. tests/test_package.py checks this table
# against the ``define_op`` calls in the sources.
OP_MODULES: dict[str, str] = {
    "kv_cache_update": "attn_ops.kv_cache",
    "rope": "attn_ops.glue",
    "slot_mapping": "attn_ops.glue",
    "rope_kv_cache_update": "attn_ops.glue",
    "quantize_fp8": "attn_ops.glue",
    "reference_attention": "attn_ops.backends.reference",
    "reference_attention_mods": "attn_ops.backends.reference",
    "cpu_attention": "attn_ops.backends.cpu_attn",
    "triton_attention": "attn_ops.backends.triton_attn",
    "flex_attention": "attn_ops.backends.flex_attention",
    "flex_attention_prepared": "attn_ops.backends.flex_attention",
    "flex_attention_decode": "attn_ops.backends.flex_attention",
    "flex_attention_gathered": "attn_ops.backends.flex_attention",
    "flashinfer_attention": "attn_ops.backends.flashinfer",
    "flash_attn_attention": "attn_ops.backends.flash_attn",
    "flash_attn_diffkv_attention": "attn_ops.backends.flash_attn_diffkv",
    "composite_sm90_attention": "attn_ops.backends.composite_sm90",
    "tree_attention": "attn_ops.backends.tree_attn",
    "mla_cache_update": "attn_ops.backends.mla.common",
    "merge_attn_states": "attn_ops.backends.mla.common",
    "mla_rope": "attn_ops.backends.mla.rope",
    "mla_rope_cache_update": "attn_ops.backends.mla.rope",
    "reference_mla_attention": "attn_ops.backends.mla.reference",
    "triton_mla_attention": "attn_ops.backends.mla.triton_mla",
    "flashinfer_mla_attention": "attn_ops.backends.mla.flashinfer_mla",
    "flashmla_attention": "attn_ops.backends.mla.flashmla",
    "composite_mla_sm90_attention": "attn_ops.backends.mla.composite",
    "flashmla_sparse": "attn_ops.backends.mla.flashmla_sparse",
    "flash_attn_mla_attention": "attn_ops.backends.mla.flash_attn_mla",
    "reference_mla_sparse": "attn_ops.backends.mla.sparse",
    "triton_mla_sparse": "attn_ops.backends.mla.sparse",
    "flashinfer_mla_sparse": "attn_ops.backends.mla.flashinfer_mla_sparse",
    "indexer_k_write": "attn_ops.backends.mla.indexer",
    "indexer_topk": "attn_ops.backends.mla.indexer",
    "indexer_slots": "attn_ops.backends.mla.indexer",
    "causal_conv1d": "attn_ops.backends.ssm.conv",
    "gated_delta_rule": "attn_ops.backends.ssm.gated_deltanet",
    "lightning_attention": "attn_ops.backends.ssm.lightning",
    "mamba1_scan": "attn_ops.backends.ssm.mamba1",
    "mamba2_ssd": "attn_ops.backends.ssm.mamba2",
    "short_conv": "attn_ops.backends.ssm.short_conv",
    "turboquant_cache_update": "attn_ops.backends.turboquant.ops",
    "turboquant_attention": "attn_ops.backends.turboquant.ops",
    "dsv4_compressor": "attn_ops.backends.deepseek_v4.compressor",
    "dsv4_compressed_slot_mapping": "attn_ops.backends.deepseek_v4.compressor",
    "dsv4_entry_write": "attn_ops.backends.deepseek_v4.cache",
    "dsv4_reference_attention": "attn_ops.backends.deepseek_v4.reference",
    "dsv4_indexer_topk": "attn_ops.backends.deepseek_v4.reference",
    "dsv4_index_write": "attn_ops.backends.deepseek_v4.cache",
    "dsv4_triton_attention": "attn_ops.backends.deepseek_v4.backend",
    "dsv4_triton_indexer_topk": "attn_ops.backends.deepseek_v4.backend",
    "dsv4_triton_compress_write": "attn_ops.backends.deepseek_v4.backend",
    "dsv4_triton_entry_write": "attn_ops.backends.deepseek_v4.backend",
    "dsv4_flashmla_attention": "attn_ops.backends.deepseek_v4.flashmla",
}


def resolve_ops_on_lookup() -> None:
    """Let a lookup of ``torch.ops.attn.<name>`` that finds no op import the module defining it
    (:data:`OP_MODULES`), then look again. Idempotent.

    torch binds an op to its namespace object on the first lookup that finds it, and raises
    ``AttributeError`` when none is registered; the namespace object is kept (its class is
    switched to a subclass that adds the import), so ops already bound and references to it
    stay valid. A hit never reaches this code: it is served from the object's attributes."""
    namespace = torch.ops.attn
    base = type(namespace)
    if getattr(base, "_attn_ops_resolves", False):
        return

    class _AttnNamespace(base):
        # torch names a bound op's module after its namespace's class ("torch._ops.attn"). FX
        # code generation writes an op of a torch module as torch.ops.attn.<name> and any other
        # as a global, which Inductor's cache key then fails to pickle: keep torch's name.
        __module__ = base.__module__
        _attn_ops_resolves = True

        def __getattr__(self, op_name: str):
            try:
                return super().__getattr__(op_name)
            except AttributeError:
                module = OP_MODULES.get(op_name)
                if module is None:
                    raise
            importlib.import_module(module)
            # define_op has bound the op; binding it again would make a second packet whose
            # overloads are not the ones define_op returned (passes compare them by identity).
            bound = self.__dict__.get(op_name)
            return bound if bound is not None else super().__getattr__(op_name)

    namespace.__class__ = _AttnNamespace


def with_fp8_output(kernel: Callable, out_index: int, num_args: int, *,
                    quantize: bool) -> Callable:
    """``kernel`` with a trailing ``output_scale`` argument (the op's ``num_args``-th; the
    dispatcher passes it only when the caller did): None runs it as is; a scale runs it into a
    buffer of the query's dtype and writes ``quantize_fp8(buffer, scale)`` into the fp8
    ``out`` (the fusion at the op level: one op instead of attention + quantization)."""

    def run(*args, output_scale=None):
        args = list(args)
        if len(args) == num_args:
            output_scale = args.pop()
        scale = output_scale
        if scale is None:
            return kernel(*args)
        out, query = args[out_index], args[0]
        if out.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
            _fail(f"output_scale is given but out.dtype={out.dtype}; allocate out as "
                  "torch.float8_e4m3fn or torch.float8_e5m2 (or pass output_scale=None)")
        if scale.numel() != 1 or scale.dtype != torch.float32 or scale.device != out.device:
            _fail(f"output_scale must be a one-element float32 tensor on {out.device}, got "
                  f"{scale.dtype} {tuple(scale.shape)} on {scale.device}")
        args[out_index] = buffer = torch.empty(out.shape, dtype=query.dtype, device=out.device)
        kernel(*args)
        if quantize:
            from attn_ops.kv_cache import quantize_fp8

            out.copy_(quantize_fp8(buffer, scale, out.dtype))

    return run


def set_debug_checks(enabled: bool) -> None:
    """Turn on value checks that read tensor data (slot and block-table ranges) inside ops.

    Off by default because on a GPU they would synchronize the device in every layer; the
    metadata builder already checks the same values where they live on the host. Also set by
    ``ATTN_OPS_DEBUG=1``.
    """
    global _DEBUG
    _DEBUG = enabled


def debug_checks_enabled() -> bool:
    return _DEBUG


def _fail(message: str) -> None:
    raise ValueError(message)


def check_layer_inputs(owner: str, device: torch.device, tensors, *, tokens: int | None = None,
                       metadata=None, page: int | None = None) -> None:
    """A layer's inputs before its ops (shapes and host values only: no device sync).

    ``tensors``: ``(name, tensor or None, expected dtype or None)``; each must have that dtype
    (None: any) and sit on ``device`` (the cache's). ``tokens``: the step's rows, which ``metadata``'s slot
    mapping must have; ``page``: the cache's page size, which the metadata must have been
    built for (its slots and block ranges are computed with it). Raises ``ValueError`` naming
    the argument, the expected and the actual value."""
    for name, x, dtype in tensors:
        if x is None:
            continue
        if dtype is not None and x.dtype != dtype:
            _fail(f"{owner}: {name}.dtype={x.dtype}, expected {dtype} (the layer's spec); "
                  f"convert it with .to({dtype})")
        if x.device != device:
            _fail(f"{owner}: {name} is on {x.device}, expected {device} (the cache's device)")
    if metadata is None:
        return
    slots = getattr(metadata, "slot_mapping", None)
    if tokens is not None and slots is not None and slots.shape[0] != tokens:
        _fail(f"{owner}: the inputs have {tokens} tokens but the metadata was built for "
              f"{slots.shape[0]} (its slot_mapping); build the step's metadata for these "
              "tokens (num_tokens_padded= covers padding rows)")
    if slots is not None and slots.device != device:
        _fail(f"{owner}: the metadata is on {slots.device}, expected {device} (the cache's "
              "device); build it with device=")
    built = getattr(metadata, "block_size", 0)
    if page is not None and built and built != page:
        _fail(f"{owner}: the metadata was built for pages of block_size={built} tokens but the "
              f"cache has pages of {page}; build the metadata with the cache's block_size "
              f"({page}: the layer's .block_size when it allocated the cache)")


def check_paged_attention_inputs(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    sinks: torch.Tensor | None,
    alibi_slopes: torch.Tensor | None,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> None:
    """Shape, dtype and device checks that need no tensor data (safe in the hot path and in
    fake kernels). Raises ``ValueError`` naming the offending value and the fix."""
    if query.dim() != 3:
        _fail(f"query must be [num_tokens, num_heads, head_dim], got shape {tuple(query.shape)}")
    num_tokens, num_heads, head_dim = query.shape
    if out.dim() != 3 or out.shape[0] != num_tokens or out.shape[1] != num_heads:
        _fail(f"out must be [{num_tokens}, {num_heads}, head_dim_v] to match query, got shape "
              f"{tuple(out.shape)}")
    if out.dtype != query.dtype:
        _fail(f"out.dtype={out.dtype} differs from query.dtype={query.dtype}; allocate out with "
              "torch.empty_like(query) (or the query dtype)")
    head_dim_v = out.shape[2]
    # Read the cache's dims from its shape (no views: this runs in every layer).
    if kv_cache.dim() == 5 and kv_cache.shape[1] == 2:
        num_kv_heads, cache_dim, cache_dim_v = kv_cache.shape[3], kv_cache.shape[4], \
            kv_cache.shape[4]
    elif kv_cache.dim() == 4:
        num_kv_heads, cache_dim = kv_cache.shape[2], head_dim
        cache_dim_v = kv_cache.shape[3] - head_dim
    else:
        from attn_ops.kv_cache import split_kv_cache

        split_kv_cache(kv_cache, head_dim, head_dim_v)  # raises, describing the layouts
    if cache_dim != head_dim:
        _fail(f"query head_dim={head_dim} differs from the KV cache's head_dim={cache_dim}: "
              f"query must be [{num_tokens}, {num_heads}, {cache_dim}], got shape "
              f"{tuple(query.shape)}")
    if cache_dim_v != head_dim_v:
        if kv_cache.dim() == 4:
            _fail(f"a packed KV cache must be [num_blocks, block_size, num_kv_heads, head_dim + "
                  f"head_dim_v = {head_dim + head_dim_v}], got shape {tuple(kv_cache.shape)}")
        _fail(f"out head_dim_v={head_dim_v} differs from the KV cache's head_dim_v="
              f"{cache_dim_v}: out must be [{num_tokens}, {num_heads}, {cache_dim_v}], got "
              f"shape {tuple(out.shape)}")
    if num_heads % num_kv_heads:
        _fail(f"num_heads={num_heads} is not a multiple of the cache's num_kv_heads="
              f"{num_kv_heads}: query must be [{num_tokens}, k x {num_kv_heads}, {head_dim}], "
              f"got shape {tuple(query.shape)}")
    device = query.device
    for name, t in (("kv_cache", kv_cache), ("out", out), ("query_start_loc", query_start_loc),
                    ("seq_lens", seq_lens), ("block_table", block_table), ("lse", lse),
                    ("sinks", sinks), ("alibi_slopes", alibi_slopes), ("k_scale", k_scale),
                    ("v_scale", v_scale)):
        if t is not None and t.device != device:
            _fail(f"{name} is on {t.device} but query is on {device}; move both to one device")
    if kv_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        if k_scale is None or v_scale is None:
            _fail(f"kv_cache.dtype={kv_cache.dtype} needs k_scale and v_scale to dequantize")
    elif kv_cache.dtype != query.dtype:
        _fail(f"kv_cache.dtype={kv_cache.dtype} differs from query.dtype={query.dtype}; store "
              "the cache in the model dtype or in fp8 with scales")
    for name, t in (("query_start_loc", query_start_loc), ("seq_lens", seq_lens),
                    ("block_table", block_table)):
        if t.dtype not in (torch.int32, torch.int64):
            _fail(f"{name}.dtype={t.dtype} must be int32 (or int64)")
    num_reqs = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    if seq_lens.dim() != 1 or query_start_loc.shape != (num_reqs + 1,):
        _fail(f"seq_lens must be [B] and query_start_loc [B+1]; got {tuple(seq_lens.shape)} and "
              f"{tuple(query_start_loc.shape)}")
    if block_table.dim() != 2 or block_table.shape[0] != num_reqs:
        _fail(f"block_table must be [B={num_reqs}, max_blocks], got {tuple(block_table.shape)}")
    if lse is not None and (lse.shape != (num_tokens, num_heads) or lse.dtype != torch.float32):
        _fail(f"lse must be float32 [{num_tokens}, {num_heads}], got {lse.dtype} "
              f"{tuple(lse.shape)}")
    for name, t in (("sinks", sinks), ("alibi_slopes", alibi_slopes)):
        if t is not None and t.shape != (num_heads,):
            _fail(f"{name} must be [num_heads={num_heads}], got {tuple(t.shape)}")


def check_query_start_loc(starts: list[int], num_tokens: int, owner: str = "") -> None:
    """Host values of ``query_start_loc``: from 0, never decreasing, within the tokens; a
    ``ValueError`` names the first entry that is not (prefixed with ``owner``, the op)."""
    prefix = f"{owner}: " if owner else ""
    if starts[0] != 0:
        _fail(f"{prefix}query_start_loc[0]={starts[0]} must be 0")
    for r in range(len(starts) - 1):
        if starts[r + 1] < starts[r]:
            _fail(f"{prefix}query_start_loc[{r + 1}]={starts[r + 1]} is below "
                  f"query_start_loc[{r}]={starts[r]}: it never decreases")
    if starts[-1] > num_tokens:
        r = next(i for i, v in enumerate(starts) if v > num_tokens)
        _fail(f"{prefix}query_start_loc[{r}]={starts[r]} is past num_tokens={num_tokens} (the "
              "rows of the step's inputs)")


def check_paged_attention_values(num_tokens: int, num_blocks: int, block_size: int,
                                 starts: list[int], lens: list[int], block_table: torch.Tensor,
                                 check_block_ids: bool) -> None:
    """Checks that need metadata *values*: monotone query_start_loc within the tokens, seq_lens
    covering the query lengths and the block table's width, and (``check_block_ids``) the used
    block ids inside the cache.

    Kernels that already hold ``starts``/``lens`` as host lists run the list checks always
    (they cost about a microsecond); the block-id scan costs tensor ops in every layer, so it
    runs only with debug checks on (:func:`set_debug_checks`) -- the metadata builder checks
    the same ids on the host once per step. Nothing here is ever a hidden device sync.
    """
    check_query_start_loc(starts, num_tokens)
    width = block_table.shape[1]
    for i, s in enumerate(lens):
        n = starts[i + 1] - starts[i]
        if s < n:
            _fail(f"seq_lens[{i}]={s} is shorter than the request's query length {n}; seq_lens "
                  "counts the cached context plus the new tokens")
        if s > width * block_size:
            _fail(f"seq_lens[{i}]={s} needs {-(-s // block_size)} blocks but block_table has "
                  f"{width} columns of {block_size} tokens")
    if not check_block_ids:
        return
    used = [block_table[i, : -(-s // block_size)] for i, s in enumerate(lens) if s > 0]
    if used:
        ids = torch.cat(used)
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= num_blocks:
            bad = lo if lo < 0 else hi
            row = next(i for i, u in enumerate(used) if bool((u == bad).any()))
            _fail(f"block_table row {row} holds block {bad}, outside the cache's "
                  f"[0, {num_blocks}) blocks")


def check_nhd_attention_inputs(backend: str, query: torch.Tensor, kv_cache: torch.Tensor,
                               out: torch.Tensor, lse: torch.Tensor | None) -> None:
    """Shape checks shared by the backends whose ops take the NHD cache
    ``[num_blocks, 2, block_size, num_kv_heads, head_dim]`` and their own metadata."""
    if query.dim() != 3 or out.dim() != 3 or out.shape[:2] != query.shape[:2] \
            or out.dtype != query.dtype:
        _fail(f"{backend}: query [T, Hq, D] and out [T, Hq, Dv] must agree; got query "
              f"{tuple(query.shape)} {query.dtype} and out {tuple(out.shape)} {out.dtype}")
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2 or kv_cache.shape[4] != query.shape[2]:
        _fail(f"{backend} needs the NHD cache [num_blocks, 2, block_size, num_kv_heads, "
              f"head_dim={query.shape[2]}], got shape {tuple(kv_cache.shape)}")
    if out.shape[2] != kv_cache.shape[4]:
        _fail(f"{backend}: out must be [{out.shape[0]}, {out.shape[1]}, {kv_cache.shape[4]}] "
              f"(the cache's head dim), got shape {tuple(out.shape)}")
    if query.shape[1] % kv_cache.shape[3]:
        _fail(f"{backend}: query's {query.shape[1]} heads are not a multiple of the cache's "
              f"{kv_cache.shape[3]} KV heads; query must be [T, k x {kv_cache.shape[3]}, "
              f"{query.shape[2]}], got shape {tuple(query.shape)}")
    if lse is not None and (lse.shape != query.shape[:2] or lse.dtype != torch.float32):
        _fail(f"lse must be float32 {tuple(query.shape[:2])}, got {lse.dtype} "
              f"{tuple(lse.shape)}")


def apply_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> None:
    """Attention sinks from the LSE (natural log, ``[T, H]``): a sink logit adds probability
    mass ``exp(sink)`` and no value, so ``out *= exp(lse) / (exp(lse) + exp(sink))``."""
    out.mul_(torch.sigmoid(lse - sinks.float()).unsqueeze(-1).to(out.dtype))


# ---------------------------------------------------------------------------------------------
# Custom mask / score mods (AttentionSpec.mask_mod / score_mod) and a backend's kernel options:
# callables and dataclasses cannot be op arguments, so each distinct triple is registered once
# and travels as an int id (0: none of them).

_MODS: list[tuple] = [(None, None, None)]


def register_mods(spec, options: object = None) -> int:
    """The id of ``spec``'s ``(mask_mod, score_mod)`` pair with a backend's frozen kernel
    ``options`` (a tuning section, compared by value), registering it on first sight."""
    triple = (spec.mask_mod, spec.score_mod, options)
    if triple == (None, None, None):
        return 0
    for i, known in enumerate(_MODS):
        if known[0] is triple[0] and known[1] is triple[1] and known[2] == triple[2]:
            return i
    _MODS.append(triple)
    return len(_MODS) - 1


def registered_mods(mods_id: int) -> tuple:
    """``(mask_mod, score_mod, options)`` registered under ``mods_id``."""
    if not 0 <= mods_id < len(_MODS):
        raise ValueError(f"mods={mods_id} is not a registered mask/score mod id "
                         "(attn_ops.ops.register_mods)")
    return _MODS[mods_id]
