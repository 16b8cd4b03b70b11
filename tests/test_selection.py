"""Selector, registry and reasons: simulated platforms, overrides, plugins, pinned reason text."""

import os
import subprocess
import sys

import expecttest
import pytest
import torch

from attn_ops import (AttentionConfig, AttentionSpec, Backend, BackendNotSupportedError,
                      KVCacheDType, LayerKind, NoBackendError, Platform, get_backend_class,
                      priority_list, register_backend, select_backend)
from attn_ops.backends.reference import ReferenceBackend
from attn_ops.capabilities import PackageRequirement
from attn_ops.registry import list_backends, resolve_name

CPU = Platform.parse("cpu")
SPEC = AttentionSpec(num_heads=8, num_kv_heads=2, head_dim=64, dtype=torch.float32)


def reasons_text(backend, spec, platform=CPU):
    return "\n".join(f"{r.code}: {r}" for r in
                     get_backend_class(backend).not_supported_reasons(spec, platform))


class TestReasons(expecttest.TestCase):
    def test_unsupported_features_of_cpu_backends(self):
        mla = AttentionSpec.mla(4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                                v_head_dim=16, dtype=torch.float32)
        self.assertExpectedInline(reasons_text("CPU_ATTN", mla), """\
feature:mla: mla is not supported""")
        cross = SPEC.with_(attn_type="encoder_decoder")
        self.assertExpectedInline(reasons_text("REFERENCE", cross), """attn_type: attn_type=encoder_decoder not in {decoder, encoder_only}""")
        self.assertExpectedInline(reasons_text("CPU_ATTN", SPEC.with_(head_dim=2048)), """\
head_dim: head_dim=2048 not in multiples of 1 in [1, 1024]""")
        self.assertExpectedInline(reasons_text("CPU_ATTN", SPEC, Platform.parse("cuda:9.0")), """\
platform: platform cuda not in {cpu}""")

    def test_planned_backends_say_not_implemented_and_missing_packages(self):
        text = reasons_text("ROCM_ATTN", SPEC, Platform.parse("rocm:gfx942"))
        self.assertIn("not_implemented: ROCM_ATTN is not implemented yet (planned: ROCm support)",
                      text)
        self.assertExpectedInline(reasons_text("XPU_ATTN", SPEC), """\
platform: platform cpu not in {xpu}
not_implemented: XPU_ATTN is not implemented yet (planned: XPU support)""")

    def test_missing_and_too_old_packages_are_reasons_not_import_errors(self):
        missing = PackageRequirement("no-such-dist", "no_such_module_xyz", "1.0")
        self.assertExpectedInline(str(missing.reason("X")), """\
package no-such-dist is not installed; pip install 'no-such-dist>=1.0'""")
        from attn_ops.capabilities import package_version

        old = PackageRequirement("torch", "torch", "99.0")
        self.assertEqual(old.reason("X").code, "package_too_old")
        self.assertIn(f"torch=={package_version('torch')} is older than 99.0",
                      old.reason("X").message)
        self.assertIsNone(PackageRequirement("torch", "torch", "2.0").reason("X"))
        new = PackageRequirement("torch", "torch", "2.0", max_version="2.1")
        self.assertEqual(new.reason("X").code, "package_too_new")
        self.assertIn("is newer than the supported <2.1", new.reason("X").message)

    def test_hint_names_a_backend_that_supports_it(self):
        class NoWindow(ReferenceBackend):
            name = "NO_WINDOW"
            capabilities = ReferenceBackend.capabilities.__class__(
                **{**ReferenceBackend.capabilities.__dict__,
                   "features": frozenset()})

        with register_backend("NO_WINDOW", NoWindow):
            sel = select_backend(SPEC.with_(sliding_window=8), CPU)
            (cand,) = [c for c in sel.candidates if c.name == "NO_WINDOW"]
            self.assertTrue(str(cand.reasons[0]).startswith(
                "sliding_window is not supported; supported by CPU_ATTN, FLEX_ATTENTION, "
                "REFERENCE"),
                cand.reasons[0])

    def test_forced_invalid_backend_raises_with_every_reason(self):
        with self.assertRaises(BackendNotSupportedError) as ctx:
            select_backend(SPEC.with_(sliding_window=4, use_alibi=True), CPU,
                           AttentionConfig(backend="FLASHINFER"))
        msg = str(ctx.exception)
        self.assertIn("attention backend FLASHINFER (forced by AttentionConfig.backend) cannot "
                      "run", msg)
        self.assertIn("FLASHINFER: platform cpu not in {cuda}", msg)
        self.assertIn("; alibi is not supported", msg)
        self.assertIn("COMPOSITE_SM90: platform cpu not in {cuda}", msg)
        self.assertIn("FLASH_ATTN_DIFFKV: alibi is not supported", msg)

    def test_no_valid_backend_lists_every_reason(self):
        with self.assertRaises(NoBackendError) as ctx:  # no GPU backend computes in fp64
            select_backend(SPEC.with_(dtype=torch.float64), Platform.parse("cuda:9.0"))
        msg = str(ctx.exception)
        for name in ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION"):
            self.assertIn(f"  {name}: ", msg)


