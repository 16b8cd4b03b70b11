"""TREE_ATTN: attention for tree-structured speculative decoding (EAGLE-style draft trees).

The spec carries the draft tree as a parent array (``AttentionSpec.spec_tree``; given as an
ancestor mask -- EAGLE's ``tree_mask`` -- it is checked to be a tree and stored as the parent
array it encodes). A request whose
query is exactly the tree (``len(spec_tree)`` tokens, root first) attends to its committed prefix
and, among the draft tokens, only to each query's ancestors and itself; any other request
(plain decodes, prefills) is ordinary causal attention -- one batch mixes both. Built on
TRITON_ATTN's kernel: the tree becomes one int64 ancestor bitmask per node (bit ``j`` of node
``i``: ``j`` is ``i`` or an ancestor of it), and the kernel masks the query-query block with it.
Checked against REFERENCE with the equivalent explicit mask (``tests/test_tree_attn.py``).
"""

from __future__ import annotations

import torch

from attn_ops.backends.triton_attn import (TritonAttnBackend, check_triton_inputs,
                                           triton_paged_attention)
from attn_ops.capabilities import BackendCapabilities, Reason
from attn_ops.ops import define_op
from attn_ops.spec import AttentionSpec, AttentionType, Feature

__all__ = ["TreeAttnBackend", "ancestor_bitmasks"]


def ancestor_bitmasks(parents: tuple[int, ...]) -> list[int]:
    """Per node, the bitmask of itself and its ancestors (as signed int64 values)."""
    masks: list[int] = []
    for i, p in enumerate(parents):
        masks.append((1 << i) | (masks[p] if p >= 0 else 0))
    return [m - (1 << 64) if m >= 1 << 63 else m for m in masks]


def _fake(query, kv_cache, query_start_loc, seq_lens, block_table, plan, tree, out, lse, sinks,
          alibi_slopes, k_scale, v_scale, scale, sliding_window, soft_cap, causal) -> None:
    check_triton_inputs(query, kv_cache, query_start_loc, seq_lens, block_table, plan, out, lse,
                        sinks, alibi_slopes, k_scale, v_scale)


def _tree_attention(query, kv_cache, query_start_loc, seq_lens, block_table, plan, tree, out,
                    lse, sinks, alibi_slopes, k_scale, v_scale, scale, sliding_window, soft_cap,
                    causal) -> None:
    if tree.dtype != torch.int64 or tree.dim() != 1 or tree.device != query.device:
        raise ValueError(f"tree must be int64 [nodes] ancestor bitmasks on {query.device}, got "
                         f"{tree.dtype} {tuple(tree.shape)} on {tree.device}")
    triton_paged_attention(query, kv_cache, query_start_loc, seq_lens, block_table, plan, out,
                           lse, sinks, alibi_slopes, k_scale, v_scale, scale, sliding_window,
                           soft_cap, causal, tree=tree)


tree_attention = define_op(
    "tree_attention",
    "(Tensor query, Tensor kv_cache, Tensor query_start_loc, Tensor seq_lens, "
    "Tensor block_table, Tensor plan, Tensor tree, Tensor(a!) out, Tensor(b!)? lse, "
    "Tensor? sinks, Tensor? alibi_slopes, Tensor? k_scale, Tensor? v_scale, float scale, "
    "int? sliding_window, float? soft_cap, bool causal) -> ()",
    _tree_attention, _fake, dispatch_keys=("CPU", "CUDA"), fp8_output_at=7)


class TreeAttnBackend(TritonAttnBackend):
    """TRITON_ATTN's kernel with the draft tree's ancestor mask."""

    name = "TREE_ATTN"
    capabilities = BackendCapabilities(**{
        **TritonAttnBackend.capabilities.__dict__,
        "features": (TritonAttnBackend.capabilities.features - {Feature.NON_CAUSAL})
        | {Feature.TREE},
        "attn_types": frozenset({AttentionType.DECODER}),  # draft trees are causal
    })
    op = tree_attention

    @classmethod
    def not_supported_reasons(cls, spec, platform):
        reasons = super().not_supported_reasons(spec, platform)
        if spec.spec_tree is None:
            reasons.append(Reason(cls.name, "feature:tree", "TREE_ATTN serves specs with a "
                                  "draft tree only (AttentionSpec.spec_tree)",
                                  "TRITON_ATTN runs the same kernel without one"))
        return reasons

    def __init__(self, spec: AttentionSpec, **options) -> None:
        if spec.spec_tree is None:
            raise ValueError("TREE_ATTN needs AttentionSpec(spec_tree=parents)")
        super().__init__(spec, **options)
        self._trees: dict[torch.device, torch.Tensor] = {}

    def _tree(self, device: torch.device) -> torch.Tensor:
        if device not in self._trees:
            self._trees[device] = torch.tensor(ancestor_bitmasks(self.spec.spec_tree),
                                               dtype=torch.int64, device=device)
        return self._trees[device]

    def op_arguments(self, query, kv_cache, metadata, out, **optional) -> tuple:
        args = super().op_arguments(query, kv_cache, metadata, out, **optional)
        return (*args[:6], self._tree(query.device), *args[6:])
