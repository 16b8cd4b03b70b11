"""An index that arrives on the device is never trusted (DESIGN.md: "Every input served or
refused", "Requests are isolated").

A block id, a slot or a seq_len is corrupted on the device tensor after the host-side metadata
builder checked the batch -- as a bug elsewhere on the device or a stale persistent buffer
would leave it -- and every kernel we own treats the index as absent: a block id outside the
cache, or a position past the block-table row, hides those keys (never read); a slot outside
the cache is skipped like -1 (nothing written, no page tail cleared). The corrupted request's
output is finite, every other request's output is bit-identical to the uncorrupted run, and the
cache changes exactly as if the bad slot were -1. (A seq_len past the table may instead be
refused with a ValueError naming seq_lens by the ops that hold the lengths on the host.)

Every cache sits inside a NaN-filled guard allocation, so a read just outside it shows as NaN
and a write there as a changed guard byte; a corrupted run of our own kernels (Triton's
interpreter, the C kernel) happens in a forked child, so an access that kills the process is
this test's failure, not the end of the run. (FLEX_ATTENTION's runs stay in the process: its
compiled CPU kernels use an OpenMP pool that a forked child cannot; its own step tables are
torch ops, which raise on a bad index rather than read past a tensor.)
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import traceback

import pytest
import torch

from attn_ops import (AttentionConfig, AttentionSpec, BlockAllocator, MLAAttention,
                      build_batch, get_backend_class, set_debug_checks)
from attn_ops.kv_cache import kv_cache_update, split_kv_cache
from attn_ops.registry import MLA_BACKENDS
from attn_ops.testing import SCENARIOS, Scenario, make_case, run_backend
from attn_ops.tuning import Tuning
from test_backends_matrix import BACKENDS, BASE, DEVICE, PLATFORM, _base, block_size_for

GUARD = 1008  # NaN pages before and after each cache: block ids -5 and num_blocks + 1000 in them
BLOCK_IDS = {"num_blocks": lambda nb: nb, "num_blocks_plus_1000": lambda nb: nb + 1000,
             "2**30": lambda nb: 2**30, "-5": lambda nb: -5}
SLOTS = {"capacity": lambda cap: cap, "2**40": lambda cap: 2**40, "-7": lambda cap: -7}


# --- harness ------------------------------------------------------------------------------------

def as_in_the_child(run):
    """``run()`` on one CPU thread, as :func:`isolated`'s child runs it (forked, it cannot
    use the parent's thread pool): a CPU kernel's reductions split by thread count, so outputs
    compared bit for bit with the child's are computed with the same count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return run()
    finally:
        torch.set_num_threads(threads)


def isolated(check, *restore: torch.Tensor, fork: bool = True, timeout: float = 900.0) -> None:
    """Run ``check()`` in a forked child (it sees the parent's tensors as they are now, and its
    changes stay there): passes, or fails this test with the child's traceback, the signal
    that killed it, or the timeout. ``fork=False``, and always on GPUs (a forked child cannot
    use the parent's CUDA context; a fault there fails this test and ends the worker's CUDA
    use, tests/conftest.py): in this process, the tensors ``restore`` put back as they were
    afterwards (without them, the prepared cases dropped: the check may have changed them)."""
    if not fork or DEVICE != "cpu":
        saved = [t.clone() for t in restore]
        try:
            as_in_the_child(check)
        finally:
            for t, s in zip(restore, saved):
                t.copy_(s)
            if not restore:
                _PREPARED.clear()
        return
    ctx = multiprocessing.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)

    def run():
        try:
            as_in_the_child(check)
            send.send("")
        except BaseException:  # (pytest's failures too)
            send.send(traceback.format_exc())

    child = ctx.Process(target=run)
    child.start()
    send.close()
    report = None
    if receive.poll(timeout):
        try:
            report = receive.recv()
        except EOFError:  # died before reporting
            pass
    child.join(10)
    if child.is_alive():
        child.kill()
        child.join()
    if report is None:
        code = child.exitcode
        how = f"was killed by signal {-code}" if code is not None and code < 0 else \
            f"exited with code {code} without a report" if code is not None else \
            f"ran past {timeout:.0f} s"
        pytest.fail(f"the corrupted run {how} (an out-of-bounds access, or a loop over a "
                    "corrupted length)", pytrace=False)
    if report:
        pytest.fail(report, pytrace=False)