class TestPriorities(expecttest.TestCase):
    def test_priority_lists_per_platform_and_architecture(self):
        lines = [f"{p}: {', '.join(priority_list(SPEC, Platform.parse(p)))}"
                 for p in ("cpu", "cuda:8.0", "cuda:9.0", "cuda:10.0", "rocm:gfx942", "xpu")]
        lines.append("cuda:9.0 diff-v: " + ", ".join(
            priority_list(SPEC.with_(head_dim_v=32), Platform.parse("cuda:9.0"))))
        self.assertExpectedInline("\n".join(lines), """\
cpu: CPU_ATTN, FLEX_ATTENTION, REFERENCE
cuda:8.0: FLASHINFER, FLASH_ATTN, TRITON_ATTN, FLEX_ATTENTION, TREE_ATTN
cuda:9.0: COMPOSITE_SM90, FLASHINFER, FLASH_ATTN, TRITON_ATTN, FLEX_ATTENTION, TREE_ATTN
cuda:10.0: FLASHINFER, FLASH_ATTN, TRITON_ATTN, FLEX_ATTENTION, TREE_ATTN
rocm:gfx942: ROCM_AITER_FA, ROCM_ATTN, TRITON_ATTN, FLEX_ATTENTION
xpu: XPU_ATTN, TRITON_ATTN, FLEX_ATTENTION
cuda:9.0 diff-v: FLASH_ATTN_DIFFKV, COMPOSITE_SM90, FLASHINFER, FLASH_ATTN, TRITON_ATTN, FLEX_ATTENTION, TREE_ATTN""")

    def test_the_priority_list_is_policy_only(self):
        """What is installed decides reasons, never the order (the composite's own reasons say
        when FlashInfer or FA4 is missing)."""
        import importlib.util
        from unittest import mock

        real = importlib.util.find_spec
        orders = []
        for present in (None, object()):
            with mock.patch.object(importlib.util, "find_spec",
                                   lambda name, *a, p=present: p if name == "flashinfer"
                                   else real(name)):
                orders.append(priority_list(SPEC, Platform.parse("cuda:9.0")))
        self.assertEqual(orders[0], orders[1])

    def test_auto_selection_on_cpu_is_deterministic(self):
        picks = {select_backend(SPEC, CPU).backend for _ in range(3)}
        self.assertEqual(picks, {"CPU_ATTN"})
        self.assertEqual(select_backend(SPEC, CPU).block_size, 16)
        self.assertEqual(select_backend(SPEC.with_(block_size=32), CPU).block_size, 32)

    def test_platform_parsing(self):
        self.assertEqual(Platform.parse("cuda:sm100").capability, (10, 0))
        self.assertEqual(Platform.parse("cuda:9.0").capability, (9, 0))
        self.assertEqual(Platform.parse("rocm:gfx942").arch, "gfx942")
        with self.assertRaisesRegex(ValueError, "platform 'tpu' is not understood"):
            Platform.parse("tpu")

    def test_the_platform_of_a_device_is_where_its_tensors_run(self):
        from attn_ops import PlatformKind, platform_of

        for device in ("cpu", torch.device("cpu"), torch.zeros(1).device):
            self.assertIs(platform_of(device).kind, PlatformKind.CPU)
            self.assertFalse(platform_of(device).simulated)
        if torch.cuda.is_available():
            self.assertEqual(platform_of("cuda:0").capability,
                             torch.cuda.get_device_capability(0))


