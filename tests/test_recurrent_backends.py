"""The recurrent-state family in the registry and the selector: a backend a layer kind,
generated from ``RECURRENT_BACKENDS`` (a new kind enrolls itself), capabilities as data with
reasons naming the values, per-kind overrides that attention forcing never reaches, a plugin
of a kind selected and run by the layer, and the CLI's ``--<kind>`` flags."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attn_ops import AttentionConfig, AttentionSpec, register_backend, select_backend
from attn_ops.backends.ssm import spec as ssm
from attn_ops.backends.ssm.backend import GatedDeltaNetBackend, RecurrentCapabilities
from attn_ops.backends.ssm.metadata import build_state_metadata
from attn_ops.platforms import Platform, PlatformKind
from attn_ops.registry import RECURRENT_BACKENDS, get_backend_class
from attn_ops.selector import (BackendNotSupportedError, NoBackendError, candidates_for)
from attn_ops.spec import LayerKind

SPECS = {"gated_deltanet": ssm.GatedDeltaNetSpec, "mamba2": ssm.Mamba2Spec,
         "mamba1": ssm.Mamba1Spec, "short_conv": ssm.ShortConvSpec,
         "lightning": ssm.LightningSpec}
CPU, H200 = Platform.parse("cpu"), Platform.parse("cuda:9.0")


def test_every_state_kind_has_a_spec_and_a_layer_kind():
    assert set(SPECS) == set(RECURRENT_BACKENDS)
    for kind, make in SPECS.items():
        assert make().kind == kind and make().layer_kind is LayerKind(kind)


@pytest.mark.parametrize("kind", sorted(RECURRENT_BACKENDS))
def test_a_state_kind_selects_its_backend_and_no_other_familys(kind):
    spec = SPECS[kind](dtype=torch.float32)
    backend = RECURRENT_BACKENDS[kind].value
    for platform in (CPU, H200):
        sel = select_backend(spec, platform)
        assert sel.backend == backend and sel.block_size is None
        assert get_backend_class(backend).kind == kind
        assert [c.name for c in candidates_for(spec, platform)] == [backend]
    attention = [c.name for c in candidates_for(AttentionSpec(num_heads=8, head_dim=64), CPU)]
    assert backend not in attention
    assert "layer_kind" in [r.code for r in get_backend_class(backend).not_supported_reasons(
        SPECS[next(k for k in SPECS if k != kind)](), CPU)]


@pytest.mark.parametrize("kind", sorted(RECURRENT_BACKENDS))
def test_a_platform_the_kernels_do_not_run_on_is_refused_naming_it(kind):
    with pytest.raises(NoBackendError, match=rf"no backend can run {kind} .* on xpu.*\n  "
                                             rf"{RECURRENT_BACKENDS[kind].value}: platform xpu "
                                             r"not in \{cpu, cuda\}"):
        select_backend(SPECS[kind](), Platform.parse("xpu"))


def test_attention_forcing_never_reaches_state_layers_and_their_own_forcing_says_why(
        monkeypatch):
    spec = ssm.GatedDeltaNetSpec(dtype=torch.float32)
    monkeypatch.setenv("ATTN_OPS_BACKEND", "REFERENCE")
    assert select_backend(spec, CPU, AttentionConfig(backend="CPU_ATTN")).backend == "GDN"
    config = AttentionConfig(backend_per_kind={LayerKind.GATED_DELTANET: "FLASHINFER"})
    with pytest.raises(BackendNotSupportedError,
                       match=r"backend FLASHINFER \(forced by AttentionConfig.backend_per_kind"
                             r"\[GATED_DELTANET\]\) cannot run gated_deltanet .*\n  FLASHINFER: "
                             r"FLASHINFER serves attention layers, not gated_deltanet"):
        select_backend(spec, CPU, config)
    with pytest.raises(BackendNotSupportedError, match=r"MAMBA2 serves mamba2 layers, not "
                                                       r"gated_deltanet"):
        select_backend(spec, CPU, AttentionConfig(
            backend_per_kind={LayerKind.GATED_DELTANET: "MAMBA2"}))
    with pytest.raises(BackendNotSupportedError, match=r"GDN serves gated_deltanet layers, not "
                                                       r"attention"):
        select_backend(AttentionSpec(num_heads=8, head_dim=64), CPU,
                       AttentionConfig(backend="GDN"))


class _CountingGDN(GatedDeltaNetBackend):
    """A plugin of the GDN kind: the built-in recurrence, counted; fp32 states only."""

    name = "COUNTING_GDN"
    capabilities = RecurrentCapabilities(platforms=frozenset({PlatformKind.CPU}),
                                         state_dtypes=frozenset({torch.float32}))
    calls: list[int] = []

    def recurrence(self, q, *args, **kwargs):
        type(self).calls.append(q.shape[0])
        return super().recurrence(q, *args, **kwargs)


def test_a_plugin_of_a_kind_is_chosen_per_kind_runs_the_layer_and_states_its_limits():
    from attn_ops.layers.ssm import GatedDeltaNet

    spec = ssm.GatedDeltaNetSpec(num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=6,
                                 dtype=torch.float32, chunk_size=4)
    config = AttentionConfig(backend_per_kind={LayerKind.GATED_DELTANET: "COUNTING_GDN"})
    with register_backend("COUNTING_GDN", _CountingGDN):
        assert "COUNTING_GDN" in [c.name for c in candidates_for(spec, CPU)]
        ours = GatedDeltaNet(spec, 24, config=config)
        builtin = GatedDeltaNet(spec, 24)
        assert (ours.backend, builtin.backend) == ("COUNTING_GDN", "GDN")
        builtin.load_state_dict(ours.state_dict())
        torch.manual_seed(0)
        with torch.no_grad():
            for p in ours.parameters():
                p.copy_(torch.randn_like(p) * 0.3)
        builtin.load_state_dict(ours.state_dict())
        x = torch.randn(7, 24)
        meta = build_state_metadata(np.array([0, 3, 7]), [0, 0], [1, 2], spec.chunk_size)
        a, b = spec.allocate(4), spec.allocate(4)
        _CountingGDN.calls.clear()
        with torch.no_grad():
            torch.testing.assert_close(ours(x, a, meta), builtin(x, b, meta))
        assert _CountingGDN.calls == [7]
        with pytest.raises(BackendNotSupportedError, match=r"COUNTING_GDN: state_dtype="
                                                           r"bfloat16 not in \{float32\}"):
            GatedDeltaNet(spec.__class__(**{**spec.__dict__, "state_dtype": torch.bfloat16}),
                          24, config=config)


@pytest.mark.parametrize("flag,backend", [("--gdn", "GDN"), ("--mamba2", "MAMBA2"),
                                          ("--mamba1", "MAMBA1"), ("--short-conv", "SHORT_CONV"),
                                          ("--lightning", "LINEAR")])
def test_select_and_info_show_every_state_kind(capsys, flag, backend):
    from attn_ops.cli import main

    assert main(["select", flag, "--platform", "cuda:9.0"]) == 0
    out = capsys.readouterr().out
    assert f"selected: {backend} (auto)" in out and "block_size" not in out
    assert main(["info", flag, "--platform", "xpu"]) == 2
    out = capsys.readouterr().out
    assert f"  {backend:<18} unavailable: platform xpu not in {{cpu, cuda}}" in out


@pytest.mark.parametrize("kind", ["gated_deltanet", "mamba2"])
def test_a_layers_tuning_reaches_its_ops(monkeypatch, kind):
    """A layer's ``AttentionConfig(tuning=...)`` is what its ops route with (the backend hands
    them its ``Tuning.ssm`` encoded), and a layer without one routes with the device's."""
    from attn_ops import routing
    from attn_ops.layers.ssm import GatedDeltaNet, Mamba2Mixer
    from attn_ops.tuning import Tuning, default_tuning

    seen = []
    real = routing.ssm_kernel
    monkeypatch.setattr(routing, "ssm_kernel", lambda *a, **k: seen.append(a) or real(*a, **k))
    if kind == "gated_deltanet":
        spec = ssm.GatedDeltaNetSpec(num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=6,
                                     dtype=torch.float32, chunk_size=4)
        make = lambda **kw: GatedDeltaNet(spec, 24, **kw)  # noqa: E731
    else:
        spec = ssm.Mamba2Spec(num_heads=4, head_dim=8, d_state=5, n_groups=2,
                              dtype=torch.float32, chunk_size=4)
        make = lambda **kw: Mamba2Mixer(spec, 24, **kw)  # noqa: E731
    tuned = Tuning().with_(ssm={"chunked_min_query_len": 3})
    meta = build_state_metadata(np.array([0, 3, 7]), [0, 0], [1, 2], spec.chunk_size)
    for layer, want in ((make(config=AttentionConfig(tuning=tuned)), 3),
                        (make(), default_tuning().ssm.chunked_min_query_len)):
        seen.clear()
        with torch.no_grad():
            layer(torch.randn(7, 24), spec.allocate(4), meta)
        routed = [args for args in seen if len(args) == 6]  # (the chunked-or-not choice)
        assert routed and all(args[-1] == want for args in routed), (seen, want)
