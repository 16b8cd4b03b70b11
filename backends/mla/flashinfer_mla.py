"""FLASHINFER_MLA: FlashInfer's MLA decode kernels for the absorbed form.

``flashinfer.mla.BatchMLAPagedAttentionWrapper`` (fa3 on sm90 for latent widths 128/256/512,
fa2 elsewhere: ``routing.flashinfer_mla_kernel``) reads ``ckv`` / ``kpe`` as two strided views
of our one latent cache. Its plan is host work: the metadata builder plans it once a step (all
layers of the step run that plan), outside any graph, and the op only runs it -- the plan's
handle travels in :attr:`~attn_ops.backends.mla.common.MLAPlan.library`. CUDA graphs: uniform
decode batches, one wrapper per capture size over persistent index buffers
(``use_cuda_graph=True``), replanned before every replay; the plan covers every request of the
capture size with its query rows (padding requests with no keys), so FlashInfer's schedule
shape stays that of the size, and the padding rows are zeroed after the kernel.

The MHA part runs the kernel :func:`attn_ops.routing.mla_prefill_kernel` picks, as in
TRITON_MLA.
"""

from __future__ import annotations

import itertools
import warnings

import numpy as np
import torch

from attn_ops.backends.mla.common import (PLAN, AbsorbedLayout, MLABackend, MLAMetadata,
                                          MLAPlan, define_mla_op)
from attn_ops.backends.flashinfer import FLASHINFER_PACKAGE
from attn_ops.backends.flashinfer_plan import float_workspace
from attn_ops.capabilities import (BackendCapabilities, CUDAGraphSupport, HeadDims, MultipleOf,
                                   Reason)
from attn_ops.metadata import CommonAttentionMetadata
from attn_ops.platforms import Platform, PlatformKind
from attn_ops.routing import (DeviceFacts, Kernel, flashinfer_mla_kernel,
                             flashinfer_mla_shared_bytes)
from attn_ops.spec import AttentionSpec, Feature, KVCacheDType

__all__ = ["WRITES_EVERY_ROW", "FlashInferMLABackend", "mla_wrapper_class"]

_LIBRARY_BACKEND = {Kernel.FLASHINFER_MLA_FA3: "fa3", Kernel.FLASHINFER_MLA_FA2: "fa2"}


_PLANNED: dict[int, object] = {}  # MLAPlan.library -> the planned wrapper
_HANDLES = itertools.count(1)


def mla_wrapper_class():
    """FlashInfer's MLA wrapper class (imported when first planned: FlashInfer is optional)."""
    from flashinfer.mla import BatchMLAPagedAttentionWrapper

    return BatchMLAPagedAttentionWrapper


def absorbed_flashinfer(ql, q_pe, latent_cache, query_start_loc, seq_lens, block_table, out,
                        kv_scale, scale, plan: MLAPlan) -> None:
    """The planned wrapper's run into ``out`` [rows, heads, rank]: every row, from the host
    plan (a graph's padding rows: anything, zeroed by the caller)."""
    wrapper = _PLANNED.get(plan.library)
    if wrapper is None:
        raise ValueError(f"FLASHINFER_MLA: no planned kernel {plan.library}; build the step's "
                         "metadata with this backend's build_metadata / graph_metadata")
    rank = ql.shape[2]
    wrapper.run(ql, q_pe, latent_cache[:, :, :rank], latent_cache[:, :, rank:], out=out)


WRITES_EVERY_ROW = AbsorbedLayout(writes_every_row=True)
flashinfer_mla_attention = define_mla_op("flashinfer_mla_attention", absorbed_flashinfer,
                                         layout=lambda plan: WRITES_EVERY_ROW)


def shared_memory_reasons(name: str, spec: AttentionSpec, platform: Platform) -> list[Reason]:
    """FlashInfer's MLA kernel for ``spec``'s latent widths on ``platform``: refused where its
    block needs more shared memory than the GPU gives one (FlashInfer would refuse the plan
    at the first step)."""
    if platform.capability is None:
        return []
    facts = DeviceFacts.for_platform(platform)
    if facts.shared_memory is None:
        return []
    per_sm, per_block = facts.shared_memory
    kernel = flashinfer_mla_kernel(platform.capability, spec.kv_lora_rank)
    need = flashinfer_mla_shared_bytes(kernel, spec.kv_lora_rank, spec.qk_rope_head_dim,
                                       spec.kv_cache_dtype.is_fp8, per_sm)
    if need is not None and need <= per_block:
        return []
    what = "has no tiling for" if need is None else f"needs {need:,} bytes of"
    major, minor = platform.capability
    return [Reason(name, "shared_memory",
                   f"{kernel.value} {what} shared memory a block at kv_lora_rank="
                   f"{spec.kv_lora_rank} + qk_rope_head_dim={spec.qk_rope_head_dim}; sm"
                   f"{major}{minor} gives a block {per_block:,}",
                   "use TRITON_MLA (any widths)")]


