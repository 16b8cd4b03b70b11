"""The benchmark scripts keep running (tiny --quick runs; no performance is asserted here:
performance claims come from full runs recorded in benchmarks/results/)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.mark.parametrize("script", ["bench_cpu_attn.py", "bench_op_overhead.py",
                                    "bench_compile_time.py", "bench_model_decode.py",
                                    "bench_model_decode.py --mla", "bench_hybrid_decode.py"])
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
