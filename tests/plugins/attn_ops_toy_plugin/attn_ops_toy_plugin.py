"""A minimal out-of-tree attn_ops backend, used by the tests to check entry-point discovery.

It reuses the REFERENCE kernel under its own name; a real plugin would register its own
``torch.ops`` op and declare its own capabilities.
"""

from attn_ops.backends.reference import ReferenceBackend


class ToyBackend(ReferenceBackend):
    name = "TOY_ATTN"