class FlashInferMLABackend(MLABackend):
    """FlashInfer's MLA kernels (fa3 / fa2) on CUDA; bf16 / fp16 latents (fp8: TRITON_MLA)."""

    name = "FLASHINFER_MLA"
    capabilities = BackendCapabilities(
        platforms=frozenset({PlatformKind.CUDA}),
        dtypes=frozenset({torch.float16, torch.bfloat16}),
        head_dims=HeadDims(),
        kv_cache_dtypes=frozenset({KVCacheDType.AUTO}),
        block_sizes=(MultipleOf(1),),
        preferred_block_size=64,
        features=frozenset({Feature.MLA, Feature.DIFF_HEAD_DIM_V}),
        min_capability=(8, 0),
        cudagraph_support=CUDAGraphSupport.UNIFORM_BATCH,
        packages=(FLASHINFER_PACKAGE,),
    )
    op = flashinfer_mla_attention

    @classmethod
    def latent_reasons(cls, spec: AttentionSpec) -> list[Reason]:
        rank, rope = spec.kv_lora_rank, spec.qk_rope_head_dim
        if rank % 128 or rope % 64:
            return [Reason(cls.name, "head_dim", f"kv_lora_rank={rank}, qk_rope_head_dim={rope}:"
                           " FlashInfer's MLA kernels take latent widths of multiples of 128 and "
                           "rope widths of multiples of 64", "use TRITON_MLA (any widths)")]
        return []

    @classmethod
    def not_supported_reasons(cls, spec: AttentionSpec, platform: Platform) -> list[Reason]:
        reasons = super().not_supported_reasons(spec, platform)
        return reasons or shared_memory_reasons(cls.name, spec, platform)

    def __init__(self, spec: AttentionSpec, **kw) -> None:
        super().__init__(spec, **kw)
        self._eager: dict[torch.device, int] = {}  # device -> handle of its eager wrapper


    def _new(self, device: torch.device, graph_size: int | None = None, width: int = 0) -> int:
        """A new wrapper (for a CUDA-graph size: over persistent index buffers) and its handle."""
        cap = torch.cuda.get_device_capability(device) if device.type == "cuda" else (9, 0)
        backend = _LIBRARY_BACKEND[flashinfer_mla_kernel(cap, self.spec.kv_lora_rank)]
        kwargs = {}
        if graph_size is not None:
            i32 = dict(dtype=torch.int32, device=device)
            kwargs = dict(use_cuda_graph=True, qo_indptr=torch.zeros(graph_size + 1, **i32),
                          kv_indptr=torch.zeros(graph_size + 1, **i32),
                          kv_indices=torch.zeros(max(1, graph_size * width), **i32),
                          kv_len_arr=torch.zeros(graph_size, **i32))
        wrapper = mla_wrapper_class()(float_workspace(device), backend=backend, **kwargs)
        handle = next(_HANDLES)
        _PLANNED[handle] = wrapper
        return handle

    def _plan(self, handle: int, qsl: np.ndarray, seq: np.ndarray, indptr: np.ndarray,
              indices: np.ndarray, page: int, causal: bool) -> None:
        spec = self.spec
        host = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32))  # noqa: E731
        with warnings.catch_warnings():  # (0.7's flat-argument plan is deprecated, not gone)
            warnings.simplefilter("ignore", DeprecationWarning)
            _PLANNED[handle].plan(
                host(qsl), host(indptr), host(indices), host(seq), spec.num_heads,
                spec.kv_lora_rank, spec.qk_rope_head_dim, page, causal, self.scale, spec.dtype,
                spec.cache_dtype)

    def plan_library(self, common: CommonAttentionMetadata, num_absorbed: int) -> int:
        """Plan this step's absorbed requests on the eager wrapper of their device."""
        device = common.seq_lens.device
        handle = self._eager.get(device)
        if handle is None:
            handle = self._eager[device] = self._new(device)
        qsl = common.query_start_loc_cpu.numpy()[:num_absorbed + 1]
        indptr, indices = common.block_csr()
        self._plan(handle, qsl, common.seq_lens_cpu.numpy()[:num_absorbed],
                   indptr[:num_absorbed + 1], indices[:indptr[num_absorbed]],
                   common.block_size, bool(np.any(np.diff(qsl) > 1)))
        return handle

    def graph_metadata(self, padded: CommonAttentionMetadata, graphs) -> MLAMetadata:
        """Replan the padded decode batch on its capture size's wrapper: every request of the
        size with ``graphs.query_len`` rows (padding: no keys), the plan fixed per size."""
        super().graph_metadata(padded, graphs)
        size, q = padded.num_reqs, graphs.query_len
        key = (*self.metadata_key(), "flashinfer_mla", size)
        state = graphs.backend_state.get(key)
        if state is None:
            handle = self._new(graphs.device, size, graphs.max_blocks_per_req)
            rows = size * q
            plan = PLAN.encode(MLAPlan(num_absorbed=size, num_absorbed_tokens=rows,
                                       num_tokens=rows,
                                       chunk_tokens=self.tuning.mla.context_chunk_tokens,
                                       library=handle, graph=True))
            state = graphs.backend_state[key] = (handle, plan)
        handle, plan = state
        indptr, indices = padded.block_csr()
        self._plan(handle, np.arange(size + 1) * q, padded.seq_lens_cpu.numpy(), indptr,
                   indices, padded.block_size, q > 1)
        return MLAMetadata(padded.slot_mapping, padded.query_start_loc, padded.seq_lens,
                           padded.block_table, plan, torch.zeros(0, 2, dtype=torch.int64),
                           block_size=padded.block_size)
