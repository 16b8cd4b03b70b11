"""Where a chunked recurrent-state prefill spends its time on the GPU: the CUDA time of each
launch of our GDN, Mamba2, Mamba1 and lightning-attention prefills (``torch.profiler``), per
case, under each of ``--tunings`` (``ATTN_OPS_TUNING`` strings, applied in this one process;
``defaults``: none); beside it, ours and the anchors' (fla's ``chunk_gated_delta_rule`` and
``chunk_lightning_attn``, mamba-ssm's ``mamba_chunk_scan_combined``, each in its varlen and
batch layouts, called by keyword as ``bench_ssm.py`` builds them) device time, host launch time
and back-to-back time a call, and with ``--host-profile`` where our host time goes.

Every anchor's outputs and final states are first cross-checked against ours on the same
inputs (``bench_ssm.cross_checks``, ``bench_ssm.TOLERANCE``); an anchor that disagrees is
marked MISMATCH on its line, with its errors: its times are of another computation.

    python benchmarks/profile_ssm_prefill.py [--cases gdn:1x8192 mamba1:8x2048 ...]
        [--tunings defaults ssm.mamba2_num_stages=2 ...] [--host-profile]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import check_text  # noqa: E402
from bench_ssm import (TOLERANCE, cross_checks, gdn_case, lightning_case,  # noqa: E402
                       mamba1_case, mamba2_case)

CASES = {"gdn": gdn_case, "mamba2": mamba2_case, "mamba1": mamba1_case,
         "lightning": lightning_case}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cases", nargs="+",
                        default=["gdn:1x8192", "gdn:64x512", "mamba2:1x8192", "mamba2:64x512"])
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--tunings", nargs="+", default=["defaults"])
    parser.add_argument("--host-profile", action="store_true",
                        help="also where our call's host time goes (cProfile)")
    args = parser.parse_args()
    from attn_ops.tuning import ENV_TUNING

    for cfg in args.tunings:
        os.environ[ENV_TUNING] = "" if cfg == "defaults" else cfg
        print(f"## {cfg}", flush=True)
        try:
            profile_cases(args.cases, args.iters, args.host_profile)
        except Exception as e:  # noqa: BLE001 -- a configuration that fails is recorded
            print(f"   failed: {type(e).__name__}: {e}"[:300], flush=True)


def profile_cases(cases, iters: int, host_profile: bool = False) -> None:
    for case in cases:
        kind, shape = case.split(":")
        batch, length = (int(v) for v in shape.split("x"))
        make = CASES[kind]
        with torch.no_grad():
            contenders, errors = make(batch, [length] * batch, initial=False)
            contenders.pop("ours_with_conv", None)
            checks, failed = cross_checks(contenders, TOLERANCE["prefill" if length > 1
                                                                else "decode"])
        for name, err in {**errors, **failed}.items():
            print(f"== {case} {name}: failed: {err}", flush=True)
        for name, contender in contenders.items():
            fn = contender.run
            rows = _device_times(fn, iters)
            total = sum(t for _, t, _ in rows)
            host, wall = _host_and_wall(fn, iters)
            check = f"; {check_text(checks.get(name))}" if contender.family else ""
            print(f"== {case} {name}: {total / 1e3:.3f} ms of device time a call, {host:.3f} ms "
                  f"on the host to launch it, {wall:.3f} ms a call back to back{check}")
            if name == "ours":
                for key, t, n in sorted(rows, key=lambda r: -r[1])[:8]:
                    print(f"   {t / 1e3:8.3f} ms  x{n:<3d} {key[:90]}", flush=True)
                if host_profile:
                    _print_host_profile(fn, iters)


def _device_times(fn, iters: int) -> list[tuple[str, float, int]]:
    """``(kernel, device us a call, launches a call)`` of ``fn`` (``torch.profiler``)."""
    from torch.profiler import ProfilerActivity, profile

    fn()  # (compiles; an anchor's autotuning)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    return [(e.key, e.device_time_total / iters, e.count // iters)
            for e in prof.key_averages() if e.device_time_total > 0]


def _print_host_profile(fn, iters: int) -> None:
    """The host's time in ``fn``, by function (``cProfile``, the 15 largest own times)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    torch.cuda.synchronize()
    prof.enable()
    for _ in range(iters):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(15)


def _host_and_wall(fn, iters: int) -> tuple[float, float]:
    """``(host, wall)`` ms of a call: the median time the host takes to launch it from an idle
    GPU (nothing to wait for), and the event-timed time a call of ``iters`` back to back (the
    larger of the host and the device time when one hides the other)."""
    host = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return statistics.median(host), start.elapsed_time(end) / iters


if __name__ == "__main__":
    main()
