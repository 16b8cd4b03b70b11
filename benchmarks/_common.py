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
        # (the tunables changed from this device's defaults for the run, if any)
        "tuning_overrides": os.environ.get("ATTN_OPS_TUNING", ""),
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


# --- cross-checks: a ratio to an anchor only where it computed what we computed ---------------
#
# Every benchmark runs its anchors (the third-party kernels and modules it compares against) on
# the same inputs as ours in the same run, called by keyword -- a positional argument that lands
# in another parameter after a library's signature changes computes something else, silently,
# at some speed. Each anchor's outputs (and final recurrent states where there are any) are
# compared with ours against a stated tolerance; where they disagree no ratio is printed or
# recorded, only "mismatch" and the errors, since a speed ratio between two different
# computations means nothing.


def max_errors(ours: torch.Tensor, anchor: torch.Tensor) -> dict[str, float]:
    """``max_abs_err`` = max |ours - anchor|, ``max_rel_err`` = that over max |anchor| (the
    error measured against the size of the values: robust where many values are near zero),
    ``rel_l2_err`` = ||ours - anchor|| / ||anchor||, and ``nonfinite`` (elements not finite on
    either side), computed in fp32 (fp64 for fp64 inputs)."""
    dtype = torch.float64 if torch.float64 in (ours.dtype, anchor.dtype) else torch.float32
    a, b = ours.detach().to(dtype).flatten(), anchor.detach().to(dtype).flatten()
    finite = torch.isfinite(a) & torch.isfinite(b)
    nonfinite = int((~finite).sum().item())
    a, b = torch.where(finite, a, 0), torch.where(finite, b, 0)
    diff = (a - b).abs()
    err = diff.max().item() if diff.numel() else 0.0
    scale = b.abs().max().item() if b.numel() else 0.0
    norm = b.norm().item()
    return {"max_abs_err": err, "max_rel_err": err / scale if scale else (0.0 if not err
                                                                           else float("inf")),
            "rel_l2_err": diff.norm().item() / norm if norm else (0.0 if not err
                                                                   else float("inf")),
            "anchor_max_abs": scale, "nonfinite": nonfinite}


def cross_check(ours, anchor, tol) -> dict:
    """Whether ``anchor`` computed what ``ours`` did: both a tensor, or dicts of named parts
    (``{"out": ..., "state": ...}``); ``tol`` the largest ``max_rel_err`` (see
    :func:`max_errors`) each part may have, one float for all or ``{part: float}``.

    Every part ``tol`` names (or, with one float, every part either side has) is compared; a
    part missing on one side, of another element count, or not finite disagrees (parts of the
    same element count are compared flattened: a layout the caller did not undo shows as a
    disagreement, never as agreement). Returns ``{"agree", "max_abs_err", "max_rel_err",
    "parts": {part: errors + "tolerance" + "agree" (or "error")}}``, JSON-ready."""
    if torch.is_tensor(ours) or torch.is_tensor(anchor):
        ours, anchor = {"out": ours}, {"out": anchor}
    names = list(tol) if isinstance(tol, dict) else sorted(set(ours) | set(anchor))
    parts, agree = {}, True
    for name in names:
        limit = tol[name] if isinstance(tol, dict) else tol
        a, b = ours.get(name), anchor.get(name)
        if a is None or b is None:
            parts[name] = {"agree": False, "tolerance": limit,
                           "error": f"{'ours' if a is None else 'the anchor'} has no {name!r}"}
        elif a.numel() != b.numel():
            parts[name] = {"agree": False, "tolerance": limit,
                           "error": f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}"}
        else:
            e = max_errors(a, b)
            parts[name] = {**e, "tolerance": limit,
                           "agree": e["nonfinite"] == 0 and e["max_rel_err"] <= limit}
        agree = agree and parts[name]["agree"]
    worst = [p for p in parts.values() if "max_abs_err" in p]
    inf = float("inf")
    return {"agree": agree and bool(parts),
            "max_abs_err": max((p["max_abs_err"] for p in worst), default=inf),
            "max_rel_err": max((p["max_rel_err"] for p in worst), default=inf),
            "parts": parts}


def check_text(check: dict | None) -> str:
    """``agree (max rel err out 1.2e-03, state 3.0e-06)`` / ``MISMATCH (...)`` / ``unchecked``."""
    if check is None:
        return "unchecked"
    errs = ", ".join(f"{n} {p['max_rel_err']:.1e}" if "max_rel_err" in p else f"{n}: {p['error']}"
                     for n, p in check["parts"].items())
    return f"{'agree' if check['agree'] else 'MISMATCH'} (max rel err {errs})"


