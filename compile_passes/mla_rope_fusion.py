"""MLA RoPE + latent write: a layer's ``attn.mla_rope`` (its query's and ``k_pe``'s rope parts)
and the write of the rotated ``k_pe`` (``attn.mla_cache_update``) become one
``attn.mla_rope_cache_update``, which rotates both, writes ``[kv_c | k_pe]`` and returns the
rotated pair -- two ops per layer become one (on the GPU one launch).

Detected per latent write: its ``k_pe`` is output 1 of an ``mla_rope`` whose outputs nothing
else reads before the write's first reader (the layer's MLA attention op). The fused op goes
right before the first reader of any of its results, where every input it needs is defined.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

from torch.fx import Graph, Node

from attn_ops.backends.mla.common import mla_cache_update
from attn_ops.backends.mla.rope import mla_rope, mla_rope_cache_update
from attn_ops.compile_passes.base import (AttnGraphPass, functionalized_op, getitem, inputs_of,
                                          insert_call, is_call, mutated_value, position,
                                          retire_write)

__all__ = ["MLARopeCacheFusion", "MLARopeMatch"]


@dataclass(frozen=True)
class MLARopeMatch:
    """One MLA layer's glue: the functionalized latent write and the RoPE it absorbs."""

    write: Node
    rope: Node


def _outputs(rope: Node) -> dict[int, Node]:
    """The rope node's getitems by index."""
    return {u.args[1]: u for u in rope.users if u.target is operator.getitem}


def _readers(write: Node, rope: Node) -> list[Node]:
    """The nodes reading a rotated output (but the write) or the written cache."""
    written = mutated_value(write, "latent_cache")
    readers = [r for g in _outputs(rope).values() for r in g.users if r is not write]
    return readers + (list(written.users) if written is not None else [])


class MLARopeCacheFusion(AttnGraphPass):
    name = "mla_rope_cache_fusion"

    def detect(self, graph: Graph) -> list[MLARopeMatch]:
        order = position(graph)
        matches = []
        for node in graph.nodes:
            if functionalized_op(node) is not mla_cache_update:
                continue
            k_pe = node.kwargs["k_pe"]
            if not (isinstance(k_pe, Node) and k_pe.target is operator.getitem
                    and k_pe.args[1] == 1 and is_call(k_pe.args[0], mla_rope)):
                continue
            rope = k_pe.args[0]
            outputs = _outputs(rope)
            readers = _readers(node, rope)
            if set(outputs) - {0, 1} or len(outputs) != len(rope.users) or not readers:
                continue
            first = min(readers, key=order.get)
            if all(order[n] < order[first] for n in inputs_of(list(rope.args))
                   + inputs_of({k: v for k, v in node.kwargs.items() if k != "k_pe"})):
                matches.append(MLARopeMatch(node, rope))
        return matches

    def replace(self, graph: Graph, m: MLARopeMatch) -> None:
        order = position(graph)
        q, k_pe, cos_sin = m.rope.args
        rest = {k: v for k, v in m.write.kwargs.items()
                if k not in ("kv_c", "k_pe", "slot_mapping", "scale")}
        kwargs = {"q": q, "kv_c": m.write.kwargs["kv_c"], "k_pe": k_pe, "cos_sin": cos_sin,
                  "slot_mapping": m.write.kwargs["slot_mapping"],
                  "scale": m.write.kwargs["scale"],
                  **rest}  # the cache: v1 passes it by name, v2 as a base index + bases
        at = min(_readers(m.write, m.rope), key=order.get)
        fused = insert_call(graph, at, m.write.target, (mla_rope_cache_update,), kwargs)
        retire_write(graph, m.write, fused, "latent_cache")
        for index, old in _outputs(m.rope).items():
            old.replace_all_uses_with(getitem(graph, fused, index))
            graph.erase_node(old)
        graph.erase_node(m.rope)
