"""Metadata-preparation fusion: the slot mapping computed in the graph
(``attn.slot_mapping(positions, query_start_loc, block_table, block_size)``) is folded into
the cache-write op that consumes it -- ``attn.rope_kv_cache_update`` then takes the positions,
``query_start_loc`` and block table and finds each token's slot itself, in the same kernel.

Applies when the write's page size (its cache's) equals the slot op's ``block_size``; the slot
op is removed once no write reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.fx import Graph, Node

from attn_ops.glue import rope_kv_cache_update, slot_mapping
from attn_ops.compile_passes.base import AttnGraphPass, functionalized_op, is_call

__all__ = ["SlotMappingFusion", "SlotPrepMatch"]


@dataclass(frozen=True)
class SlotPrepMatch:
    """A functionalized fused cache write and the slot-mapping op feeding it."""

    write: Node
    slots: Node


def _page_size(write: Node) -> int:
    """The page size of the cache a functionalized write mutates (from its fake value)."""
    if "_all_bases" in write.kwargs:
        cache = write.kwargs["_all_bases"][write.kwargs["_kv_cache_base_index"]]
    else:
        cache = write.kwargs["kv_cache"]
    shape = cache.meta["val"].shape
    return shape[2] if len(shape) == 5 else shape[1]


class SlotMappingFusion(AttnGraphPass):
    name = "slot_mapping_fusion"

    def detect(self, graph: Graph) -> list[SlotPrepMatch]:
        return [SlotPrepMatch(node, node.kwargs["slot_mapping"]) for node in graph.nodes
                if functionalized_op(node) is rope_kv_cache_update
                and is_call(node.kwargs["slot_mapping"], slot_mapping)
                and node.kwargs["slot_mapping"].args[3] == _page_size(node)]

    def replace(self, graph: Graph, m: SlotPrepMatch) -> None:
        positions, query_start_loc, block_table, _ = m.slots.args
        m.write.kwargs = {**m.write.kwargs, "slot_mapping": None, "positions": positions,
                          "query_start_loc": query_start_loc, "block_table": block_table}
        if not m.slots.users:
            graph.erase_node(m.slots)
