"""Kernel schedules computed once a step and shared by the step's layers.

Some kernels split their work by a device computation over the step's lengths (FlashMLA's tile
schedule, FA3's scheduler metadata). Every layer of a step has the same lengths, so the first
layer computes it and the later ones reuse it. A backend's ``build_metadata`` takes a fresh
handle (:func:`new_schedule`) and carries it in its plan; the op looks the schedule up by the
handle and by a key of the call's own parameters (layers sharing metadata with different head
counts or windows each get theirs).

CUDA graphs: a capture size keeps one handle (``graph=True``) and restarts it for every step
(:func:`restart_schedule`). A schedule is never carried across a capture boundary: calls inside
a capture compute their own (so the graph holds the computation, and each replay redoes it from
the replay's lengths), calls outside one compute theirs.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Hashable

import torch

__all__ = ["new_schedule", "restart_schedule", "step_schedule"]


@dataclass
class _Held:
    """One step's (or capture size's) schedules by call key: ``eager`` for calls outside a
    graph capture, ``capture`` for calls inside one (``kept``: every captured one, alive as
    long as the graphs that read them)."""

    eager: dict = field(default_factory=dict)
    capture: dict = field(default_factory=dict)
    kept: list = field(default_factory=list)


_STEPS: OrderedDict[int, _Held] = OrderedDict()  # eager steps, newest last
_GRAPHS: dict[int, _Held] = {}  # one a capture size
_KEPT_STEPS = 64  # an older step's plan recomputes its schedule in every layer: still correct
_HANDLES = itertools.count(1)


def new_schedule(graph: bool) -> int:
    """A handle for a plan: a fresh schedule for one step (``graph``: for a capture size, kept
    as long as the process)."""
    handle = next(_HANDLES)
    if graph:
        _GRAPHS[handle] = _Held()
    else:
        _STEPS[handle] = _Held()
        while len(_STEPS) > _KEPT_STEPS:
            _STEPS.popitem(last=False)
    return handle


def restart_schedule(handle: int) -> None:
    """A new step on a capture size's handle (its lengths changed): the next call computes its
    schedule again, eagerly or inside the next capture."""
    held = _GRAPHS[handle]
    held.eager, held.capture = {}, {}


def step_schedule(handle: int | None, key: Hashable, device_tensor: torch.Tensor,
                  compute: Callable[[], object]) -> object:
    """The schedule of this call: the one computed by an earlier call of the step with the same
    ``key`` on this side of a graph capture, else ``compute()`` (kept for the later ones).
    ``device_tensor``: any tensor of the call (tells whether a capture is under way). A handle
    of 0 / None or one no longer held computes every time."""
    held = (_GRAPHS.get(handle) or _STEPS.get(handle)) if handle else None
    if held is None:
        return compute()
    capturing = device_tensor.is_cuda and torch.cuda.is_current_stream_capturing()
    table = held.capture if capturing else held.eager
    got = table.get(key)
    if got is None:
        got = table[key] = compute()
        if capturing:
            held.kept.append(got)
    return got
