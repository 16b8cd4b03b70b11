"""Fuzz: every op family gets a valid step, then ONE input at a time corrupted to an out-of-range
or inconsistent value (DESIGN.md, "Every input served or refused"). The contract:

* the call raises ``ValueError`` whose message names the corrupted input -- and leaves every
  untouched request's cache pages / state slots as they were or as the clean step leaves them,
  writing nothing outside its tensors; or
* it returns, and then, for a corruption local to some requests (a slot, a block id, a length,
  a query offset, a selection, a state slot): every other request's output rows are
  bit-identical to the clean run's, the touched requests' outputs are finite (integer outputs:
  only -1 or indices the request may reach); the pages / slots of untouched requests are
  bit-identical to the clean run's, unowned ones unchanged; for a corruption of the whole step
  (a dtype, the page size, ``max_query_len`` -- a bound, which never changes the answer): every
  output (and state) equals the clean run's within the dtype's tolerance -- served means served
  right.

Every cache, state and per-token input of a call sits inside a buffer with guard zones (as large
as the tensor, NaN or a sentinel) before and after it: a kernel writing just outside a tensor
changes a guard (reported, instead of corrupting the heap), one reading there reads NaN. On the
CPU, Triton kernels run in the interpreter under :class:`InterpreterMemcheck` (the interpreter
loads and stores through raw addresses: unchecked, an out-of-bounds store corrupts the test
process's heap and crashes it later, elsewhere): every access outside the launch's tensors (a
guarded one's guard zones included) is an ``OutOfBoundsAccess`` failure of that trial. Caches
start NaN in every page no request owns (a read of a wrong page shows) and finite in the pages
requests own (a skipped write leaves a finite stale value, as a reused page holds).

Targets come from the registry (every attention / MLA / sparse MLA backend that runs here, each
with the first of the candidate specs it serves), the indexer's paths (the op; on the CPU also
its Triton kernels in the interpreter, what the op runs on a GPU) and the recurrent ops' kernels
(``attn_ops.routing.Kernel.SSM_*``, forced through the routing). The far-out-of-range values
(``*_far`` kinds: 2**40, 2**30, 2**31 - 1) run last: a compiled kernel that follows one can
crash the process (an illegal address on a GPU, a segfault in a C kernel).

``TRIALS`` sets the corruptions per kind and target (``ATTN_OPS_FUZZ_SCALE=k`` multiplies them);
the session prints how many ran of each kind and how each was handled (``pytest -s``), and writes
them as JSON to ``$ATTN_OPS_FUZZ_REPORT`` when set (updated after every trial, so a crash keeps
what ran before it).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import math
import os
import random
import weakref
import zlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import pytest
import torch

from attn_ops import (Attention, AttentionConfig, AttentionSpec, BlockAllocator, MLAAttention,
                      build_batch, current_platform, get_backend_class)
from attn_ops.registry import MLA_BACKENDS, backend_family, list_backends

PLATFORM = current_platform()
ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
TRITON_HERE = importlib.util.find_spec("triton") is not None and (
    ON_GPU or os.environ.get("TRITON_INTERPRET") == "1")

SEED = 20_251_117
SCALE = max(1, int(os.environ.get("ATTN_OPS_FUZZ_SCALE", "1")))
# corruptions per kind and target (small for CI: the file runs in under a minute on 2 cores)
TRIALS = {
    "slot": 3,              # slot_mapping entry -> capacity, capacity + k, -7
    "block_table": 2,       # a used block-table entry -> num_blocks, -5
    "seq_len_beyond": 1,    # seq_lens[r] -> past what the block table covers
    "seq_len_zero": 1,      # seq_lens[r] -> 0 (a request with new tokens)
    "qsl_beyond": 1,        # query_start_loc entries past the step's rows (monotone)
    "qsl_nonmonotone": 2,   # query_start_loc[j] above the next / below the previous
    "max_query_len": 1,     # below the longest query
    "dtype": 2,             # q as float64 / another float; a state as int32 / float64
    "page_size": 1,         # metadata built for pages twice the cache's
    "topk_slot": 2,         # a selection entry -> capacity, -5
    "topk_hole": 1,         # a selection entry in the middle -> -1
    "topk_row": 1,          # a whole selection row -> -1
    "position": 3,          # indexer_slots position -> past the request, past the table, < 0
    "state_slot": 2,        # state_indices[r] -> num_slots, -3
    "c_table": 2,           # a V4 compressed block-table entry -> num_blocks, -5
    # far out of range (run last)
    "slot_far": 1,          # 2**40
    "block_table_far": 1,   # 2**30
    "topk_slot_far": 1,     # 2**30
    "position_far": 1,      # 2**30
    "state_slot_far": 1,    # 2**31 - 1
    "c_table_far": 1,       # 2**30
}
NAMES = {  # what a refusal must name (any of these)
    "slot": ("slot_mapping",), "block_table": ("block_table",),
    "seq_len_beyond": ("seq_lens", "seq_len"), "seq_len_zero": ("seq_lens", "seq_len"),
    "qsl_beyond": ("query_start_loc",), "qsl_nonmonotone": ("query_start_loc",),
    "max_query_len": ("max_query_len",), "dtype": ("dtype",), "page_size": ("block_size", "page"),
    "topk_slot": ("topk_slots",), "topk_hole": ("topk_slots",), "topk_row": ("topk_slots",),
    "position": ("positions",), "state_slot": ("state_indices",),
    "c_table": ("compressed_block_table",),
}
GLOBAL_KINDS = {"max_query_len", "dtype", "page_size"}
PAD = 2  # padding rows past each step's tokens
EXTRA_PAGES = 6  # pages no request owns (NaN)
UNOWNED, PADDING = "unowned", "padding"


def _names(kind: str) -> tuple[str, ...]:
    return NAMES[kind.removesuffix("_far")]


# --- comparisons and guard zones -------------------------------------------------------------

def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical (NaN equals the same NaN)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bytes(a), _bytes(b))


def _diff(got: torch.Tensor, want: torch.Tensor) -> str:
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"got {got.dtype} {tuple(got.shape)}, clean {want.dtype} {tuple(want.shape)}"
    if got.is_floating_point():
        g, w = got.double(), want.double()
        differ = ~((g == w) | (g.isnan() & w.isnan()))
        both = differ & g.isfinite() & w.isfinite()
        worst = f", max |diff| {float((g - w)[both].abs().max()):.3g}" if both.any() else ""
        bad = int((differ & ~g.isfinite()).sum())
        return (f"{int(differ.sum())} of {g.numel()} entries differ{worst}"
                + (f", {bad} non-finite where the clean run is not" if bad else ""))
    differ = got != want
    at = tuple(int(i) for i in differ.nonzero()[0])
    return (f"{int(differ.sum())} of {got.numel()} entries differ, first at {at}: "
            f"{got[at].item()} (clean {want[at].item()})")


def _fill_sentinel(t: torch.Tensor) -> None:
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        t.view(torch.uint8).fill_(0x7F)
    elif t.is_floating_point():
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.fill_(True)
    else:
        t.fill_(-23_131)


# the live guarded buffers by storage address (what the interpreter's memcheck allows a kernel
# is the guarded tensor's own byte range, not the whole buffer); weak: a freed buffer's address
# is another tensor's later
_GUARDED: weakref.WeakValueDictionary[int, Guarded] = weakref.WeakValueDictionary()


class Guarded:
    """A copy of ``t`` in the middle of a buffer whose zones before and after it (each as large
    as ``t``) hold NaN (or a sentinel): writes just outside the tensor are seen, reads there
    read NaN (and, in Triton's interpreter, :class:`InterpreterMemcheck` refuses both)."""

    def __init__(self, t: torch.Tensor) -> None:
        n = t.numel()
        self.g, self.n = max(n, 1024), n
        self.base = torch.empty(2 * self.g + n, dtype=t.dtype, device=t.device)
        _fill_sentinel(self.base)
        self.pattern = self.base[:self.g].clone()
        self.tensor = self.base[self.g:self.g + n].view(t.shape)
        self.tensor.copy_(t)
        start = self.tensor.data_ptr()
        self.span = (start, start + n * t.element_size())
        _GUARDED[self.base.untyped_storage().data_ptr()] = self

    def breach(self) -> str | None:
        sides = [side for side, zone in (("before", self.base[:self.g]),
                                         ("after", self.base[self.g + self.n:]))
                 if not _same(zone, self.pattern)]
        return " and ".join(sides) or None


# --- trials, verdicts and the log ------------------------------------------------------------

@dataclass
class Trial:
    desc: str
    kind: str
    touched: frozenset  # owners (request ids, PADDING) whose rows / pages the corruption touches
    meta: Any = None  # the corrupted metadata (default: the harness's)
    inputs: dict = field(default_factory=dict)  # overrides of the harness's inputs
    states0: list | None = None  # other initial states (another layout or dtype)
    stray: list = field(default_factory=list)  # (state, index): no one's this step: unchanged
    reach: frozenset | None = None  # pages a touched row's slots may land in (default: its own)
    extra: Callable[[Any], list[str]] | None = None  # more checks of a served output
    compare_states: bool = True
    run: Callable | None = None  # (tests of the judge) instead of the harness's run

    @property
    def global_(self) -> bool:
        return self.kind in GLOBAL_KINDS


@dataclass
class Verdict:
    outcome: str  # "error" (refused, naming it), "served" (contract held), "fail"
    detail: str


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:400] if text else ""


def _owner(o) -> str:
    return f"request {o}" if isinstance(o, int) else f"the {o} rows" if o == PADDING \
        else f"{o} pages/slots"


