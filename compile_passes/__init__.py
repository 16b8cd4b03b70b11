"""Inductor passes that fuse attention metadata preparation with the kernel call
(installed as ``attn_ops.compile_passes``). Each pass is a ``CustomGraphPass`` with a ``uuid()``;
a manager appends them to Inductor's custom passes without overwriting others. The passes
themselves arrive with the torch.compile / CUDA-graph work (issue 5); nothing is installed on
import.
"""
