"""Experiment (not a benchmark of record): how fast can a decode of short contexts at batch 64
be on the H200? Issue 3 asks >= 3.9 TB/s at batch >= 64; B=64 ctx 1k stays at 3.74 with every
kernel measured (a 268 MB read in ~72 us, where B >= 128 reach 4.1-4.4).

At each point (``AB_CEIL=BxCTXxPAGE,...``), as CUDA-graph replays in one run:

* ``flat<P>``: a Triton kernel reading the cache's bytes (the K and V the decode reads, no
  more) as one flat array in ``P`` x SMs programs, grid-stride -- the memory system's ceiling
  at this size;
* ``heads1``: a Triton kernel reading exactly the decode's pattern -- per (request, KV head)
  program, 64-key tiles of K and V through the block table -- summing them instead of
  attending: the ceiling of the access pattern;
* FlashInfer's tensor-core decode (``fi_auto``; ``fi_nosplit``), FA4 (``fa4``), the FLASH_ATTN
  op as selected (``selected``);
* TRITON_ATTN as shipped (``triton``), and with ``S`` splits (0: its rule's) and decode tile
  ``R`` rows x ``K`` keys, ``W`` warps, ``T`` stages (``triton_s<S>_<R>x<K>w<W>t<T>``;
  ``AB_CEIL_TRITON=S/R/K/W/T,...``). Shared memory holds ``T`` tiles of K and V (``K x 512``
  bytes each at d128, bf16), so the tile and the stages set how many programs share an SM.

``AB_CEIL_READS=0`` leaves out the read kernels. Prints one line per point (TB/s of the
decode's K and V bytes), writes ``$OUT/exp_decode_ceiling.json``. Run 2 (03a4887) meant its
``s2`` variants to split in two, but its split rule's target rounded down to one split.

    source .gpu/bootstrap.sh && python benchmarks/exp/exp_decode_ceiling.py
"""
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from _common import run_info, with_setting  # noqa: E402
from bench_gpu_attention import (D, HKV, Batch, check_outputs, decode_bytes,  # noqa: E402
                                 fa4_direct, ours, time_graph)
from bench_triton_attention import built_with  # noqa: E402
from sweep_kernel_configs import flashinfer_tc, try_variant  # noqa: E402

from attn_ops.backends import triton_attn as ta  # noqa: E402

POINTS = [tuple(int(x) for x in p.split("x")) for p in os.environ.get(
    "AB_CEIL", "64x1024x128,64x1024x16,128x1024x128,256x1024x128").split(",")]
TRITON = [tuple(int(x) for x in v.split("/")) for v in os.environ.get(
    "AB_CEIL_TRITON", "1/16/64/4/4,1/16/64/4/3,2/16/64/4/4,4/16/64/4/2,1/16/32/4/2,1/16/32/4/3,"
    "1/16/32/4/4,1/16/32/4/6,1/16/16/4/4,1/16/16/4/6,1/16/16/4/8,1/16/32/2/3,1/16/32/2/4,"
    "2/16/32/4/3").split(",")]
FLAT_PROGRAMS = (1, 4, 16)  # x SMs
READS = os.environ.get("AB_CEIL_READS", "1") == "1"
FLAT_BLOCK = 4096  # bf16 elements per load


@triton.jit
def _read_flat(x_ptr, out_ptr, n_blocks, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], tl.float32)
    for i in range(pid, n_blocks, tl.num_programs(0)):
        acc += tl.load(x_ptr + i * BLOCK + tl.arange(0, BLOCK)).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc, 0))