def judge(h, t: Trial) -> Verdict:
    """Run trial ``t`` on harness ``h`` (guarded copies of its inputs and states) and hold the
    result to the contract."""
    init = t.states0 if t.states0 is not None else h.states0
    states = [Guarded(s) for s in init]
    inputs = {**h.inputs, **t.inputs}
    guarded = {k: Guarded(v) for k, v in inputs.items() if torch.is_tensor(v)}
    args = {k: guarded[k].tensor if k in guarded else v for k, v in inputs.items()}
    meta = t.meta if t.meta is not None else h.meta
    try:
        out = (t.run or h.run)(args, meta, [s.tensor for s in states])
        if ON_GPU:
            torch.cuda.synchronize()
    except ValueError as e:
        msg = _first_line(e)
        problems = []
        if not any(n in str(e) for n in _names(t.kind)):
            problems.append(f"ValueError not naming {'/'.join(_names(t.kind))}: {msg}")
        problems += _breaches(states, guarded)
        if t.compare_states:
            for owner, regions in h.regions.items():
                if owner in t.touched and not t.global_:
                    continue
                for i, idx in regions:
                    got, was = states[i].tensor[idx], init[i][idx]
                    clean = h.clean_states[i][idx]
                    if not (_same(got, was) or _same(got, clean)):
                        problems.append(f"the refused call changed {h.state_names[i]} of "
                                        f"{_owner(owner)}")
        return Verdict("fail", "; ".join(problems)) if problems else Verdict("error", msg)
    except Exception as e:  # (the contract allows ValueError only)
        return Verdict("fail", f"{type(e).__name__}: {_first_line(e)}")
    problems = _breaches(states, guarded) + _served_problems(h, t, out, states, init)
    return Verdict("fail", "; ".join(problems)) if problems else Verdict("served", "")


def _breaches(states, guarded) -> list[str]:
    out = []
    for name, g in [*((f"state {i}", s) for i, s in enumerate(states)), *guarded.items()]:
        if (side := g.breach()) is not None:
            out.append(f"wrote outside {name} ({side} it)")
    return out


def _served_problems(h, t: Trial, out, states, init) -> list[str]:
    problems = []
    if h.out_rows and (out is None or out.shape[0] != h.clean_out.shape[0]):
        return [f"output {None if out is None else tuple(out.shape)}, clean "
                f"{tuple(h.clean_out.shape)}"]
    if t.global_:  # served means served right
        for owner, rows in h.out_rows.items():
            got, want = out[rows].double(), h.clean_out[rows].double()
            if got.shape != want.shape or not got.isfinite().all() or not torch.allclose(
                    got, want, atol=h.tol, rtol=h.tol):
                diff = _diff(out[rows].to(h.clean_out.dtype), h.clean_out[rows])
                problems.append(f"{_owner(owner)} served wrong: {diff}")
        if t.compare_states:
            for i, s in enumerate(states):
                got, want = s.tensor.double(), h.clean_states[i].double()
                if not torch.allclose(got, want, atol=h.tol, rtol=h.tol, equal_nan=True):
                    problems.append(f"{h.state_names[i]} differs from the clean run's: "
                                    f"{_diff(got, want)}")
        return problems
    for owner, rows in h.out_rows.items():
        got, want = out[rows], h.clean_out[rows]
        if owner in t.touched:
            problems += h.validate(got, owner, t)
        elif not _same(got, want):
            problems.append(f"untouched {_owner(owner)}'s output differs: {_diff(got, want)}")
    if t.compare_states:
        for owner, regions in h.regions.items():
            if owner in t.touched:
                continue
            for i, idx in regions:
                got, want = states[i].tensor[idx], h.clean_states[i][idx]
                if not _same(got, want):
                    problems.append(f"{h.state_names[i]} of untouched {_owner(owner)} "
                                    f"differs: {_diff(got, want)}")
        for i, idx in t.stray:
            if not _same(states[i].tensor[idx], init[i][idx]):
                problems.append(f"{h.state_names[i]} at {idx.tolist()} (no request's this step) "
                                f"was written: {_diff(states[i].tensor[idx], init[i][idx])}")
    if t.extra is not None:
        problems += t.extra(out)
    return problems


def _finite(got: torch.Tensor, owner) -> list[str]:
    if got.is_floating_point() and not got.isfinite().all():
        return [f"touched {_owner(owner)}'s output is not finite "
                f"({int((~got.isfinite()).sum())} of {got.numel()} entries)"]
    return []


class FuzzLog:
    """How many corruptions of each kind ran on each target and how each was handled."""

    def __init__(self) -> None:
        self.counts: dict[tuple, Counter] = {}
        self.trials: list[dict] = []

    def record(self, family: str, target: str, kind: str, trial: Trial, v: Verdict) -> None:
        self.counts.setdefault((family, kind, target), Counter())[v.outcome] += 1
        self.trials.append(dict(family=family, target=target, kind=kind, trial=trial.desc,
                                outcome=v.outcome, detail=v.detail))
        self.dump()

    def rows(self) -> list[dict]:
        return [dict(family=f, kind=k, target=t, ran=sum(c.values()), error=c["error"],
                     served=c["served"], failed=c["fail"])
                for (f, k, t), c in sorted(self.counts.items())]

    def table(self) -> str:
        rows = self.rows()
        if not rows:
            return "fuzz: no corruption ran"
        head = ("family", "kind", "target", "ran", "error", "served", "FAILED")
        body = [(r["family"], r["kind"], r["target"], str(r["ran"]), str(r["error"]),
                 str(r["served"]), str(r["failed"])) for r in rows]
        by_kind: dict[tuple, Counter] = {}
        for r in rows:
            c = by_kind.setdefault((r["family"], r["kind"]), Counter())
            for k in ("ran", "error", "served", "failed"):
                c[k] += r[k]
        body.append(("-",) * 7)
        body += [(f, k, "(all targets)", str(c["ran"]), str(c["error"]), str(c["served"]),
                  str(c["failed"])) for (f, k), c in sorted(by_kind.items())]
        total = Counter()
        for r in rows:
            for k in ("ran", "error", "served", "failed"):
                total[k] += r[k]
        body.append(("TOTAL", "", "", str(total["ran"]), str(total["error"]),
                     str(total["served"]), str(total["failed"])))
        widths = [max(len(x[i]) for x in [head, *body]) for i in range(7)]
        line = lambda cells: "  ".join(c.ljust(w) if c != "-" else "-" * w  # noqa: E731
                                       for c, w in zip(cells, widths))
        return "\n".join(["", "fuzz corruptions (error: refused with a ValueError naming the "
                          "input; served: contract held; FAILED: contract broken)",
                          line(head), *map(line, body)])

    def dump(self) -> None:
        path = os.environ.get("ATTN_OPS_FUZZ_REPORT")
        if path:
            with open(path, "w") as f:
                json.dump(dict(seed=SEED, trials_per_kind={k: v * SCALE for k, v in
                                                           TRIALS.items()},
                               device=DEVICE, counts=self.rows(),
                               failures=[t for t in self.trials if t["outcome"] == "fail"],
                               trials=self.trials), f, indent=1)


@pytest.fixture(scope="session")
def fuzz_log():
    log = FuzzLog()
    yield log
    print(log.table())
    log.dump()


class OutOfBoundsAccess(RuntimeError):
    pass