def test_override_precedence(monkeypatch):
    assert select_backend(SPEC, CPU).forced_by is None
    monkeypatch.setenv("ATTN_OPS_BACKEND", "reference")
    sel = select_backend(SPEC, CPU)
    assert (sel.backend, sel.forced_by) == ("REFERENCE", "ATTN_OPS_BACKEND")
    sel = select_backend(SPEC, CPU, AttentionConfig(backend=Backend.CPU_ATTN))
    assert (sel.backend, sel.forced_by) == ("CPU_ATTN", "AttentionConfig.backend")
    per_kind = AttentionConfig(backend="CPU_ATTN",
                               backend_per_kind={LayerKind.SLIDING_WINDOW: "REFERENCE"})
    sel = select_backend(SPEC.with_(sliding_window=4), CPU, per_kind)
    assert (sel.backend, sel.forced_by) == (
        "REFERENCE", "AttentionConfig.backend_per_kind[SLIDING_WINDOW]")
    assert select_backend(SPEC, CPU, per_kind).backend == "CPU_ATTN"
    monkeypatch.setenv("ATTN_OPS_BACKEND", "auto")
    assert select_backend(SPEC, CPU).forced_by is None


def test_unknown_backend_name_lists_valid_ones():
    with pytest.raises(ValueError, match="unknown attention backend 'NOPE'; valid names: "
                                         "COMPOSITE_SM90, FLASH_ATTN, FLASHINFER"):
        resolve_name("NOPE")


def test_register_backend_override_and_remove():
    class Mine(ReferenceBackend):
        name = "CPU_ATTN"

    handle = register_backend("cpu_attn", Mine)
    assert get_backend_class("CPU_ATTN") is Mine
    inner = register_backend("CPU_ATTN", "attn_ops.backends.reference:ReferenceBackend")
    assert get_backend_class("CPU_ATTN") is ReferenceBackend
    handle.remove()  # removing the older registration keeps the newer one
    assert get_backend_class("CPU_ATTN") is ReferenceBackend
    inner.remove()
    assert get_backend_class("CPU_ATTN").__name__ == "CPUAttnBackend"
    with register_backend("BRAND_NEW", Mine):
        assert "BRAND_NEW" in list_backends()
    assert "BRAND_NEW" not in list_backends()


def test_broken_plugin_path_is_a_reason_not_a_crash():
    with register_backend("BROKEN", "no_such_module_for_attn_ops:Backend"):
        sel = select_backend(SPEC, CPU)
        (cand,) = [c for c in sel.candidates if c.name == "BROKEN"]
        assert cand.reasons[0].code == "import_error"
        with pytest.raises(BackendNotSupportedError, match="cannot import BROKEN"):
            select_backend(SPEC, CPU, AttentionConfig(backend="BROKEN"))