@triton.jit
def _read_heads(cache_ptr, bt_ptr, out_ptr, ctx, bt_stride, SPLITS: tl.constexpr,
                PAGE: tl.constexpr, KEYS: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr):
    pid = tl.program_id(0)
    req = pid // (HKV * SPLITS)
    h = (pid // SPLITS) % HKV
    s = pid % SPLITS
    per = ctx // SPLITS
    acc = tl.zeros([KEYS, D], tl.float32)
    dims = tl.arange(0, D)
    for k0 in range(s * per, (s + 1) * per, KEYS):
        tok = k0 + tl.arange(0, KEYS)
        page = tl.load(bt_ptr + req * bt_stride + tok // PAGE).to(tl.int64)
        row = (page * 2 * PAGE + tok % PAGE) * (HKV * D) + h * D
        k = tl.load(cache_ptr + row[:, None] + dims[None, :])
        v = tl.load(cache_ptr + row[:, None] + PAGE * HKV * D + dims[None, :])
        acc += k.to(tl.float32) + v.to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(tl.sum(acc, 1), 0))


def read_flat(b: Batch, programs: int):
    """Reads as many bytes as the decode does: the first ``B x pages`` cache blocks."""
    used = b.cache[:b.meta.num_reqs * b.pages].reshape(-1)
    n_blocks = used.numel() // FLAT_BLOCK
    out = torch.empty(programs, dtype=torch.float32, device="cuda")
    return lambda: _read_flat[(programs,)](used, out, n_blocks, BLOCK=FLAT_BLOCK, num_warps=8)


def read_heads(b: Batch, splits: int, stages: int = 3):
    bt = b.meta.block_table
    n = b.meta.num_reqs * HKV * splits
    out = torch.empty(n, dtype=torch.float32, device="cuda")
    ctx = b.pages * b.page
    return lambda: _read_heads[(n,)](b.cache, bt, out, ctx, bt.stride(0), SPLITS=splits,
                                     PAGE=b.page, KEYS=min(64, b.page * 4), HKV=HKV, D=D,
                                     num_warps=4, num_stages=stages)


def triton_variant(b: Batch, splits: int, tile: tuple[int, int, int, int]):
    """TRITON_ATTN with ``splits`` (its split rule aimed at splits x items programs; 0: its own
    rule) and its decode tile ``tile`` (rows, keys, warps, stages)."""
    if splits:
        items = b.meta.num_reqs * HKV
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        fn = built_with(b, "TRITON_ATTN", ta, "PROGRAMS_PER_SM", -(-splits * items // sms))
    else:
        fn = ours(b, "TRITON_ATTN")
    fn = with_setting(fn, ta, "MANY_ITEMS_TILE", None)
    return with_setting(fn, ta.DECODE_TILES, True, tile)


def main():
    gen = torch.Generator().manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    out_path = os.path.join(os.environ.get("OUT", "."), "exp_decode_ceiling.json")
    for bsz, ctx, page in POINTS:
        b = Batch(bsz, ctx, 1, page, gen)
        fns, errors = {}, {}
        try_variant(fns, errors, "fi_auto", flashinfer_tc(b))
        try_variant(fns, errors, "fi_nosplit", flashinfer_tc(b, nosplit=True))
        if page == 128:
            try:
                try_variant(fns, errors, "fa4", fa4_direct(b))
            except ImportError as e:  # FA4 is not on this machine
                errors["fa4"] = str(e)
        try_variant(fns, errors, "selected", ours(b, "FLASH_ATTN"))
        for s, r, k, w, t in TRITON:
            try_variant(fns, errors, f"triton_s{s}_{r}x{k}w{w}t{t}",
                        triton_variant(b, s, (r, k, w, t)))
        diffs = check_outputs(b, fns, "fi_auto")
        if READS:
            for p in FLAT_PROGRAMS:
                try_variant(fns, errors, f"flat{p}", read_flat(b, p * sms))
            try_variant(fns, errors, "heads1", read_heads(b, 1))
        try_variant(fns, errors, "triton", ours(b, "TRITON_ATTN"))
        ms = time_graph(fns, 3)
        nbytes = decode_bytes(bsz, ctx)
        tbs = {k: nbytes / v / 1e9 for k, v in ms.items()}
        best = max((k for k in tbs if not k.startswith(("flat", "heads"))), key=tbs.get)
        print(f"decode B={bsz} ctx={ctx} page={page}: best kernel {best} {tbs[best]:.2f} TB/s "
              f"({ms[best] * 1e3:.1f} us)  " + " ".join(f"{k} {v:.2f}" for k, v in tbs.items()),
              flush=True)
        if errors:
            print("  errors:", errors, flush=True)
        rows.append({"batch": bsz, "ctx": ctx, "page": page, "bytes": nbytes, "ms": ms,
                     "tbs": tbs, "max_abs_diff": diffs, "errors": errors})
        with open(out_path, "w") as f:
            json.dump({**run_info("exp_decode_ceiling"), "device": torch.cuda.get_device_name(),
                       "rows": rows}, f, indent=1)
        del b, fns


if __name__ == "__main__":
    main()
