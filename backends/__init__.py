"""Attention backends, one module each (installed as ``attn_ops.backends``).

A backend module reads top to bottom: capabilities as data, reasons, metadata builder, op
registration with its fake kernel, kernel call. Importing a backend module registers its
``torch.ops.attn.*`` op; nothing here is imported until the registry asks for it.
"""
