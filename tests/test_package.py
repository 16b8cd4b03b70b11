"""The installable package: what its wheel holds, and what ``import attn_ops`` makes resolvable.

Both are derived from the sources: the folders come from pyproject.toml's package-dir mapping,
the ops from the ``define_op`` calls, so a new module, subpackage or op is checked without
editing this file.
"""

import ast
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from attn_ops.ops import OP_MODULES

tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PACKAGE_DIRS: dict[str, str] = PYPROJECT["tool"]["setuptools"]["package-dir"]


def _sources(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and "__pycache__" not in p.parts)


def _modules() -> dict[str, Path]:
    """Every module of the package: its import name and its source file."""
    modules = {}
    for package, folder in PACKAGE_DIRS.items():
        for path in _sources(ROOT / folder):
            if path.suffix == ".py":
                parts = [package, *path.relative_to(ROOT / folder).with_suffix("").parts]
                if parts[-1] == "__init__":
                    parts.pop()
                modules[".".join(parts)] = path
    return modules


def _called(call: ast.Call) -> str | None:
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None


def _defined_ops() -> dict[str, str]:
    """``{op name: defining module}`` from the sources: the calls of ``define_op`` and of the
    helpers that pass their own ``name`` parameter on to it (``define_mla_op``, ...)."""
    trees = {m: ast.parse(p.read_text(), str(p)) for m, p in _modules().items()}
    functions = [(m, f) for m, t in trees.items() for f in ast.walk(t)
                 if isinstance(f, ast.FunctionDef)]
    definers, helpers = {"define_op"}, set()
    while True:  # a helper of a helper is a helper too
        new = {(m, f.name) for m, f in functions if f.name not in definers and any(
            isinstance(c, ast.Call) and _called(c) in definers and c.args
            and isinstance(c.args[0], ast.Name)
            and c.args[0].id in {a.arg for a in f.args.args} for c in ast.walk(f))}
        if not new:
            break
        definers |= {name for _, name in new}
        helpers |= new
    ops, unnamed = {}, []
    helper_bodies = {id(c) for m, f in functions if (m, f.name) in helpers for c in ast.walk(f)}
    for module, tree in trees.items():
        for c in ast.walk(tree):
            if not isinstance(c, ast.Call) or _called(c) not in definers:
                continue
            if c.args and isinstance(c.args[0], ast.Constant) and isinstance(c.args[0].value,
                                                                            str):
                assert c.args[0].value not in ops, f"{c.args[0].value} is defined twice"
                ops[c.args[0].value] = module
            elif id(c) not in helper_bodies:
                unnamed.append(f"{module}:{c.lineno}")
    # A name computed at run time could not be listed in OP_MODULES ahead of the lookup.
    assert not unnamed, f"ops must be defined with a literal name, not at {unnamed}"
    return ops


def test_op_table_lists_every_defined_op():
    """OP_MODULES is what makes ``torch.ops.attn.<name>`` resolvable after ``import attn_ops``:
    it must name every op, each with the module whose import defines it."""
    defined = _defined_ops()
    assert defined, "no define_op call found"
    missing = {n: m for n, m in defined.items() if OP_MODULES.get(n) != m}
    stale = sorted(set(OP_MODULES) - set(defined))
    assert not missing and not stale, (
        f"attn_ops/ops.py OP_MODULES is out of date: add or fix {missing}, remove {stale}")


_RESOLVE = """
import json, sys
before = set(sys.modules)
import attn_ops
import torch
loaded = sorted(m for m in set(sys.modules) - before
                if m.startswith("attn_ops.") and m != "attn_ops.ops"
                or m.split(".")[0] in ("triton", "flashinfer", "flash_attn"))
# The module torch gives the ops of a namespace: FX code generation and Inductor's cache key
# refer to an op through it.
plain_module = type(torch.ops.aten).__module__ + ".attn"
resolved = {}
for name in json.loads(sys.argv[1]):
    packet = getattr(torch.ops.attn, name, None)
    resolved[name] = (packet is not None and packet.default is attn_ops.ops._DEFINED.get(name)
                      and packet.default.__module__ == plain_module)
print(json.dumps({"loaded": loaded, "resolved": resolved}))
"""


def test_import_attn_ops_makes_every_op_resolvable():
    """In a fresh process, ``import attn_ops`` alone loads no backend and no kernel package,
    and then every ``torch.ops.attn.<name>`` found in the sources resolves to the overload its
    ``define_op`` returned, named as torch names any namespace's ops."""
    names = sorted(_defined_ops())
    run = subprocess.run([sys.executable, "-c", _RESOLVE, json.dumps(names)], cwd=ROOT,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["loaded"] == [], "import attn_ops loaded these eagerly"
    assert [n for n in names if not result["resolved"][n]] == []


def test_wheel_holds_the_whole_package(tmp_path):
    """A wheel built from the sources holds every module and C / CUDA source of the mapped folders,
    each under the one ``attn_ops`` namespace, and nothing else (no top-level ``backends``,
    ``tests``, ``benchmarks``)."""
    pytest.importorskip("setuptools", minversion="68")
    # Build from a copy: an in-tree build reuses build/, whose stale files would end up in it.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", PYPROJECT["project"]["readme"]):
        shutil.copy(ROOT / name, src / name)
    for folder in set(PACKAGE_DIRS.values()):
        shutil.copytree(ROOT / folder, src / folder,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(tmp_path / "dist"), str(src)],
                   check=True, capture_output=True, text=True)
    (wheel,) = (tmp_path / "dist").glob("attn_ops-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"attn_ops"}, tops
    expected = {
        "/".join([*package.split("."), *p.relative_to(src / folder).parts])
        for package, folder in PACKAGE_DIRS.items() for p in _sources(src / folder)
        if p.suffix in (".py", ".c", ".cu")}
    assert "attn_ops/backends/cpu_attn_kernels.c" in expected
    assert "attn_ops/backends/turboquant/decode_kernels.cu" in expected
    assert sorted(expected - names) == []
