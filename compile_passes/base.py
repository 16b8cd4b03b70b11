"""What every attn_ops graph pass shares: ``detect`` -> typed matches -> ``replace``, a uuid from
the pass's source, and helpers for the functionalized post-grad graph.

Inductor hands custom post-grad passes a *functionalized* graph: an op that mutates an argument
(``kv_cache_update`` writes the cache; attention ops write ``out``) appears as
``auto_functionalized_v2(op, **kwargs, _<arg>_base_index=i, _all_bases=[...])`` -- or
``auto_functionalized(op, **kwargs)`` when ``enable_auto_functionalized_v2`` is off -- whose
outputs are read with ``getitem``: index 0 is the op's own result, then the new value of each
mutated argument (v2: of each base, ``1 + base_index``; v1: in schema order). Functional ops
(``attn.rope``, ``attn.slot_mapping``) are plain ``call_function`` nodes. The helpers here
read and build both forms, so the passes work whichever one the user's Inductor config picks.
"""

from __future__ import annotations

import hashlib
import inspect
import operator
import sys
from collections.abc import Iterable
from typing import Any

import torch
from torch._higher_order_ops.auto_functionalize import (auto_functionalized,
                                                       auto_functionalized_v2)
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.fx import Graph, Node

__all__ = ["AttnGraphPass", "FUNCTIONALIZED", "attn_ops_in", "functionalized_op",
           "graph_text", "is_call", "mutated_index", "mutated_value"]

FUNCTIONALIZED = (auto_functionalized, auto_functionalized_v2)


def is_call(node: Any, op) -> bool:
    """``node`` calls ``op`` directly (a functional op)."""
    return isinstance(node, Node) and node.op == "call_function" and node.target is op


def functionalized_op(node: Any):
    """The op a functionalized node wraps, or None."""
    if isinstance(node, Node) and node.op == "call_function" and node.target in FUNCTIONALIZED:
        return node.args[0]
    return None


def mutated_index(node: Node, arg: str) -> int:
    """Where a functionalized ``node``'s outputs hold the new value of mutated ``arg``: after
    the op's returns (one slot for an op returning nothing), v2 by the base's index."""
    op = functionalized_op(node)
    returns = max(len(op._schema.returns), 1)
    if node.target is auto_functionalized_v2:
        return returns + node.kwargs[f"_{arg}_base_index"]
    mutated = [a.name for a in op._schema.arguments
               if a.alias_info is not None and a.alias_info.is_write]
    return returns + mutated.index(arg)


def mutated_value(node: Node, arg: str) -> Node | None:
    """The ``getitem`` giving the new value of mutated argument ``arg`` of functionalized
    ``node`` (None if nothing reads it)."""
    index = mutated_index(node, arg)
    for user in node.users:
        if user.target is operator.getitem and user.args[1] == index:
            return user
    return None


def attn_ops_in(graph: Graph) -> list[str]:
    """The ``attn::`` ops a graph calls, in order (functionalized ones by their op name)."""
    names = []
    for node in graph.nodes:
        op = functionalized_op(node) or (node.target if node.op == "call_function" else None)
        if isinstance(op, torch._ops.OpOverload) and op.namespace == "attn":
            names.append(op._schema.name.split("::")[1])
    return names


def graph_text(graph: Graph, ops: Iterable[str] = ("attn",)) -> str:
    """A stable, readable listing of the nodes that matter to our passes -- calls into
    ``attn::`` ops (functionalized or not) and the reads of their results -- with inputs named
    by position, for snapshot tests."""
    names: dict[Node, str] = {}
    counts: dict[str, int] = {}
    lines = []

    def show(a):
        if isinstance(a, Node):
            return names.get(a, "_")
        if isinstance(a, (list, tuple)):
            return "[" + ", ".join(show(x) for x in a) + "]"
        return repr(a)

    for node in graph.nodes:
        if node.op == "placeholder":
            names[node] = f"in{counts.setdefault('in', 0)}"
            counts["in"] += 1
            continue
        op = functionalized_op(node) or node.target
        if isinstance(op, torch._ops.OpOverload) and op.namespace in ops:
            short = op._schema.name.split("::")[1]
            names[node] = f"{short}{counts.setdefault(short, 0)}"
            counts[short] += 1
            kwargs = {k: v for k, v in node.kwargs.items() if not k.startswith("_")}
            args = [show(a) for a in node.args[1 if functionalized_op(node) else 0:]]
            args += [f"{k}={show(v)}" for k, v in kwargs.items() if v is not None]
            tag = " (functionalized)" if functionalized_op(node) else ""
            lines.append(f"{names[node]} = {short}({', '.join(args)}){tag}")
        elif node.target is operator.getitem and node.args[0] in names \
                and functionalized_op(node.args[0]):
            names[node] = f"{names[node.args[0]]}[{node.args[1]}]"
    return "\n".join(lines)