class InterpreterMemcheck:
    """compute-sanitizer's memcheck for Triton's CPU interpreter (which loads and stores through
    raw addresses): every load, store and atomic of a kernel must fall inside the storage of one
    of its launch's tensor arguments (a guarded tensor's own range, not its guard zones); one
    outside raises :class:`OutOfBoundsAccess` before it happens -- reported as the trial's
    failure, where it would read garbage or corrupt the process's heap (a crash of the whole
    run, later and elsewhere)."""

    def __init__(self) -> None:
        self.kernel, self.lo, self.hi = "?", None, None

    def install(self, monkeypatch) -> bool:
        try:
            import numpy as np
            from triton.runtime import interpreter as ti

            builder, executor = ti.InterpreterBuilder, ti.GridExecutor
            element_size = lambda ptrs: np.dtype(ti._get_np_dtype(  # noqa: E731
                ptrs.get_element_ty())).itemsize
            originals = {name: getattr(builder, name) for name in (
                "create_masked_load", "create_masked_store", "create_atomic_rmw",
                "create_atomic_cas")}
            init_args = executor._init_args_hst
        except (ImportError, AttributeError):
            return False
        memcheck = self

        def collect(arg, out):
            if isinstance(arg, (tuple, list)):
                for a in arg:
                    collect(a, out)
            elif isinstance(arg, torch.Tensor):
                storage = arg.untyped_storage()
                guarded = _GUARDED.get(storage.data_ptr())
                out.append(guarded.span if guarded is not None else (
                    storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
            elif hasattr(arg, "base") and isinstance(getattr(arg, "base"), torch.Tensor):
                collect(arg.base, out)

        def init(self_, args_dev, kwargs):
            args_hst, kwargs_hst = init_args(self_, args_dev, kwargs)
            ranges = []
            collect([*args_hst, *kwargs_hst.values()], ranges)
            memcheck.kernel = getattr(self_.fn, "__name__", "?")
            memcheck.lo = np.array([r[0] for r in ranges], dtype=np.uint64)
            memcheck.hi = np.array([r[1] for r in ranges], dtype=np.uint64)
            return args_hst, kwargs_hst

        def check(what, ptrs, mask):
            if memcheck.lo is None:
                return
            addr = np.asarray(ptrs.data).astype(np.uint64)
            if mask is not None:
                addr = addr[np.broadcast_to(np.asarray(mask.data, dtype=bool), addr.shape)]
            addr = addr.reshape(-1)
            if addr.size == 0:
                return
            end = addr + np.uint64(element_size(ptrs))
            inside = ((addr[:, None] >= memcheck.lo[None]) & (end[:, None] <= memcheck.hi[None])
                      & (end[:, None] > addr[:, None])).any(1)
            if not inside.all():
                raise OutOfBoundsAccess(
                    f"Triton kernel {memcheck.kernel}: {what} of {int((~inside).sum())} "
                    f"element(s) outside every tensor argument (first at "
                    f"{int(addr[~inside][0]):#x}; arguments span {len(memcheck.lo)} storages)")

        def load(self_, ptrs, mask, other, *rest):
            check("load", ptrs, mask)
            return originals["create_masked_load"](self_, ptrs, mask, other, *rest)

        def store(self_, ptrs, value, mask, *rest):
            check("store", ptrs, mask)
            return originals["create_masked_store"](self_, ptrs, value, mask, *rest)

        def rmw(self_, op, ptr, val, mask, *rest):
            check("atomic", ptr, mask)
            return originals["create_atomic_rmw"](self_, op, ptr, val, mask, *rest)

        def cas(self_, ptr, cmp, val, *rest):
            check("atomic", ptr, None)
            return originals["create_atomic_cas"](self_, ptr, cmp, val, *rest)

        monkeypatch.setattr(executor, "_init_args_hst", init)
        for name, fn in (("create_masked_load", load), ("create_masked_store", store),
                         ("create_atomic_rmw", rmw), ("create_atomic_cas", cas)):
            monkeypatch.setattr(builder, name, fn)
        return True


@pytest.fixture(scope="module", autouse=True)
def interpreter_memcheck():
    """On the CPU, Triton kernels run in the interpreter with :class:`InterpreterMemcheck`."""
    if ON_GPU or not TRITON_HERE:
        yield None
        return
    mp = pytest.MonkeyPatch()
    installed = InterpreterMemcheck().install(mp)
    yield installed
    mp.undo()


# --- paged families: attention, MLA, sparse MLA ----------------------------------------------

def _request_of(qsl: list[int], t: int) -> int:
    return next(r for r in range(len(qsl) - 1) if qsl[r] <= t < qsl[r + 1])


def _rng_for(*parts) -> random.Random:
    return random.Random(zlib.crc32(":".join(map(str, (SEED, *parts))).encode()))


class PagedHarness:
    """One valid step over a paged cache: requests (context, new tokens), decode-first, then
    ``PAD`` padding rows; pages in random order, NaN in every page no request owns."""

    family = ""
    reqs: tuple = ()
    kinds: tuple = ()
    state_names = ("the cache",)

    def __init__(self, target: str) -> None:
        self.target = target
        self.g = torch.Generator().manual_seed(zlib.crc32(f"{self.family}{target}".encode()))
        self.build_layer()  # self.layer, self.bs, self.spec
        need = sum(-(-(c + q) // self.bs) for c, q in self.reqs)
        self.nb = 2 * (-(-(need + EXTRA_PAGES) // 2))  # (even: the page-size trial halves it)
        self.num_tokens = sum(q for _, q in self.reqs)
        self.rows = self.num_tokens + PAD
        self.capacity = self.nb * self.bs
        self.tol = 1e-4 if self.spec.dtype in (torch.float32, torch.float64) else 3e-2
        self.make_data()
        self.meta, self.states0, alloc, extra = self.world(self.bs)
        self.inputs.update(extra)
        qsl = self.meta.query_start_loc_cpu.tolist()
        self.out_rows = {r: slice(qsl[r], qsl[r + 1]) for r in range(len(self.reqs))}
        self.out_rows[PADDING] = slice(qsl[-1], self.rows)
        self.pages = {r: alloc.blocks(r)[:-(-(c + q) // self.bs)]
                      for r, (c, q) in enumerate(self.reqs)}
        owned = set().union(*map(set, self.pages.values()))
        self.regions = {r: [(0, torch.tensor(p, device=DEVICE))] for r, p in self.pages.items()}
        self.regions[UNOWNED] = [(0, torch.tensor(sorted(set(range(self.nb)) - owned),
                                                  device=DEVICE))]
        self.all_owners = frozenset(self.out_rows) | frozenset(self.regions)
        self.clean_out, self.clean_states = clean_run(self)

    def rand(self, *shape, dtype=None) -> torch.Tensor:
        return torch.randn(*shape, generator=self.g, dtype=torch.float64).to(
            dtype or self.spec.dtype).to(DEVICE)

    def world(self, page: int):
        """The step's metadata for pages of ``page`` tokens over the same cache memory (pages of
        ``self.bs``), the cache with every context written, and the inputs that depend on the
        layout."""
        alloc = BlockAllocator(self.capacity // page, page, shuffle=True, seed=7)
        meta = build_batch(alloc, list(range(len(self.reqs))), [c for c, _ in self.reqs],
                           [q for _, q in self.reqs], device=DEVICE, num_tokens_padded=self.rows)
        cache = self.allocate()
        _fill_sentinel(cache)  # (NaN: pages nobody owns)
        owned = sorted({(b * page + o) // self.bs for r in range(len(self.reqs))
                        for b in alloc.blocks(r) for o in range(page)})
        stale = torch.randn(cache[owned].shape, generator=self.g).to(cache.dtype).to(DEVICE)
        cache[owned] = stale  # (what earlier requests left: finite)
        for r, (c, _) in enumerate(self.reqs):
            if c:
                self.write(cache, r, torch.tensor(alloc.slots(r, 0, c), device=DEVICE))
        return meta, [cache], alloc, self.layout_inputs(meta, page)

    def layout_inputs(self, meta, page) -> dict:
        return {}

    def validate(self, got, owner, t: Trial) -> list[str]:
        return _finite(got, owner)

    def trial(self, kind: str, i: int, rng: random.Random) -> Trial:
        return paged_trial(self, kind, i, rng)


def _replace(meta, **changes):
    """``meta`` with ``changes``; host-derived tables dropped where a table or length changes
    (backends then build them from the changed host arrays)."""
    if {"block_table", "seq_lens", "query_start_loc"} & set(changes):
        changes.update(block_indptr_cpu=None, block_indices_cpu=None, device_tables=None)
    return dataclasses.replace(meta, **changes)


def _qsl_trial(h, kind, i, rng, qsl: list[int], rows: int, num_owned: int):
    """A corrupted ``query_start_loc`` (as a list) and the owners it touches: requests whose
    range changed, and the padding rows when the end moved."""
    new = list(qsl)
    n = len(qsl) - 1
    if kind == "qsl_beyond":
        j = rng.randint(1, n)
        delta = rows - qsl[j] + rng.randint(1, 3)
        new[j:] = [v + delta for v in qsl[j:]]
        what = f"query_start_loc[{j}:] shifted past the {rows} rows: {new}"
    else:
        j = rng.randint(1, n - 1)
        if i % 2 == 0:
            new[j] = qsl[j + 1] + rng.randint(1, 3)
            what = f"query_start_loc[{j}]={new[j]} above query_start_loc[{j + 1}]={qsl[j + 1]}"
        else:
            new[j] = qsl[j - 1] - rng.randint(1, 2)
            what = f"query_start_loc[{j}]={new[j]} below query_start_loc[{j - 1}]={qsl[j - 1]}"
    # touched: each request whose range changed, and each whose rows a changed range (either
    # way round) now covers -- the padding rows too
    changed = [r for r in range(n) if (qsl[r], qsl[r + 1]) != (new[r], new[r + 1])]
    claimed = set()
    for r in changed:
        lo, hi = min(new[r], new[r + 1]), max(new[r], new[r + 1])
        claimed.update(range(max(lo, 0), min(hi, rows)))
    touched = set(changed) | {_request_of(qsl, t) if t < qsl[-1] else PADDING for t in claimed}
    touched = {r if r == PADDING or r < num_owned else PADDING for r in touched}
    if new[-1] != qsl[-1]:
        touched.add(PADDING)
    return new, frozenset(touched), what


def paged_trial(h, kind: str, i: int, rng: random.Random) -> Trial:
    """One corruption of ``kind`` of ``h``'s step (a :class:`CommonAttentionMetadata` one)."""
    meta, bs = h.meta, h.bs
    qsl, seq = meta.query_start_loc_cpu.tolist(), meta.seq_lens_cpu.tolist()
    b = len(seq)
    if kind in ("slot", "slot_far"):
        t = rng.randrange(h.num_tokens)
        r = _request_of(qsl, t)
        values = [(h.capacity, "capacity"), (h.capacity + rng.randint(1, bs), "capacity + k"),
                  (-7, "-7")] if kind == "slot" else [(2 ** 40, "2**40")]
        v, label = values[i % len(values)]
        bad = meta.slot_mapping.clone()
        bad[t] = v
        return Trial(f"slot_mapping[{t}] (request {r}) = {v} ({label}; {h.nb} pages x {bs})",
                     kind, frozenset({r}), meta=_replace(meta, slot_mapping=bad))
    if kind in ("block_table", "block_table_far"):
        r = rng.choice([r for r in range(b) if seq[r] > 0])
        c = rng.randrange(-(-seq[r] // bs))
        values = [(h.nb, "num_blocks"), (-5, "-5")] if kind == "block_table" \
            else [(2 ** 30, "2**30")]
        v, label = values[i % len(values)]
        table, table_cpu = meta.block_table.clone(), meta.block_table_cpu.clone()
        table[r, c] = table_cpu[r, c] = v
        return Trial(f"block_table[{r}, {c}] = {v} ({label}; was {int(meta.block_table_cpu[r, c])}"
                     f", {h.nb} blocks)", kind, frozenset({r}),
                     meta=_replace(meta, block_table=table, block_table_cpu=table_cpu))
    if kind in ("seq_len_beyond", "seq_len_zero"):
        r = rng.randrange(b)
        width = meta.block_table.shape[1]
        v = width * bs + rng.randint(1, bs) if kind == "seq_len_beyond" else 0
        lens, lens_cpu = meta.seq_lens.clone(), meta.seq_lens_cpu.clone()
        lens[r] = lens_cpu[r] = v
        return Trial(f"seq_lens[{r}] = {v} (was {seq[r]}; the table covers {width} x {bs})",
                     kind, frozenset({r}),
                     meta=_replace(meta, seq_lens=lens, seq_lens_cpu=lens_cpu,
                                   max_seq_len=int(lens_cpu.max())))
    if kind in ("qsl_beyond", "qsl_nonmonotone"):
        new, touched, what = _qsl_trial(h, kind, i, rng, qsl, h.rows, b)
        dev = torch.tensor(new, dtype=meta.query_start_loc.dtype, device=DEVICE)
        return Trial(what, kind, touched,
                     meta=_replace(meta, query_start_loc=dev,
                                   query_start_loc_cpu=dev.cpu().to(torch.int32)))
    if kind == "max_query_len":
        v = rng.randint(1, meta.max_query_len - 1)
        return Trial(f"max_query_len = {v} (the longest query has {meta.max_query_len})", kind,
                     h.all_owners, meta=dataclasses.replace(meta, max_query_len=v))
    if kind == "dtype":
        others = [torch.float64, torch.bfloat16 if h.spec.dtype != torch.bfloat16
                  else torch.float16]
        dt = others[i % len(others)]
        name = h.query_name
        return Trial(f"{name} as {dt} into a {h.spec.dtype} layer", kind, h.all_owners,
                     inputs={name: h.inputs[name].to(dt)})
    if kind == "page_size":
        page = 2 * bs
        meta2, states2, _, extra = h.world(page)
        return Trial(f"metadata built for pages of {page} tokens, the cache's are {bs}", kind,
                     h.all_owners, meta=meta2, states0=states2, inputs=extra,
                     compare_states=False)
    raise AssertionError(kind)


PAGED_KINDS = ("slot", "block_table", "seq_len_beyond", "seq_len_zero", "qsl_beyond",
               "qsl_nonmonotone", "max_query_len", "dtype", "page_size", "slot_far",
               "block_table_far")


def _first_spec(cls, candidates) -> AttentionSpec | None:
    """The first of ``candidates`` backend ``cls`` serves here (None: none of them)."""
    return next((s for s in candidates if not cls.not_supported_reasons(s, PLATFORM)), None)


def _page_for(cls, spec: AttentionSpec, page: int) -> int:
    if any(r.code == "block_size" for r in
           cls.not_supported_reasons(spec.with_(block_size=page), PLATFORM)):
        return cls.preferred_block_size(spec)
    return page


# each backend runs the first spec of these it serves (a vendor kernel: the dtypes and head dims
# it takes)
if ON_GPU:
    ATTN_SPECS = [AttentionSpec(num_heads=8, num_kv_heads=2, head_dim=64, dtype=dt)
                  for dt in (torch.float16, torch.bfloat16)] + [
        AttentionSpec(num_heads=8, num_kv_heads=2, head_dim=128, dtype=torch.bfloat16)]
    ATTN_PAGE, PAGED_REQS = 16, ((37, 1), (130, 1), (0, 45), (70, 33))
else:
    ATTN_SPECS = [AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32)]
    ATTN_PAGE, PAGED_REQS = 4, ((5, 1), (9, 1), (0, 6), (3, 4))


class AttentionHarness(PagedHarness):
    family, reqs, kinds, query_name = "attention", PAGED_REQS, PAGED_KINDS, "q"

    def build_layer(self):
        cls = get_backend_class(self.target)
        spec = _first_spec(cls, ATTN_SPECS)
        self.spec = spec.with_(block_size=_page_for(cls, spec, ATTN_PAGE))
        self.layer = Attention(self.spec, AttentionConfig(backend=self.target)).to(DEVICE)
        self.bs = self.layer.block_size

    def make_data(self):
        s = self.spec
        self.ctx = [(self.rand(c, s.kv_heads, s.head_dim), self.rand(c, s.kv_heads, s.v_head_dim))
                    for c, _ in self.reqs]
        self.inputs = {"q": self.rand(self.rows, s.num_heads, s.head_dim),
                       "k": self.rand(self.rows, s.kv_heads, s.head_dim),
                       "v": self.rand(self.rows, s.kv_heads, s.v_head_dim)}

    def allocate(self):
        return self.layer.allocate_kv_cache(self.nb, DEVICE)

    def write(self, cache, r, slots):
        from attn_ops.kv_cache import kv_cache_update

        kv_cache_update(*self.ctx[r], cache, slots, self.layer.k_scale, self.layer.v_scale)

    def run(self, args, meta, states):
        return self.layer(args["q"], args["k"], args["v"], states[0], meta)


def _attention_targets():
    for name in list_backends():
        try:
            cls = get_backend_class(name)
        except ImportError:
            continue
        if backend_family(name) == "attention" and _first_spec(cls, ATTN_SPECS) is not None:
            yield name


MLA_SPECS = [AttentionSpec.mla(4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                               v_head_dim=12, dtype=torch.float32)]
if ON_GPU:  # (the vendor kernels: 16-bit, DeepSeek's latent dims)
    MLA_SPECS += [MLA_SPECS[0].with_(dtype=torch.bfloat16),
                  AttentionSpec.mla(16, dtype=torch.bfloat16)]
MLA_PAGE = 16 if ON_GPU else 4
SPARSE_TOPK = 16 if ON_GPU else 8


def _mla_specs(sparse: bool) -> list[AttentionSpec]:
    return [s.with_(index_topk=SPARSE_TOPK if sparse else None) for s in MLA_SPECS]


class MLAHarness(PagedHarness):
    family, reqs, kinds, query_name = "mla", PAGED_REQS, PAGED_KINDS, "q"
    index_topk = None

    def build_layer(self):
        cls = get_backend_class(self.target)
        spec = _first_spec(cls, _mla_specs(self.index_topk is not None))
        self.spec = spec.with_(block_size=_page_for(cls, spec, MLA_PAGE))
        self.layer = MLAAttention(self.spec, AttentionConfig(backend=self.target)).to(DEVICE)
        s = self.spec
        w = torch.randn(s.num_heads * (s.qk_nope_head_dim + s.v_head_dim), s.kv_lora_rank,
                        generator=self.g) / s.kv_lora_rank ** 0.5
        self.layer.load_kv_b_proj(w.to(s.dtype).to(DEVICE))
        self.bs = self.layer.block_size

    def make_data(self):
        s = self.spec
        self.ctx = [self.rand(c, s.latent_dim) for c, _ in self.reqs]
        self.inputs = {"q": self.rand(self.rows, s.num_heads, s.head_dim),
                       "kv_c": self.rand(self.rows, s.kv_lora_rank),
                       "k_pe": self.rand(self.rows, s.qk_rope_head_dim)}

    def allocate(self):
        return self.layer.allocate_cache(self.nb, DEVICE)

    def write(self, cache, r, slots):
        from attn_ops.backends.mla.common import mla_cache_update

        rank = self.spec.kv_lora_rank
        lat = self.ctx[r]
        mla_cache_update(lat[:, :rank], lat[:, rank:], cache, slots, self.layer.kv_scale)

    def run(self, args, meta, states):
        extra = {"topk_slots": args["topk_slots"]} if self.index_topk else {}
        return self.layer(args["q"], args["kv_c"], args["k_pe"], states[0], meta, **extra)


SPARSE_KINDS = ("slot", "topk_slot", "topk_hole", "topk_row", "dtype", "page_size", "slot_far",
                "topk_slot_far")


class SparseMLAHarness(MLAHarness):
    """Each token selects a random causal subset of its request's positions (-1 holes
    anywhere), as global slots through the step's block table (``indexer_slots``)."""

    family, kinds, index_topk = "sparse_mla", SPARSE_KINDS, SPARSE_TOPK

    def make_data(self):
        super().make_data()
        rows = []
        for c, n in self.reqs:
            for j in range(n):
                p = c + j
                k = int(torch.randint(1, min(self.index_topk, p + 1) + 1, (1,),
                                      generator=self.g))
                chosen = torch.randperm(p + 1, generator=self.g)[:k].tolist()
                row = chosen + [-1] * (self.index_topk - k)
                rows.append([row[x] for x in torch.randperm(self.index_topk,
                                                            generator=self.g).tolist()])
        rows += [[-1] * self.index_topk] * PAD
        self.positions = torch.tensor(rows, dtype=torch.int32, device=DEVICE)

    def layout_inputs(self, meta, page):
        from attn_ops.backends.mla.indexer import indexer_slots

        return {"topk_slots": indexer_slots(self.positions, meta.block_table,
                                            meta.query_start_loc, page, meta.seq_lens)}

    def trial(self, kind, i, rng):
        if not kind.startswith("topk"):
            return paged_trial(self, kind, i, rng)
        slots = self.inputs["topk_slots"]
        qsl = self.meta.query_start_loc_cpu.tolist()
        t = rng.randrange(self.num_tokens)
        r = _request_of(qsl, t)
        bad = slots.clone()
        k = slots.shape[1]
        if kind == "topk_row":
            bad[t] = -1
            what = f"topk_slots[{t}] (request {r}) all -1"
        else:
            j = rng.randrange(1, k - 1) if kind == "topk_hole" else rng.randrange(k)
            values = {"topk_slot": [(self.capacity, "capacity"), (-5, "-5")],
                      "topk_slot_far": [(2 ** 30, "2**30")],
                      "topk_hole": [(-1, "-1 in the middle")]}[kind]
            v, label = values[i % len(values)]
            bad[t, j] = v
            what = f"topk_slots[{t}, {j}] (request {r}) = {v} ({label}; was {int(slots[t, j])})"
        return Trial(what, kind, frozenset({r}), inputs={"topk_slots": bad})


def _mla_targets(sparse: bool):
    for b in sorted(MLA_BACKENDS, key=lambda b: b.value):
        try:
            cls = get_backend_class(b.value)
        except ImportError:
            continue
        if _first_spec(cls, _mla_specs(sparse)) is not None:
            yield b.value


def clean_run(h):
    """``h``'s clean step on guarded copies: its outputs and states (the trials' baseline)."""
    states = [Guarded(s) for s in h.states0]
    inputs = {k: Guarded(v) if torch.is_tensor(v) else v for k, v in h.inputs.items()}
    out = h.run({k: v.tensor if isinstance(v, Guarded) else v for k, v in inputs.items()},
                h.meta, [s.tensor for s in states])
    breaches = _breaches(states, {k: v for k, v in inputs.items() if isinstance(v, Guarded)})
    assert not breaches, f"the clean step of {h.family} {h.target}: {breaches}"
    if out is not None:
        real = out[:h.num_tokens]
        assert not real.is_floating_point() or real.isfinite().all(), \
            f"the clean step of {h.family} {h.target} is not finite"
        out = out.clone()
    return out, [s.tensor.clone() for s in states]


# --- the indexer: indexer_k_write, indexer_topk, indexer_slots -------------------------------

if ON_GPU:
    IDX_PAGE, IDX_HEADS, IDX_DIM, IDX_TOPK = 16, 4, 64, 16
    IDX_REQS = ((60, 1), (9, 1), (0, 30), (40, 21))
else:
    IDX_PAGE, IDX_HEADS, IDX_DIM, IDX_TOPK = 4, 2, 16, 6
    IDX_REQS = ((12, 1), (4, 1), (0, 7), (9, 5))
IDX_KINDS = {
    "k_write": ("slot", "slot_far"),
    "topk": ("block_table", "seq_len_beyond", "seq_len_zero", "qsl_beyond", "qsl_nonmonotone",
             "block_table_far"),
    "slots": ("position", "block_table", "seq_len_beyond", "seq_len_zero", "qsl_beyond",
              "qsl_nonmonotone", "position_far", "block_table_far"),
}


class IndexerHarness(PagedHarness):
    """Index keys in fp32 pages (``IDX_PAGE``), contexts written; target ``op/path``: the op
    (``torch.ops.attn.indexer_*``) or, on the CPU, its Triton kernels in the interpreter (what
    the op runs on a GPU)."""

    family, reqs, state_names = "indexer", IDX_REQS, ("the index keys",)

    def __init__(self, target: str) -> None:
        self.op, self.path = target.split("/")
        self.kinds = IDX_KINDS[self.op]
        super().__init__(target)
        if self.op == "k_write":  # (no output: the keys it writes are what is checked)
            self.out_rows = {}

    def build_layer(self):
        self.spec = AttentionSpec(num_heads=IDX_HEADS, head_dim=IDX_DIM, dtype=torch.float32)
        self.bs = IDX_PAGE

    def make_data(self):
        t = self.rows
        self.inputs = {"k": self.rand(t, IDX_DIM), "q": self.rand(t, IDX_HEADS, IDX_DIM),
                       "w": self.rand(t, IDX_HEADS)}
        self.ctx = [self.rand(c, IDX_DIM) for c, _ in self.reqs]
        rows = []
        for c, n in self.reqs:  # (a causal selection with -1 holes, as for sparse MLA)
            for j in range(n):
                p = c + j
                k = int(torch.randint(1, min(IDX_TOPK, p + 1) + 1, (1,), generator=self.g))
                row = torch.randperm(p + 1, generator=self.g)[:k].tolist() + [-1] * (IDX_TOPK - k)
                rows.append(row)
        rows += [[-1] * IDX_TOPK] * PAD
        self.inputs["positions"] = torch.tensor(rows, dtype=torch.int32, device=DEVICE)

    def allocate(self):
        from attn_ops.backends.mla.indexer import allocate_index_cache

        return allocate_index_cache(self.nb, self.bs, IDX_DIM, torch.float32, device=DEVICE)[0]

    def write(self, cache, r, slots):
        self.k_write(self.ctx[r], cache, None, slots)

    def world(self, page):
        meta, states, alloc, extra = super().world(page)
        if self.op != "k_write":  # (topk and slots read a cache holding the step's keys too)
            self.k_write(self.inputs["k"], states[0], None, meta.slot_mapping)
        return meta, states, alloc, extra

    def k_write(self, k, keys, scales, slots):
        from attn_ops.backends.mla.indexer import FP8_MAX, indexer_k_write

        if self.path == "triton":
            from attn_ops.backends.mla.indexer_kernels import indexer_k_write_device

            return indexer_k_write_device(k, keys, scales, slots, FP8_MAX)
        return indexer_k_write(k, keys, scales, slots)

    def run(self, args, meta, states):
        from attn_ops.backends.mla import indexer as ix

        if self.op == "k_write":
            self.k_write(args["k"], states[0], None, meta.slot_mapping)
            return None
        triton = self.path == "triton"
        if triton:
            from attn_ops.backends.mla import indexer_kernels as kx
        if self.op == "topk":
            fn = kx.indexer_topk_device if triton else ix.indexer_topk
            return fn(args["q"], args["w"], states[0], None, meta.block_table, meta.seq_lens,
                      meta.query_start_loc, IDX_TOPK)
        fn = kx.indexer_slots_device if triton else ix.indexer_slots
        return fn(args["positions"], meta.block_table, meta.query_start_loc, self.bs,
                  meta.seq_lens)

    def validate(self, got, owner, t: Trial) -> list[str]:
        if self.op == "topk":  # positions: -1, or inside what the block table addresses
            limit = self.meta.block_table.shape[1] * self.bs
            bad = ~((got == -1) | ((got >= 0) & (got < limit)))
            if bad.any():
                return [f"touched {_owner(owner)}'s top-k holds positions outside [0, {limit}) "
                        f"and not -1: {sorted(set(got[bad].tolist()))[:8]}"]
            return []
        # slots: absent (negative or past the cache) or in a page the request may reach
        pages = t.reach if t.reach is not None else frozenset(self.pages.get(owner, ()))
        page_of = torch.div(got, self.bs, rounding_mode="floor")
        inside = (got >= 0) & (got < self.capacity)
        wrong = inside & ~torch.isin(page_of, torch.tensor(sorted(pages), dtype=got.dtype,
                                                            device=got.device))
        if wrong.any():
            return [f"touched {_owner(owner)}'s slots land in pages it does not own: "
                    f"{sorted(set(got[wrong].tolist()))[:8]} (its pages "
                    f"{sorted(pages)}, {self.bs} slots each)"]
        return []

    def trial(self, kind, i, rng):
        if not kind.startswith("position"):
            t = paged_trial(self, kind, i, rng)
            if kind.startswith("qsl"):  # (rows re-assigned: any request's pages)
                t.reach = frozenset().union(*map(frozenset, self.pages.values()))
            return t
        qsl = self.meta.query_start_loc_cpu.tolist()
        seq = self.meta.seq_lens_cpu.tolist()
        pos = self.inputs["positions"]
        t = rng.randrange(self.num_tokens)
        r = _request_of(qsl, t)
        j = rng.randrange(IDX_TOPK)
        width = self.meta.block_table.shape[1] * self.bs
        values = [(seq[r] + rng.randint(0, 2), "past the request's length"),
                  (width + rng.randint(0, 3), "past the block table"),
                  (-5, "negative")] if kind == "position" else [(2 ** 30, "2**30")]
        v, label = values[i % len(values)]
        bad = pos.clone()
        bad[t, j] = v

        def absent(out):
            s = int(out[t, j])
            return [] if s < 0 or s >= self.capacity else [
                f"positions[{t}, {j}]={v} ({label}) became slot {s}, not -1"]

        return Trial(f"positions[{t}, {j}] (request {r}, length {seq[r]}) = {v} ({label})",
                     kind, frozenset({r}), inputs={"positions": bad}, extra=absent)


def _indexer_targets():
    paths = ["op"] + (["triton"] if TRITON_HERE and not ON_GPU else [])
    return [f"{op}/{path}" for op in IDX_KINDS for path in paths]


# --- the recurrent-state ops -----------------------------------------------------------------

if ON_GPU:
    SSM_DIMS = dict(conv=24, short=16, hk=2, hv=4, dk=32, dv=32, h=4, p=16, g=2, n=16)
    SSM_LENS, SSM_CTX = [1, 1, 9, 17], [40, 3, 0, 21]
else:
    SSM_DIMS = dict(conv=6, short=5, hk=2, hv=4, dk=5, dv=3, h=4, p=3, g=2, n=5)
    SSM_LENS, SSM_CTX = [1, 1, 5, 3], [4, 2, 0, 6]
SSM_SLOTS, SSM_NUM_SLOTS, SSM_CHUNK = [3, 7, 1, 5], 9, 4
SSM_OPS = ("causal_conv1d", "short_conv", "gated_delta_rule", "mamba2_ssd", "mamba1_scan",
           "lightning_attention")
SSM_MAX_QUERY_LEN_OPS = ("gated_delta_rule", "mamba2_ssd", "mamba1_scan",
                         "lightning_attention")  # (the ops that take the bound)
SSM_CHUNKED_OPS = ("gated_delta_rule", "mamba2_ssd")  # (the ops with a chunked kernel)


class SSMHarness:
    """One step of a recurrent op: requests of ``SSM_LENS`` new tokens after ``SSM_CTX``, on
    ``SSM_SLOTS`` of ``SSM_NUM_SLOTS`` (0: the null slot), a padding request on the null slot
    and ``PAD`` padding rows; random finite states everywhere; fp32; target ``op/kernel``
    (the kernel forced through ``attn_ops.routing.ssm_kernel``)."""

    family = "ssm"

    def __init__(self, target: str) -> None:
        from attn_ops.backends.ssm.metadata import build_state_metadata

        self.target = target
        self.op, kernel = target.split("/")
        self.kinds = ("state_slot", "qsl_beyond", "qsl_nonmonotone", "dtype") + (
            ("max_query_len",) if self.op in SSM_MAX_QUERY_LEN_OPS else ()) + (
            "state_slot_far",)
        self.g = torch.Generator().manual_seed(zlib.crc32(target.encode()))
        self.tol = 1e-4
        b = len(SSM_LENS)
        qsl = [0]
        for n in SSM_LENS:
            qsl.append(qsl[-1] + n)
        self.num_tokens = qsl[-1]
        self.rows = qsl[-1] + PAD
        self.meta = build_state_metadata(qsl + [qsl[-1]], SSM_CTX + [0], SSM_SLOTS + [0],
                                         SSM_CHUNK, device=DEVICE)
        d = SSM_DIMS
        r = self.rand
        if self.op == "causal_conv1d":
            self.inputs = {"x": r(self.rows, d["conv"]), "w": r(d["conv"], 4),
                           "b": r(d["conv"])}
            state = r(SSM_NUM_SLOTS, 3, d["conv"])
        elif self.op == "short_conv":
            self.inputs = {"bcx": r(self.rows, 3 * d["short"]), "w": r(d["short"], 3),
                           "b": r(d["short"])}
            state = r(SSM_NUM_SLOTS, 2, d["short"])
        elif self.op == "gated_delta_rule":
            self.inputs = {"q": r(self.rows, d["hk"], d["dk"]), "k": r(self.rows, d["hk"], d["dk"]),
                           "v": r(self.rows, d["hv"], d["dv"]),
                           "g": -torch.nn.functional.softplus(r(self.rows, d["hv"])),
                           "beta": torch.sigmoid(r(self.rows, d["hv"]))}
            state = r(SSM_NUM_SLOTS, d["hv"], d["dk"], d["dv"])
        elif self.op == "mamba1_scan":
            c = d["h"] * d["p"]  # (channels)
            self.inputs = {"x": r(self.rows, c), "dt": r(self.rows, c),
                           "A": -r(c, d["n"]).exp(), "B": r(self.rows, d["n"]),
                           "C": r(self.rows, d["n"]), "D": r(c), "z": r(self.rows, c),
                           "dt_bias": r(c)}
            state = r(SSM_NUM_SLOTS, c, d["n"])
        elif self.op == "lightning_attention":
            self.inputs = {"q": r(self.rows, d["hv"], d["dk"]), "k": r(self.rows, d["hv"], d["dk"]),
                           "v": r(self.rows, d["hv"], d["dv"]), "slope": r(d["hv"]).abs() + 0.05}
            state = r(SSM_NUM_SLOTS, d["hv"], d["dk"], d["dv"])
        else:
            self.inputs = {"x": r(self.rows, d["h"], d["p"]), "dt": r(self.rows, d["h"]),
                           "A": -r(d["h"]).exp(), "B": r(self.rows, d["g"], d["n"]),
                           "C": r(self.rows, d["g"], d["n"]), "D": r(d["h"]),
                           "z": r(self.rows, d["h"], d["p"]), "dt_bias": r(d["h"])}
            state = r(SSM_NUM_SLOTS, d["h"], d["p"], d["n"])
        self.states0 = [state]
        self.state_names = ("conv_state" if "conv" in self.op else "state",)
        self.out_rows = {i: slice(qsl[i], qsl[i + 1]) for i in range(b)}
        self.out_rows[PADDING] = slice(qsl[-1], self.rows)
        slot = lambda s: [(0, torch.tensor([s], device=DEVICE))]  # noqa: E731
        self.regions = {i: slot(s) for i, s in enumerate(SSM_SLOTS)}
        self.regions[PADDING] = slot(0)
        self.regions[UNOWNED] = [(0, torch.tensor(
            [s for s in range(1, SSM_NUM_SLOTS) if s not in SSM_SLOTS], device=DEVICE))]
        self.all_owners = frozenset(self.out_rows) | frozenset(self.regions)
        self.clean_out, self.clean_states = clean_run(self)

    def rand(self, *shape):
        return torch.randn(*shape, generator=self.g, dtype=torch.float64).float().to(DEVICE)

    def run(self, args, meta, states):
        from attn_ops.backends.ssm.conv import causal_conv1d
        from attn_ops.backends.ssm.gated_deltanet import gated_delta_rule
        from attn_ops.backends.ssm.lightning import lightning_attention
        from attn_ops.backends.ssm.mamba1 import mamba1_scan
        from attn_ops.backends.ssm.mamba2 import mamba2_ssd
        from attn_ops.backends.ssm.short_conv import short_conv

        step = (meta.query_start_loc, meta.state_indices, meta.has_initial_state)
        mql = args.get("max_query_len", meta.max_query_len)
        a, s = args, states[0]
        if self.op == "causal_conv1d":
            return causal_conv1d(a["x"], a["w"], a["b"], s, *step, "silu")
        if self.op == "short_conv":
            return short_conv(a["bcx"], a["w"], a["b"], s, *step)
        if self.op == "gated_delta_rule":
            return gated_delta_rule(a["q"], a["k"], a["v"], a["g"], a["beta"], s, *step, mql,
                                    SSM_DIMS["dk"] ** -0.5, True)
        if self.op == "lightning_attention":
            return lightning_attention(a["q"], a["k"], a["v"], a["slope"], s, *step, mql)
        if self.op == "mamba1_scan":
            return mamba1_scan(a["x"], a["dt"], a["A"], a["B"], a["C"], a["D"], a["z"],
                               a["dt_bias"], s, *step, mql, True)
        return mamba2_ssd(a["x"], a["dt"], a["A"], a["B"], a["C"], a["D"], a["z"], a["dt_bias"],
                          s, *step, mql, True, 0.01, 2.0)

    def validate(self, got, owner, t: Trial) -> list[str]:
        return _finite(got, owner)

    def trial(self, kind, i, rng) -> Trial:
        meta = self.meta
        if kind in ("state_slot", "state_slot_far"):
            r = rng.randrange(len(SSM_SLOTS))
            values = [(SSM_NUM_SLOTS, "num_slots"), (-3, "-3")] if kind == "state_slot" \
                else [(2 ** 31 - 1, "2**31 - 1")]
            v, label = values[i % len(values)]
            bad = meta.state_indices.clone()
            bad[r] = v
            return Trial(f"state_indices[{r}] = {v} ({label}; was {SSM_SLOTS[r]}, "
                         f"{SSM_NUM_SLOTS} slots)", kind, frozenset({r}),
                         meta=dataclasses.replace(meta, state_indices=bad),
                         stray=[(0, torch.tensor([SSM_SLOTS[r]], device=DEVICE))])
        if kind in ("qsl_beyond", "qsl_nonmonotone"):
            qsl = meta.query_start_loc_cpu.tolist()
            new, touched, what = _qsl_trial(self, kind, i, rng, qsl, self.rows, len(SSM_SLOTS))
            dev = torch.tensor(new, dtype=meta.query_start_loc.dtype, device=DEVICE)
            return Trial(what + " (the device tensor the op reads)", kind, touched,
                         meta=dataclasses.replace(meta, query_start_loc=dev))
        if kind == "max_query_len":
            v = rng.randint(1, meta.max_query_len - 1)
            return Trial(f"max_query_len = {v} passed to the op (the longest query has "
                         f"{meta.max_query_len})", kind, self.all_owners,
                         inputs={"max_query_len": v})
        if kind == "dtype":
            dt = [torch.int32, torch.float64][i % 2]
            return Trial(f"{self.state_names[0]} as {dt} (fp32 inputs)", kind, self.all_owners,
                         states0=[self.states0[0].to(dt)])
        raise AssertionError(kind)


def _ssm_targets():
    from attn_ops.routing import Kernel

    kernels = [k for k in Kernel if k.name.startswith("SSM_")
               and (k is Kernel.SSM_TORCH or TRITON_HERE)]
    for op in SSM_OPS:
        for k in kernels:
            if k.name == "SSM_TRITON_CHUNKED" and op not in SSM_CHUNKED_OPS:
                continue  # (no chunked kernel: the routing sends them to the torch body)
            yield f"{op}/{k.name}"


# --- DeepSeek-V4's attention layers -----------------------------------------------------------

V4_REQS = ((13, 1), (6, 1), (0, 7), (9, 5))
V4_KINDS = ("slot", "block_table", "seq_len_beyond", "seq_len_zero", "qsl_beyond",
            "qsl_nonmonotone", "dtype", "c_table", "state_slot", "slot_far", "block_table_far",
            "c_table_far", "state_slot_far")
V4_TRITON_KINDS = ("slot", "block_table", "seq_len_beyond", "qsl_beyond", "c_table",
                   "state_slot", "block_table_far", "c_table_far", "state_slot_far")
V4_TRITON_TRIALS = 1  # (a trial a kind on the kernels: each runs the whole layer interpreted)
V4_LAYERS = {"swa": ("sliding_attention", 0), "csa": ("compressed_sparse_attention", 4),
             "hca": ("heavily_compressed_attention", 8)}
V4_CPAGE = 2  # (compressed entries a page)


class DeepseekV4Harness(PagedHarness):
    """A DeepSeek-V4 layer (``backend/kind``) at small widths: a window cache of rows in pages
    of 4 tokens (NaN where no request owns), a compressed cache and index keys in pages of 2
    entries through a compressed block table of their own, the compressors' state slots; every
    context written by the layer's own prefill. States: the window, compressed and index caches
    and both compressors' states (those of the kind)."""

    family, reqs, kinds, query_name = "deepseek_v4", V4_REQS, V4_KINDS, "x"

    def build_layer(self):
        from attn_ops.backends.deepseek_v4.spec import DeepseekV4Spec
        from attn_ops.layers.deepseek_v4 import DeepseekV4Attention
        from attn_ops.spec import LayerKind

        backend, kind = self.target.split("/")
        layer_type, ratio = V4_LAYERS[kind]
        sparse = kind == "csa"
        self.spec = DeepseekV4Spec(layer_type, num_heads=2, head_dim=16, rope_dim=4,
                                   sliding_window=6, compress_ratio=ratio,
                                   index_heads=4 if sparse else 0,
                                   index_head_dim=8 if sparse else 0,
                                   index_topk=3 if sparse else 0, dtype=torch.float32)
        torch.manual_seed(zlib.crc32(self.target.encode()))
        self.layer = DeepseekV4Attention(self.spec, 16, 8, 2, 4, config=AttentionConfig(
            backend_per_kind={LayerKind.DEEPSEEK_V4: backend})).to(DEVICE)
        with torch.no_grad():
            for p in self.layer.parameters():
                p.normal_(0, 0.3)
        self.bs = 4
        self.state_names = ("the window cache", "the compressed cache", "the compressor state",
                            "the index keys", "the index state")[:{0: 1, 4: 5, 8: 3}[ratio]]
        self.slots = [3, 7, 1, 5]
        self.num_slots = 9

    def make_data(self):
        self.prompts = [self.rand(c + n, 16) for c, n in self.reqs]
        self.inputs = {"x": torch.cat([p[c:] for p, (c, _) in zip(self.prompts, self.reqs)]
                                      + [self.rand(PAD, 16)]),
                       "positions": torch.tensor([c + j for c, n in self.reqs for j in range(n)]
                                                 + [0] * PAD, device=DEVICE),
                       "state_indices": torch.tensor(self.slots, dtype=torch.int32,
                                                     device=DEVICE)}
        self.rope = self.rand(64, 4)
        entries = max((c + n) // max(self.spec.compress_ratio, 1) for c, n in self.reqs)
        self.c_cols = max(1, -(-entries // V4_CPAGE))
        self.c_blocks = len(self.reqs) * self.c_cols + EXTRA_PAGES
        perm = torch.randperm(self.c_blocks, generator=self.g)
        self.inputs["c_table"] = perm[:len(self.reqs) * self.c_cols].view(
            len(self.reqs), self.c_cols).int().to(DEVICE)

    def _step(self, args, meta):
        return dict(query_start_loc=meta.query_start_loc, seq_lens=meta.seq_lens,
                    block_table=meta.block_table, slot_mapping=meta.slot_mapping,
                    compressed_block_table=args["c_table"],
                    state_indices=args["state_indices"])

    def world(self, page):
        alloc = BlockAllocator(self.capacity // page, page, shuffle=True, seed=7)
        meta = build_batch(alloc, list(range(len(self.reqs))), [c for c, _ in self.reqs],
                           [q for _, q in self.reqs], device=DEVICE, num_tokens_padded=self.rows)
        d, s = 16, self.spec
        shapes = [(self.capacity // self.bs, self.bs, d)]
        if s.compress_ratio:
            coff = 2 if s.index_topk else 1
            shapes += [(self.c_blocks, V4_CPAGE, d),
                       (self.num_slots, coff * s.compress_ratio, 2 * coff * d)]
        if s.index_topk:
            shapes += [(self.c_blocks, V4_CPAGE, 8), (self.num_slots, 2 * s.compress_ratio, 32)]
        states = [torch.full(shape, float("nan"), device=DEVICE) for shape in shapes]
        # (what earlier requests left in the pages and slots the requests own: finite)
        owned = sorted({(b * page + o) // self.bs for r in range(len(self.reqs))
                        for b in alloc.blocks(r) for o in range(page)})
        states[0][owned] = torch.randn(states[0][owned].shape, generator=self.g).to(DEVICE)
        c_owned = self.inputs["c_table"].flatten().long().cpu()
        for i in range(1, len(states)):
            rows = c_owned if i in (1, 3) else torch.tensor(self.slots)
            states[i][rows] = torch.randn(states[i][rows].shape, generator=self.g).to(DEVICE)
        for r, (c, _) in enumerate(self.reqs):  # (each context: the layer's own prefill)
            if not c:
                continue
            one = build_batch(alloc, [r], [0], [c], device=DEVICE)
            step = self._step({"c_table": self.inputs["c_table"][r:r + 1],
                               "state_indices": self.inputs["state_indices"][r:r + 1]}, one)
            with torch.no_grad():
                self.layer(self.prompts[r][:c], torch.arange(c, device=DEVICE), self.rope,
                           states[0], step, *states[1:])
        return meta, states, alloc, {}

    def __init__(self, target: str) -> None:
        super().__init__(target)
        # the compressed pages and state slots of each request (its table row's pages: the
        # allocator gave it them), and those no one's
        table = self.inputs["c_table"].cpu()
        c_pages = {r: table[r].tolist() for r in range(len(self.reqs))}
        owned = set().union(*map(set, c_pages.values()))
        free_c = sorted(set(range(self.c_blocks)) - owned)
        free_slots = sorted(set(range(self.num_slots)) - set(self.slots))
        for r in range(len(self.reqs)):
            regions = self.regions[r]
            if len(self.states0) > 1:
                regions.append((1, torch.tensor(c_pages[r], dtype=torch.long, device=DEVICE)))
                regions.append((2, torch.tensor([self.slots[r]], device=DEVICE)))
            if len(self.states0) > 3:
                regions.append((3, torch.tensor(c_pages[r], dtype=torch.long, device=DEVICE)))
                regions.append((4, torch.tensor([self.slots[r]], device=DEVICE)))
        if len(self.states0) > 1:
            self.regions[UNOWNED] += [(1, torch.tensor(free_c, device=DEVICE)),
                                      (2, torch.tensor(free_slots, device=DEVICE))]
        if len(self.states0) > 3:
            self.regions[UNOWNED] += [(3, torch.tensor(free_c, device=DEVICE)),
                                      (4, torch.tensor(free_slots, device=DEVICE))]

    def run(self, args, meta, states):
        with torch.no_grad():
            return self.layer(args["x"], args["positions"], self.rope, states[0],
                              self._step(args, meta), *states[1:])

    def trial(self, kind, i, rng):
        if kind.startswith("c_table"):
            if not self.spec.compress_ratio:  # (a window-only layer reads no compressed table)
                kind = "c_table"
            table = self.inputs["c_table"]
            r = rng.randrange(len(self.reqs))
            c = rng.randrange(table.shape[1])
            values = [(self.c_blocks, "num_blocks"), (-5, "-5")] if kind == "c_table" \
                else [(2 ** 30, "2**30")]
            v, label = values[i % len(values)]
            bad = table.clone()
            bad[r, c] = v
            return Trial(f"compressed_block_table[{r}, {c}] = {v} ({label}; was "
                         f"{int(table[r, c])}, {self.c_blocks} blocks)", kind, frozenset({r}),
                         inputs={"c_table": bad})
        if kind.startswith("state_slot"):
            r = rng.randrange(len(self.reqs))
            v = [self.num_slots, -3][i % 2] if kind == "state_slot" else 2 ** 31 - 1
            bad = self.inputs["state_indices"].clone()
            bad[r] = v
            stray = [(k, torch.tensor([self.slots[r]], device=DEVICE))
                     for k in (2, 4) if k < len(self.states0)]
            return Trial(f"state_indices[{r}] = {v} (was {self.slots[r]}, {self.num_slots} "
                         "slots)", kind, frozenset({r}), inputs={"state_indices": bad},
                         stray=stray)
        return paged_trial(self, kind, i, rng)


def _v4_targets():
    from attn_ops.registry import KIND_BACKENDS

    for b in KIND_BACKENDS["deepseek_v4"]:
        cls = get_backend_class(b.value)
        from attn_ops.backends.deepseek_v4.spec import DeepseekV4Spec

        if cls.not_supported_reasons(DeepseekV4Spec("sliding_attention", dtype=torch.float32),
                                     PLATFORM):
            continue
        # (the kernels' paths: a compressed-sparse layer runs every kernel of the others but
        # the dense entries' loop, which reads what the picks' does; the torch paths run all
        # three kinds)
        for kind in V4_LAYERS if b.value == "DSV4_REFERENCE" else ("csa",):
            yield f"{b.value}/{kind}"


# --- the test --------------------------------------------------------------------------------

HARNESSES = {"attention": AttentionHarness, "mla": MLAHarness, "sparse_mla": SparseMLAHarness,
             "indexer": IndexerHarness, "ssm": SSMHarness, "deepseek_v4": DeepseekV4Harness}


@functools.cache
def harness(family: str, target: str):
    return HARNESSES[family](target)


def _targets():
    yield from (("attention", t) for t in _attention_targets())
    yield from (("mla", t) for t in _mla_targets(False))
    yield from (("sparse_mla", t) for t in _mla_targets(True))
    yield from (("indexer", t) for t in _indexer_targets())
    yield from (("ssm", t) for t in _ssm_targets())
    yield from (("deepseek_v4", t) for t in _v4_targets())


def _kinds(family: str, target: str) -> tuple[str, ...]:
    if family in ("attention", "mla"):
        return PAGED_KINDS
    if family == "sparse_mla":
        return SPARSE_KINDS
    if family == "indexer":
        return IDX_KINDS[target.split("/")[0]]
    if family == "deepseek_v4":  # (the kernels: the kinds that reach them -- a dtype, a
        # non-monotone query_start_loc or a zero length are refused or absent alike on both)
        return V4_KINDS if target.startswith("DSV4_REFERENCE") else V4_TRITON_KINDS
    ssm = ("state_slot", "qsl_beyond", "qsl_nonmonotone", "dtype")
    if target.split("/")[0] in SSM_MAX_QUERY_LEN_OPS:
        ssm += ("max_query_len",)
    return ssm + ("state_slot_far",)


def _cases():
    near, far = [], []
    for family, target in _targets():
        for kind in _kinds(family, target):
            (far if kind.endswith("_far") else near).append(
                pytest.param(family, target, kind, id=f"{family}-{target}-{kind}"))
    return near + far  # (far-out-of-range indices last: following one can crash the process)


def _force_ssm_kernel(monkeypatch, family: str, target: str) -> None:
    if family == "ssm":
        from attn_ops import routing

        kernel = getattr(routing.Kernel, target.split("/")[1])
        monkeypatch.setattr(routing, "ssm_kernel", lambda *args, **kwargs: kernel)


@pytest.mark.parametrize("family,target,kind", _cases())
def test_one_corrupted_input_is_refused_or_served_in_isolation(family, target, kind, fuzz_log,
                                                                monkeypatch):
    _force_ssm_kernel(monkeypatch, family, target)
    h = harness(family, target)
    rng = _rng_for(family, target, kind)
    failures = []
    trials = TRIALS[kind]
    if family == "deepseek_v4" and not target.startswith("DSV4_REFERENCE"):
        trials = min(trials, V4_TRITON_TRIALS)
    for i in range(trials * SCALE):
        trial = h.trial(kind, i, rng)
        verdict = judge(h, trial)
        fuzz_log.record(family, target, kind, trial, verdict)
        if verdict.outcome == "fail":
            failures.append(f"{trial.desc}: {verdict.detail}")
    assert not failures, "\n".join(failures)


def test_every_family_has_targets_here():
    families = {f for f, _ in _targets()}
    assert families == set(HARNESSES), families
    assert {"REFERENCE", "CPU_ATTN"} <= {t for f, t in _targets() if f == "attention"} or ON_GPU


def _tampered(h, change):
    """``h``'s run, then ``change(out, the first cache or state)``: a wrong answer to judge."""
    def run(args, meta, states):
        out = h.run(args, meta, states)
        change(out, states[0])
        return out
    return run


def test_the_judge_catches_silent_wrong_answers():
    """The checks fail where they must: a bit changed in an untouched request's output, a write
    into a page no request owns or into another request's page, a write just past the cache,
    NaN in the touched request, a refusal not naming the input, an exception other than
    ValueError -- and pass the clean step and a refusal naming the input."""
    h = harness("attention", "REFERENCE")


    def bump(out, cache):  # one ulp in magnitude, in any float dtype on any device
        bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[out.element_size()]
        out[h.out_rows[0]].view(-1)[:1].view(bits).add_(1)

    def write_unowned(out, cache):
        cache[int(h.regions[UNOWNED][0][1][0])].fill_(0.5)

    def write_other(out, cache):
        cache[h.pages[0][0]].fill_(0.5)

    def past_the_end(out, cache):
        torch.as_strided(cache, (1,), (1,), cache.storage_offset() + cache.numel()).fill_(0.0)

    def nan_touched(out, cache):
        out[h.out_rows[1]] = math.nan

    def refuse(message, kind=ValueError):
        def run(args, meta, states):
            raise kind(message)
        return run

    def verdict(run, touched=frozenset({1}), kind="slot"):
        return judge(h, Trial("judge test", kind, touched, run=run)).outcome

    assert verdict(None) == "served"
    assert verdict(refuse("slot_mapping holds slot 99")) == "error"
    assert verdict(refuse("something is wrong")) == "fail"
    assert verdict(refuse("slot_mapping out of range", IndexError)) == "fail"
    for change in (bump, write_unowned, write_other, past_the_end, nan_touched):
        assert verdict(_tampered(h, change)) == "fail", change.__name__
    assert verdict(_tampered(h, bump), touched=h.all_owners, kind="dtype") == "served"  # (1 ulp)
    assert verdict(_tampered(h, nan_touched), touched=h.all_owners, kind="dtype") == "fail"


def test_the_judge_catches_stray_state_writes(monkeypatch):
    """For the recurrent ops: a write into a slot no request owns, into the slot a corrupted
    request no longer names, or a changed bit in another request's output or state fails."""
    target = "causal_conv1d/SSM_TORCH"
    _force_ssm_kernel(monkeypatch, "ssm", target)
    h = harness("ssm", target)
    t = h.trial("state_slot", 0, random.Random(0))
    (r,) = t.touched
    other = next(o for o in h.out_rows if o != r and o != PADDING)


    def check(change):
        return judge(h, dataclasses.replace(t, run=_tampered(h, change))).outcome

    assert check(lambda out, s: None) == "served"
    assert check(lambda out, s: s[int(h.regions[UNOWNED][0][1][0])].add_(1)) == "fail"
    assert check(lambda out, s: s[SSM_SLOTS[r]].add_(1)) == "fail"  # (the stray slot)
    assert check(lambda out, s: s[SSM_SLOTS[other]].add_(1)) == "fail"
    assert check(lambda out, s: out[h.out_rows[other]].add_(1)) == "fail"


class _TritonSplitHarness(AttentionHarness):
    """TRITON_ATTN's harness with the decodes' keys split (``combine``: the split combine as a
    second kernel, or fused into the attention launch) or not (``None``)."""

    def __init__(self, combine: str | None) -> None:
        self.combine = combine
        super().__init__("TRITON_ATTN")

    def build_layer(self):
        from attn_ops.tuning import Tuning

        super().build_layer()
        if self.combine is not None:
            tuning = Tuning().with_(triton={"min_keys_per_split": 2,
                                            "fused_combine": self.combine == "fused"})
            self.layer = Attention(self.spec, AttentionConfig(backend=self.target,
                                                              tuning=tuning)).to(DEVICE)


@pytest.mark.skipif(ON_GPU or not TRITON_HERE, reason="the GPU runs these trials itself (the "
                    "op reads query_start_loc on the device); needs Triton's interpreter")
@pytest.mark.parametrize("combine", [None, "kernel", "fused"], ids=["unsplit", "split_combine",
                                                                     "split_fused"])
def test_triton_attn_serves_a_corrupt_device_query_start_loc(combine, monkeypatch):
    """On a GPU TRITON_ATTN's kernels take query_start_loc as the device holds it; on the CPU
    the op checks it (a host tensor there) and refuses, so the query_start_loc trials never
    reach the kernels. With that check off they do, as on a GPU, in the interpreter with the
    memcheck, the layer's output buffer NaN until written: every output row comes back finite
    (a row no request covers as 0), every untouched request's bit-identical, nothing read or
    written outside the tensors."""
    from attn_ops.backends import triton_attn
    from attn_ops.backends.triton_attn import PLAN

    h = _TritonSplitHarness(combine)
    splits = PLAN.decode(h.layer.impl.build_metadata(h.meta).plan).splits
    assert (splits > 1) == (combine is not None), splits
    monkeypatch.setattr(triton_attn, "check_query_start_loc", lambda *args, **kwargs: None)
    new_empty = torch.Tensor.new_empty

    def nan_empty(self, *args, **kwargs):
        out = new_empty(self, *args, **kwargs)
        return out.fill_(math.nan) if out.is_floating_point() else out

    monkeypatch.setattr(torch.Tensor, "new_empty", nan_empty)
    rng = _rng_for("triton_device_qsl", combine)
    failures = []
    for kind in ("qsl_beyond", "qsl_nonmonotone"):
        for i in range(5):  # (the interpreter's second a trial)
            trial = h.trial(kind, i, rng)
            verdict = judge(h, trial)
            if verdict.outcome != "served":
                failures.append(f"{trial.desc}: {verdict.outcome}: {verdict.detail}")
    assert not failures, "\n".join(failures)


if TRITON_HERE and not ON_GPU:
    import triton
    import triton.language as tl

    @triton.jit
    def _store_first(ptr, n):
        offs = tl.arange(0, 8)
        tl.store(ptr + offs, offs.to(tl.float32), mask=offs < n)


def test_the_memcheck_stops_out_of_bounds_accesses_before_they_happen(interpreter_memcheck):
    """The interpreter's memcheck lets a kernel store inside its tensor argument and stops one
    storing past it -- into the guard zone here -- before the store."""
    if not interpreter_memcheck:
        pytest.skip("no Triton interpreter in use here")
    g = Guarded(torch.zeros(4))
    _store_first[(1,)](g.tensor, 4)
    assert g.tensor.tolist() == [0.0, 1.0, 2.0, 3.0] and g.breach() is None
    with pytest.raises(Exception, match="OutOfBoundsAccess.*_store_first: store of 2 element"):
        _store_first[(1,)](g.tensor, 6)
    assert g.breach() is None
