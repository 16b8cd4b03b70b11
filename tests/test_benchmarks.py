"""The benchmark scripts keep running (tiny --quick runs; no performance is asserted here:
performance claims come from full runs recorded in benchmarks/results/), and their rule holds:
a ratio to an anchor only where the anchor computed what we computed."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.mark.parametrize("script", ["bench_cpu_attn.py", "bench_op_overhead.py",
                                    "bench_compile_time.py", "bench_model_decode.py",
                                    "bench_model_decode.py --mla", "bench_hybrid_decode.py",
                                    "bench_prefix_cache.py --kind mamba1",
                                    "turboquant_accuracy.py", "bench_turboquant.py",
                                    "dsv4_memory.py", "bench_dsv4.py",
                                    "bench_hf.py --profile --backends FLEX_ATTENTION"])
def test_benchmark_quick_run_writes_json(script, tmp_path):
    out = tmp_path / "result.json"
    name, *flags = script.split()
    res = subprocess.run([sys.executable, str(BENCHMARKS / name), "--quick", *flags, "--out",
                          str(out)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    result = json.loads(out.read_text())
    assert result["quick"] is True and result["torch"] and result["commit"]


@pytest.mark.parametrize("script", sorted(p.name for pattern in ("bench_*.py", "profile_*.py",
                                                                  "sweep_*.py")
                                          for p in BENCHMARKS.glob(pattern)))
def test_every_benchmark_parses_its_flags(script, monkeypatch, capsys):
    """Every script, the GPU-only ones included, imports and answers --help here (a GPU round
    must not be where a broken script shows)."""
    import importlib.util

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    monkeypatch.setattr(sys, "argv", [script, "--help"])
    spec = importlib.util.spec_from_file_location(script[:-3], BENCHMARKS / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(SystemExit) as done:
        module.main()
    assert done.value.code == 0 and "usage" in capsys.readouterr().out


def test_an_anchor_that_disagrees_gets_no_ratio(monkeypatch):
    """The shared cross-check (benchmarks/_common.py): an anchor whose output or final state
    disagrees with ours beyond the tolerance gets no ratio -- None where it is recorded,
    "mismatch" where it is printed -- nor does its library's best layout, and the record keeps
    the errors; an anchor that agrees gets anchor time / our time."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import _common

    ours = {"out": torch.linspace(-1, 1, 32).view(4, 8), "state": torch.ones(2, 3)}
    agreeing = {"out": ours["out"] * (1 + 1e-4), "state": ours["state"].clone()}
    wrong_state = {"out": ours["out"].clone(), "state": torch.full((2, 3), 0.5)}
    tol = {"out": 1e-2, "state": 1e-3}
    checks = {"good": _common.cross_check(ours, agreeing, tol),
              "bad": _common.cross_check(ours, wrong_state, tol),
              "no_state": _common.cross_check(ours, {"out": ours["out"]}, tol)}
    assert checks["good"]["agree"] and not checks["bad"]["agree"]
    assert not checks["no_state"]["agree"] and "error" in checks["no_state"]["parts"]["state"]
    assert checks["bad"]["parts"]["out"]["agree"] and checks["bad"]["max_abs_err"] == 0.5
    assert checks["bad"]["parts"]["state"]["max_rel_err"] == 1.0
    times = {"ours": 1.0, "good": 2.0, "bad": 0.5, "no_state": 0.25}
    ratios = _common.anchor_ratios(times, "ours", checks, {"lib": ["good", "bad"]})
    assert ratios == {"good": 2.0, "bad": None, "no_state": None, "best_lib": None}
    text = _common.ratios_text(ratios)
    assert text == "vs good 2.00x, vs bad mismatch, vs no_state mismatch, vs best_lib mismatch"
    assert json.loads(json.dumps(checks))["bad"]["parts"]["state"]["max_abs_err"] == 0.5
    nan = torch.tensor([float("nan")])
    assert not _common.cross_check(nan, nan, 1.0)["agree"]  # (NaN never agrees, even with NaN)
    assert _common.checked_ratio(1.0, 3.0, None) is None  # (an unchecked anchor: no ratio)
    untimed = _common.checked_ratio(None, 3.0, checks["good"])  # (agreed, not timed: n/a)
    assert untimed != untimed and _common.ratio_text(untimed) == "n/a"


def test_bench_ssm_prints_mismatch_instead_of_a_ratio(monkeypatch, capsys):
    """bench_ssm's point: ours and each anchor from the same states, cross-checked before the
    timings; the anchor that computes something else shows "MISMATCH" and "mismatch" where a
    ratio would be, its row keeps the errors and null ratios (timings faked: no GPU here)."""
    import argparse

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_ssm

    monkeypatch.setattr(bench_ssm, "DEVICE", "cpu")
    monkeypatch.setattr(bench_ssm, "time_graph_and_eager", lambda fns, rounds, eager=True: (
        {n: 1.0 for n in fns}, {n: 2.0 for n in fns}, {}))
    x, state = torch.arange(1.0, 9.0).view(2, 4), torch.zeros(3, 4)

    def ours():
        state[1:] += x
        return x * 2

    def anchor(scale):
        return lambda: (x * scale, x.clone())

    contenders = {
        "ours": bench_ssm.Contender(ours, 8, lambda o: {"out": o, "state": state[1:]},
                                    reset=state.zero_),
        "right": bench_ssm.Contender(anchor(2), 8, lambda r: {"out": r[0], "state": r[1]},
                                     family="lib"),
        "wrong": bench_ssm.Contender(anchor(3), 8, lambda r: {"out": r[0], "state": r[1]},
                                     family="lib")}
    row = bench_ssm.measure("decode", "gated_deltanet", contenders, {},
                            argparse.Namespace(rounds=1, no_eager=False), batch=2)
    printed = capsys.readouterr().out
    assert "MISMATCH" in printed and "vs wrong mismatch" in printed
    assert "vs right 1.00x" in printed and "vs best_lib mismatch" in printed
    assert row["speedup"]["graph"] == {"right": 1.0, "wrong": None, "best_lib": None}
    assert row["cross_check"]["wrong"]["parts"]["out"]["max_abs_err"] == 8.0
    assert row["cross_check"]["right"]["agree"]


def test_hybrid_memory_reproduces_vllms_unified_block_for_qwen3_next():
    """vLLM's unified attention block for Qwen3-Next (36 GDN : 12 attention, 2 KV heads x 256
    bf16), from our GDN spec's state bytes: 1056 tokens with an fp32 recurrent state and 544
    with a bf16 one, at TP 1 and 2 alike (vLLM's logs and issue reports give these); a
    12-token request then holds 1056 tokens of KV a layer there and 16 here."""
    sys.path.insert(0, str(BENCHMARKS))
    import hybrid_memory as h

    for tp in (1, 2):
        token = h.attention_bytes_per_token(tp)
        assert h.vllm_block_size(h.gdn_state_bytes(tp, 4), token) == 1056
        assert h.vllm_block_size(h.gdn_state_bytes(tp, 2), token) == 544
    assert h.gdn_state_bytes(1, 4) == 3 * 8192 * 2 + 32 * 128 * 128 * 4
    kv, _ = h.request_bytes(12, 1, 4, 2048, vllm=True, prefix_cached=False)
    ours, _ = h.request_bytes(12, 1, 4, 2048, vllm=False, prefix_cached=False)
    assert (kv, ours) == (12 * 1056 * 2048, 12 * 16 * 2048)