class AttnGraphPass(CustomGraphPass):
    """A post-grad pass: :meth:`detect` returns typed matches, :meth:`replace` rewrites one.

    ``uuid()`` hashes the defining module's source, so editing a pass never reuses a graph
    that Inductor's FX-graph cache compiled with the old one. ``matches_applied`` counts the
    rewrites (tests and logs read it)."""

    name = "attn_pass"

    def __init__(self) -> None:
        self.matches_applied = 0

    def detect(self, graph: Graph) -> list:
        raise NotImplementedError

    def replace(self, graph: Graph, match) -> None:
        raise NotImplementedError

    def __call__(self, graph: Graph) -> None:
        matches = self.detect(graph)
        for match in matches:
            self.replace(graph, match)
        if matches:
            graph.lint()
        self.matches_applied += len(matches)

    def uuid(self) -> bytes:
        source = inspect.getsource(sys.modules[type(self).__module__])
        base = inspect.getsource(sys.modules[__name__])
        return hashlib.sha256((self.name + source + base).encode()).digest()


def fake_value(target, args: tuple, kwargs: dict):
    """Run ``target`` on the fake values of its node inputs (for a new node's ``meta['val']``)."""
    from torch._guards import detect_fake_mode

    def val(a):
        if isinstance(a, Node):
            return a.meta["val"]
        if isinstance(a, (list, tuple)):
            return type(a)(val(x) for x in a)
        return a

    fake_args, fake_kwargs = val(args), {k: val(v) for k, v in kwargs.items()}
    leaves = [v for v in list(fake_args) + list(fake_kwargs.values())
              if isinstance(v, torch.Tensor)]
    leaves += [x for v in fake_kwargs.values() if isinstance(v, (list, tuple)) for x in v]
    mode = detect_fake_mode(leaves)
    with mode:
        return target(*fake_args, **fake_kwargs)


def insert_call(graph: Graph, before: Node, target, args: tuple, kwargs: dict) -> Node:
    """A new ``call_function`` node before ``before``, with its fake value computed."""
    with graph.inserting_before(before):
        node = graph.call_function(target, args, kwargs)
    node.meta["val"] = fake_value(target, args, kwargs)
    return node


def retire_write(graph: Graph, write: Node, fused: Node, cache: str) -> None:
    """Erase functionalized cache write ``write``, which ``fused`` (functionalized too) does
    now: readers of the written ``cache`` read ``fused``'s new value of it instead, and the
    write's unread getitem (of its empty result) goes with it."""
    written = mutated_value(write, cache)
    if written is not None:
        written.replace_all_uses_with(getitem(graph, fused, mutated_index(fused, cache)))
        graph.erase_node(written)
    for user in list(write.users):
        graph.erase_node(user)
    graph.erase_node(write)


def getitem(graph: Graph, source: Node, index: int) -> Node:
    """``source[index]`` right after ``source``, with its fake value."""
    with graph.inserting_after(source):
        node = graph.call_function(operator.getitem, (source, index))
    node.meta["val"] = source.meta["val"][index]
    return node


def position(graph: Graph) -> dict[Node, int]:
    return {n: i for i, n in enumerate(graph.nodes)}


def inputs_of(value) -> list[Node]:
    if isinstance(value, Node):
        return [value]
    if isinstance(value, (list, tuple)):
        return [n for v in value for n in inputs_of(v)]
    if isinstance(value, dict):
        return [n for v in value.values() for n in inputs_of(v)]
    return []
