"""Shared helpers for the benchmark scripts: interleaved timing, statistics, result JSON.

Timing method: every variant is run ``number[variant]`` times back to back (calibrated so one
batch lasts about the same time for every variant) and the mean per-call time of
that batch is one sample; one *round* takes one sample of every variant (in a rotating order, so
no variant always runs first or last); the reported figure is the median over ``rounds`` rounds,
after ``warmup`` untimed rounds. Interleaving means slow drift or a noisy neighbour on the
machine hits all variants alike, and ratios taken per round (``paired_ratio``) cancel most of it.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable

import torch

NOISY = 0.1  # other processes' CPU share above which a measurement is flagged and retried
RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def time_interleaved(fns: dict[str, Callable[[], object]], *, number: dict[str, int],
                     rounds: int, warmup: int = 2) -> dict[str, list[float]]:
    """Per-call seconds of each function: ``rounds`` samples, each the mean of ``number[name]``
    back-to-back calls."""
    names = list(fns)
    samples: dict[str, list[float]] = {n: [] for n in names}
    clock = time.perf_counter
    for r in range(warmup + rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            fn, k = fns[name], number[name]
            t0 = clock()
            for _ in range(k):
                fn()
            dt = (clock() - t0) / k
            if r >= warmup:
                samples[name].append(dt)
    return samples


def calibrate_number(fn: Callable[[], object], target_s: float, cap: int = 100_000) -> int:
    """How many calls make one sample last about ``target_s`` seconds."""
    fn()
    n = 1
    while True:
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        dt = time.perf_counter() - t0
        if dt >= target_s / 4 or n >= cap:
            return max(1, min(cap, int(n * target_s / max(dt, 1e-9))))
        n *= 4


def calibrate_all(fns: dict[str, Callable[[], object]], target_s: float,
                  cap: int = 100_000) -> dict[str, int]:
    """``calibrate_number`` for every function, so each sample of each lasts ~``target_s``."""
    return {name: calibrate_number(fn, target_s, cap) for name, fn in fns.items()}


def stats(xs: list[float]) -> dict[str, float]:
    """median / 25th / 75th percentile / min of a sample list (same unit as the input)."""
    xs = sorted(xs)
    q = statistics.quantiles(xs, n=4) if len(xs) >= 2 else [xs[0]] * 3
    return {"median": statistics.median(xs), "p25": q[0], "p75": q[2], "min": xs[0],
            "n": len(xs)}


def paired(a: list[float], b: list[float], op: str) -> dict[str, float]:
    """Stats of ``a[i] - b[i]`` or ``a[i] / b[i]`` over rounds (both sampled in the same round)."""
    vals = [x - y for x, y in zip(a, b)] if op == "-" else [x / y for x, y in zip(a, b)]
    return stats(vals)


def run_info(name: str) -> dict[str, object]:
    from attn_ops import current_platform

    plat = current_platform()
    return {
        "benchmark": name,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python"] + [shlex.quote(a) for a in sys.argv]),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": str(plat),
        "cpu": plat.device_name,
        "num_threads": torch.get_num_threads(),
        "num_interop_threads": torch.get_num_interop_threads(),
        "os_cpu_count": os.cpu_count(),
        "commit": _commit(),
    }


def _commit() -> str:
    """``git describe`` of the checkout (``-dirty`` when it has uncommitted changes); on a
    machine whose copy has no git metadata (the GPU machine), ``$ATTN_OPS_COMMIT``."""
    import subprocess

    if os.environ.get("ATTN_OPS_COMMIT"):
        return os.environ["ATTN_OPS_COMMIT"]

    try:
        return subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True,
                              text=True, cwd=os.path.dirname(os.path.abspath(__file__)),
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def cpu_bench_parser(name: str, doc: str):
    """The options every CPU benchmark takes: ``--out``, ``--quick``, ``--wait-idle``."""
    import argparse

    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--out", default=None,
                        help="result JSON path (default: benchmarks/results/%s_cpu.json, "
                             "or ..._cpu_quick.json with --quick)" % name)
    parser.add_argument("--quick", action="store_true", help="tiny run (a few seconds), for CI")
    parser.add_argument("--wait-idle", type=float, default=None, metavar="S",
                        help="wait up to S seconds for other processes to go quiet before each "
                             "measurement, and retry one taken while they were busy "
                             "(default: 60, 0 with --quick)")
    return parser


def wait_seconds(args) -> float:
    return args.wait_idle if args.wait_idle is not None else (0.0 if args.quick else 60.0)


def default_out(name: str, quick: bool = False) -> str:
    """``results/<name>_cpu.json``; ``--quick`` runs go to ``<name>_cpu_quick.json`` so a CI smoke
    test never overwrites the full results."""
    return os.path.join(RESULTS_DIR, f"{name}_cpu{'_quick' if quick else ''}.json")


def host_us(fn, n: int = 50, warmup: int = 1) -> float:
    """Mean host microseconds per call of ``fn`` (no device synchronization: for host-side
    work such as metadata builders), after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def back_to_back_us(fn, n: int = 200, warmup: int = 10) -> float:
    """Microseconds per call of ``fn``, ``n`` calls issued back to back with the device
    synchronized only before and after: the slower of host and device sets the pace."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def time_steps(fn, steps, device) -> float:
    """Median milliseconds of ``fn()`` (CUDA events on GPUs, wall clock on the CPU)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(steps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def decode_step_parser(doc: str, ctx: int, out_name: str):
    """The arguments of the whole-decode-step benchmarks (``bench_model_decode``,
    ``bench_hybrid_decode``): model depth, batch, context, timed steps, ``--quick`` (a CPU
    smoke run), ``--no-hf`` and the JSON path."""
    import argparse

    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--ctx", type=int, default=ctx)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-hf", action="store_true")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), out_name))
    return parser


