"""Per-step hoisting: metadata preparation computed once per step, not once per layer.

In a whole-model graph every layer prepares the same step metadata (e.g. the slot mapping from
positions and the block table): identical functional ``attn::`` ops -- same op, same inputs --
are kept once, at the first, and every layer reads that one. AOTAutograd's CSE usually merges
them already; this pass makes it hold regardless (``torch._functorch.config.cse=False``, or ops
CSE treats as distinct). Mutating ops are never merged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import Graph, Node

from attn_ops.compile_passes.base import AttnGraphPass

__all__ = ["DuplicatePrep", "HoistStepPrep"]


@dataclass(frozen=True)
class DuplicatePrep:
    """``duplicate`` computes what ``first`` already has."""

    duplicate: Node
    first: Node


def _key(value):
    if isinstance(value, (list, tuple)):
        return tuple(_key(v) for v in value)
    return value


class HoistStepPrep(AttnGraphPass):
    name = "hoist_step_prep"

    def detect(self, graph: Graph) -> list[DuplicatePrep]:
        seen: dict = {}
        matches = []
        for node in graph.nodes:
            op = node.target
            if node.op != "call_function" or not isinstance(op, torch._ops.OpOverload) \
                    or op.namespace != "attn" or op._schema.is_mutable:
                continue
            key = (op, _key(node.args), _key(tuple(sorted(node.kwargs.items()))))
            if key in seen:
                matches.append(DuplicatePrep(node, seen[key]))
            else:
                seen[key] = node
        return matches

    def replace(self, graph: Graph, m: DuplicatePrep) -> None:
        m.duplicate.replace_all_uses_with(m.first)
        graph.erase_node(m.duplicate)
