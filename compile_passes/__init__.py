"""Inductor passes that fuse attention metadata preparation with the kernel call
(installed as ``attn_ops.compile_passes``). Each pass is a ``CustomGraphPass`` with a ``uuid()``;
:func:`attn_ops.compile_passes.manager.install` appends them to Inductor's custom post-grad pass
without overwriting one already set. The manager exists; the fusion passes themselves (metadata
preparation, RoPE + KV write, FP8 output) are issue 5's remaining work. Nothing is installed on
import.
"""
