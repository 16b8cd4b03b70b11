"""What the recurrent ops share: the varlen batch as token -> request maps and as a padded
``[requests, steps]`` gather, both computed on the device from ``query_start_loc`` (no host
reads, so the ops capture in CUDA graphs); the state slots' reads and writes, where a slot
outside the state tensor is absent; and the checks of the step tensors -- their shapes, dtypes
and devices always, their values where they are on the host (or with debug checks)."""

from __future__ import annotations

import functools

import torch

from attn_ops.ops import check_query_start_loc, debug_checks_enabled
from attn_ops.plan_codec import PlanCodec
from attn_ops.tuning.ssm import SSMTuning

__all__ = ["FLOAT_DTYPES", "SSM_PLAN", "check_inputs", "check_step", "check_step_values",
           "chunked_step_kernel", "compute_dtype", "padded_steps", "padded_tokens",
           "read_states", "sanitized_starts", "scan_requests", "split_slots", "ssm_tuning",
           "step_writes", "store_states", "token_requests", "triton_available", "use_triton"]

SSM_PLAN = PlanCodec(SSMTuning)  # a layer's Tuning.ssm, handed to the ops by its backend

# The dtypes of the ops' floating inputs and states (the kernels load them into fp32; fp64 is
# the oracle's, on the torch body).
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def split_slots(state_indices: torch.Tensor):
    """``(read, writes)`` of ``state_indices``: ``[B]`` -- each request reads and writes its
    final state at one slot (``writes`` None); ``[B, 1 + W]`` (speculative decoding) -- it
    reads column 0 (the slot of its last accepted position) and writes its state after its
    ``i``-th new token to column ``1 + min(i, W - 1)``: a decode of ``1 + K <= W`` tokens keeps
    the state of every position, a longer request (a prefill, ``W = 1``) its final state."""
    idx = state_indices.long()
    if idx.dim() == 1:
        return idx, None
    return idx[:, 0], idx[:, 1:]


def step_writes(writes: torch.Tensor, lens: torch.Tensor, i: int) -> torch.Tensor:
    """``[B]``: where the state after each request's ``i``-th new token goes (see
    :func:`split_slots`; the null slot 0 where it is not kept)."""
    w = writes.shape[1]
    kept = (lens > i) & ((i < w - 1) | (lens == i + 1))
    return torch.where(kept, writes[:, min(i, w - 1)], 0)


def use_triton(x: torch.Tensor) -> bool:
    """Whether an op on ``x`` runs its Triton kernels (:func:`attn_ops.routing.ssm_kernel`)."""
    from attn_ops.routing import Kernel, ssm_kernel

    return ssm_kernel(x.is_cuda, x.dtype, triton_available()) is Kernel.SSM_TRITON


def ssm_tuning(plan: torch.Tensor | None):
    """The recurrent ops' tunables (:class:`~attn_ops.tuning.ssm.SSMTuning`): the layer's,
    encoded by its backend (:data:`SSM_PLAN`, the ops' ``tuning`` argument), or for a call
    without one the device's default."""
    if plan is not None:
        return SSM_PLAN.decode(plan)
    from attn_ops.tuning import default_tuning

    return default_tuning().ssm


def chunked_step_kernel(x: torch.Tensor, max_query_len: int, state_indices: torch.Tensor,
                        plan: torch.Tensor | None = None):
    """``(kernel, Tuning.ssm)`` of an op with a chunked kernel for a step
    (:func:`attn_ops.routing.ssm_kernel`), ``plan`` as :func:`ssm_tuning`'s."""
    from attn_ops.routing import ssm_kernel

    tuning = ssm_tuning(plan)
    return ssm_kernel(x.is_cuda, x.dtype, triton_available(), max_query_len,
                      state_indices.dim() == 1, tuning.chunked_min_query_len), tuning


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """fp64 for fp64 inputs (the oracle), else fp32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _dtype_names(dtypes) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def check_inputs(op: str, device: torch.device, tensors: dict, same_dtype=()) -> None:
    """Each of ``tensors`` (name -> tensor, None where absent) of a dtype in
    :data:`FLOAT_DTYPES` and on ``device``; those named in ``same_dtype`` of the first one's
    dtype (the kernels take them as one family: a step's activations)."""
    for name, t in tensors.items():
        if t is None:
            continue
        if t.device != device:
            raise ValueError(f"{op}: {name} must be on {device} (the inputs' device), got "
                             f"{t.device}")
        if t.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{op}: {name}.dtype must be one of {_dtype_names(FLOAT_DTYPES)}, "
                             f"got {_dtype_names([t.dtype])}")
    family = [(n, tensors[n]) for n in same_dtype if tensors.get(n) is not None]
    for name, t in family[1:]:
        if t.dtype != family[0][1].dtype:
            raise ValueError(f"{op}: {name}.dtype must be {_dtype_names([family[0][1].dtype])}"
                             f" ({family[0][0]}'s), got {_dtype_names([t.dtype])}")