@dataclasses.dataclass
class Guarded:
    """A cache (``view``) inside a NaN-filled allocation ``GUARD`` pages longer at each end."""

    view: torch.Tensor
    whole: torch.Tensor

    @classmethod
    def of(cls, cache: torch.Tensor) -> Guarded:
        n = cache.shape[0]
        if cache.dtype == torch.uint8:  # (a TurboQuant cache: 0xFF bytes read as NaN K and V)
            whole = torch.full((n + 2 * GUARD, *cache.shape[1:]), 0xFF, dtype=torch.uint8,
                               device=cache.device)
        else:
            whole = torch.full((n + 2 * GUARD, *cache.shape[1:]), float("nan"),
                               device=cache.device).to(cache.dtype)
        whole[GUARD:GUARD + n] = cache
        return cls(whole[GUARD:GUARD + n], whole)

    def bytes(self) -> torch.Tensor:
        return self.whole.view(torch.uint8).clone()


def assert_same_bytes(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    same = got.view(torch.uint8) == want.view(torch.uint8)
    if not bool(same.all()):
        where = (~same).nonzero()[:5].tolist()
        raise AssertionError(f"{what} differs (first differing byte indices {where})")


def check_outcome(run, rows: slice, clean, names: str | None = None, *, oracle=None) -> None:
    """``run()`` returns outputs whose ``rows`` are finite (and match ``oracle`` where given)
    and whose other rows equal ``clean`` bit for bit -- or, where ``names`` is given (an input
    the op may hold on the host), raises a ValueError naming it. ``run()`` and ``clean`` may
    be ``(out, lse)``: the LSE's other rows bit for bit too, its own rows not NaN (-inf where
    a row sees no key)."""
    try:
        out = run()
    except ValueError as e:
        if names is None:
            raise
        assert names in str(e), f"a ValueError that does not name {names}: {e}"
        return
    (out, lse), (clean, clean_lse) = (x if isinstance(x, tuple) else (x, None)
                                      for x in (out, clean))
    mine = out[rows]
    assert bool(mine.isfinite().all()), f"the corrupted request's rows are not finite: {mine}"
    others = torch.ones(out.shape[0], dtype=torch.bool, device=out.device)
    others[rows] = False
    assert_same_bytes(out[others], clean[others], "another request's output")
    if lse is not None and clean_lse is not None:
        assert not bool(lse[rows].isnan().any()), f"the corrupted request's LSE: {lse[rows]}"
        assert_same_bytes(lse[others], clean_lse[others], "another request's LSE")
    if oracle is not None:  # (16-bit outputs: their kernels' 16-bit products, a few ulps)
        tol = {torch.float16: 4e-3, torch.bfloat16: 3e-2}.get(mine.dtype, 1e-4)
        torch.testing.assert_close(mine.double().cpu(), oracle[rows].double().cpu(), atol=tol,
                                   rtol=tol)


# --- paged attention: block ids and seq_lens ----------------------------------------------------

def _forced_splits(splits: int, fused: bool):
    """TRITON_ATTN with the decodes' split count forced (split-KV at these small sizes)."""
    from attn_ops.backends.triton_attn import PLAN, TritonAttnBackend

    class Split(TritonAttnBackend):
        def build_metadata(self, common):
            m = super().build_metadata(common)
            plan = dataclasses.replace(PLAN.decode(m.plan), splits=splits, fused_combine=fused)
            return dataclasses.replace(m, plan=PLAN.encode(plan))

    return Split


TREE_SPEC = BASE.with_(spec_tree=(-1, 0, 0, 1, 2, 3))
# decodes (the first the widest row), a prefill, a draft tree of 6 queries
TREE_SCENARIO = Scenario(((30, 1), (3, 1), (0, 9), (20, 6)))
FLEX_GATHERED = Tuning().with_(flex={"gather_min_pairs_per_key_cpu": 0.0,
                                     "gather_min_pairs_per_key_gpu": 0.0})


def _attention_cases():
    """id -> (backend class, spec, scenario, options, whether the corrupted request's rows
    must also match REFERENCE with the corrupted keys masked out -- a draft tree's excepted:
    REFERENCE has no tree)."""
    cases = {}
    for name in BACKENDS:
        cls = get_backend_class(name)
        cases[name] = (cls, _base(cls), SCENARIOS["mixed"], {}, True)
    if "TRITON_ATTN" in BACKENDS:
        for fused in (False, True):
            cases[f"TRITON_ATTN-split_kv{'_fused' if fused else ''}"] = (
                _forced_splits(4, fused), BASE, SCENARIOS["long_context"], {}, True)
    if "FLEX_ATTENTION" in BACKENDS:
        flex = get_backend_class("FLEX_ATTENTION")
        cases["FLEX_ATTENTION-decode_layout"] = (flex, BASE, SCENARIOS["decode_only"], {},
                                                 True)
        # (a gathered page holding a bad block is left out whole: finite, not the oracle)
        cases["FLEX_ATTENTION-gathered"] = (flex, BASE, SCENARIOS["mixed"],
                                            {"tuning": FLEX_GATHERED}, False)
    tree = get_backend_class("TREE_ATTN")
    if not tree.not_supported_reasons(TREE_SPEC, PLATFORM):
        cases["TREE_ATTN"] = (tree, TREE_SPEC, TREE_SCENARIO, {}, True)
    return cases


ATTENTION = _attention_cases()
_PREPARED: dict = {}


def _prepared(case_id):
    """(case, guarded cache, clean out, clean lse, run) of an attention case, made once."""
    if case_id not in _PREPARED:
        cls, spec, scenario, options, _ = ATTENTION[case_id]
        case = make_case(spec, scenario, block_size=block_size_for(cls, spec), device=DEVICE,
                         seed=7)
        cache = Guarded.of(case.kv_cache)
        case = dataclasses.replace(case, kv_cache=cache.view)
        with_lse = cls.returns_lse(PLATFORM)

        def run(c=case):
            return run_backend(cls, c, with_lse=with_lse, **options)

        out, lse = as_in_the_child(run)
        n = case.metadata.num_actual_tokens
        assert bool(out[:n].isfinite().all())
        _PREPARED[case_id] = (case, cache, out, lse, run)
    return _PREPARED[case_id]


def _forks(case_id) -> bool:
    return ATTENTION[case_id][0].name != "FLEX_ATTENTION"


def _requests(case):
    """The requests corrupted: the first decode with the most pages, and the last request."""
    meta = case.metadata
    qlens = meta.query_lens_cpu.tolist()
    seq = meta.seq_lens_cpu.tolist()
    decodes = [i for i, q in enumerate(qlens) if q == 1] or [0]
    widest = max(decodes, key=lambda i: seq[i])
    return {"decode": widest, "last": len(qlens) - 1}


def _rows(case, r) -> slice:
    qsl = case.metadata.query_start_loc_cpu.tolist()
    return slice(qsl[r], qsl[r + 1])


def _oracle(case_id, case, r, mask_mod=None):
    """REFERENCE on the clean case (with ``mask_mod``), where it defines request ``r``'s rows:
    None for a draft tree's request or a case whose oracle is off."""
    spec = case.spec
    tree = spec.spec_tree is not None and int(case.metadata.query_lens_cpu[r]) == len(
        spec.spec_tree)
    if not ATTENTION[case_id][4] or tree:
        return None
    case = case.read_back(spec.dtype)  # (a TurboQuant cache: as its slots read)
    spec = case.spec.with_(spec_tree=None, mask_mod=mask_mod)  # (a tree: other rows alone)
    out, _ = run_backend(get_backend_class("REFERENCE"), dataclasses.replace(case, spec=spec))
    return out


def _masked_oracle(case_id, case, r, col):
    """:func:`_oracle` with request ``r``'s keys in table column ``col`` masked."""
    bs = case.metadata.block_size

    def hide(request, head, q_pos, kv_pos):
        return (request != r) | (kv_pos // bs != col)

    return _oracle(case_id, case, r, hide)


@pytest.mark.parametrize("value", list(BLOCK_IDS))
@pytest.mark.parametrize("request_kind", ["decode", "last"])
@pytest.mark.parametrize("case_id", list(ATTENTION))
def test_a_block_id_outside_the_cache_hides_its_keys(case_id, request_kind, value):
    case, cache, clean, clean_lse, run = _prepared(case_id)
    r = _requests(case)[request_kind]
    bs, num_blocks = case.metadata.block_size, case.kv_cache.shape[0]
    col = (int(case.metadata.seq_lens_cpu[r]) - 1) // bs // 2  # a page its queries see
    oracle = _masked_oracle(case_id, case, r, col)
    before = cache.bytes()

    def check():
        case.metadata.block_table[r, col] = BLOCK_IDS[value](num_blocks)
        check_outcome(run, _rows(case, r), (clean, clean_lse), oracle=oracle)
        assert_same_bytes(cache.bytes(), before, "the cache")

    isolated(check, case.metadata.block_table, fork=_forks(case_id))


@pytest.mark.parametrize("past", ["just_past", "2**30"])
@pytest.mark.parametrize("case_id", list(ATTENTION))
def test_a_seq_len_past_the_block_table_reads_nothing_past_its_row(case_id, past):
    """The widest row's seq_len made longer than its table covers: the keys past the row are
    absent (a decode's output is then REFERENCE's over the whole row), never a neighbour
    row's pages; or the op, holding the lengths on the host, refuses them naming seq_lens."""
    case, cache, clean, clean_lse, run = _prepared(case_id)
    meta = case.metadata
    width, bs = meta.block_table.shape[1], meta.block_size
    pages = -(-meta.seq_lens_cpu.long() // bs)
    r = int(pages.argmax())
    rows = _rows(case, r)
    oracle = None
    if rows.stop - rows.start == 1:  # a decode: every key of the row
        lens = meta.seq_lens.clone()
        meta.seq_lens[r] = width * bs
        oracle = _oracle(case_id, case, r)
        meta.seq_lens.copy_(lens)
    before = cache.bytes()

    def check():
        meta.seq_lens[r] = width * bs + 5 if past == "just_past" else 2**30
        check_outcome(run, rows, (clean, clean_lse), "seq_lens", oracle=oracle)
        assert_same_bytes(cache.bytes(), before, "the cache")

    isolated(check, meta.seq_lens, fork=_forks(case_id))


@pytest.mark.parametrize("case_id", [c for c in ATTENTION if _forks(c)])
def test_debug_checks_refuse_a_block_id_outside_the_cache_instead(case_id):
    """With ``set_debug_checks(True)`` the ops that check block ids (ours but FLEX_ATTENTION's,
    whose step tables leave them out) raise on one, naming the table, before any kernel."""
    case, cache, _, _, run = _prepared(case_id)
    r = _requests(case)["decode"]
    before = cache.bytes()

    def check():
        case.metadata.block_table[r, 0] = case.kv_cache.shape[0] + 1000
        set_debug_checks(True)
        with pytest.raises(ValueError, match=rf"block_table row {r} holds block \d+, outside"):
            run()
        assert_same_bytes(cache.bytes(), before, "the cache")

    isolated(check)


# --- KV-cache writes: slots and the block table they come from ----------------------------------

NUM_BLOCKS, PAGE = 12, 4
HAS_TRITON = not get_backend_class("TRITON_ATTN").not_supported_reasons(BASE, PLATFORM)


def _write_batch():
    """A decode, a 6-token prefill (its 5th token enters a page at row 0), 2 padding rows."""
    alloc = BlockAllocator(NUM_BLOCKS, PAGE, shuffle=True, seed=1)
    return build_batch(alloc, [0, 1], [5, 0], [1, 6], num_tokens_padded=9, device=DEVICE)


BAD_TOKEN = 5  # the prefill's position 4: row 0 of its second page
BAD_COLUMN = (1, 1)  # that page's block-table entry


def _write_inputs(fp8=False):
    from attn_ops.models.llama import rope_cache

    meta = _write_batch()
    g = torch.Generator().manual_seed(3)
    t = meta.slot_mapping.shape[0]
    rand = lambda *shape: torch.randn(*shape, generator=g).to(DEVICE)  # noqa: E731
    cache = torch.full((NUM_BLOCKS, 2, PAGE, 2, 8), float("nan"), device=DEVICE)
    latent = torch.full((NUM_BLOCKS, PAGE, 40), float("nan"), device=DEVICE)
    scales = (None, None)
    if fp8:
        cache = cache.to(torch.float8_e4m3fn)
        scales = (torch.tensor([0.5], device=DEVICE), torch.tensor([0.25], device=DEVICE))
    return dict(meta=meta, q=rand(t, 4, 8), k=rand(t, 2, 8), v=rand(t, 2, 8),
                cos_sin=rope_cache(8, 64, 10000.0)[meta.positions.cpu()].to(DEVICE),
                cache=Guarded.of(cache), latent=Guarded.of(latent), mq=rand(t, 4, 24),
                kv_c=rand(t, 32), k_pe=rand(t, 8), mcos=rope_cache(8, 64, 10000.0)[
                    meta.positions.cpu()].to(DEVICE), scales=scales)


def _write(path, x, slots, block_table=None, positions=None):
    """Run write ``path`` on ``x``'s guarded caches with ``slots`` (or, where ``block_table``
    is given, slots computed from ``positions`` -- default the batch's -- and that table);
    returns its query output."""
    from attn_ops.backends.mla.common import mla_cache_update
    from attn_ops.backends.mla.rope import mla_rope_cache_update
    from attn_ops.glue import rope_kv_cache_update

    meta, cache, latent = x["meta"], x["cache"].view, x["latent"].view
    q, k, v, cos_sin, scales = x["q"], x["k"], x["v"], x["cos_sin"], x["scales"]
    positions = meta.positions if positions is None else positions
    slot_args = (slots, None, None, None) if block_table is None else \
        (None, positions, meta.query_start_loc, block_table)
    if path == "kv_cache_update":
        kv_cache_update(k, v, cache, slots, *scales)
    elif path == "kv_write_kernel":
        from attn_ops.glue_kernels import kv_cache_update_triton

        kv_cache_update_triton(k, v, *split_kv_cache(cache, 8, 8), slots, *scales)
    elif path == "rope_kv_cache_update":
        return rope_kv_cache_update(q, k, v, cos_sin, cache, *slot_args, *scales)
    elif path == "rope_kv_write_kernel":
        from attn_ops.glue_kernels import rope_kv_cache_update_triton

        return rope_kv_cache_update_triton(q, k, v, cos_sin, cache, *slot_args, *scales)
    elif path == "mla_cache_update":
        mla_cache_update(x["kv_c"], x["k_pe"], latent, slots, None)
    elif path == "mla_write_kernel":
        from attn_ops.glue_kernels import kv_cache_update_triton

        kv_cache_update_triton(x["kv_c"][:, None], x["k_pe"][:, None], latent[:, :, None, :32],
                               latent[:, :, None, 32:], slots, None, None)
    elif path == "mla_rope_cache_update":
        q_rot, k_rot = mla_rope_cache_update(x["mq"], x["kv_c"], x["k_pe"], x["mcos"], latent,
                                             slots, None)
        return torch.cat([q_rot.flatten(1), k_rot.flatten(1)], 1)
    elif path == "mla_rope_write_kernel":
        from attn_ops.glue_kernels import rope_write_paged

        q_rot, k_rot = rope_write_paged(x["mq"], x["k_pe"][:, None], x["kv_c"][:, None],
                                        x["mcos"], latent[:, :, None, 32:],
                                        latent[:, :, None, :32], slots, None, None, None, None,
                                        None, nope=16, key_out=True)
        return torch.cat([q_rot.flatten(1), k_rot.flatten(1)], 1)
    else:
        raise AssertionError(path)
    return None


TORCH_WRITES = ["kv_cache_update", "kv_cache_update-fp8", "rope_kv_cache_update",
                "mla_cache_update", "mla_rope_cache_update"]
KERNEL_WRITES = ["kv_write_kernel", "kv_write_kernel-fp8", "rope_kv_write_kernel",
                 "mla_write_kernel", "mla_rope_write_kernel"]
WRITES = TORCH_WRITES + (KERNEL_WRITES if HAS_TRITON else [])


def _compare_writes(path, corrupt, skipped):
    """``path`` run with ``corrupt(x)``'s ``(slots, block table)`` against the same run with
    plain slots, tokens ``skipped`` -1: the same outputs and the same bytes in every cache and
    guard."""
    name, _, variant = path.partition("-")
    results = []
    for bad in (True, False):
        x = _write_inputs(fp8=variant == "fp8")
        if bad:
            slots, table, positions = corrupt(x)
        else:
            slots, table, positions = x["meta"].slot_mapping.clone(), None, None
            slots[skipped] = -1
        out = _write(name, x, slots, table, positions)
        results.append((out, x["cache"].bytes(), x["latent"].bytes()))
    (out, cache, latent), (want_out, want_cache, want_latent) = results
    assert_same_bytes(cache, want_cache, "the KV cache (with its guards)")
    assert_same_bytes(latent, want_latent, "the latent cache (with its guards)")
    if want_out is not None:
        assert_same_bytes(out, want_out, "the rotated query")


@pytest.mark.parametrize("value", list(SLOTS))
@pytest.mark.parametrize("path", WRITES)
def test_a_slot_outside_the_cache_is_skipped_like_padding(path, value):
    def by_slot(x):
        slots = x["meta"].slot_mapping.clone()
        slots[BAD_TOKEN] = SLOTS[value](NUM_BLOCKS * PAGE)
        return slots, None, None

    isolated(lambda: _compare_writes(path, by_slot, [BAD_TOKEN]))


@pytest.mark.parametrize("value", list(BLOCK_IDS))
@pytest.mark.parametrize("path", ["rope_kv_cache_update"]
                         + (["rope_kv_write_kernel"] if HAS_TRITON else []))
def test_slots_from_a_block_id_outside_the_cache_are_skipped(path, value):
    """The fused write computing slots from positions and the block table: the tokens of a
    page whose block id is outside the cache write nothing (the entering one clears nothing)."""
    def by_table(x):
        table = x["meta"].block_table.clone()
        table[BAD_COLUMN] = BLOCK_IDS[value](NUM_BLOCKS)
        return None, table, None

    isolated(lambda: _compare_writes(path, by_table, [BAD_TOKEN, BAD_TOKEN + 1]))


@pytest.mark.parametrize("position", [10**6, 2**40, -3])
@pytest.mark.parametrize("path", ["rope_kv_cache_update"]
                         + (["rope_kv_write_kernel"] if HAS_TRITON else []))
def test_a_position_past_the_block_table_row_is_skipped(path, position):
    """A token's position read on the device, past its block-table row (or negative): its
    slot is padding -- never a neighbour row's entry nor memory past the table."""
    def by_position(x):
        positions = x["meta"].positions.clone()
        positions[BAD_TOKEN] = position
        return None, x["meta"].block_table.clone(), positions

    isolated(lambda: _compare_writes(path, by_position, [BAD_TOKEN]))


@pytest.mark.parametrize("copy", ["torch", "kernel"] if HAS_TRITON else ["torch"])
def test_flex_page_copy_reads_nothing_for_an_id_outside_the_cache(copy):
    """FLEX_ATTENTION's gathered-layout copy: a page_map id outside the cache (the builder
    leaves such a page out of the virtual table; the op takes page_map from the device all
    the same) is copied as zeros, the other pages as they are."""
    from attn_ops.backends.flex_attention_gather import (_copy_with_kernel, gather_pages_torch,
                                                         gathered_shape, slot_major)

    cache = Guarded.of(torch.randn(14, 2, 16, 2, 8, device=DEVICE))
    page_map = torch.tensor([[7, 3, 9, 7, 7, 7, 7, 7], [1, 2, 4, 5, 6, 8, 10, 11]],
                            device=DEVICE)
    want = gather_pages_torch(cache.view, page_map, 2)
    before = cache.bytes()

    def check():
        bad = page_map.clone()
        bad[1, 3] = {"torch": 14, "kernel": 2**30}[copy]
        bad[0, 1] = -5
        if copy == "torch":
            got = gather_pages_torch(cache.view, bad, 2)
        else:
            slots = slot_major(cache.view)
            got = slots.new_full(gathered_shape(slots, bad, 2), float("nan"))
            _copy_with_kernel(slots, bad, got)
        keep = torch.ones(page_map.numel(), 16, dtype=torch.bool, device=DEVICE)  # (slots)
        keep[1 * 8 + 3] = keep[0 * 8 + 1] = False
        keep = keep.flatten()
        copied = page_map.numel() * 16
        assert_same_bytes(got[:, :, :copied][:, :, keep], want[:, :, :copied][:, :, keep],
                          "the pages copied")
        assert not got[:, :, :copied][:, :, ~keep].any(), "a bad id's page is not zeros"
        assert_same_bytes(cache.bytes(), before, "the cache")

    isolated(check)


@pytest.mark.parametrize("slot", [NUM_BLOCKS * PAGE, 2**40, -7])
def test_debug_checks_refuse_a_bad_slot_instead(slot):
    x = _write_inputs()
    slots = x["meta"].slot_mapping.clone()
    slots[BAD_TOKEN] = slot
    before = x["cache"].bytes()
    set_debug_checks(True)
    try:
        with pytest.raises(ValueError, match=rf"slot_mapping holds slot {slot} but the cache"):
            kv_cache_update(x["k"], x["v"], x["cache"].view, slots, None, None)
    finally:
        set_debug_checks(False)
    assert_same_bytes(x["cache"].bytes(), before, "the cache")


# --- MLA: latent reads and the context-chunk gathers --------------------------------------------

MLA_SPEC = AttentionSpec.mla(4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                             v_head_dim=12, dtype=torch.float64, block_size=4)


def _mla_spec(backend):
    for dtype in (torch.float64, torch.float32):
        spec = MLA_SPEC.with_(dtype=dtype)
        if not get_backend_class(backend).not_supported_reasons(spec, PLATFORM):
            return spec
    return None


MLA_HERE = {b.value: s for b in sorted(MLA_BACKENDS, key=lambda b: b.value)
            if "SPARSE" not in b.value and (s := _mla_spec(b.value)) is not None}
# decodes (the first the widest row) absorbed; a prefill and a chunked prefill in the MHA form
MLA_REQS = [(29, 1), (12, 1), (0, 6), (9, 13)]
MLA_TUNING = Tuning().with_(mla={"context_chunk_tokens": 7, "absorbed_max_query_len": 1,
                                 "min_keys_per_split": 4, "programs_per_sm": 8,
                                 "decode_keys": 16})
MLA_BLOCKS = 24
# pages of 4 (many per key block) and of 16 (one per key block of 16: TRITON_MLA reads one block
# id per step)
MLA_PAGES = (4, 16)
_MLA: dict = {}


def _mla_prepared(backend, page):
    """(metadata, guarded latent cache, clean out, run, common metadata) of the MLA step."""
    if (backend, page) not in _MLA:
        from attn_ops.backends.mla.common import mla_cache_update

        spec = MLA_HERE[backend].with_(block_size=page)
        g = torch.Generator().manual_seed(5)
        layer = MLAAttention(spec, AttentionConfig(backend=backend, tuning=MLA_TUNING))
        layer = layer.to(DEVICE)
        h, nope, v, rank = spec.num_heads, spec.qk_nope_head_dim, spec.v_head_dim, \
            spec.kv_lora_rank
        layer.load_kv_b_proj((torch.randn(h * (nope + v), rank, generator=g,
                                          dtype=torch.float64) / rank ** 0.5).to(spec.dtype))
        alloc = BlockAllocator(MLA_BLOCKS, page, shuffle=True, seed=5)
        ids = list(range(len(MLA_REQS)))
        lat = [torch.randn(c + n, rank + 8, generator=g, dtype=torch.float64)
               .to(DEVICE, spec.dtype) for c, n in MLA_REQS]
        common = build_batch(alloc, ids, [c for c, _ in MLA_REQS], [n for _, n in MLA_REQS],
                             device=DEVICE)
        cache = Guarded.of(torch.full((MLA_BLOCKS, page, rank + 8), float("nan"),
                                      dtype=spec.dtype, device=DEVICE))
        for i, (c, n) in enumerate(MLA_REQS):  # every token's latent row in the cache
            slots = torch.tensor(alloc.slots(i, 0, c + n), device=DEVICE)
            mla_cache_update(lat[i][:, :rank], lat[i][:, rank:], cache.view, slots, None)
        new = torch.cat([lat[i][c:] for i, (c, _) in enumerate(MLA_REQS)])
        q = torch.randn(new.shape[0], h, spec.head_dim, generator=g,
                        dtype=torch.float64).to(DEVICE, spec.dtype)
        meta = layer.impl.build_metadata(common)

        def run(meta=meta):
            out = torch.full((q.shape[0], h, v), float("nan"), dtype=spec.dtype, device=DEVICE)
            layer.impl.forward(q, new[:, :rank], new[:, rank:], cache.view, meta, out,
                               w_uk=layer.w_uk, w_uv=layer.w_uv, kv_scale=None)
            return out

        clean = as_in_the_child(run)
        assert bool(clean.isfinite().all())
        _MLA[backend, page] = (meta, cache, clean, run, common)
    return _MLA[backend, page]


def _mla_rows(common, r):
    qsl = common.query_start_loc_cpu.tolist()
    return slice(qsl[r], qsl[r + 1])


@pytest.mark.parametrize("value", list(BLOCK_IDS))
@pytest.mark.parametrize("page", MLA_PAGES)
@pytest.mark.parametrize("backend", MLA_HERE)
def test_mla_latent_reads_hide_a_block_id_outside_the_cache(backend, page, value):
    meta, cache, clean, run, common = _mla_prepared(backend, page)
    r = 1  # an absorbed decode
    col = (int(common.seq_lens_cpu[r]) - 1) // page // 2  # a page its query sees
    before = cache.bytes()

    def check():
        meta.block_table[r, col] = BLOCK_IDS[value](MLA_BLOCKS)
        check_outcome(run, _mla_rows(common, r), clean)
        assert_same_bytes(cache.bytes(), before, "the latent cache")

    isolated(check)


@pytest.mark.parametrize("past", ["just_past", "2**30"])
@pytest.mark.parametrize("page", MLA_PAGES)
@pytest.mark.parametrize("backend", MLA_HERE)
def test_mla_latent_reads_stop_at_the_end_of_the_block_table_row(backend, page, past):
    meta, cache, clean, run, common = _mla_prepared(backend, page)
    r = 0  # the widest row, an absorbed decode
    width = meta.block_table.shape[1]
    lens = meta.seq_lens.clone()
    meta.seq_lens[r] = width * page  # the whole row: what the keys past it being absent leaves
    oracle = run()
    meta.seq_lens.copy_(lens)
    before = cache.bytes()

    def check():
        meta.seq_lens[r] = width * page + 5 if past == "just_past" else 2**30
        check_outcome(run, _mla_rows(common, r), clean, "seq_lens", oracle=oracle)
        assert_same_bytes(cache.bytes(), before, "the latent cache")

    isolated(check)


@pytest.mark.parametrize("value", list(SLOTS))
@pytest.mark.parametrize("backend", MLA_HERE)
def test_mla_context_chunk_gathers_never_read_a_slot_outside_the_cache(backend, value):
    meta, cache, clean, run, common = _mla_prepared(backend, 4)
    r = len(MLA_REQS) - 1  # the chunked prefill: its context fills the first chunk
    before = cache.bytes()

    def check():
        meta.chunk_slots[0][3] = SLOTS[value](MLA_BLOCKS * 4)
        check_outcome(run, _mla_rows(common, r), clean)
        assert_same_bytes(cache.bytes(), before, "the latent cache")

    isolated(check)
