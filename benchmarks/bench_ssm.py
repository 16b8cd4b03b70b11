"""Recurrent-state layers on the H200: our ops against flash-linear-attention (Gated DeltaNet,
lightning attention) and mamba-ssm (Mamba2, Mamba1), side by side in one run, on the same inputs and states, each
anchor's outputs and final states cross-checked against ours.

* ``decode`` -- one token per request, every request continuing from its state, at
  ``--batches`` (default B = 1, 64, 256, 1024): the GDN op (Qwen3-Next shapes: 16 key / 32
  value heads of 128, fp32 state) with its conv update (conv width 8192, kernel 4) and without,
  the Mamba2 op (80 heads x 64, d_state 128, 1 group, fp32 state) with its conv update (conv
  width 5376) and without, the Mamba1 op (Mamba-2.8B: 5120 channels, d_state 16, fp32 state)
  with its conv update (width 5120) and without, lightning attention (64 heads of 128, fp32
  state; no conv). Bytes = every state read and written once
  (+ the step's inputs and outputs) -> TB/s; ``copy``: a device-to-device copy of the same
  state bytes in the same run.
* ``prefill`` -- ``--prefills`` (default 1 x 8k, 4 x 4k, 32 x 1k tokens) from zero states, in
  M tokens/s.

Anchors, called by keyword, every layout of each timed (the anchor's best layout counts):

* GDN decode: fla's ``fused_recurrent_gated_delta_rule`` -- ``fla_varlen`` (``[1, B, H, D]``
  with ``cu_seqlens``), ``fla_batch`` (``[B, 1, H, D]``); q / k at their 16 heads (fla maps
  each key head to 2 value heads, as ours does); states read from a contiguous copy of ours.
* GDN prefill: fla's ``chunk_gated_delta_rule`` -- ``fla_chunk_varlen`` (``cu_seqlens``, its
  host copy and chunk indices made once, outside the timing, as a serving engine does),
  ``fla_chunk_batch`` (``[B, L, H, D]``).
* Mamba2 decode: mamba-ssm's Triton ``selective_state_update`` (A, dt, dt_bias, D broadcast
  over the head dim: its tied-head-dim path) -- ``mamba_ssm`` (contiguous states ``[B, ...]``),
  ``mamba_ssm_indexed`` (``state_batch_indices`` into a copy of our slot pool, updated in
  place as ours is).
* Mamba2 prefill: mamba-ssm's ``mamba_chunk_scan_combined`` (chunk 256) --
  ``mamba_ssm_varlen`` (``seq_idx`` + ``cu_seqlens``, ``return_varlen_states``),
  ``mamba_ssm_batch`` (``[B, L, H, P]``, ``return_final_states``).
* Mamba1 decode: mamba-ssm's ``selective_state_update`` in its Mamba1 layout (``[B, D, N]``
  states, A ``[D, N]``) -- ``mamba_ssm`` and ``mamba_ssm_indexed`` as for Mamba2.
* Mamba1 prefill: mamba-ssm's ``selective_scan_fn`` (its CUDA extension, where it is built) --
  ``mamba_ssm_batch`` (``[B, D, L]``, ``return_last_state``).
* Lightning attention (MiniMax-Text-01: 64 heads of 128, fp32 state; the decay of layer 40 of
  80 as fla derives it): fla's ``fused_recurrent_lightning_attn`` (decode) and
  ``chunk_lightning_attn`` (prefill), ``scale=1`` -- ``fla[_chunk]_varlen`` (``cu_seqlens``),
  ``fla[_chunk]_batch`` (``[B, L, H, D]``).

Cross-check (``_common.cross_check``): ours and every anchor run once from the same initial
states before timing; outputs and final states must agree within ``TOLERANCE`` (max |ours -
anchor| over max |anchor|, per part). An anchor that disagrees gets no ratio: the row prints
"mismatch" and the JSON keeps its errors (``cross_check``) with ``null`` ratios.

Timing: every contender as CUDA-graph replays (device time, ``do_bench_cudagraph`` medians)
and eagerly (calls back to back: the host's launch work counts where it is slower than the
device), contenders interleaved over ``--rounds`` rounds, medians. Ratios = anchor time / our
time (above 1: ours is faster), for each timing, per anchor layout and against the anchor's
fastest layout (``best_fla`` / ``best_mamba_ssm``, only when every layout of it agreed).

    python benchmarks/bench_ssm.py [--only decode prefill] [--batches 1 64 256 1024]
        [--prefills 1x8192 4x4096 32x1024] [--kinds gated_deltanet mamba2 mamba1 lightning]
        [--without fla_varlen copy ...] [--no-eager] [--rounds R] [--out PATH]
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import sys
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (anchor_ratios, check_text, cross_check, ratios_text,  # noqa: E402
                     time_graph_and_eager)
from bench_gpu_attention import gpu_parser, write_result  # noqa: E402

BF16, F32 = torch.bfloat16, torch.float32
DEVICE = "cuda"  # (the cross-checks also run on the CPU, Triton's interpreter running anchors)
GDN = {"hk": 16, "hv": 32, "dk": 128, "dv": 128, "kernel": 4}
M2 = {"h": 80, "p": 64, "n": 128, "g": 1, "kernel": 4}
M1 = {"d": 5120, "n": 16, "kernel": 4}
LIGHT = {"h": 64, "d": 128, "layer": 40, "layers": 80}  # MiniMax-Text-01's linear attention
DECODE_BATCHES = (1, 64, 256, 1024)
PREFILLS = ((1, 8192), (4, 4096), (32, 1024))
MAMBA_CHUNK = 256
# Largest max |ours - anchor| / max |anchor| each part may show. Decode: one step from the same
# fp32 states in fp32 arithmetic on both sides; the outputs are rounded to bf16 (one ulp is up
# to 2^-7 of the largest value: allow about two), the states stay fp32 (only summation order
# differs). Prefill: both sides run chunked algorithms whose products take bf16 operands (and
# mamba-ssm's varlen states are bf16), so outputs and states carry a few bf16 ulps of error. A
# different computation (an argument in the wrong parameter, say) is off by O(1).
TOLERANCE = {"decode": {"out": 2e-2, "state": 1e-3}, "prefill": {"out": 5e-2, "state": 5e-2}}


def state_bytes(kind: str, batch: int) -> int:
    """Every state of ``batch`` requests read and written once, bytes (fp32)."""
    elems = {"gated_deltanet": GDN["hv"] * GDN["dk"] * GDN["dv"],
             "mamba2": M2["h"] * M2["p"] * M2["n"], "mamba1": M1["d"] * M1["n"],
             "lightning": LIGHT["h"] * LIGHT["d"] * LIGHT["d"]}[kind]
    return batch * elems * 4 * 2


def io_bytes(kind: str, tokens: int) -> int:
    """The inputs and outputs of a step of ``tokens`` tokens, bytes (bf16)."""
    if kind == "gated_deltanet":
        c = GDN
        return tokens * (2 * c["hk"] * c["dk"] + 2 * c["hv"] * c["dv"]) * 2
    if kind == "mamba1":  # x, dt, z in, y out, B and C
        return tokens * (4 * M1["d"] + 2 * M1["n"]) * 2
    if kind == "lightning":  # q, k, v in, o out
        return tokens * 4 * LIGHT["h"] * LIGHT["d"] * 2
    c = M2
    return tokens * (2 * c["h"] * c["p"] + c["h"] + 2 * c["g"] * c["n"]) * 2


class Contender:
    """A timed callable ``run`` moving ``nbytes``. ``parts`` reads what a call computed as
    ``{"out": [T, H, D], "state": [B, H, ., .]}`` (request order) from its return value;
    ``reset`` restores the states it updates in place, so the cross-check starts every
    contender from the same states; ``family``: the anchor library (None: ours, or a
    reference such as the copy)."""

    def __init__(self, run: Callable[[], object], nbytes: int = 0,
                 parts: Callable[[object], dict[str, torch.Tensor]] | None = None,
                 reset: Callable[[], object] = lambda: None, family: str | None = None):
        self.run, self.nbytes, self.parts, self.reset, self.family = (run, nbytes, parts,
                                                                      reset, family)


def _step(batch, lens, initial, conv_dim, kernel):
    """A step of ``batch`` requests with ``lens`` new tokens on slots 1..batch (initial states
    or not): ``(qsl, slots, init, conv, conv_bytes)``, ``conv()`` its causal conv update over
    ``conv_dim`` channels and the bytes that moves."""
    from attn_ops.backends.ssm.conv import causal_conv1d

    t = sum(lens)
    qsl = torch.zeros(batch + 1, dtype=torch.int32, device=DEVICE)
    qsl[1:] = torch.tensor(lens, device=DEVICE).cumsum(0)
    slots = torch.arange(1, batch + 1, dtype=torch.int32, device=DEVICE)
    init = torch.full((batch,), initial, dtype=torch.bool, device=DEVICE)
    x = torch.randn(t, conv_dim, dtype=BF16, device=DEVICE)
    w = torch.randn(conv_dim, kernel, dtype=BF16, device=DEVICE) * 0.3
    conv_state = torch.randn(batch + 1, kernel - 1, conv_dim, dtype=BF16, device=DEVICE)

    def conv():
        return causal_conv1d(x=x, weight=w, bias=None, conv_state=conv_state,
                             query_start_loc=qsl, state_indices=slots, has_initial_state=init,
                             activation="silu")

    conv_bytes = batch * (kernel - 1) * conv_dim * 2 * 2 + t * conv_dim * 2 * 2
    return qsl, slots, init, conv, conv_bytes


def _copy(nbytes):
    """A device-to-device copy of ``nbytes`` (read + written): the bandwidth this size
    reaches, timed in the same run as the state updates."""
    src = torch.empty(nbytes // 8, dtype=F32, device=DEVICE)
    dst = torch.empty_like(src)
    return Contender(lambda: dst.copy_(src), nbytes=nbytes)


def _cu_seqlens(lens):
    return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.long, device=DEVICE)


def _ours(run, state, state0, batch, nbytes):
    """Our op: it reads and writes slots 1..batch of ``state`` in place."""
    return Contender(run, nbytes, parts=lambda o: {"out": o, "state": state[1:batch + 1]},
                     reset=lambda: state.copy_(state0))


def gdn_case(batch, lens, initial=True) -> tuple[dict[str, Contender], dict[str, str]]:
    """The contenders of a GDN step (ours, with its conv update for decodes, fla's layouts)
    and the anchors that could not be built here."""
    from attn_ops.backends.ssm.gated_deltanet import gated_delta_rule

    c = GDN
    t, mql = sum(lens), max(lens)
    qsl, slots, init, conv, conv_bytes = _step(batch, lens, initial,
                                               2 * c["hk"] * c["dk"] + c["hv"] * c["dv"],
                                               c["kernel"])
    q = torch.randn(t, c["hk"], c["dk"], dtype=BF16, device=DEVICE)
    k = torch.randn(t, c["hk"], c["dk"], dtype=BF16, device=DEVICE)
    v = torch.randn(t, c["hv"], c["dv"], dtype=BF16, device=DEVICE)
    g = -torch.rand(t, c["hv"], device=DEVICE) * 0.1
    beta = torch.rand(t, c["hv"], device=DEVICE)
    state = torch.randn(batch + 1, c["hv"], c["dk"], c["dv"], dtype=F32, device=DEVICE) * 0.1
    state0 = state.clone()
    scale = c["dk"] ** -0.5

    def ours():
        return gated_delta_rule(q=q, k=k, v=v, g=g, beta=beta, state=state, query_start_loc=qsl,
                                state_indices=slots, has_initial_state=init, max_query_len=mql,
                                scale=scale, qk_l2norm=True)

    nbytes = state_bytes("gated_deltanet", batch) + io_bytes("gated_deltanet", t)
    found = {"ours": _ours(ours, state, state0, batch, nbytes)}
    if mql == 1:
        found["ours_with_conv"] = Contender(lambda: (conv(), ours())[1], nbytes + conv_bytes)
    errors = {}
    try:
        found.update(_fla(q, k, v, g, beta, state0[1:batch + 1].clone() if initial else None,
                          lens, scale, nbytes))
    except Exception as e:  # noqa: BLE001 -- an anchor that cannot run here is recorded
        errors["fla"] = f"{type(e).__name__}: {e}"[:300]
    return found, errors


def _fla(q, k, v, g, beta, initial_state, lens, scale, nbytes) -> dict[str, Contender]:
    """fla's GDN on the step, in its varlen and batch layouts (equal lengths): the fused
    recurrent kernel for decodes, the chunked one for prefills. fla reads ``initial_state``
    (or zeros) and returns new final states, in request order."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    t, hv, dv = v.shape
    n, length = len(lens), lens[0]
    cu = _cu_seqlens(lens)
    common = dict(scale=scale, initial_state=initial_state, output_final_state=True,
                  use_qk_l2norm_in_kernel=True)

    def parts(res):
        o, final = res
        return {"out": o.reshape(t, hv, dv), "state": final}

    def varlen(x):
        return x[None]

    def batched(x):
        return x.view(n, length, *x.shape[1:])

    if max(lens) == 1:
        fn, extra = fused_recurrent_gated_delta_rule, {}
    else:
        fn = chunk_gated_delta_rule
        cu_cpu = cu.cpu()
        extra = {"cu_seqlens_cpu": cu_cpu}
        try:  # (fla computes them itself when this helper moves)
            from fla.ops.utils.index import prepare_chunk_indices

            extra["chunk_indices"] = prepare_chunk_indices(cu, 64, cu_seqlens_cpu=cu_cpu)
        except ImportError:
            pass
    found = {}
    name = "fla" if max(lens) == 1 else "fla_chunk"
    found[f"{name}_varlen"] = Contender(
        lambda: fn(q=varlen(q), k=varlen(k), v=varlen(v), g=varlen(g), beta=varlen(beta),
                   cu_seqlens=cu, **extra, **common), nbytes, parts, family="fla")
    if len(set(lens)) == 1:
        found[f"{name}_batch"] = Contender(
            lambda: fn(q=batched(q), k=batched(k), v=batched(v), g=batched(g),
                       beta=batched(beta), **common), nbytes, parts, family="fla")
    return found


def mamba2_case(batch, lens, initial=True) -> tuple[dict[str, Contender], dict[str, str]]:
    """The contenders of a Mamba2 step (ours, with its conv update for decodes, mamba-ssm's
    layouts) and the anchors that could not be built here."""
    from attn_ops.backends.ssm.mamba2 import mamba2_ssd

    c = M2
    t, mql = sum(lens), max(lens)
    qsl, slots, init, conv, conv_bytes = _step(batch, lens, initial,
                                               c["h"] * c["p"] + 2 * c["g"] * c["n"], c["kernel"])
    x = torch.randn(t, c["h"], c["p"], dtype=BF16, device=DEVICE)
    dt = torch.randn(t, c["h"], dtype=BF16, device=DEVICE)
    A = -torch.rand(c["h"], device=DEVICE)
    B = torch.randn(t, c["g"], c["n"], dtype=BF16, device=DEVICE)
    C = torch.randn(t, c["g"], c["n"], dtype=BF16, device=DEVICE)
    D = torch.randn(c["h"], device=DEVICE)
    dt_bias = torch.randn(c["h"], device=DEVICE)
    state = torch.randn(batch + 1, c["h"], c["p"], c["n"], dtype=F32, device=DEVICE) * 0.1
    state0 = state.clone()

    def ours():
        return mamba2_ssd(x=x, dt=dt, A=A, B=B, C=C, D=D, z=None, dt_bias=dt_bias, state=state,
                          query_start_loc=qsl, state_indices=slots, has_initial_state=init,
                          max_query_len=mql, dt_softplus=True, dt_min=0.0, dt_max=float("inf"))

    nbytes = state_bytes("mamba2", batch) + io_bytes("mamba2", t)
    found = {"ours": _ours(ours, state, state0, batch, nbytes)}
    if mql == 1:
        found["ours_with_conv"] = Contender(lambda: (conv(), ours())[1], nbytes + conv_bytes)
    errors = {}
    try:
        inputs = dict(x=x, dt=dt, A=A, B=B, C=C, D=D, dt_bias=dt_bias)
        if mql == 1:
            found.update(_mamba_decode(inputs, state0, slots, batch, nbytes))
        else:
            found.update(_mamba_prefill(inputs, lens, nbytes))
    except Exception as e:  # noqa: BLE001 -- an anchor that cannot run here is recorded
        errors["mamba_ssm"] = f"{type(e).__name__}: {e}"[:300]
    return found, errors


def _mamba_decode(inputs, state0, slots, batch, nbytes) -> dict[str, Contender]:
    """mamba-ssm's ``selective_state_update`` on the step: on contiguous states in request
    order, and through ``state_batch_indices`` on a copy of our slot pool."""
    from mamba_ssm.ops.triton.selective_state_update import selective_state_update

    p, n = M2["p"], M2["n"]
    x, dt, A = inputs["x"], inputs["dt"], inputs["A"]
    kw = dict(x=x, dt=dt[..., None].expand(-1, -1, p), A=A[:, None, None].expand(-1, p, n),
              B=inputs["B"], C=inputs["C"], D=inputs["D"][:, None].expand(-1, p),
              dt_bias=inputs["dt_bias"][:, None].expand(-1, p), dt_softplus=True)
    return _state_update_contenders(selective_state_update, kw, state0, slots, batch, nbytes)


def _state_update_contenders(update, kw, state0, slots, batch, nbytes) -> dict[str, Contender]:
    """mamba-ssm's ``selective_state_update`` (``update``) with its arguments ``kw``: on
    contiguous states in request order (``mamba_ssm``), and through ``state_batch_indices``
    on a copy of our slot pool (``mamba_ssm_indexed``)."""
    states = state0[1:batch + 1].clone()
    pool = state0.clone()
    return {
        "mamba_ssm": Contender(
            lambda: update(state=states, **kw), nbytes,
            parts=lambda out: {"out": out, "state": states},
            reset=lambda: states.copy_(state0[1:batch + 1]), family="mamba_ssm"),
        "mamba_ssm_indexed": Contender(
            lambda: update(state=pool, state_batch_indices=slots, **kw), nbytes,
            parts=lambda out: {"out": out, "state": pool[1:batch + 1]},
            reset=lambda: pool.copy_(state0), family="mamba_ssm")}


def _mamba_prefill(inputs, lens, nbytes) -> dict[str, Contender]:
    """mamba-ssm's ``mamba_chunk_scan_combined`` from zero states, in its varlen layout
    (``seq_idx`` marks each token's request) and its batch layout (equal lengths)."""
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

    x, dt, B, C = inputs["x"], inputs["dt"], inputs["B"], inputs["C"]
    t, h, p = x.shape
    n, length = len(lens), lens[0]
    common = dict(A=inputs["A"], chunk_size=MAMBA_CHUNK, D=inputs["D"],
                  dt_bias=inputs["dt_bias"], dt_softplus=True)
    seq_idx = torch.repeat_interleave(torch.arange(n, dtype=torch.int32, device=DEVICE),
                                      torch.tensor(lens, device=DEVICE))[None]
    cu = _cu_seqlens(lens)

    def parts(res):
        out, final = res
        return {"out": out.reshape(t, h, p), "state": final}

    found = {"mamba_ssm_varlen": Contender(
        lambda: mamba_chunk_scan_combined(x=x[None], dt=dt[None], B=B[None], C=C[None],
                                          seq_idx=seq_idx, cu_seqlens=cu,
                                          return_varlen_states=True, **common),
        nbytes, parts, family="mamba_ssm")}
    if len(set(lens)) == 1:
        def batched(u):
            return u.view(n, length, *u.shape[1:])

        found["mamba_ssm_batch"] = Contender(
            lambda: mamba_chunk_scan_combined(x=batched(x), dt=batched(dt), B=batched(B),
                                              C=batched(C), return_final_states=True,
                                              **common),
            nbytes, parts, family="mamba_ssm")
    return found


def mamba1_case(batch, lens, initial=True) -> tuple[dict[str, Contender], dict[str, str]]:
    """The contenders of a Mamba1 step (ours, with its conv update for decodes, mamba-ssm's)
    and the anchors that could not be built here."""
    from attn_ops.backends.ssm.mamba1 import mamba1_scan

    c = M1
    t, mql = sum(lens), max(lens)
    qsl, slots, init, conv, conv_bytes = _step(batch, lens, initial, c["d"], c["kernel"])
    x = torch.randn(t, c["d"], dtype=BF16, device=DEVICE)
    dt = torch.randn(t, c["d"], dtype=BF16, device=DEVICE) * 0.5 - 2.0
    z = torch.randn(t, c["d"], dtype=BF16, device=DEVICE)
    A = -torch.rand(c["d"], c["n"], device=DEVICE) - 0.5
    B = torch.randn(t, c["n"], dtype=BF16, device=DEVICE)
    C = torch.randn(t, c["n"], dtype=BF16, device=DEVICE)
    D = torch.randn(c["d"], device=DEVICE)
    dt_bias = torch.randn(c["d"], device=DEVICE) * 0.1
    state = torch.randn(batch + 1, c["d"], c["n"], dtype=F32, device=DEVICE) * 0.1
    state0 = state.clone()

    def ours():
        return mamba1_scan(x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias, state=state,
                           query_start_loc=qsl, state_indices=slots, has_initial_state=init,
                           max_query_len=mql, dt_softplus=True)

    nbytes = state_bytes("mamba1", batch) + io_bytes("mamba1", t)
    found = {"ours": _ours(ours, state, state0, batch, nbytes)}
    if mql == 1:
        found["ours_with_conv"] = Contender(lambda: (conv(), ours())[1], nbytes + conv_bytes)
    errors = {}
    try:
        inputs = dict(x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias)
        if mql == 1:
            found.update(_mamba1_decode(inputs, state0, slots, batch, nbytes))
        elif len(set(lens)) == 1:
            found.update(_mamba1_prefill(inputs, lens, nbytes))
    except Exception as e:  # noqa: BLE001 -- an anchor that cannot run here is recorded
        errors["mamba_ssm"] = f"{type(e).__name__}: {e}"[:300]
    return found, errors


def _mamba1_decode(inputs, state0, slots, batch, nbytes) -> dict[str, Contender]:
    """mamba-ssm's ``selective_state_update`` in its Mamba1 layout: on contiguous states in
    request order, and through ``state_batch_indices`` on a copy of our slot pool."""
    from mamba_ssm.ops.triton.selective_state_update import selective_state_update

    return _state_update_contenders(selective_state_update, dict(dt_softplus=True, **inputs),
                                    state0, slots, batch, nbytes)


def _mamba1_prefill(inputs, lens, nbytes) -> dict[str, Contender]:
    """mamba-ssm's ``selective_scan_fn`` from zero states on ``[B, D, L]`` (equal lengths)."""
    from mamba_ssm.ops.selective_scan_interface import selective_scan_fn

    n, length = len(lens), lens[0]
    d = inputs["x"].shape[1]

    def channels(u):  # [T, X] -> [B, X, L]
        return u.view(n, length, -1).transpose(1, 2).contiguous()

    args = dict(u=channels(inputs["x"]), delta=channels(inputs["dt"]), A=inputs["A"],
                B=channels(inputs["B"]), C=channels(inputs["C"]), D=inputs["D"],
                z=channels(inputs["z"]), delta_bias=inputs["dt_bias"], delta_softplus=True,
                return_last_state=True)

    def parts(res):
        out, last = res
        return {"out": out.transpose(1, 2).reshape(n * length, d), "state": last}

    return {"mamba_ssm_batch": Contender(lambda: selective_scan_fn(**args), nbytes, parts,
                                         family="mamba_ssm")}


def lightning_slopes(heads: int, layer: int, layers: int) -> torch.Tensor:
    """fla's lightning-attention decay rates for ``layer`` of ``layers`` (its
    ``chunk_lightning_attn`` derives them from the layer index: ``8 / H * (1 - l / L) * h``),
    so the anchor called with the layer index computes what ours computes from the rates."""
    return 8 / heads * (1 - layer / layers) * torch.arange(heads, dtype=F32, device=DEVICE)


def lightning_case(batch, lens, initial=True) -> tuple[dict[str, Contender], dict[str, str]]:
    """The contenders of a lightning-attention step (ours, fla's layouts) and the anchors that
    could not be built here."""
    from attn_ops.backends.ssm.lightning import lightning_attention

    c = LIGHT
    t, mql = sum(lens), max(lens)
    qsl, slots, init, _, _ = _step(batch, lens, initial, 8, 2)
    q, k, v = (torch.randn(t, c["h"], c["d"], dtype=BF16, device=DEVICE) * 0.3
               for _ in range(3))
    slope = lightning_slopes(c["h"], c["layer"], c["layers"])
    state = torch.randn(batch + 1, c["h"], c["d"], c["d"], dtype=F32, device=DEVICE) * 0.1
    state0 = state.clone()

    def ours():
        return lightning_attention(q=q, k=k, v=v, slope=slope, state=state,
                                   query_start_loc=qsl, state_indices=slots,
                                   has_initial_state=init, max_query_len=mql)

    nbytes = state_bytes("lightning", batch) + io_bytes("lightning", t)
    found = {"ours": _ours(ours, state, state0, batch, nbytes)}
    errors = {}
    try:
        found.update(_fla_lightning(q, k, v, state0[1:batch + 1].clone() if initial else None,
                                    lens, nbytes))
    except Exception as e:  # noqa: BLE001 -- an anchor that cannot run here is recorded
        errors["fla"] = f"{type(e).__name__}: {e}"[:300]
    return found, errors


def _fla_lightning(q, k, v, initial_state, lens, nbytes) -> dict[str, Contender]:
    """fla's lightning attention on the step (its fused recurrent kernel for decodes, its
    chunked one for prefills) in its varlen and batch layouts (equal lengths), unscaled
    (``scale=1``: MiniMax's q k^T is not scaled) and with the decay of ``LIGHT``'s layer."""
    from fla.ops.lightning_attn import chunk_lightning_attn, fused_recurrent_lightning_attn

    t, h, d = v.shape
    n, length = len(lens), lens[0]
    common = dict(layer_idx=LIGHT["layer"], num_layers=LIGHT["layers"], scale=1.0,
                  initial_state=initial_state, output_final_state=True)
    fn, name = ((fused_recurrent_lightning_attn, "fla") if max(lens) == 1
                else (chunk_lightning_attn, "fla_chunk"))

    def parts(res):
        o, final = res
        return {"out": o.reshape(t, h, d), "state": final}

    def batched(x):
        return x.view(n, length, *x.shape[1:])

    cu = _cu_seqlens(lens)
    found = {f"{name}_varlen": Contender(
        lambda: fn(q=q[None], k=k[None], v=v[None], cu_seqlens=cu, **common), nbytes, parts,
        family="fla")}
    if len(set(lens)) == 1:
        found[f"{name}_batch"] = Contender(
            lambda: fn(q=batched(q), k=batched(k), v=batched(v), **common), nbytes, parts,
            family="fla")
    return found


def cross_checks(contenders: dict[str, Contender], tol: dict[str, float]
                 ) -> tuple[dict[str, dict], dict[str, str]]:
    """Ours and every anchor once, each from the same initial states: each anchor's output and
    final states against ours (:func:`_common.cross_check`). An anchor that fails to run is
    dropped from ``contenders`` with its error."""
    ours = contenders["ours"]
    ours.reset()
    ref = {k: v.clone() for k, v in ours.parts(ours.run()).items()}
    checks, errors = {}, {}
    for name, c in list(contenders.items()):
        if c.family is None:
            continue
        try:
            c.reset()
            got = {k: v.clone() for k, v in c.parts(c.run()).items()}
            if DEVICE == "cuda":
                torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 -- an anchor that cannot run here is recorded
            errors[name] = f"{type(e).__name__}: {e}"[:300]
            del contenders[name]
            continue
        checks[name] = cross_check(ref, got, tol)
        del got
    del ref
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return checks, errors


def measure(mode, kind, contenders, errors, args, **shape) -> dict:
    """One point: cross-checks, then graph and eager timings, ratios guarded by the checks; the
    result row, and one printed line per contender and one of the ratios."""
    checks, run_errors = cross_checks(contenders, TOLERANCE[mode])
    errors.update(run_errors)
    fns = {n: c.run for n, c in contenders.items()}
    graph, eager, timing_errors = time_graph_and_eager(fns, args.rounds, eager=not args.no_eager)
    errors.update(timing_errors)
    families = {}
    for n, c in contenders.items():
        if c.family:
            families.setdefault(c.family, []).append(n)
    ratios = {"graph": anchor_ratios(graph, "ours", checks, families),
              "eager": anchor_ratios(eager, "ours", checks, families)}

    unit = "tbs" if mode == "decode" else "mtoks"
    tokens = shape["batch"] * shape.get("len", 1)

    def rate(name, ms):  # TB/s from the contender's bytes, M tokens/s from the step's tokens
        return contenders[name].nbytes / ms / 1e9 if unit == "tbs" else tokens / ms / 1e3

    row = {"mode": mode, "kind": kind, **shape,
           "graph_ms": graph, "eager_ms": eager,
           f"graph_{unit}": {n: rate(n, v) for n, v in graph.items()},
           f"eager_{unit}": {n: rate(n, v) for n, v in eager.items()},
           "speedup": ratios, "cross_check": checks, "errors": errors,
           "tolerance": TOLERANCE[mode]}
    if unit == "tbs":
        row["bytes"] = {n: c.nbytes for n, c in contenders.items()}
    label = f"{mode:7s} {kind:14s} " + " ".join(f"{k}={v}" for k, v in shape.items())
    shown = "{:6.2f} TB/s" if unit == "tbs" else "{:7.2f} Mtok/s"
    time_unit, scale = ("us", 1e3) if mode == "decode" else ("ms", 1.0)

    def timed(name, ms):
        if name not in ms:
            return f"{'-':>10s} {'':>12s}"
        return f"{ms[name] * scale:7.3f} {time_unit} " + shown.format(rate(name, ms[name]))

    for name, c in contenders.items():
        check = checks.get(name)
        print(f"{label} {name:18s} graph {timed(name, graph)} | eager {timed(name, eager)}"
              + (f" | {check_text(check)}" if c.family else ""), flush=True)
    if checks:
        print(f"{label} ours: graph {ratios_text(ratios['graph'])} | eager "
              f"{ratios_text(ratios['eager'])}", flush=True)
    for name, err in errors.items():
        print(f"{label} {name}: {err}", flush=True)
    return row


def main() -> None:
    parser = gpu_parser(__doc__, "bench_ssm_h200.json", page=16, rounds=3, quick=False)
    parser.add_argument("--only", nargs="*", default=["decode", "prefill"])
    parser.add_argument("--batches", type=int, nargs="+", default=list(DECODE_BATCHES))
    parser.add_argument("--prefills", nargs="+", default=[f"{b}x{s}" for b, s in PREFILLS],
                        metavar="BxL", help="prefill points: B requests of L tokens")
    parser.add_argument("--kinds", nargs="+",
                        default=["gated_deltanet", "mamba2", "mamba1", "lightning"])
    parser.add_argument("--without", nargs="*", default=[],
                        help="contenders not to run, by name or anchor family (fla, mamba_ssm, "
                             "copy, ours_with_conv, ...)")
    parser.add_argument("--no-eager", action="store_true",
                        help="CUDA-graph replays only (a tuning sweep)")
    args = parser.parse_args()
    from attn_ops.tuning import default_tuning

    tuning = dataclasses.asdict(default_tuning().ssm)  # (ATTN_OPS_TUNING applied: the sweeps)
    rows = []
    cases = {kind: make for kind, make in
             (("gated_deltanet", gdn_case), ("mamba2", mamba2_case), ("mamba1", mamba1_case),
              ("lightning", lightning_case))
             if kind in args.kinds}

    def kept(contenders):
        return {n: c for n, c in contenders.items()
                if n == "ours" or (n not in args.without and c.family not in args.without)}

    def save(complete=False):
        write_result("bench_ssm", args.out, quiet=not complete, rows=rows, complete=complete,
                     tuning=tuning, tolerance=TOLERANCE,
                     method="per point: ours and each anchor run once from the same states and "
                            "cross-checked; then CUDA-graph replays (do_bench_cudagraph "
                            "medians) and eager back-to-back calls, contenders interleaved "
                            "over rotating rounds, medians; ratios = anchor / ours time, only "
                            "where the anchor agreed")

    points = [("decode", kind, batch, 1) for kind in cases for batch in args.batches
              if "decode" in args.only]
    points += [("prefill", kind, *(int(v) for v in p.split("x"))) for kind in cases
               for p in args.prefills if "prefill" in args.only]
    for mode, kind, batch, length in points:
        shape = {"batch": batch} if mode == "decode" else {"batch": batch, "len": length}
        try:
            with torch.no_grad():
                contenders, errors = cases[kind](batch, [length] * batch,
                                                 initial=mode == "decode")
                if mode == "decode":
                    contenders["copy"] = _copy(state_bytes(kind, batch))
                rows.append(measure(mode, kind, kept(contenders), errors, args, **shape))
            del contenders
        except Exception as e:  # noqa: BLE001 -- a point that fails is recorded, the rest run
            error = f"{type(e).__name__}: {e}"[:300]
            rows.append({"mode": mode, "kind": kind, **shape, "failed": error})
            print(f"{mode:7s} {kind:14s} {shape}: failed: {error}", flush=True)
        save()
        torch.cuda.empty_cache()
    save(complete=True)


if __name__ == "__main__":
    main()
