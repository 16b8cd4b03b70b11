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


def test_info_says_which_provider_serves_each_kernel(capsys, monkeypatch):
    import types

    monkeypatch.setitem(sys.modules, "flash_attn_interface", None)
    monkeypatch.setitem(sys.modules, "flash_mla", None)
    monkeypatch.setitem(sys.modules, "vllm.third_party.flashmla.flash_mla_interface", None)
    fa = types.ModuleType("vllm.vllm_flash_attn")
    fa.FA3_AVAILABLE = True
    monkeypatch.setitem(sys.modules, "vllm.vllm_flash_attn", fa)
    _, out, _ = run(capsys, "info")
    assert "  FlashAttention 3   from vLLM's vllm_flash_attn (vllm.vllm_flash_attn)\n" in out
    assert ("  FlashMLA           no provider (flash_mla is not installed; "
            "vllm.third_party.flashmla.flash_mla_interface is not installed)\n") in out


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
    assert "CPU_ATTN (forced by --backend) cannot run" in err and "head_dim=2048" in err
    assert "Unset --backend" in err


def test_demo_eager_checks_against_reference(capsys):
    code, out, _ = run(capsys, "demo", "--no-compile", "--layers", "2", "--steps", "4")
    assert code == 0, out
    assert "backend:  CPU_ATTN (block_size 16), eager" in out
    assert "-> PASS" in out and "tokens/s decode" in out


@pytest.mark.parametrize("kind", ["gated_deltanet", "mamba2"])
def test_hybrid_demo_checks_chunked_steps_against_one_prefill(capsys, kind):
    code, out, _ = run(capsys, "demo", "--hybrid", kind, "--no-compile", "--steps", "2",
                       "--prompt-lens", "20", "3")
    assert code == 0, out
    assert f"4 layers ({kind}, {kind}, {kind}, attention)" in out
    assert "-> PASS" in out and "state slot" in out


@pytest.mark.slow
def test_demo_compiled_subprocess():
    res = subprocess.run([sys.executable, "-m", "attn_ops", "demo", "--layers", "2", "--steps",
                          "4"], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "torch.compile(fullgraph=True)" in res.stdout and "-> PASS" in res.stdout


def test_info_prints_the_backend_table_even_when_the_forced_backend_cannot_run(capsys,
                                                                                monkeypatch):
    monkeypatch.setenv("ATTN_OPS_BACKEND", "FLASHINFER")
    code, out, _ = run(capsys, "info")
    assert code == 2
    assert "  CPU_ATTN           available" in out
    assert "  FLASHINFER         unavailable: platform cpu not in {cuda}" in out
    assert "selected: none -- attention backend FLASHINFER (forced by ATTN_OPS_BACKEND)" in out
    assert "tuning:   generic (unmeasured defaults)" in out


def test_select_can_assume_the_optional_packages_and_prints_each_parts_route(capsys):
    code, out, _ = run(capsys, "select", "--platform", "cuda:9.0", "--heads", "32",
                       "--kv-heads", "8", "--assume-installed", "--batch", "64x4096,1x8192:8192")
    assert code == 0, out
    assert "selected: COMPOSITE_SM90 (auto), block_size=128" in out
    assert "kernels:  prefill: FlashAttention 4; decode: FlashInfer FA2" in out
    assert "(optional packages assumed installed: --assume-installed)" in out
    assert "routes of COMPOSITE_SM90 for --batch 64x4096,1x8192:8192 (132 SMs" in out
    assert "decode part: 64 request(s), 64 query rows, up to 4096 keys -> FlashInfer FA2" in out
    assert "prefill part: 1 request(s), 8192 query rows, up to 8192 keys -> FlashAttention 4" \
        in out
    code, out, _ = run(capsys, "select", "--platform", "cuda:9.0", "--heads", "32", "--kv-heads",
                       "8", "--assume-installed", "--tuning", "H200", "--batch", "8x1024")
    assert "tuning NVIDIA H200 (measured)" in out
    assert "-> FlashAttention 4, tile 64x128 (0.48 waves at 1024 keys: FA4's decode tile)" in out
    code, out, _ = run(capsys, "select", "--platform", "cuda:9.0")  # as installed here
    assert "selected: COMPOSITE_SM90" not in out and "package flashinfer-python is not " \
        "installed" in out


def test_every_flag_has_help_and_shows_its_default():
    import argparse

    from attn_ops import cli

    parsers = []
    real = argparse.ArgumentParser.parse_args
    try:
        argparse.ArgumentParser.parse_args = lambda self, *a, **k: parsers.append(self) or \
            (_ for _ in ()).throw(SystemExit(0))
        with pytest.raises(SystemExit):
            cli.main([])
    finally:
        argparse.ArgumentParser.parse_args = real
    (root,) = parsers
    subs = [a for a in root._actions if isinstance(a, argparse._SubParsersAction)][0]
    for name, parser in [("", root), *subs.choices.items()]:
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            assert action.help, f"{name} {action.option_strings} has no help"
        assert "(default: 128)" in subs.choices["select"].format_help().replace("\n", " ") \
            or "default: 128" in subs.choices["select"].format_help()


def test_the_extras_install_what_the_selector_accepts():
    import tomllib
    from pathlib import Path

    from attn_ops.backends.flash_attn import GENERATIONS
    from attn_ops.backends.flashinfer import FLASHINFER_PACKAGE

    extras = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())[
        "project"]["optional-dependencies"]

    def spec_of(req):
        return (f"{req.distribution}>={req.min_version}"
                + (f",<{req.max_version}" if req.max_version else ""))

    assert extras["flashinfer"] == [spec_of(FLASHINFER_PACKAGE)]
    assert extras["flash-attn"] == [spec_of(GENERATIONS[4].package)]
    assert extras["triton"] == ["triton>=3.6"]


