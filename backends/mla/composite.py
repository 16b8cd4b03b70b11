"""COMPOSITE_MLA_SM90: each MLA step's absorbed part on the fastest of three kernels, on Hopper.

No one kernel is fastest at every decode shape (H200, 512 + 64 latents): FlashInfer's fa3 MLA
kernel leads at short contexts and mid batches, FlashMLA at many requests over long contexts,
FlashAttention 3's MLA path (else TRITON_MLA's split kernel) at a handful of query rows. This
backend runs each step's absorbed part on the kernel :func:`attn_ops.routing.
mla_absorbed_route` picks for it (requests, longest query and context, heads), in one op,
``torch.ops.attn.composite_mla_sm90_attention``; the plan carries the route
(:attr:`~attn_ops.backends.mla.common.MLAPlan.route`) and each kernel's own plan (FlashInfer's
host plan, FlashMLA's tile schedule, TRITON_MLA's launch). The MHA part runs the kernel
:func:`attn_ops.routing.mla_prefill_kernel` picks, as in the other MLA backends.

CUDA graphs: a capture size's kernel is fixed when it is captured, before the lengths of its
replays are known, so graphs run FlashInfer's kernel, replanned before each replay from its
lengths (within a few percent of the fastest at every length; FlashMLA is at half of it at 1k).

Needs FlashMLA (either provider), flashinfer-python and Triton; FlashAttention 3 (either
provider) where installed.
"""

from __future__ import annotations

import dataclasses

from attn_ops.backends.flashinfer import FLASHINFER_PACKAGE
from attn_ops.backends.mla.common import (SEPARATE, AbsorbedLayout, MLABackend, MLAMetadata,
                                          MLAPlan, define_mla_op)
from attn_ops.backends.mla.flash_attn_mla import absorbed_fa3
from attn_ops.backends.mla.flashinfer_mla import (WRITES_EVERY_ROW, FlashInferMLABackend,
                                                  absorbed_flashinfer, shared_memory_reasons)
from attn_ops.backends.mla.flashmla import JOINED, FlashMLABackend, absorbed_flashmla, checker
from attn_ops.backends.mla.triton_mla import TritonMLABackend, absorbed_triton
from attn_ops.backends.step_schedules import new_schedule
from attn_ops.capabilities import Reason
from attn_ops.metadata import CommonAttentionMetadata
from attn_ops.platforms import Platform
from attn_ops.providers import FA3
from attn_ops.routing import Kernel, mla_absorbed_route
from attn_ops.spec import AttentionSpec

__all__ = ["CompositeMLABackend", "ROUTES"]

# MLAPlan.route -> the absorbed part's kernel (0, the default: FlashInfer's, as graphs run it)
ROUTES = (Kernel.FLASHINFER_MLA_FA3, Kernel.FLASHMLA, Kernel.TRITON_MLA, Kernel.FA3_MLA)


def _absorbed(ql, q_pe, latent_cache, query_start_loc, seq_lens, block_table, out, kv_scale,
              scale, plan: MLAPlan) -> None:
    args = (ql, q_pe, latent_cache, query_start_loc, seq_lens, block_table, out, kv_scale, scale)
    kernel = ROUTES[plan.route]
    if kernel is Kernel.FLASHMLA:
        absorbed_flashmla(*args, plan)
    elif kernel is Kernel.TRITON_MLA:
        absorbed_triton(*args, plan.decode)
    elif kernel is Kernel.FA3_MLA:
        absorbed_fa3(*args, plan)
    else:
        absorbed_flashinfer(*args, plan)


_LAYOUTS = {Kernel.FLASHINFER_MLA_FA3: WRITES_EVERY_ROW, Kernel.FLASHMLA: JOINED,
            Kernel.TRITON_MLA: SEPARATE, Kernel.FA3_MLA: SEPARATE}


def _layout(plan: MLAPlan) -> AbsorbedLayout:
    return _LAYOUTS[ROUTES[plan.route]]


composite_mla_attention = define_mla_op("composite_mla_sm90_attention", _absorbed,
                                        check=checker("COMPOSITE_MLA_SM90"),
                                        layout=_layout)


class CompositeMLABackend(MLABackend):
    """FlashMLA, FlashInfer's MLA and TRITON_MLA routed per step on sm90; bf16 / fp16 latents
    of 512 + 64 in pages of 64."""

    name = "COMPOSITE_MLA_SM90"
    # FlashMLA's constraints (its pages, widths and dtypes bound every route), on sm90 only
    # (FlashInfer's fa3 MLA kernel), with FlashInfer's and Triton's packages
    capabilities = dataclasses.replace(
        FlashMLABackend.capabilities, max_capability=(9, 0),
        packages=(FLASHINFER_PACKAGE, *TritonMLABackend.capabilities.packages))
    op = composite_mla_attention

    latent_widths = FlashMLABackend.latent_widths
    latent_kernel = FlashMLABackend.latent_kernel
    kernel_providers = FlashMLABackend.kernel_providers

    @classmethod
    def not_supported_reasons(cls, spec: AttentionSpec, platform: Platform) -> list[Reason]:
        reasons = super().not_supported_reasons(spec, platform)
        return reasons or shared_memory_reasons(cls.name, spec, platform)

    def __init__(self, spec: AttentionSpec, **kw) -> None:
        super().__init__(spec, **kw)
        self._flashinfer = FlashInferMLABackend(spec, tuning=self.tuning)
        self._triton = TritonMLABackend(spec, tuning=self.tuning)
        self._fa3 = FA3.found() is not None  # (FA3's MLA path for a handful of rows)

    def plan_absorbed(self, common: CommonAttentionMetadata, num_absorbed: int,
                      max_query_len: int, max_seq_len: int) -> dict:
        """The route of the step's absorbed part and that kernel's own plan."""
        if not num_absorbed:
            return {}
        kernel = mla_absorbed_route(self.spec.num_heads, num_absorbed, max_query_len,
                                    max_seq_len, self.tuning.mla, self._fa3).kernel
        fields = {"route": ROUTES.index(kernel)}
        if kernel is Kernel.TRITON_MLA:
            fields["decode"] = self._triton.decode_launch(num_absorbed, max_query_len,
                                                          max_seq_len, common.seq_lens.device)
        elif kernel is Kernel.FLASHMLA:
            fields["library"] = new_schedule(graph=False)
        else:
            fields["library"] = self._flashinfer.plan_library(common, num_absorbed)
        return fields

    def graph_metadata(self, padded: CommonAttentionMetadata, graphs) -> MLAMetadata:
        """FlashInfer's graph plan of the size (route 0), replanned from each replay's
        lengths."""
        return self._flashinfer.graph_metadata(padded, graphs)
