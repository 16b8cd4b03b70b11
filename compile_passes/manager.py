"""The pass manager: our Inductor passes appended to -- never replacing -- whatever custom
post-grad passes are already configured.

Inductor takes one ``post_grad_custom_post_pass``; its ``uuid()`` goes into the FX-graph cache
key (``None`` disables caching for graphs it touches). :func:`install` puts an
:class:`AttnPassManager` there that first runs the pass that was already configured (a user's,
another library's), then ours in order; installing again appends to the same manager. The
manager's uuid hashes every sub-pass's uuid, so adding, removing or changing a pass never
reuses a stale cached graph, and a sub-pass without a uuid (a plain function) makes the whole
uuid ``None``, as Inductor requires.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

__all__ = ["AttnPassManager", "install"]


class AttnPassManager(CustomGraphPass):
    """Runs ``passes`` in order on a post-grad FX graph."""

    def __init__(self, passes: Iterable[Callable[[torch.fx.Graph], None]] = ()) -> None:
        self.passes = list(passes)

    def __call__(self, graph: torch.fx.Graph) -> None:
        for p in self.passes:
            p(graph)

    def uuid(self) -> bytes | None:
        digest = hashlib.sha256(b"attn_ops.AttnPassManager/1")
        for p in self.passes:
            sub = p.uuid() if isinstance(p, CustomGraphPass) else None
            if sub is None:
                return None  # a pass Inductor cannot key on: no caching, never a stale graph
            digest.update(sub if isinstance(sub, bytes) else repr(sub).encode())
        return digest.digest()


def install(passes: Iterable[Callable[[torch.fx.Graph], None]],
            config=None) -> AttnPassManager:
    """Append ``passes`` to Inductor's ``post_grad_custom_post_pass`` (``config`` defaults to
    ``torch._inductor.config``), keeping whatever pass was set there and running it first."""
    if config is None:
        import torch._inductor.config as config
    existing = config.post_grad_custom_post_pass
    if isinstance(existing, AttnPassManager):
        manager = existing
    else:
        manager = AttnPassManager([existing] if existing is not None else [])
        config.post_grad_custom_post_pass = manager
    manager.passes.extend(passes)
    return manager
