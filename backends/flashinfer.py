"""FLASHINFER: FlashInfer's paged attention kernels as one traceable custom op.

FlashInfer registers no torch ops of its own, and ``torch.compile(fullgraph=True)`` breaks
inside its JIT loader. Here planning happens in the metadata builder, on the host, once per
step (:mod:`attn_ops.backends.flashinfer_plan`): the batch (decodes first) is split into a
decode part and a prefill part, each routed (:mod:`attn_ops.routing`) and planned.
``torch.ops.attn.flashinfer_attention`` then only *runs* the parts (:func:`run_parts`): every
argument is a tensor or a scalar, so the op sits inside compiled graphs and CUDA graphs.

Kernels: decodes run FlashInfer's tensor-core decode -- its FA2 prefill kernel with one query
row per request, the GQA heads of a KV head packed into one tile -- split into KV chunks by
``routing.flashinfer_decode_split`` (about one CTA per SM at small batches); prefills run FA3
(sm90) or FA2.

Semantics are REFERENCE's: ``sliding_window=W`` is FlashInfer's ``window_left=W-1``; the
kernels' base-2 LSE is converted to natural log; attention sinks (which FlashInfer's sm90
paths ignore) are applied exactly from the LSE, ``out *= sigmoid(lse - sink)``; an fp8 cache's
``k_scale`` multiplies the query and ``v_scale`` the output on the device, so no scale is ever
read back to the host.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch

from attn_ops.backend import AttentionBackend
from attn_ops.backends.flashinfer_plan import (PART, FlashInferMetadata, GraphPlanner, PartPlan,
                                               Planner, flashinfer_module, part_tables,
                                               plan_once, prefill_kernel)
from attn_ops.capabilities import (BackendCapabilities, CUDAGraphSupport, MultipleOf,
                                   PackageRequirement, Reason)
from attn_ops.kv_cache import nhd_kv_halves
from attn_ops.metadata import CommonAttentionMetadata
from attn_ops.ops import apply_sinks, check_nhd_attention_inputs, define_op
from attn_ops.platforms import Platform, PlatformKind
from attn_ops.routing import DeviceFacts, Kernel, PartRoute, flashinfer_decode_split
from attn_ops.spec import (AttentionSpec, AttentionType, Feature, KVCacheDType,
                           TURBOQUANT_KV_DTYPES)

__all__ = ["FLASHINFER_PACKAGE", "FlashInferBackend", "FlashInferMetadata", "PARTS_SCHEMA",
           "run_flashinfer_part", "run_parts"]

LN2 = math.log(2.0)
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)

# A part runner: (part plan, int workspace, the part's table views, q, k_cache, v_cache, out,
# lse or None, float workspace, scale, sliding_window, soft_cap, causal) -> None; writes the
# part's rows of out and lse (natural log).
PartRunner = Callable[..., None]


def run_flashinfer_part(p: PartPlan, ws, views, q, k_cache, v_cache, out, lse, float_ws, scale,
                        sliding_window, soft_cap, causal) -> None:
    """A FlashInfer FA2/FA3 part: ``paged_run`` with the part's plan, LSE to natural log."""
    qo, kv_indptr, last, kv_indices = views
    window = -1 if sliding_window is None else sliding_window - 1
    cap = soft_cap or 0.0
    mod = flashinfer_module(p.kernel, q.dtype, k_cache.dtype, q.shape[2], out.shape[2],
                            window >= 0, cap > 0)
    mod.paged_run(float_ws, ws, list(p.library_plan), q, k_cache, v_cache, qo, kv_indptr,
                  kv_indices, last, out, lse, int(causal), 0, window, True, None, None, None,
                  None, None, None, cap, scale, None, None, None, 1.0, 1e4, 0, float_ws.numel())
    if lse is not None:
        lse.mul_(LN2)  # FlashInfer's LSE is base 2


FLASHINFER_RUNNERS: Mapping[Kernel, PartRunner] = {
    Kernel.FLASHINFER_FA2: run_flashinfer_part, Kernel.FLASHINFER_FA3: run_flashinfer_part}

# id(plan vector) -> (plan vector, its tables tensor, decoded plan, its table views): made by
# a step's first layer, reused by the others (decoding and slicing per layer cost microseconds);
# a few steps' worth (an entry holds its plan vector, so no other can take its id meanwhile)
_PARTS: dict = {}