def decode_step_device(args) -> tuple[str, torch.dtype]:
    """``(device, dtype)`` of a whole-step run: the GPU in bf16 where there is one, else (and
    with ``--quick``, which also shrinks batch, context and steps) the CPU in fp32."""
    device = "cpu" if args.quick or not torch.cuda.is_available() else "cuda"
    if args.quick:
        args.batch, args.ctx, args.steps = 4, 64, 3
    return device, torch.float32 if device == "cpu" else torch.bfloat16


def write_json(path: str, payload: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
        f.write("\n")
    print(f"\nwrote {os.path.relpath(path)}")


class CpuMonitor:
    """How busy the machine was with *other* processes while we measured.

    On a small machine a neighbour process costs far more than its share: torch's intra-op
    thread pool (OpenMP, one thread per core by default) waits at the end of every parallel
    region for its slowest thread, so when another process holds one core each parallel kernel
    can stall for a scheduler tick (~4 ms). ``others_cpu_fraction`` (0..1 of all cores) is
    recorded with the results so such runs can be recognised; above ~0.1 the numbers are not
    trustworthy.
    """

    def __init__(self) -> None:
        self.start()

    @staticmethod
    def _busy_s() -> float | None:
        try:
            with open("/proc/stat") as f:
                fields = [int(x) for x in f.readline().split()[1:]]
        except OSError:
            return None
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        busy = sum(fields[:8]) - idle  # user nice system idle iowait irq softirq steal
        return busy / os.sysconf("SC_CLK_TCK")

    @staticmethod
    def _own_s() -> float:
        t = os.times()
        return t.user + t.system

    def start(self) -> None:
        self._t0, self._busy0, self._own0 = time.perf_counter(), self._busy_s(), self._own_s()

    def others_cpu_fraction(self) -> float | None:
        busy = self._busy_s()
        if busy is None or self._busy0 is None:
            return None
        wall = time.perf_counter() - self._t0
        others = (busy - self._busy0) - (self._own_s() - self._own0)
        return max(0.0, others / (wall * (os.cpu_count() or 1)))


def wait_idle(max_wait_s: float, threshold: float = 0.1, window_s: float = 1.0) -> float | None:
    """Block (up to ``max_wait_s``) until other processes use <= ``threshold`` of the CPUs over
    a ``window_s`` window; returns the last measured fraction."""
    deadline = time.perf_counter() + max_wait_s
    while True:
        mon = CpuMonitor()
        time.sleep(window_s)
        frac = mon.others_cpu_fraction()
        if frac is None or frac <= threshold or time.perf_counter() >= deadline:
            return frac


def us(seconds: float) -> str:
    return f"{seconds * 1e6:9.2f}"


def time_quietly(fns: dict[str, Callable[[], object]], *, rounds: int, target_s: float,
                 wait_s: float, label: str) -> tuple[dict[str, list[float]], dict[str, object]]:
    """:func:`time_interleaved` after waiting for a quiet machine; a run during which other
    processes used more than ``NOISY`` of the CPUs is retried (up to 3 attempts), since a busy
    neighbour only inflates times. Returns the samples and how they were taken
    (``calls_per_sample``, ``others_cpu_fraction``, ``attempts``)."""
    attempts = 0
    while True:
        attempts += 1
        if wait_s:
            wait_idle(wait_s)
        number = calibrate_all(fns, target_s)
        mon = CpuMonitor()
        samples = time_interleaved(fns, number=number, rounds=rounds)
        others = mon.others_cpu_fraction()
        if not wait_s or others is None or others <= NOISY or attempts >= 3:
            return samples, {"calls_per_sample": number, "others_cpu_fraction": others,
                             "attempts": attempts}
        print(f"  {label}: other processes used {others:.0%} of the CPUs, retrying")