def checked_ratio(ours_time: float | None, anchor_time: float | None,
                  check: dict | None) -> float | None:
    """``anchor_time / ours_time`` (above 1: ours is faster); None -- no ratio -- where the
    anchor's cross-check is missing or disagreed; NaN where it agreed but a time is missing
    (a contender that could not be timed that way)."""
    if check is None or not check.get("agree"):
        return None
    if not ours_time or not anchor_time:
        return float("nan")
    return anchor_time / ours_time


def ratio_text(ratio: float | None) -> str:
    """``1.23x``; ``mismatch`` where :func:`checked_ratio` refused the ratio, ``n/a`` where a
    time is missing."""
    if ratio is None:
        return "mismatch"
    return "n/a" if ratio != ratio else f"{ratio:.2f}x"


def anchor_ratios(times: dict[str, float], ours: str, checks: dict[str, dict],
                  families: dict[str, list[str]] | None = None) -> dict[str, float | None]:
    """Guarded ratios (:func:`checked_ratio`) of ``ours`` against every checked anchor, and
    per family (``{"fla": ["fla_varlen", "fla_batch"]}``: one library's layouts of the same
    computation) against its fastest layout, as ``best_<family>``: the anchor's best layout
    counts, and only if every layout of it agreed with ours -- a family with a disagreeing
    layout gets no ratio."""
    out = {name: checked_ratio(times.get(ours), times.get(name), check)
           for name, check in checks.items()}
    for family, names in (families or {}).items():
        checked = [n for n in names if n in checks]
        if checked:
            best = min((n for n in checked if n in times), key=times.get, default=None)
            agree = all(checks[n]["agree"] for n in checked)
            out[f"best_{family}"] = checked_ratio(times.get(ours), times.get(best),
                                                  {"agree": agree})
    return out


def ratios_text(ratios: dict[str, float | None]) -> str:
    """``vs fla_varlen 1.23x, vs best_fla mismatch``."""
    return ", ".join(f"vs {name} {ratio_text(r)}" for name, r in ratios.items())


# --- GPU timing: device time (CUDA-graph replays) and eager time, side by side --------------


def eager_ms(fn, budget_s: float = 0.05, warmup: int = 3) -> float:
    """Milliseconds a call of ``fn`` issued back to back (:func:`back_to_back_us`: the device
    synchronized only around the batch), as an eager caller runs it: the host's launch work
    counts wherever it is slower than the device's. The call count fills about ``budget_s``."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    n = max(10, min(1000, int(budget_s / max(time.perf_counter() - t0, 1e-6))))
    return back_to_back_us(fn, n=n, warmup=0) / 1e3


def graph_ms(fn, rep_ms: int = 30) -> float:
    """Median milliseconds of ``fn`` as CUDA-graph replays (``do_bench_cudagraph``): device
    time, the host's launch work left out."""
    from triton.testing import do_bench_cudagraph

    return do_bench_cudagraph(fn, rep=rep_ms, return_mode="median")


def time_graph_and_eager(fns: dict, rounds: int, eager: bool = True
                         ) -> tuple[dict[str, float], dict[str, float], dict[str, str]]:
    """``(graph_ms, eager_ms, errors)`` of every contender: medians over ``rounds`` rounds,
    the contenders in a rotating order each round so drift hits all alike. A contender that
    fails (a capture it does not support, say) is dropped from that timing with its error
    recorded (``errors["<name> graph"]``), the others go on."""
    graph, eager_t, errors = {n: [] for n in fns}, {n: [] for n in fns}, {}
    names = list(fns)
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            for label, timer, samples in (("graph", graph_ms, graph),
                                          ("eager", eager_ms, eager_t if eager else None)):
                key = f"{n} {label}"
                if samples is None or key in errors:
                    continue
                try:
                    samples[n].append(timer(fns[n]))
                except Exception as e:  # noqa: BLE001 -- recorded; the other contenders go on
                    errors[key] = f"{type(e).__name__}: {str(e)[:300]}"
                    try:
                        torch.cuda.synchronize()
                    except Exception:  # noqa: BLE001 -- (the next timing reports it)
                        pass
    med = {label: {n: statistics.median(v) for n, v in samples.items() if v}
           for label, samples in (("graph", graph), ("eager", eager_t))}
    return med["graph"], med["eager"], errors