def _part(plan_vec, tables, seq_lens, block_table) -> tuple[PartPlan, tuple]:
    entry = _PARTS.get(id(plan_vec))
    if entry is None or entry[0] is not plan_vec or entry[1] is not tables:
        if len(_PARTS) > 16:
            _PARTS.clear()
        p = PART.decode(plan_vec)
        views = part_tables(tables, seq_lens, block_table, p) if p.kernel is not None else ()
        entry = _PARTS[id(plan_vec)] = (plan_vec, tables, p, views)
    return entry[2], entry[3]


def run_parts(query, kv_cache, out, lse, float_workspace, tables, seq_lens, block_table,
              decode_workspace, decode_plan, prefill_workspace, prefill_plan, sinks, k_scale,
              v_scale, scale, sliding_window, soft_cap, causal, *,
              runners: Mapping[Kernel, PartRunner], backend: str) -> None:
    """Run a step's two parts (:class:`PartPlan`), each on its kernel's runner, then the
    step-wide epilogue: zeroed padding rows, sinks from the LSE, the fp8 cache's V scale."""
    check_nhd_attention_inputs(backend, query, kv_cache, out, lse)
    k_cache, v_cache = nhd_kv_halves(kv_cache)
    fp8 = kv_cache.dtype in _FP8
    q = query * k_scale.to(query.dtype) if fp8 else query  # dequantizes K inside q.k
    need_lse = lse is not None or sinks is not None
    lse_buf = lse if lse is not None else (
        torch.empty(query.shape[:2], dtype=torch.float32, device=query.device) if need_lse
        else None)
    total = out.shape[0]
    start, padded_part = 0, None
    for plan_vec, ws in ((decode_plan, decode_workspace), (prefill_plan, prefill_workspace)):
        p, views = _part(plan_vec, tables, seq_lens, block_table)
        if p.kernel is None:
            continue
        runner = runners.get(p.kernel)
        if runner is None:
            raise ValueError(f"{backend} cannot run a part planned for {p.kernel.value}; "
                             "build the metadata with this backend's build_metadata")
        if start == 0 and p.rows == total:  # the part is the whole batch: no views to make
            q_part, out_part, lse_part = q, out, lse_buf
        else:
            rows_of = slice(start, start + p.rows)
            q_part, out_part = q[rows_of], out[rows_of]
            lse_part = lse_buf[rows_of] if need_lse else None
        runner(p, ws, views, q_part, k_cache, v_cache, out_part, lse_part, float_workspace,
               scale, sliding_window, soft_cap, causal)
        if p.padded and lse is not None:
            padded_part = (start, p.rows, views[2])
        start += p.rows
    if start < total:  # padding rows past the batch are zero, like REFERENCE's
        out[start:].zero_()
        if need_lse:
            lse_buf[start:].zero_()
    if sinks is not None:
        apply_sinks(out, lse_buf, sinks)
    if fp8:
        out.mul_(v_scale.to(out.dtype))
    if padded_part is not None:  # a CUDA-graph batch: requests without pages are padding,
        first, rows, last = padded_part  # their rows zero, their LSE -inf (or the sink's)
        lse[first:first + rows].masked_fill_((last == 0)[:, None], 0.0)


def _flashinfer_attention(*args) -> None:
    run_parts(*args, runners=FLASHINFER_RUNNERS, backend="FLASHINFER")


def _fake(query, kv_cache, out, lse, *args) -> None:
    check_nhd_attention_inputs("FLASHINFER", query, kv_cache, out, lse)


PARTS_SCHEMA = (
    "(Tensor query, Tensor kv_cache, Tensor(a!) out, Tensor(b!)? lse, Tensor(c!) float_workspace, "
    "Tensor tables, Tensor seq_lens, Tensor block_table, Tensor decode_workspace, "
    "Tensor decode_plan, Tensor prefill_workspace, Tensor prefill_plan, "
    "Tensor? sinks, Tensor? k_scale, Tensor? v_scale, float scale, int? sliding_window, "
    "float? soft_cap, bool causal) -> ()")
"""The schema of ops that run a step as planned parts (:func:`run_parts`)."""

flashinfer_attention = define_op("flashinfer_attention", PARTS_SCHEMA, _flashinfer_attention,
                                 _fake, dispatch_keys=("CUDA",))

# The range the selector accepts; pyproject's [flashinfer] extra says the same.
FLASHINFER_PACKAGE = PackageRequirement("flashinfer-python", "flashinfer", "0.7.2",
                                        max_version="0.8")

_EAGER_PLANNERS: dict = {}  # (planning key, device) -> Planner


