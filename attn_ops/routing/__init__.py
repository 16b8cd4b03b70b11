"""Routing is policy, in one place: which kernel runs each part of a step, and how.

Every per-step decision of every backend is a pure function here, over typed inputs -- the
device's facts (:class:`DeviceFacts`), the shape of a part of the batch, and the backend's
section of the :class:`~attn_ops.tuning.Tuning` -- returning a typed route. Backends build
their plans from these routes and execute them; none decides on its own. Each rule's comment
says why it holds; the measurements behind the numbers are in ``docs/tuning.md``.

A module per family, all importable from here:

* :mod:`~attn_ops.routing.common` -- device facts, kernel names, route types, tile arithmetic;
* :mod:`~attn_ops.routing.attention` -- FlashInfer's split-KV decode, the sm90 composite,
  FlashAttention 4's tiles and modes, TRITON_ATTN's launches, FlexAttention's layouts;
* :mod:`~attn_ops.routing.mla` -- the MLA family (dense, sparse, the indexer);
* :mod:`~attn_ops.routing.ssm` -- the recurrent-state family;
* :mod:`~attn_ops.routing.explain` -- above them all: the route of every part of a step
  (``python -m attn_ops select ... --batch 64x4096,1x8192:8192``).
"""

from attn_ops.routing.attention import *  # noqa: F401,F403
from attn_ops.routing.attention import __all__ as _attention
from attn_ops.routing.common import *  # noqa: F401,F403
from attn_ops.routing.common import __all__ as _common
from attn_ops.routing.explain import *  # noqa: F401,F403
from attn_ops.routing.explain import __all__ as _explain
from attn_ops.routing.mla import *  # noqa: F401,F403
from attn_ops.routing.mla import __all__ as _mla
from attn_ops.routing.ssm import *  # noqa: F401,F403
from attn_ops.routing.ssm import __all__ as _ssm

__all__ = [*_common, *_attention, *_mla, *_ssm, *_explain]
