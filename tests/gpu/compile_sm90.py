"""Compile, for a GPU this machine does not have, every Triton kernel launch a CPU test run makes.

Triton's interpreter (how the CPU suite runs the kernels) accepts code the compiler rejects --
a shape that is not a power of two, a tensor where a constexpr belongs, branches that return
different types -- so a kernel can pass every CPU test and fail its first GPU launch. This
runs the given tests in the interpreter, records each distinct launch (the kernel, its argument
types, its constexpr values, num_warps / num_stages), then compiles each for the target
(``sm_90`` by default, the H200) in a process without the interpreter, with the Triton that is
importable there (put the GPU machine's version first on ``PYTHONPATH`` to check that one):

    PYTHONPATH=/path/to/triton-3.6 python tests/gpu/compile_sm90.py tests/test_deepseek_v4.py -k triton

Prints one line a failing launch and a count; exits 1 when any launch fails to compile.
"""

import argparse
import importlib
import os
import pickle
import subprocess
import sys
import tempfile
from collections import Counter

_TYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64",
          "int8": "i8", "uint8": "u8", "int16": "i16", "int32": "i32", "int64": "i64",
          "bool": "i1", "float8_e4m3fn": "fp8e4nv", "float8_e5m2": "fp8e5",
          "uint16": "u16", "uint32": "u32", "uint64": "u64"}


def _arg_type(value) -> str | None:
    """Triton's signature type for a runtime argument (None: passed as a constexpr)."""
    import torch

    if isinstance(value, torch.Tensor):
        return "*" + _TYPES[str(value.dtype).removeprefix("torch.")]
    if value is None:
        return None
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"argument of type {type(value).__name__}")


def _is_constexpr(fn, name: str) -> bool:
    annotation = fn.__annotations__.get(name)
    return annotation is not None and "constexpr" in str(annotation)


def record(pytest_args: list[str], path: str) -> int:
    """Run ``pytest_args`` in the interpreter; write the distinct launches to ``path``."""
    os.environ["TRITON_INTERPRET"] = "1"
    import pytest
    from triton.runtime.interpreter import InterpretedFunction

    launches: dict = {}
    run = InterpretedFunction.run

    def recording(self, *args, grid, warmup, **kwargs):
        fn = self.fn
        options = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
        bound = dict(zip(self.arg_names, args))
        bound.update({k: v for k, v in kwargs.items() if k in self.arg_names})
        try:
            signature, constexprs = {}, {}
            for name in self.arg_names:
                value = bound.get(name)
                kind = None if _is_constexpr(fn, name) else _arg_type(value)
                if kind is None:
                    constexprs[name] = value
                else:
                    signature[name] = kind
            key = (fn.__module__, fn.__qualname__, tuple(signature.items()),
                   repr(sorted(constexprs.items())), tuple(sorted(options.items())))
            test = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]
            launches.setdefault(key, (fn.__module__, fn.__qualname__, signature,
                                      pickle.dumps(constexprs), options, test))
        except (TypeError, KeyError, pickle.PicklingError) as e:
            print(f"compile_sm90: not recorded {fn.__qualname__}: {e}", file=sys.stderr)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording
    code = pytest.main(["-q", "-p", "no:cacheprovider", *pytest_args])
    with open(path, "wb") as f:
        pickle.dump(list(launches.values()), f)
    return int(code)


def _jit_function(module: str, qualname: str):
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    while not hasattr(obj, "arg_names") or not hasattr(obj, "src"):
        obj = obj.fn  # autotuner / heuristics wrappers
    return obj


def compile_all(path: str, arch: int, verbose: bool = False) -> int:
    """Compile each recorded launch for ``sm_<arch>``; the number that failed."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    with open(path, "rb") as f:
        launches = pickle.load(f)
    target = GPUTarget("cuda", arch, 32)
    failed, skipped, per_kernel = 0, 0, Counter()
    for module, qualname, signature, constexprs, options, test in launches:
        try:
            fn = _jit_function(module, qualname)
        except (ImportError, AttributeError) as e:
            print(f"skipped {module}.{qualname}: not importable here ({e})")
            skipped += 1
            continue
        constexprs = pickle.loads(constexprs)
        names = fn.arg_names
        full = {n: signature.get(n, "constexpr") for n in names}
        # Pointers 16-byte aligned, as the launcher specializes a torch allocation's.
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
                 if full[n].startswith("*")}
        src = ASTSource(fn=fn, signature=full, attrs=attrs,
                        constexprs={(names.index(n),): v for n, v in constexprs.items()})
        per_kernel[qualname] += 1
        shown = {k: v for k, v in constexprs.items() if v is not None}
        try:
            triton.compile(src, target=target, options=options)
        except Exception as e:  # noqa: BLE001 -- every compiler error is a finding
            failed += 1
            kind, chain = type(e).__name__, []
            while e is not None:  # each source line the error passed through, then its cause
                lines = [x for x in str(e).strip().split("\n") if x.strip()]
                if e.__cause__ is not None and len(lines) > 2 and lines[-1].strip() == "^":
                    lines = [lines[0], lines[-2].strip()]  # "at L:C:", the line it points at
                chain.append(" ".join(" ".join(lines).split()))
                e = e.__cause__
            message = " | ".join(chain)
            message = message if len(message) < 700 else message[:200] + " ... " + message[-500:]
            print(f"FAILED {module}.{qualname} {options} {shown} (first launched by {test}): "
                  f"{kind}: {message}")
        else:
            if verbose:
                print(f"ok {qualname} {options} {shown}")
    print(f"compiled for sm_{arch} with Triton {triton.__version__}: "
          f"{len(launches) - failed - skipped} of {len(launches)} launches"
          + (f", {skipped} not importable" if skipped else "") + " "
          f"({len(per_kernel)} kernels: " + ", ".join(
              f"{k} x{n}" for k, n in sorted(per_kernel.items())) + ")")
    return failed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--verbose", action="store_true", help="a line for every launch")
    parser.add_argument("--records", metavar="PATH",
                        help="keep the recorded launches there (a pickle; --compile PATH "
                             "compiles them again without running the tests)")
    parser.add_argument("--compile", metavar="RECORDS",
                        help="compile the launches recorded in RECORDS; run no tests")
    args, pytest_args = parser.parse_known_args()
    if args.compile:
        sys.exit(1 if compile_all(args.compile, args.arch, args.verbose) else 0)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.records or os.path.join(tmp, "launches.pkl")
        code = record(pytest_args, path)
        print(f"compile_sm90: tests exited {code}; compiling their launches", flush=True)
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        done = subprocess.run([sys.executable, __file__, "--arch", str(args.arch),
                               "--compile", path] + ["--verbose"] * args.verbose, env=env)
    sys.exit(done.returncode)


if __name__ == "__main__":
    main()
