"""``torch.ops.attn.short_conv``: LFM2's gated short convolution, ``y = C * conv(B * x)`` with
``[B | C | x] = bcx`` ``[T, 3 D]``, the convolution (no activation) continuing each request from
its conv state as :data:`~attn_ops.backends.ssm.conv.causal_conv1d` does (its input checks and
its rule for a state slot outside ``conv_state`` too: absent, neither read nor written); its
torch body is the reference and the CPU path."""

from __future__ import annotations

import torch

from attn_ops.backends.ssm.common import (check_inputs, check_step_values, store_states,
                                          use_triton)
from attn_ops.backends.ssm.conv import _check, _reference
from attn_ops.ops import define_op

__all__ = ["short_conv"]


def _split(bcx: torch.Tensor):
    if bcx.dim() != 2 or bcx.shape[1] % 3:
        raise ValueError(f"short_conv: bcx must be [num_tokens, 3 * dim] ([B | C | x]), got "
                         f"{tuple(bcx.shape)}")
    check_inputs("short_conv", bcx.device, {"bcx": bcx})
    return bcx.chunk(3, dim=1)


def _impl(bcx, weight, bias, conv_state, query_start_loc, state_indices, has_initial_state):
    b, c, x = _split(bcx)
    _check(b, weight, bias, conv_state, query_start_loc, state_indices, has_initial_state, "")
    check_step_values("short_conv", query_start_loc, state_indices, bcx.shape[0],
                      conv_state.shape[0])
    if use_triton(bcx):
        from attn_ops.backends.ssm.triton_kernels import conv_triton

        y = conv_triton(b * x, weight, bias, conv_state, query_start_loc, state_indices,
                        has_initial_state, "")
    else:
        y, new, slots = _reference(b * x, weight, bias, conv_state, query_start_loc,
                                   state_indices, has_initial_state, "")
        store_states(conv_state, slots, new)
    real = torch.arange(bcx.shape[0], device=bcx.device) < query_start_loc[-1]
    return torch.where(real[:, None], c.to(y.dtype) * y, 0.0).to(bcx.dtype)


def _fake(bcx, weight, bias, conv_state, query_start_loc, state_indices, has_initial_state):
    b, _, _ = _split(bcx)
    _check(b, weight, bias, conv_state, query_start_loc, state_indices, has_initial_state, "")
    return torch.empty_like(b)


short_conv = define_op(
    "short_conv",
    "(Tensor bcx, Tensor weight, Tensor? bias, Tensor(a!) conv_state, Tensor query_start_loc, "
    "Tensor state_indices, Tensor has_initial_state) -> Tensor",
    _impl, _fake)