class FlashInferBackend(AttentionBackend):
    """FlashInfer tensor-core decode + FA3 (sm90) / FA2 prefill over the NHD cache."""

    name = "FLASHINFER"
    capabilities = BackendCapabilities(
        platforms=frozenset({PlatformKind.CUDA}),
        dtypes=frozenset({torch.float16, torch.bfloat16}),
        head_dims=frozenset({64, 128, 256}),
        kv_cache_dtypes=frozenset(KVCacheDType) - TURBOQUANT_KV_DTYPES,
        block_sizes=(MultipleOf(1),),
        preferred_block_size=16,  # FlashInfer is indifferent to the page size
        features=frozenset({Feature.SLIDING_WINDOW, Feature.SOFT_CAP, Feature.SINKS,
                            Feature.NON_CAUSAL, Feature.FP8_KV}),
        attn_types=frozenset({AttentionType.DECODER, AttentionType.ENCODER_ONLY}),
        min_capability=(8, 0),
        cudagraph_support=CUDAGraphSupport.UNIFORM_SINGLE_TOKEN_DECODE,
        packages=(FLASHINFER_PACKAGE,),
    )
    op = flashinfer_attention
    kernels = "FlashInfer: FA2 tensor-core decode (split-KV), FA3 (sm90) / FA2 prefill"

    @classmethod
    def not_supported_reasons(cls, spec: AttentionSpec, platform: Platform) -> list[Reason]:
        reasons = super().not_supported_reasons(spec, platform)
        if spec.sliding_window is not None and not spec.causal:
            reasons.append(Reason(cls.name, "feature:bidirectional_window",
                                  "a sliding window with non-causal attention is not supported "
                                  "(FlashInfer windows only to the left)"))
        return reasons

    def __init__(self, spec: AttentionSpec, **kw) -> None:
        super().__init__(spec, **kw)
        self._key = self.metadata_key()  # (hashed every step: made once)

    def make_planner(self, device: torch.device) -> Planner:
        """The eager planner of this backend on ``device``: FlashInfer's split decode and its
        FA3/FA2 prefill."""
        tuning, kv, facts = self.tuning, self.spec.kv_heads, DeviceFacts.of(device)

        def route_decode(requests, max_pages, block_size, query_rows) -> PartRoute:
            return PartRoute(Kernel.FLASHINFER_FA2, flashinfer_decode_split(
                requests, kv, max_pages, block_size, facts.num_sms, tuning.flashinfer))

        return Planner(self.spec, device, tuning, route_decode,
                       prefill_kernel(self.spec, facts.major), facts=facts)

    def build_metadata(self, common: CommonAttentionMetadata) -> FlashInferMetadata:
        """Plan once per step and per distinct planning key; layers sharing one reuse it."""
        if isinstance(common, FlashInferMetadata):
            return common
        device = common.seq_lens.device
        return plan_once(common, self._key, _EAGER_PLANNERS, (self._key, device),
                         lambda: self.make_planner(device))

    def graph_metadata(self, padded: CommonAttentionMetadata, graphs) -> FlashInferMetadata:
        """Replan a padded decode batch into ``graphs``' persistent buffers (see
        :class:`~attn_ops.backends.flashinfer_plan.GraphPlanner`); the plan for each capture
        size is fixed at its first call."""
        super().graph_metadata(padded, graphs)
        return plan_once(padded, self._key, graphs.backend_state, self._key,
                         lambda: GraphPlanner(self.spec, graphs, self.tuning))

    def advance_graph_metadata(self, metadata, padded, graphs):
        """The step before's graph metadata, its last-page lengths advanced on the device
        (:meth:`~attn_ops.backends.flashinfer_plan.GraphPlanner.advance`) where its planner's
        tables still hold it; else planned again."""
        planner = graphs.backend_state.get(self._key)
        if planner is not None and planner.advance(metadata, padded.num_actual_tokens):
            return metadata
        return self.graph_metadata(padded, graphs)

    def metadata_key(self) -> tuple:
        """Everything a plan depends on besides the batch."""
        spec = self.spec
        return (self.name, spec.num_heads, spec.kv_heads, spec.head_dim, spec.v_head_dim,
                spec.dtype, spec.cache_dtype, spec.sliding_window, spec.logits_soft_cap,
                spec.causal, self.tuning.key)

    def op_arguments(self, query, kv_cache, metadata, out, *, lse=None, sinks=None,
                     alibi_slopes=None, k_scale=None, v_scale=None) -> tuple:
        m = metadata
        return (query, kv_cache, out, lse, m.float_workspace, m.tables, m.seq_lens,
                m.block_table, m.decode_workspace, m.decode_plan, m.prefill_workspace,
                m.prefill_plan, sinks, k_scale, v_scale, self.scale,
                self.spec.sliding_window, self.spec.logits_soft_cap,
                self.spec.causal and m.causal)
