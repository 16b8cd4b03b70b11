"""``torch.ops.attn.causal_conv1d``: the causal depthwise convolution of a step's new tokens,
each request continuing from its conv state, and the state update -- one op for prefills,
decodes and mixed batches.

``x`` ``[T, D]`` (rows past ``query_start_loc[-1]`` are padding: output 0), ``weight``
``[D, K]``, ``bias`` ``[D]`` or None, ``conv_state`` ``[slots, K - 1, D]`` (the last ``K - 1``
inputs of each slot's request, oldest first), ``activation`` ``"silu"`` or ``""``. Token ``i`` of
a request sees its ``K - 1`` predecessors: earlier new tokens, then the conv state where the
request ``has_initial_state``, else zeros. Afterwards each request's slot holds its last
``K - 1`` inputs (a request with no new tokens keeps its state). The torch body here is the
reference and the CPU path; it computes in fp32 (fp64 for fp64 inputs) and reads nothing on
the host.

Inputs served or refused: shapes, dtypes (floating; ``conv_state`` too) and devices are checked
at every call, ``query_start_loc``'s values where they are on the host (from 0, never
decreasing, at most ``T``), all with a ``ValueError`` naming the value. A state slot is a
device-side index: one outside ``conv_state`` (``< 0`` or ``>= slots``) is absent -- its
request starts from zeros, as without an initial state, and its slot is not written -- in the
torch body and the kernels alike, with no host sync; with debug checks
(:func:`attn_ops.set_debug_checks`) the op raises on the first one instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from attn_ops.backends.ssm.common import (check_inputs, check_step, check_step_values,
                                          compute_dtype, read_states, sanitized_starts,
                                          split_slots, step_writes, store_states,
                                          token_requests, use_triton)
from attn_ops.ops import define_op

__all__ = ["ACTIVATIONS", "causal_conv1d", "conv_windows", "conv_reference"]

ACTIVATIONS = ("", "silu")


def _check(x, weight, bias, conv_state, query_start_loc, state_indices, has_initial_state,
           activation) -> None:
    op = "causal_conv1d"
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[0] != x.shape[1]:
        raise ValueError(f"{op}: x must be [num_tokens, dim] and weight [dim, kernel], got "
                         f"{tuple(x.shape)} and {tuple(weight.shape)}")
    check_inputs(op, x.device, {"x": x, "weight": weight, "bias": bias,
                                "conv_state": conv_state})
    d, k = weight.shape
    if k < 2:
        raise ValueError(f"{op}: the kernel width {k} must be >= 2")
    if conv_state.dim() != 3 or tuple(conv_state.shape[1:]) != (k - 1, d):
        raise ValueError(f"{op}: conv_state must be [num_slots, kernel - 1 = {k - 1}, dim = {d}]"
                         f", got {tuple(conv_state.shape)}")
    if bias is not None and tuple(bias.shape) != (d,):
        raise ValueError(f"{op}: bias must be [dim={d}], got {tuple(bias.shape)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"{op}: activation={activation!r} must be one of {ACTIVATIONS}")
    check_step(op, query_start_loc, state_indices, has_initial_state, conv_state,
               "conv_state")


def conv_windows(x, conv_state, query_start_loc, state_indices, has_initial_state, kernel):
    """``[T, K, D]``: each row's ``K`` inputs, oldest first (the row itself last), in the
    compute dtype, and ``real`` ``[T]``."""
    dtype = compute_dtype(x)
    t, d = x.shape
    req, pos, real = token_requests(query_start_loc, t)
    lags = torch.arange(kernel - 1, -1, -1, device=x.device)
    p = pos[:, None] - lags[None, :]  # [T, K]: position of each window entry in the request
    rows = (torch.arange(t, device=x.device)[:, None] - lags[None, :]).clamp(min=0)
    from_x = x.to(dtype)[rows]  # [T, K, D]
    states = read_states(conv_state, split_slots(state_indices)[0], has_initial_state,
                         dtype)  # [B, K - 1, D]: zeros without an initial state or a slot
    idx = (kernel - 1 + p).clamp(0, kernel - 2)
    from_state = states[req[:, None], idx]  # [T, K, D]
    window = torch.where((p >= 0)[..., None], from_x, from_state)
    return window, real


def _states_after(x, states, query_start_loc, kernel, ends):
    """``[B, K - 1, D]``: each request's last ``K - 1`` inputs after its first ``ends`` new
    tokens, from ``states`` (its conv states read before the step, compute dtype: zeros
    without an initial state)."""
    dtype = compute_dtype(x)
    qsl = query_start_loc.long()
    i = torch.arange(kernel - 1, device=x.device)
    p = ends[:, None] - (kernel - 1) + i[None, :]  # [B, K - 1]
    xs = x.to(dtype) if x.shape[0] else x.new_zeros(1, x.shape[1], dtype=dtype)  # (a step
    # without rows takes every entry from the states: p < 0)
    from_x = xs[(qsl[:-1, None] + p).clamp(0, xs.shape[0] - 1)]
    from_state = states.gather(1, (kernel - 1 + p).clamp(0, kernel - 2)[..., None].expand(
        -1, -1, x.shape[1]))
    return torch.where((p >= 0)[..., None], from_x, from_state)


def _new_states(x, conv_state, query_start_loc, state_indices, has_initial_state, kernel):
    """``(states [N, K - 1, D], slots [N])``: the conv states this step writes and where."""
    read, writes = split_slots(state_indices)
    states = read_states(conv_state, read, has_initial_state, compute_dtype(x))
    qsl = query_start_loc.long()
    lens = qsl[1:] - qsl[:-1]
    if writes is None:
        return _states_after(x, states, query_start_loc, kernel, lens), read
    w = writes.shape[1]
    new = [_states_after(x, states, query_start_loc, kernel, torch.clamp(lens, max=i + 1))
           for i in range(w - 1)]
    slots = [step_writes(writes, lens, i) for i in range(w - 1)]
    new.append(_states_after(x, states, query_start_loc, kernel, lens))
    slots.append(torch.where(lens >= w, writes[:, w - 1], 0))  # (the final state of longer ones)
    return torch.cat(new), torch.cat(slots)


def conv_reference(x, weight, bias, conv_state, query_start_loc, state_indices,
                   has_initial_state, activation):
    """The op's torch body, returning ``(y, states, slots)`` in the compute dtype: the output
    and the conv states the step writes at ``slots`` (nothing written here; slots outside
    ``conv_state`` are absent: :func:`~attn_ops.backends.ssm.common.store_states`)."""
    _check(x, weight, bias, conv_state, query_start_loc, state_indices, has_initial_state,
           activation)
    return _reference(x, weight, bias, conv_state, query_start_loc, state_indices,
                      has_initial_state, activation)


def _reference(x, weight, bias, conv_state, query_start_loc, state_indices, has_initial_state,
               activation):
    kernel = weight.shape[1]
    dtype = compute_dtype(x)
    query_start_loc = sanitized_starts(query_start_loc, x.shape[0])  # (no row outside the batch)
    if x.shape[0] == 0:
        return (x.new_zeros(0, x.shape[1], dtype=dtype),
                *_new_states(x, conv_state, query_start_loc, state_indices, has_initial_state,
                             kernel))
    window, real = conv_windows(x, conv_state, query_start_loc, state_indices,
                                has_initial_state, kernel)
    y = (window * weight.to(dtype).t()[None]).sum(1)
    if bias is not None:
        y = y + bias.to(dtype)
    if activation == "silu":
        y = F.silu(y)
    y = torch.where(real[:, None], y, torch.zeros_like(y))
    return (y, *_new_states(x, conv_state, query_start_loc, state_indices, has_initial_state,
                            kernel))


def _impl(x, weight, bias, conv_state, query_start_loc, state_indices, has_initial_state,
          activation):
    _check(x, weight, bias, conv_state, query_start_loc, state_indices, has_initial_state,
           activation)
    check_step_values("causal_conv1d", query_start_loc, state_indices, x.shape[0],
                      conv_state.shape[0])
    if use_triton(x):
        from attn_ops.backends.ssm.triton_kernels import conv_triton

        return conv_triton(x, weight, bias, conv_state, query_start_loc, state_indices,
                           has_initial_state, activation)
    y, new, slots = _reference(x, weight, bias, conv_state, query_start_loc, state_indices,
                               has_initial_state, activation)
    store_states(conv_state, slots, new)
    return y.to(x.dtype)


def _fake(x, weight, bias, conv_state, query_start_loc, state_indices, has_initial_state,
          activation):
    _check(x, weight, bias, conv_state, query_start_loc, state_indices, has_initial_state,
           activation)
    return torch.empty_like(x)


causal_conv1d = define_op(
    "causal_conv1d",
    "(Tensor x, Tensor weight, Tensor? bias, Tensor(a!) conv_state, Tensor query_start_loc, "
    "Tensor state_indices, Tensor has_initial_state, str activation) -> Tensor",
    _impl, _fake)
