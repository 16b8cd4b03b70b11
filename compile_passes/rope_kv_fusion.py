"""RoPE + KV-cache write: ``attn.rope`` of the query and of the key and the write of the rotated
key (``attn.kv_cache_update``) become one ``attn.rope_kv_cache_update``, which rotates both,
writes the cache and returns the rotated query -- three ops per layer become one.

Detected per cache write: its key is ``rope(k, cos_sin)`` read by nothing else, and an attention
op that reads the written cache takes ``rope(q, cos_sin)`` with the same ``cos_sin`` as its
query (so the query belongs to the same layer). The fused op goes right before the first
reader of either of its results (the attention op), where every input it needs is defined.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.fx import Graph, Node

from attn_ops.glue import rope, rope_kv_cache_update
from attn_ops.kv_cache import kv_cache_update
from attn_ops.compile_passes.base import (AttnGraphPass, functionalized_op, getitem, inputs_of,
                                 insert_call, is_call, mutated_value, position, retire_write)

__all__ = ["RopeKVCacheFusion", "RopeKVMatch"]


@dataclass(frozen=True)
class RopeKVMatch:
    """One layer's glue: the functionalized cache write and the two rotations it absorbs."""

    write: Node
    key_rope: Node
    query_rope: Node


def _first_reader(write: Node, query_rope: Node, order: dict) -> Node:
    """The earliest node reading the rotated query or the written cache."""
    written = mutated_value(write, "kv_cache")
    readers = list(query_rope.users) + (list(written.users) if written is not None else [])
    return min(readers, key=order.get)


class RopeKVCacheFusion(AttnGraphPass):
    name = "rope_kv_cache_fusion"

    def detect(self, graph: Graph) -> list[RopeKVMatch]:
        order = position(graph)
        matches = []
        for node in graph.nodes:
            if functionalized_op(node) is not kv_cache_update:
                continue
            key_rope = node.kwargs["key"]
            if not is_call(key_rope, rope) or len(key_rope.users) != 1:
                continue
            cos_sin = key_rope.args[1]
            written = mutated_value(node, "kv_cache")
            query_rope = next((r.kwargs["query"] for r in (written.users if written else ())
                               if functionalized_op(r) is not None
                               and is_call(r.kwargs.get("query"), rope)
                               and r.kwargs["query"].args[1] is cos_sin), None)
            if query_rope is None:
                continue
            if all(order[n] < order[_first_reader(node, query_rope, order)]
                   for n in [query_rope.args[0], key_rope.args[0], cos_sin]
                   + inputs_of({k: v for k, v in node.kwargs.items() if k != "key"})):
                matches.append(RopeKVMatch(node, key_rope, query_rope))
        return matches

    def replace(self, graph: Graph, m: RopeKVMatch) -> None:
        order = position(graph)
        rest = {k: v for k, v in m.write.kwargs.items()
                if k not in ("key", "value", "slot_mapping", "k_scale", "v_scale")}
        kwargs = {"query": m.query_rope.args[0], "key": m.key_rope.args[0],
                  "value": m.write.kwargs["value"], "cos_sin": m.key_rope.args[1],
                  "slot_mapping": m.write.kwargs["slot_mapping"], "positions": None,
                  "query_start_loc": None, "block_table": None,
                  "k_scale": m.write.kwargs["k_scale"], "v_scale": m.write.kwargs["v_scale"],
                  **rest}  # the cache: v1 passes it by name, v2 as a base index + bases
        at = _first_reader(m.write, m.query_rope, order)
        fused = insert_call(graph, at, m.write.target, (rope_kv_cache_update,), kwargs)
        retire_write(graph, m.write, fused, "kv_cache")
        m.query_rope.replace_all_uses_with(getitem(graph, fused, 0))
        for node in (m.key_rope, m.query_rope):
            graph.erase_node(node)