@pytest.fixture
def toy_plugin(tmp_path, monkeypatch):
    """tests/plugins/attn_ops_toy_plugin as an installed distribution would appear: its module on
    sys.path and a dist-info declaring its entry point (what pip writes from its pyproject),
    for this test only -- a test plugin never shows up in a user's backend list."""
    from attn_ops.registry import refresh_plugins

    plugin = os.path.join(os.path.dirname(__file__), "plugins", "attn_ops_toy_plugin")
    info = tmp_path / "attn_ops_toy_plugin-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: attn-ops-toy-plugin\n"
                                   "Version: 0.1.0\n")
    (info / "entry_points.txt").write_text("[attn_ops.backends]\n"
                                           "TOY_ATTN = attn_ops_toy_plugin:ToyBackend\n")
    monkeypatch.syspath_prepend(plugin)
    monkeypatch.syspath_prepend(str(tmp_path))
    refresh_plugins()
    yield
    monkeypatch.undo()
    refresh_plugins()


def test_entry_point_plugin_is_discovered_and_selectable(toy_plugin):
    assert "TOY_ATTN" in list_backends()
    sel = select_backend(SPEC, CPU, AttentionConfig(backend="toy_attn"))
    assert sel.backend == "TOY_ATTN" and sel.backend_cls.__module__ == "attn_ops_toy_plugin"
    assert select_backend(SPEC, CPU).backend == "CPU_ATTN"  # plugins are not auto-selected


def test_no_test_plugin_without_it():
    assert "TOY_ATTN" not in list_backends()


_SIDE_EFFECTS = """
import sys, torch, torch._inductor.config as ic
keys = ("post_grad_custom_pre_pass", "post_grad_custom_post_pass", "custom_should_partition_ops")
config_before = [getattr(ic, k) for k in keys]
modules_before = set(sys.modules)
import attn_ops
ops_after_import = bool(attn_ops.ops._DEFINED)  # (resolvable on lookup, none defined yet)
spec = attn_ops.AttentionSpec(num_heads=4, head_dim=16)
for p in ("cpu", "cuda:9.0", "cuda:10.0", "rocm"):
    attn_ops.select_backend(spec, attn_ops.Platform.parse(p),
                            attn_ops.AttentionConfig(backend="REFERENCE"))
new = set(sys.modules) - modules_before
print(sorted(m for m in new if m.split(".")[0] in ("triton", "flashinfer", "flash_attn")),
      ops_after_import, [getattr(ic, k) for k in keys] == config_before)
"""


def test_import_and_selection_have_no_side_effects():
    """Importing attn_ops defines no op and changes no Inductor setting; selecting a backend
    on any platform imports no kernel package (availability is checked without importing)."""
    out = subprocess.run([sys.executable, "-c", _SIDE_EFFECTS], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[] False True", out


def test_spec_validation_errors_name_the_value():
    with pytest.raises(ValueError, match="num_heads=6 is not a multiple of num_kv_heads=4"):
        AttentionSpec(num_heads=6, num_kv_heads=4, head_dim=64)
    with pytest.raises(ValueError, match="head_dim=0 must be a positive int"):
        AttentionSpec(num_heads=4, head_dim=0)
    with pytest.raises(ValueError, match="logits_soft_cap=0.0 must be > 0"):
        AttentionSpec(num_heads=4, head_dim=8, logits_soft_cap=0.0)
    with pytest.raises(ValueError, match="is not a floating model dtype"):
        AttentionSpec(num_heads=4, head_dim=8, dtype=torch.int8)
    assert AttentionSpec(num_heads=4, head_dim=8, kv_cache_dtype="fp8_e4m3").kv_cache_dtype \
        is KVCacheDType.FP8_E4M3


def test_shared_memory_per_block_from_the_device_or_a_conservative_default(monkeypatch):
    """Kernels size their pipelines from it; torch names it only on NVIDIA GPUs."""
    from types import SimpleNamespace

    from attn_ops import platforms

    props = {0: SimpleNamespace(shared_memory_per_block_optin=232448), 1: SimpleNamespace()}
    monkeypatch.setattr(torch.cuda, "get_device_properties", props.__getitem__)
    platforms._shared_memory.cache_clear()
    try:
        assert platforms.shared_memory_per_block(torch.device("cuda", 0)) == 232448
        assert platforms.shared_memory_per_block(torch.device("cuda", 1)) == 64 << 10
    finally:
        platforms._shared_memory.cache_clear()