def check_step(op: str, query_start_loc, state_indices, has_initial_state, state: torch.Tensor,
               state_name: str, dims: dict[str, int] | None = None,
               max_query_len: int | None = None) -> None:
    """The step tensors' shapes, dtypes and device (``state``'s): ``state`` floating
    (:data:`FLOAT_DTYPES`), ``[num_slots >= 1, ...]`` -- with ``dims``,
    ``[num_slots, *dims.values()]`` (named by ``dims``' keys) -- with contiguous last-dim
    entries (the kernels update it in place, rows of it at a time); ``max_query_len`` >= 0."""
    if state.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{op}: {state_name}.dtype must be one of {_dtype_names(FLOAT_DTYPES)},"
                         f" got {_dtype_names([state.dtype])}")
    if dims is not None and (state.dim() != 1 + len(dims)
                             or tuple(state.shape[1:]) != tuple(dims.values())):
        named = ", ".join(f"{k}={v}" for k, v in dims.items())
        raise ValueError(f"{op}: {state_name} must be [num_slots, {named}], got "
                         f"{tuple(state.shape)}")
    if state.dim() < 2 or state.shape[0] < 1:
        raise ValueError(f"{op}: {state_name} must be [num_slots >= 1, ...], got "
                         f"{tuple(state.shape)}")
    if state.stride(-1) != 1 and state.shape[-1] > 1:
        raise ValueError(f"{op}: {state_name} must have stride 1 in its last dim (updated in "
                         f"place), got strides {state.stride()}")
    if max_query_len is not None and max_query_len < 0:
        raise ValueError(f"{op}: max_query_len={max_query_len} must be >= 0")
    b = state_indices.shape[0] if state_indices.dim() in (1, 2) else -1
    if query_start_loc.dim() != 1 or query_start_loc.shape[0] != b + 1 or (
            state_indices.dim() == 2 and state_indices.shape[1] < 2):
        raise ValueError(f"{op}: query_start_loc must be [num_reqs + 1] and state_indices "
                         f"[num_reqs] (or [num_reqs, 1 + tokens] with speculative decodes), got "
                         f"{tuple(query_start_loc.shape)} and {tuple(state_indices.shape)}")
    if has_initial_state.shape != (b,) or has_initial_state.dtype != torch.bool:
        raise ValueError(f"{op}: has_initial_state must be bool [num_reqs={b}], got "
                         f"{has_initial_state.dtype} {tuple(has_initial_state.shape)}")
    for name, t in (("query_start_loc", query_start_loc), ("state_indices", state_indices)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{op}: {name} must be int32 or int64, got {t.dtype}")
    for name, t in (("query_start_loc", query_start_loc), ("state_indices", state_indices),
                    ("has_initial_state", has_initial_state)):
        if t.device != state.device:
            raise ValueError(f"{op}: {name} must be on {state.device} (the inputs' device), "
                             f"got {t.device}")


def check_step_values(op: str, query_start_loc: torch.Tensor, state_indices: torch.Tensor,
                      num_tokens: int, num_slots: int, max_query_len: int | None = None) -> None:
    """The step's index values, where reading them costs no device sync -- on the host -- or
    with debug checks (:func:`attn_ops.set_debug_checks`): ``query_start_loc`` from 0, never
    decreasing, at most ``num_tokens``, no query longer than ``max_query_len``; with debug
    checks also every state slot inside ``[0, num_slots)`` (without them a slot outside is
    absent: :func:`read_states`, :func:`store_states`). Raises ``ValueError`` naming the
    value."""
    debug = debug_checks_enabled()
    if query_start_loc.device.type == "cpu" or debug:
        qsl = query_start_loc.tolist()
        check_query_start_loc(qsl, num_tokens, op)
        lens = [b - a for a, b in zip(qsl, qsl[1:])]
        if max_query_len is not None and lens and max(lens) > max_query_len:
            r = lens.index(max(lens))
            raise ValueError(f"{op}: max_query_len={max_query_len} is below request {r}'s "
                             f"{lens[r]} new tokens (query_start_loc[{r}:{r + 2}]="
                             f"{qsl[r:r + 2]}); it must bound every request's")
    if debug and state_indices.numel():
        bad = (state_indices < 0) | (state_indices >= num_slots)
        if bool(bad.any()):
            flat = int(bad.flatten().int().argmax())
            at = (flat if state_indices.dim() == 1
                  else f"{flat // state_indices.shape[1]}, {flat % state_indices.shape[1]}")
            raise ValueError(f"{op}: state_indices[{at}]={int(state_indices.flatten()[flat])} "
                             f"is outside the state's slots [0, {num_slots})")


def read_states(state: torch.Tensor, slots: torch.Tensor, init: torch.Tensor,
                dtype: torch.dtype) -> torch.Tensor:
    """``[B, ...]``: ``state`` at ``slots`` in ``dtype`` where ``init``, else zeros -- zeros
    too where a slot is outside ``state`` (an absent slot: never read)."""
    inside = (slots >= 0) & (slots < state.shape[0])
    s = state[torch.where(inside, slots, 0)].to(dtype)
    keep = (inside & init).view(-1, *(1,) * (s.dim() - 1))
    return torch.where(keep, s, torch.zeros_like(s))


def store_states(state: torch.Tensor, slots: torch.Tensor, new: torch.Tensor) -> None:
    """``state[slots] = new`` where a slot is inside ``state``; an absent one is not written.
    Without a host sync (no data-dependent shapes): each absent entry rewrites what the first
    entry inside writes at its slot -- the same bytes twice, in any order -- or, where none is
    inside, slot 0's own contents."""
    if slots.numel() == 0:
        return
    inside = (slots >= 0) & (slots < state.shape[0])
    first = inside.int().argmax()
    some = inside.any()
    new = new.to(state.dtype)
    fill = torch.where(some, new[first], state[0])
    target = torch.where(inside, slots, torch.where(some, slots[first], 0))
    state.index_copy_(0, target, torch.where(inside.view(-1, *(1,) * (new.dim() - 1)), new,
                                             fill[None]))


def padded_steps(query_start_loc: torch.Tensor, num_tokens: int) -> int:
    """The steps of a torch body's padded loop (:func:`padded_tokens`): the longest query,
    read where ``query_start_loc`` is on the host; on a device, where reading it would sync,
    ``num_tokens``, which bounds every query -- so no token is dropped whatever the caller's
    ``max_query_len`` says (the Triton kernels read each request's range itself)."""
    if query_start_loc.device.type != "cpu":
        return num_tokens
    if query_start_loc.shape[0] < 2:
        return 0
    return max(int((query_start_loc[1:] - query_start_loc[:-1]).max()), 0)


def sanitized_starts(query_start_loc: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """``query_start_loc`` (int64) clamped into ``[0, num_tokens]`` and never decreasing: the
    torch paths read no row outside the batch whatever a corrupt device value says (the
    kernels clamp each request's span the same way; the host checks the values where it
    holds them)."""
    return torch.cummax(query_start_loc.long().clamp(0, num_tokens), 0).values


def token_requests(query_start_loc: torch.Tensor, num_tokens: int):
    """``(request, position, real)`` of each of ``num_tokens`` rows: its request (rows past the
    last request's tokens -- padding -- get the last request, and ``real`` False) and its
    offset among that request's new tokens."""
    qsl = sanitized_starts(query_start_loc, num_tokens)
    num_reqs = qsl.shape[0] - 1
    tok = torch.arange(num_tokens, device=qsl.device)
    req = torch.searchsorted(qsl[1:], tok, right=True).clamp(max=max(num_reqs - 1, 0))
    real = tok < qsl[-1]
    return req, tok - qsl[req], real


def padded_tokens(query_start_loc: torch.Tensor, steps: int):
    """``(rows, valid)``, both ``[num_reqs, steps]``: the batch row of each request's
    ``i``-th new token (clamped into range where it has none) and whether it has one."""
    qsl = query_start_loc.long()
    offs = torch.arange(steps, device=qsl.device)
    lens = qsl[1:] - qsl[:-1]
    valid = offs[None, :] < lens[:, None]
    rows = torch.where(valid, qsl[:-1, None] + offs[None, :], 0)
    return rows, valid


def scan_requests(state, query_start_loc, state_indices, has_initial_state, num_tokens: int,
                  dtype: torch.dtype, out_shape: tuple[int, ...], step):
    """The torch bodies' recurrence over every request's new tokens at once, token by token
    (the requests padded to the longest): each request from its read state (zeros without an
    initial state or with an absent slot); ``step(s, rows) -> (updated, out)``, the states
    ``[B, ...]`` and outputs ``[B, *out_shape]`` after the requests' tokens at batch
    ``rows``. Returns ``(out, states, slots, real)``: the outputs ``[num_tokens,
    *out_shape]`` (zero where no token wrote), the states the step writes at ``slots`` (its
    final ones at the read slots; with speculative writes every kept one), and which rows
    hold a request's token (not padding)."""
    read, writes = split_slots(state_indices)
    s = read_states(state, read, has_initial_state, dtype)
    out = torch.zeros(num_tokens + 1, *out_shape, dtype=dtype, device=s.device)  # (row
    query_start_loc = sanitized_starts(query_start_loc, num_tokens)  # num_tokens: no token)
    steps = padded_steps(query_start_loc, num_tokens)
    rows, valid = padded_tokens(query_start_loc, steps)
    lens = valid.sum(1)
    written, slots = [], []
    for i in range(steps):
        r, ok = rows[:, i], valid[:, i]
        updated, o = step(s, r)
        s = torch.where(ok.view(-1, *(1,) * (s.dim() - 1)), updated, s)
        out.index_copy_(0, torch.where(ok, r, num_tokens), o)
        if writes is not None:
            written.append(s)
            slots.append(step_writes(writes, lens, i))
    real = torch.arange(num_tokens, device=s.device) < query_start_loc[-1]
    if writes is None:
        return out[:num_tokens], s, read, real
    return out[:num_tokens], torch.cat(written or [s[:0]]), torch.cat(slots or [read[:0]]), real