def test_select_mla_prints_the_step_split_and_each_forms_kernel(capsys):
    code, out, _ = run(capsys, "select", "--mla", "--heads", "128", "--platform", "cuda:9.0",
                       "--assume-installed", "--batch", "1x32768")
    assert code == 0, out
    assert "selected: COMPOSITE_MLA_SM90 (auto), block_size=64" in out
    assert "absorbed form: 1 request(s), 1 row(s) over the latent cache -- route: short " \
        "contexts or few requests -- FlashInfer MLA fa3 (sm90)" in out
    for heads, batch, kernel in ((128, "64x32768", "FlashMLA dense decode"),
                                 (16, "1x32768", "FlashAttention 3 MLA path")):
        code, out, _ = run(capsys, "select", "--mla", "--heads", str(heads), "--platform",
                           "cuda:9.0", "--assume-installed", "--batch", batch)
        absorbed = next(line for line in out.splitlines() if "absorbed form:" in line)
        assert kernel in absorbed, absorbed
    code, out, _ = run(capsys, "select", "--mla", "--heads", "128", "--platform", "cuda:9.0",
                       "--assume-installed", "--backend", "FLASHINFER_MLA", "--batch", "1x32768")
    assert "latent cache -- FlashInfer MLA fa3 (sm90)" in out
    code, out, _ = run(capsys, "select", "--mla", "--heads", "128", "--platform", "cuda:9.0",
                       "--assume-installed", "--backend", "TRITON_MLA", "--batch",
                       "1x32768,2x30000:4096")
    assert code == 0, out
    assert ("absorbed form: 1 request(s), 1 row(s) over the latent cache -- TRITON_MLA kernel, "
            "128 split(s) of each request's keys, 1 query x 64 head rows a program") in out
    assert ("MHA form: 2 request(s), 8192 new token(s) on FlashInfer ragged prefill; 51808 context "
            "row(s) in 13 chunk(s) of at most 4096") in out
