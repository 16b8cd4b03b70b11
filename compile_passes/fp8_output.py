"""Attention + FP8 output quantization: an attention op whose output is only read (possibly
through views) by ``attn.quantize_fp8(out, scale, dtype)`` is given ``output_scale=scale`` and
an fp8 ``out`` instead -- the op writes the quantized result itself, and the full-precision
output never makes a round trip through memory as a tensor of its own.

Applies to attention ops that take ``output_scale`` (every ``attn::`` attention op defined with
``define_op(..., fp8_output_at=...)``: REFERENCE, CPU_ATTN, TRITON_ATTN, FLEX_ATTENTION,
TREE_ATTN, FLASH_ATTN_DIFFKV); FlashInfer's and FlashAttention's ops do not, and are left
alone. Views between the output and the quantization (``flatten``, ``view``) are replayed on
the fp8 output.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch.fx import Graph, Node

from attn_ops.compile_passes.base import (AttnGraphPass, functionalized_op, getitem,
                                          insert_call, is_call, mutated_index, position)
from attn_ops.glue import quantize_fp8_op

__all__ = ["Fp8OutputFusion", "Fp8OutputMatch"]

_VIEWS = (torch.ops.aten.view.default, torch.ops.aten.reshape.default,
          torch.ops.aten._unsafe_view.default)


@dataclass(frozen=True)
class Fp8OutputMatch:
    """The quantization, the attention op, its output read, the views between them (in
    order) and the ``empty`` that allocated the output."""

    quantize: Node
    attention: Node
    result: Node
    views: tuple[Node, ...]
    out_buffer: Node


def _out_buffer(attention: Node) -> Node:
    kwargs = attention.kwargs
    if "_all_bases" in kwargs:
        return kwargs["_all_bases"][kwargs["_out_base_index"]]
    return kwargs["out"]


class Fp8OutputFusion(AttnGraphPass):
    name = "fp8_output_fusion"

    def detect(self, graph: Graph) -> list[Fp8OutputMatch]:
        order = position(graph)
        matches = []
        for node in graph.nodes:
            if not is_call(node, quantize_fp8_op):
                continue
            x, views = node.args[0], []
            while isinstance(x, Node) and x.target in _VIEWS and len(x.users) == 1:
                views.append(x)
                x = x.args[0]
            if not isinstance(x, Node) or x.target is not operator.getitem:
                continue
            attention = x.args[0]
            op = functionalized_op(attention)
            if op is None or "output_scale" not in {a.name for a in op._schema.arguments} \
                    or attention.kwargs.get("output_scale") is not None \
                    or x.args[1] != mutated_index(attention, "out") or len(x.users) != 1:
                continue
            buffer = _out_buffer(attention)
            scale = node.args[1]
            if buffer.target is not torch.ops.aten.empty.memory_format \
                    or len(buffer.users) != 1 or order[scale] > order[attention]:
                continue
            matches.append(Fp8OutputMatch(node, attention, x, tuple(reversed(views)), buffer))
        return matches

    def replace(self, graph: Graph, m: Fp8OutputMatch) -> None:
        _, scale, dtype = m.quantize.args
        buffer = insert_call(graph, m.attention, m.out_buffer.target, m.out_buffer.args,
                             {**m.out_buffer.kwargs, "dtype": dtype})
        kwargs = {**m.attention.kwargs, "output_scale": scale}
        if "_all_bases" in kwargs:
            bases = list(kwargs["_all_bases"])
            bases[kwargs["_out_base_index"]] = buffer
            kwargs["_all_bases"] = bases
        else:
            kwargs["out"] = buffer
        fused = insert_call(graph, m.attention, m.attention.target, m.attention.args, kwargs)
        for old in list(m.attention.users):  # every output read (out, lse) moves over
            if old is not m.result:
                old.replace_all_uses_with(getitem(graph, fused, old.args[1]))
                graph.erase_node(old)
        value = getitem(graph, fused, m.result.args[1])
        for view in m.views:  # replayed on the fp8 output
            args = (value, *view.args[1:])
            value = insert_call(graph, m.quantize, view.target, args, dict(view.kwargs))
        m.quantize.replace_all_uses_with(value)
        for node in (m.quantize, *reversed(m.views), m.result, m.attention, m.out_buffer):
            graph.erase_node(node)
