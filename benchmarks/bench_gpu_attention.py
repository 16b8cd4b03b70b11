"""The selected GPU backend through ``torch.ops.attn.*`` against the kernel libraries called
directly, side by side in one run (H200).

Contenders on the same paged cache (bf16, NHD, 32 query / 8 KV heads, head dim 128, page 128
unless ``--page``: the selector's page for COMPOSITE_SM90; pages in random order) and the same
batch:

* ``selected``       -- what ``Attention`` selects by default here (on the H200: COMPOSITE_SM90,
  FA4 prefill beside FlashInfer's tensor-core / FA4 / TRITON_ATTN decode), metadata from
  ``build_metadata``;
* ``selected_graph`` -- the same with CUDA-graph metadata (``CUDAGraphBatch`` padding included);
* ``flashinfer_op``  -- FLASHINFER through ``torch.ops.attn.flashinfer_attention``
  (tensor-core decode, FA3 prefill);
* ``flashinfer``     -- FlashInfer's wrapper called directly (CUDA-core decode, FA3 prefill);
* ``flashinfer_tc``  -- FlashInfer's decode wrapper with ``use_tensor_cores=True``;
* ``fa4``            -- FlashAttention 4's ``flash_attn_varlen_func`` (default ``num_splits=1``);
* ``fa3``            -- vLLM's FA3 (``vllm.vllm_flash_attn``) as vLLM calls it, scheduler
  metadata computed before the capture;
* ``fa3_op``         -- FLASH_ATTN on FA3 through ``torch.ops.attn.flash_attn_attention`` (its
  scheduler metadata computed by the step's first layer: inside the graph, in each replay).

Every contender's output is first cross-checked against FlashInfer's (``check_outputs``,
``TOLERANCE``); one that disagrees is printed as ``name(MISMATCH)`` and listed in the row's
``mismatch`` (its times are of another computation; no ratio is taken from them). Every
contender is planned before timing and timed as CUDA-graph replays of one call
(``triton.testing.do_bench_cudagraph``, median), the contenders of a point interleaved over
``--rounds`` rounds (rotating order) and the median taken, so drift hits all alike. Eager
per-call times (calls back to back, host overhead included) and the metadata builders' host
time are reported too. The libraries are called by keyword.

Formulas: decode bytes = B * ctx * Hkv * D * 2 (K and V) * 2 bytes -> TB/s;
causal prefill FLOPs = 4 * B * S^2 * Hq * D / 2 -> TFLOP/s.

    python benchmarks/bench_gpu_attention.py [--quick] [--page N] [--rounds R] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

from attn_ops import AttentionSpec

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import cross_check, eager_ms, host_us, run_info  # noqa: E402

HQ, HKV, D = 32, 8, 128
DTYPE = torch.bfloat16
SPEC = AttentionSpec(num_heads=HQ, num_kv_heads=HKV, head_dim=D, dtype=DTYPE)
DECODE_BATCH = (1, 2, 4, 8, 12, 16, 32, 64, 128, 256)
DECODE_CTX = (1024, 4096, 8192, 32768)
PREFILL = ((1, 8192), (4, 4096), (16, 1024))


class Batch:
    """Equal requests over a random cache whose pages are in random order."""

    def __init__(self, batch, ctx, query_len, page, gen):
        from attn_ops.metadata import build_common_metadata

        self.page, self.pages = page, -(-ctx // page)
        num_blocks = batch * self.pages + 1
        perm = torch.randperm(num_blocks, generator=gen).tolist()
        tables = [perm[i * self.pages:(i + 1) * self.pages] for i in range(batch)]
        self.meta = build_common_metadata([query_len] * batch, [ctx] * batch, tables, page,
                                          num_blocks, device="cuda")
        self.cache = torch.randn(num_blocks, 2, page, HKV, D, dtype=DTYPE, device="cuda")
        self.q = torch.randn(batch * query_len, HQ, D, dtype=DTYPE, device="cuda")
        self.out = torch.empty_like(self.q)


def tuned(**sections):
    """This machine's tuning (what ``ours`` uses by default) with fields of ``sections``
    changed: ``tuned(triton={"fused_combine": True})``."""
    from attn_ops.tuning import default_tuning

    return default_tuning().with_(**sections)


def ours(b: Batch, backend: str, graph: bool = False, tuning=None, **options):
    """``backend`` through its op on ``b``, built with ``tuning`` (default: this machine's)
    and its ``options``."""
    from attn_ops import get_backend_class
    from attn_ops.cudagraph import CUDAGraphBatch

    impl = get_backend_class(backend)(SPEC, tuning=tuning, **options)
    if graph:
        graphs = CUDAGraphBatch((b.meta.num_reqs,), b.pages, b.page, "cuda")
        meta = impl.graph_metadata(graphs.pad(b.meta), graphs)
    else:
        meta = impl.build_metadata(b.meta)
    return lambda: impl.forward(b.q, b.cache, meta, b.out)


def flashinfer_direct(b: Batch, prefill: bool, tensor_cores: bool = False):
    import flashinfer

    from attn_ops.backends.flashinfer_plan import paged_kv_csr

    ws = torch.zeros(128 << 20, dtype=torch.uint8, device="cuda")
    indptr, indices, last = (t.cuda() for t in paged_kv_csr(b.meta.seq_lens_cpu,
                                                            b.meta.block_table_cpu, b.page))
    if prefill:
        w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(float_workspace_buffer=ws,
                                                           kv_layout="NHD")
        w.plan(qo_indptr=b.meta.query_start_loc, paged_kv_indptr=indptr,
               paged_kv_indices=indices, paged_kv_last_page_len=last, num_qo_heads=HQ,
               num_kv_heads=HKV, head_dim_qk=D, page_size=b.page, causal=True,
               q_data_type=DTYPE, kv_data_type=DTYPE)
    else:
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(float_workspace_buffer=ws,
                                                          kv_layout="NHD",
                                                          use_tensor_cores=tensor_cores)
        w.plan(indptr=indptr, indices=indices, last_page_len=last, num_qo_heads=HQ,
               num_kv_heads=HKV, head_dim=D, page_size=b.page, q_data_type=DTYPE,
               kv_data_type=DTYPE)
    return lambda: w.run(q=b.q, paged_kv_cache=b.cache, out=b.out)


def fa4_direct(b: Batch):
    from flash_attn.cute.interface import flash_attn_varlen_func

    k, v = b.cache.unbind(1)
    m = b.meta
    return lambda: flash_attn_varlen_func(q=b.q, k=k, v=v, cu_seqlens_q=m.query_start_loc,
                                          seqused_k=m.seq_lens, max_seqlen_q=m.max_query_len,
                                          max_seqlen_k=m.max_seq_len, page_table=m.block_table,
                                          causal=True)


def fa3_direct(b: Batch):
    """vLLM's FA3 as vLLM's FLASH_ATTN backend calls it: scheduler metadata computed once
    outside the call (outside the graph), the output written in place."""
    from vllm.vllm_flash_attn import flash_attn_varlen_func, get_scheduler_metadata

    k, v = b.cache.unbind(1)
    m = b.meta
    schedule = get_scheduler_metadata(
        batch_size=m.num_reqs, max_seqlen_q=m.max_query_len, max_seqlen_k=m.max_seq_len,
        num_heads_q=HQ, num_heads_kv=HKV, headdim=D, cache_seqlens=m.seq_lens, qkv_dtype=DTYPE,
        cu_seqlens_q=m.query_start_loc, page_size=b.page, causal=True)
    return lambda: flash_attn_varlen_func(
        q=b.q, k=k, v=v, max_seqlen_q=m.max_query_len, cu_seqlens_q=m.query_start_loc,
        max_seqlen_k=m.max_seq_len, seqused_k=m.seq_lens, block_table=m.block_table,
        softmax_scale=D ** -0.5, causal=True, out=b.out, scheduler_metadata=schedule,
        fa_version=3)


def contenders(b: Batch, have_fa4: bool, have_fa3: bool) -> dict:
    """The FlashAttention contenders of a point: FA4 direct; FA3 direct (as vLLM runs it) and
    FLASH_ATTN on FA3 through our op."""
    fns = {}
    if have_fa4:
        fns["fa4"] = fa4_direct(b)
    if have_fa3:
        fns["fa3"] = fa3_direct(b)
        fns["fa3_op"] = ours(b, "FLASH_ATTN", version=3)
    return fns


def time_graph(fns: dict, rounds: int) -> dict[str, float]:
    """Median over rounds of each contender's CUDA-graph replay time (ms), rotating order."""
    from triton.testing import do_bench_cudagraph

    names, samples = list(fns), {n: [] for n in fns}
    for r in range(rounds):
        shift = r % len(names)
        for n in names[shift:] + names[:shift]:
            samples[n].append(do_bench_cudagraph(fns[n], rep=30, return_mode="median"))
    return {n: statistics.median(v) for n, v in samples.items()}


# Largest max |contender - reference| / max |reference| of a bf16 attention output: both sides
# round to bf16 (one ulp is up to 2^-7 of the largest value) after accumulating in another
# order, and the PV products take bf16 probabilities; a wrong mask, page or scale is off by
# O(1).
TOLERANCE = 2e-2


def check_outputs(b: Batch, fns: dict, truth_name: str, tol: float = TOLERANCE
                  ) -> dict[str, dict]:
    """Every contender's output against ``truth_name``'s on the same batch
    (:func:`_common.cross_check`, ``tol``): ``{name: check}`` with ``agree`` and the max
    errors. A contender's output is what it returns (a tensor, or a tuple led by one) or else
    what it wrote into ``b.out``, which is zeroed before each run."""
    def output(fn) -> torch.Tensor:
        b.out.zero_()
        res = fn()
        got = res[0] if isinstance(res, tuple) else (res if torch.is_tensor(res) else b.out)
        return got.float().clone()

    truth = output(fns[truth_name])
    return {name: cross_check(output(fn), truth, tol) for name, fn in fns.items()}


def mismatches(checks: dict[str, dict]) -> list[str]:
    """The contenders whose output disagreed (their times are of another computation)."""
    return [name for name, check in checks.items() if not check["agree"]]


def shown(name: str, checks: dict[str, dict]) -> str:
    """``name``, marked where its output disagreed with the reference's."""
    return name if checks.get(name, {}).get("agree", True) else f"{name}(MISMATCH)"


def decode_bytes(batch: int, ctx: int) -> int:
    """K and V of every request read once: B * ctx * Hkv * D * 2 * 2 bytes."""
    return batch * ctx * HKV * D * 2 * 2


def prefill_flops(batch: int, seq: int) -> float:
    """Causal: 4 * B * S^2 * Hq * D / 2."""
    return 4 * batch * seq * seq * HQ * D / 2


def timed_fields(ms: dict[str, float], amount: float, unit: str) -> dict[str, float]:
    """``<name>_ms`` and ``<name>_<unit>`` (TB/s from bytes or TFLOP/s from FLOPs: amount /
    ms / 1e9) of each contender."""
    return {**{f"{k}_ms": v for k, v in ms.items()},
            **{f"{k}_{unit}": amount / v / 1e9 for k, v in ms.items()}}


def gpu_parser(doc: str, out_name: str, page: int, rounds: int,
               quick: bool = True) -> argparse.ArgumentParser:
    """The options of the GPU benchmarks: ``--page``, ``--rounds``, ``--out`` (default
    ``$OUT/<out_name>``), and ``--quick``."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    if quick:
        parser.add_argument("--quick", action="store_true")
    parser.add_argument("--page", type=int, default=page)
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), out_name))
    return parser


def write_result(name: str, path: str, quiet: bool = False, **fields) -> None:
    """The run's JSON: :func:`run_info`, the device, ``fields``. (Benchmarks write it after
    every row too, with ``complete=False``: a run stopped by a time limit keeps its rows.)"""
    info = run_info(name)
    info.update(device=torch.cuda.get_device_name(), **fields)
    with open(path, "w") as f:
        json.dump(info, f, indent=1)
    if not quiet:
        print(f"wrote {path}")


def builder_host_times(page, gen) -> dict[str, float]:
    """Per-step host time of each metadata builder (plans included) for decode batches: steps
    that must replan (alternating two batches whose page counts differ) and, for the eager
    builders, steps with unchanged page counts (the plan in the workspace is kept)."""
    from attn_ops import get_backend_class
    from attn_ops.backends import flashinfer_plan
    from attn_ops.cudagraph import CUDAGraphBatch

    out = {}
    for batch, ctx in ((256, 4096), (64, 4096)):
        b = Batch(batch, ctx, 1, page, gen)
        other = Batch(batch, ctx + page, 1, page, gen)  # one more page per request
        graphs = CUDAGraphBatch((batch,), other.pages, page, "cuda")
        for name in ("COMPOSITE_SM90", "FLASHINFER"):
            impl = get_backend_class(name)(SPEC)
            metas = [b.meta, other.meta]

            def replan():
                metas.reverse()
                flashinfer_plan._PLANS.pop(metas[0], None)  # plan afresh, as for a new step
                impl.build_metadata(metas[0])

            def same_pages():
                flashinfer_plan._PLANS.pop(b.meta, None)
                impl.build_metadata(b.meta)

            out[f"{name} B={batch} ctx={ctx}"] = host_us(replan)
            out[f"{name} B={batch} ctx={ctx} same pages"] = host_us(same_pages)
            out[f"{name} graph B={batch} ctx={ctx}"] = host_us(
                lambda: impl.graph_metadata(graphs.pad(metas.reverse() or metas[0]), graphs))
        out[f"CUDAGraphBatch.pad B={batch} ctx={ctx}"] = host_us(lambda: graphs.pad(b.meta))
    return out


def main() -> None:
    parser = gpu_parser(__doc__, "bench_gpu_attention_h200.json", page=128, rounds=3)
    parser.add_argument("--batches", default=None,
                        help=f"decode batch sizes, comma-separated (default {DECODE_BATCH})")
    parser.add_argument("--ctxs", default=None,
                        help=f"decode context lengths, comma-separated (default {DECODE_CTX})")
    parser.add_argument("--prefills", default=None,
                        help="prefill points as BxS, comma-separated (default 1x8192,4x4096,"
                             "16x1024; '' for none)")
    args = parser.parse_args()
    from attn_ops import current_platform, select_backend
    from attn_ops.backends.flashinfer_plan import warmup
    from attn_ops.providers import FA3

    platform = current_platform()
    selected = select_backend(SPEC.with_(block_size=args.page), platform).backend
    have_fa4 = selected in ("COMPOSITE_SM90", "FLASH_ATTN")  # (both run FA4)
    found = FA3.found()
    have_fa3 = found is not None and found.distribution == "vllm"
    warmup(SPEC, torch.cuda.get_device_capability()[0])
    gen = torch.Generator().manual_seed(0)
    rows = []

    def save(complete=False, **fields):
        write_result("bench_gpu_attention", args.out, quiet=not complete, quick=args.quick,
                     page=args.page, selected=selected, rounds=args.rounds, rows=rows,
                     complete=complete, **fields,
                     method="median over rotating rounds of triton.testing.do_bench_cudagraph "
                            "medians (rep=30 ms)")

    batches, ctxs = ((1, 64), (4096,)) if args.quick else (DECODE_BATCH, DECODE_CTX)
    prefills = PREFILL[:1] if args.quick else PREFILL
    if args.batches:
        batches = tuple(int(x) for x in args.batches.split(","))
    if args.ctxs:
        ctxs = tuple(int(x) for x in args.ctxs.split(","))
    if args.prefills is not None:
        prefills = tuple(tuple(int(v) for v in x.split("x")) for x in args.prefills.split(",")
                         if x)
    for bsz in batches:
        for ctx in ctxs:
            b = Batch(bsz, ctx, 1, args.page, gen)
            fns = {"selected": ours(b, selected), "selected_graph": ours(b, selected, True),
                   "flashinfer_op": ours(b, "FLASHINFER"),
                   "flashinfer": flashinfer_direct(b, False),
                   "flashinfer_tc": flashinfer_direct(b, False, tensor_cores=True)}
            fns.update(contenders(b, have_fa4, have_fa3))
            checks = check_outputs(b, fns, "flashinfer")
            ms = time_graph(fns, args.rounds)
            nbytes = decode_bytes(bsz, ctx)
            r = {"kind": "decode", "batch": bsz, "ctx": ctx, "bytes": nbytes,
                 "cross_check_vs_flashinfer": checks, "mismatch": mismatches(checks),
                 **timed_fields(ms, nbytes, "tbs"),
                 "eager_us": {k: eager_ms(fn) * 1e3 for k, fn in fns.items()}}
            rows.append(r)
            save()
            print(f"decode  B={bsz:<4} ctx={ctx:<6} " + "  ".join(
                f"{shown(k, checks)} {nbytes / v / 1e9:.2f}" for k, v in ms.items())
                + " TB/s (graph); eager us: " + "  ".join(
                    f"{k} {v:.1f}" for k, v in r["eager_us"].items()), flush=True)
            del b, fns
    for bsz, s in prefills:
        b = Batch(bsz, s, s, args.page, gen)
        fns = {"selected": ours(b, selected), "flashinfer_op": ours(b, "FLASHINFER"),
               "flashinfer": flashinfer_direct(b, True)}
        fns.update(contenders(b, have_fa4, have_fa3))
        checks = check_outputs(b, fns, "flashinfer")
        ms = time_graph(fns, args.rounds)
        flops = prefill_flops(bsz, s)
        r = {"kind": "prefill", "batch": bsz, "seq": s, "flops": flops,
             "cross_check_vs_flashinfer": checks, "mismatch": mismatches(checks),
             **timed_fields(ms, flops, "tflops"),
             "eager_ms": {k: eager_ms(fn) for k, fn in fns.items()}}
        rows.append(r)
        save()
        print(f"prefill {bsz}x{s:<6} " + "  ".join(
            f"{shown(k, checks)} {flops / v / 1e9:.0f}" for k, v in ms.items())
            + " TFLOP/s (graph); eager ms: " + "  ".join(
                f"{k} {v:.3f}" for k, v in r["eager_ms"].items()), flush=True)
        del b, fns
    host = builder_host_times(args.page, gen)
    print("builder host time per step (us):", {k: round(v, 1) for k, v in host.items()})
    save(complete=True, builder_host_us=host)


if __name__ == "__main__":
    main()
