"""python -m attn_ops info / select / demo."""

import subprocess
import sys

import pytest

from attn_ops.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_info_lists_platform_versions_and_every_backend(capsys):
    code, out, _ = run(capsys, "info")
    assert code == 0
    assert "platform: cpu" in out and "torch " in out and "flashinfer-python" in out
    assert "  CPU_ATTN           available" in out
    assert "  FLASHINFER         unavailable: platform cpu not in {cuda}" in out
    assert "selected: CPU_ATTN" in out


def test_select_on_a_simulated_platform_prints_the_ranked_table(capsys):
    code, out, _ = run(capsys, "select", "--platform", "cpu", "--heads", "8", "--kv-heads", "2",
                       "--head-dim", "72", "--sliding-window", "128", "--dtype", "float32")
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == ("spec:     AttentionSpec(heads=8/2, head_dim=72, dtype=float32, "
                        "sliding_window=128)")
    assert "selected: CPU_ATTN (auto), block_size=16" in out
    assert any(line.startswith("1     CPU_ATTN           SELECTED") for line in lines)
    assert any(line.startswith("3     REFERENCE          available (lower priority)")
               for line in lines)


def test_select_with_no_valid_backend_explains_why(capsys):
    code, _, err = run(capsys, "select", "--platform", "cuda:9.0", "--head-dim", "512")
    assert code == 2
    assert "no attention backend can run AttentionSpec(heads=32/32, head_dim=512" in err
    assert "FLASHINFER: head_dim=512 not in {64, 128, 256}" in err
    assert "package flashinfer-python is not installed" in err


def test_forced_backend_flag_raises_with_reasons(capsys):
    code, _, err = run(capsys, "select", "--platform", "cpu", "--backend", "cpu_attn",
                       "--head-dim", "2048")
    assert code == 2
    assert "CPU_ATTN (forced by config) cannot run" in err and "head_dim=2048" in err


def test_demo_eager_checks_against_reference(capsys):
    code, out, _ = run(capsys, "demo", "--no-compile", "--layers", "2", "--steps", "4")
    assert code == 0, out
    assert "backend:  CPU_ATTN (block_size 16), eager" in out
    assert "-> PASS" in out and "tokens/s decode" in out


@pytest.mark.slow
def test_demo_compiled_subprocess():
    res = subprocess.run([sys.executable, "-m", "attn_ops", "demo", "--layers", "2", "--steps",
                          "4"], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "torch.compile(fullgraph=True)" in res.stdout and "-> PASS" in res.stdout
