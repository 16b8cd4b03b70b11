"""Recurrent-state layers on the H200: our ops against flash-linear-attention (Gated DeltaNet)
and mamba-ssm (Mamba2), side by side in one run.

* ``decode`` -- one token per request, every request continuing from its state: the GDN op
  (Qwen3-Next shapes: 16 key / 32 value heads of 128, fp32 state) with its conv update (conv
  width 8192, kernel 4), and the Mamba2 op (80 heads x 64, d_state 128, 1 group, fp32 state)
  with its conv update (conv width 5376). Anchors: fla's ``fused_recurrent_gated_delta_rule``
  (q / k repeated to the value heads) and mamba-ssm's Triton ``selective_state_update`` on the
  same states (recurrence only). Bytes = every state read and written once (+ the step's
  inputs and outputs) -> TB/s against the 4.27 TB/s copy bandwidth and against ``copy``, a
  device-to-device copy of the same state bytes in the same run; CUDA-graph replays.
* ``prefill`` -- 1 x 8k, 8 x 2k, 64 x 512 tokens from zero states: the GDN op against fla's
  ``chunk_gated_delta_rule``, the Mamba2 op against mamba-ssm's ``mamba_chunk_scan_combined``
  (chunk 256), in M tokens/s; ``triton.testing.do_bench`` medians.

    python benchmarks/bench_ssm.py [--only decode prefill] [--batches ...]
        [--kinds gated_deltanet mamba2] [--without fla copy ...] [--rounds R] [--out PATH]
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_gpu_attention import gpu_parser, time_graph, write_result  # noqa: E402

BF16, F32 = torch.bfloat16, torch.float32
GDN = {"hk": 16, "hv": 32, "dk": 128, "dv": 128, "kernel": 4}
M2 = {"h": 80, "p": 64, "n": 128, "g": 1, "kernel": 4}


def _step(batch, lens, initial, conv_dim, kernel):
    """A step of ``batch`` requests with ``lens`` new tokens on slots 1..batch (initial states
    or not): ``(qsl, slots, init, conv, conv_bytes)``, ``conv()`` its causal conv update over
    ``conv_dim`` channels and the bytes that moves."""
    from attn_ops.backends.ssm.conv import causal_conv1d

    t = sum(lens)
    qsl = torch.zeros(batch + 1, dtype=torch.int32, device="cuda")
    qsl[1:] = torch.tensor(lens, device="cuda").cumsum(0)
    slots = torch.arange(1, batch + 1, dtype=torch.int32, device="cuda")
    init = torch.full((batch,), initial, dtype=torch.bool, device="cuda")
    x = torch.randn(t, conv_dim, dtype=BF16, device="cuda")
    w = torch.randn(conv_dim, kernel, dtype=BF16, device="cuda") * 0.3
    conv_state = torch.randn(batch + 1, kernel - 1, conv_dim, dtype=BF16, device="cuda")

    def conv():
        causal_conv1d(x, w, None, conv_state, qsl, slots, init, "silu")

    conv_bytes = batch * (kernel - 1) * conv_dim * 2 * 2 + t * conv_dim * 2 * 2
    return qsl, slots, init, conv, conv_bytes


def _copy(state_bytes):
    """A device-to-device copy of ``state_bytes`` (read + written): the bandwidth this size
    reaches, timed in the same run as the state updates."""
    src = torch.empty(state_bytes // 8, dtype=F32, device="cuda")
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def gdn_case(batch, lens, initial=True):
    from attn_ops.backends.ssm.gated_deltanet import gated_delta_rule

    c = GDN
    t = sum(lens)
    qsl, slots, init, conv, conv_bytes = _step(batch, lens, initial,
                                               2 * c["hk"] * c["dk"] + c["hv"] * c["dv"],
                                               c["kernel"])
    q = torch.randn(t, c["hk"], c["dk"], dtype=BF16, device="cuda")
    k = torch.randn(t, c["hk"], c["dk"], dtype=BF16, device="cuda")
    v = torch.randn(t, c["hv"], c["dv"], dtype=BF16, device="cuda")
    g = -torch.rand(t, c["hv"], device="cuda") * 0.1
    beta = torch.rand(t, c["hv"], device="cuda")
    state = torch.randn(batch + 1, c["hv"], c["dk"], c["dv"], dtype=F32, device="cuda") * 0.1
    mql = max(lens)

    def ours_recurrence():
        return gated_delta_rule(q, k, v, g, beta, state, qsl, slots, init, mql,
                                c["dk"] ** -0.5, True)

    def ours():
        conv()
        return ours_recurrence()

    fns = {"ours_with_conv": ours, "ours": ours_recurrence}
    state_bytes = batch * c["hv"] * c["dk"] * c["dv"] * 4 * 2
    io = t * (2 * c["hk"] * c["dk"] + 2 * c["hv"] * c["dv"]) * 2
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, \
            fused_recurrent_gated_delta_rule

        rep = c["hv"] // c["hk"]
        cu = qsl.long()
        qf, kf = (a.repeat_interleave(rep, 1)[None] for a in (q, k))
        s0 = state[1:].clone()
        fla = fused_recurrent_gated_delta_rule if mql == 1 else chunk_gated_delta_rule

        def anchor():
            return fla(qf, kf, v[None], g[None], beta[None], scale=c["dk"] ** -0.5,
                       initial_state=s0 if initial else None, output_final_state=True,
                       cu_seqlens=cu, use_qk_l2norm_in_kernel=True)

        fns["fla"] = anchor
    except Exception as e:  # noqa: BLE001 -- an anchor that cannot run here is recorded
        print(f"fla: {type(e).__name__}: {e}"[:200])
    return fns, {"ours_with_conv": state_bytes + io + conv_bytes, "ours": state_bytes + io,
                 "fla": state_bytes + io, "copy": state_bytes}


def mamba2_case(batch, lens, initial=True):
    from attn_ops.backends.ssm.mamba2 import mamba2_ssd

    c = M2
    t = sum(lens)
    qsl, slots, init, conv, conv_bytes = _step(batch, lens, initial,
                                               c["h"] * c["p"] + 2 * c["g"] * c["n"], c["kernel"])
    x = torch.randn(t, c["h"], c["p"], dtype=BF16, device="cuda")
    dt = torch.randn(t, c["h"], dtype=BF16, device="cuda")
    A = -torch.rand(c["h"], device="cuda")
    B = torch.randn(t, c["g"], c["n"], dtype=BF16, device="cuda")
    C = torch.randn(t, c["g"], c["n"], dtype=BF16, device="cuda")
    D = torch.randn(c["h"], device="cuda")
    dt_bias = torch.randn(c["h"], device="cuda")
    state = torch.randn(batch + 1, c["h"], c["p"], c["n"], dtype=F32, device="cuda") * 0.1
    mql = max(lens)

    def ours_recurrence():
        return mamba2_ssd(x, dt, A, B, C, D, None, dt_bias, state, qsl, slots, init, mql, True,
                          0.0, float("inf"))

    def ours():
        conv()
        return ours_recurrence()

    fns = {"ours_with_conv": ours, "ours": ours_recurrence}
    state_bytes = batch * c["h"] * c["p"] * c["n"] * 4 * 2
    io = t * (2 * c["h"] * c["p"] + c["h"] + 2 * c["g"] * c["n"]) * 2
    try:
        if mql == 1:
            from mamba_ssm.ops.triton.selective_state_update import selective_state_update

            s0 = state[1:].clone()
            args = (x, dt[..., None].expand(-1, -1, c["p"]),
                    A[:, None, None].expand(-1, c["p"], c["n"]), B, C)
            kw = {"D": D[:, None].expand(-1, c["p"]),
                  "dt_bias": dt_bias[:, None].expand(-1, c["p"]), "dt_softplus": True}
            fns["mamba_ssm"] = lambda: selective_state_update(s0, *args, **kw)
        else:
            from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

            seq_idx = torch.repeat_interleave(torch.arange(batch, device="cuda", dtype=torch.int32),
                                              torch.tensor(lens, device="cuda"))[None]
            fns["mamba_ssm"] = lambda: mamba_chunk_scan_combined(
                x[None], dt[None], A, B[None], C[None], 256, D=D, dt_bias=dt_bias,
                seq_idx=seq_idx, cu_seqlens=qsl.long(), dt_softplus=True,
                return_varlen_states=True)
    except Exception as e:  # noqa: BLE001
        print(f"mamba_ssm: {type(e).__name__}: {e}"[:200])
    return fns, {"ours_with_conv": state_bytes + io + conv_bytes, "ours": state_bytes + io,
                 "mamba_ssm": state_bytes + io, "copy": state_bytes}


def _agreement(fns):
    """Relative L2 distance between our prefill output and the anchor's (zero initial states,
    so both compute the same thing): the anchors double as a real-size cross-check."""
    anchor = [n for n in fns if n != "ours"]
    if not anchor:
        return float("nan")
    ours = fns["ours"]().float().flatten()
    theirs = fns[anchor[0]]()[0].float().flatten()
    return ((ours - theirs).norm() / theirs.norm()).item()


def main() -> None:
    from triton.testing import do_bench

    parser = gpu_parser(__doc__, "bench_ssm_h200.json", page=16, rounds=3, quick=False)
    parser.add_argument("--only", nargs="*", default=["decode", "prefill"])
    parser.add_argument("--batches", type=int, nargs="+",
                        default=[1, 8, 32, 64, 128, 256, 512, 1024])
    parser.add_argument("--kinds", nargs="+", default=["gated_deltanet", "mamba2"])
    parser.add_argument("--without", nargs="*", default=[],
                        help="columns not to time (e.g. fla: its decode faults at batch 1024)")
    args = parser.parse_args()
    from attn_ops.tuning import default_tuning

    tuning = dataclasses.asdict(default_tuning().ssm)  # (ATTN_OPS_TUNING applied: the sweeps)
    rows = []
    cases = {kind: make for kind, make in
             (("gated_deltanet", gdn_case), ("mamba2", mamba2_case)) if kind in args.kinds}
    if "decode" in args.only:
        for kind, make in cases.items():
            for batch in args.batches:
                fns, nbytes = make(batch, [1] * batch)
                if "copy" not in args.without:
                    fns["copy"] = _copy(nbytes["copy"])
                fns = {n: f for n, f in fns.items() if n not in args.without}
                ms = time_graph(fns, args.rounds)
                row = {"mode": "decode", "kind": kind, "batch": batch,
                       **{f"{n}_us": v * 1e3 for n, v in ms.items()},
                       **{f"{n}_tbs": nbytes[n] / v / 1e9 for n, v in ms.items()}}
                rows.append(row)
                print(f"decode {kind:14s} B={batch:<5d} " + "  ".join(
                    f"{n} {v * 1e3:7.1f} us {nbytes[n] / v / 1e9:5.2f} TB/s"
                    for n, v in ms.items()), flush=True)
                write_result("bench_ssm", args.out, quiet=True, rows=rows, complete=False,
                             tuning=tuning)
    if "prefill" in args.only:
        for kind, make in cases.items():
            for batch, length in ((1, 8192), (8, 2048), (64, 512)):
                fns, _ = make(batch, [length] * batch, initial=False)
                fns = {n: f for n, f in fns.items() if n not in args.without}
                fns.pop("ours_with_conv", None)
                samples = {n: [] for n in fns}
                for _ in range(args.rounds):
                    for n, fn in fns.items():
                        samples[n].append(do_bench(fn, rep=50, return_mode="median"))
                ms = {n: statistics.median(v) for n, v in samples.items()}
                tokens = batch * length
                agree = _agreement(fns)
                rows.append({"mode": "prefill", "kind": kind, "batch": batch, "len": length,
                             **{f"{n}_ms": v for n, v in ms.items()},
                             **{f"{n}_mtoks": tokens / v / 1e3 for n, v in ms.items()},
                             "rel_err_vs_anchor": agree})
                print(f"prefill {kind:14s} {batch}x{length:<6d} " + "  ".join(
                    f"{n} {v:8.3f} ms {tokens / v / 1e3:7.1f} Mtok/s" for n, v in ms.items())
                    + f"  rel err vs anchor {agree:.1e}", flush=True)
                write_result("bench_ssm", args.out, quiet=True, rows=rows, complete=False,
                             tuning=tuning)
    write_result("bench_ssm", args.out, rows=rows, complete=True, tuning=tuning)


if __name__ == "__main__":
    main()
