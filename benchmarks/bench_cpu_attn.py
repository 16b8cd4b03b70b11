"""CPU_ATTN vs REFERENCE vs "torch SDPA on the same data already gathered into dense tensors".

Shapes are the demo's (``attn_ops.models.llama.ModelConfig`` defaults): 8 query heads / 2 KV heads,
head_dim 32, fp32, block size 16, pages handed out in random order
(``BlockAllocator(shuffle=True)``), NHD cache. Scenarios:

* ``decode_demo``  -- 4 decodes, contexts 40/33/56/25 (the demo's prompts 24/17/40/9 after 16
                      decode steps), 1 query token each;
* ``decode_long``  -- 8 decodes x 512 context tokens;
* ``prefill_demo`` -- the demo's prompts 24/17/40/9 as fresh prefills (square causal);
* ``mixed``        -- the 4 demo decodes + a chunked prefill (64 cached + 32 new) + a fresh
                      40-token prefill, in one batch (decodes first).

Timed in the same run, interleaved round by round (see ``_common.py``):

* ``CPU_ATTN``  -- ``torch.ops.attn.cpu_attention`` reading the paged cache;
* ``REFERENCE`` -- ``torch.ops.attn.reference_attention``;
* ``SDPA-dense`` (the anchor) -- per request, Q ``[1, Hq, n, D]`` and K/V ``[1, Hkv, L, D]``
  pre-gathered into contiguous tensors *before* timing; the timed region is the loop of
  ``F.scaled_dot_product_attention(q, k, v, enable_gqa=True, ...)`` calls over the requests,
  with ``is_causal=True`` for square prefills, an explicit bottom-right causal float mask
  (prebuilt) for chunked prefill, and no mask for single-token decode.

All three outputs are cross-checked against each other before timing (``TOL``: max |diff| <=
1e-4 of the largest value), so the benchmark cannot time wrong code: a scenario whose outputs
disagree is recorded with its errors and "mismatch", not timed, and gets no ratio. The SDPA
anchor is called by keyword. Everything runs under ``torch.inference_mode()`` (as
``attn_ops.models.llama.Generator`` does), with torch's default thread count.

FLOPs and bytes (per request i with s_i keys in total and n_i queries, causal):
  visible_i = n_i * (s_i - n_i) + n_i * (n_i + 1) / 2        query-key pairs that are computed
  FLOPs     = sum_i 4 * visible_i * Hq * D                   (2 for QK^T, 2 for PV)
  bytes     = sum_i [2 * s_i * Hkv * D  +  2 * n_i * Hq * D] * 4   (K,V read once; Q read, O
                                                                    written; fp32)
GFLOP/s and GB/s are these useful-work counts divided by the median time.

    python benchmarks/bench_cpu_attn.py [--quick] [--out PATH] [--profile]
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (NOISY, CpuMonitor, check_text, cpu_bench_parser,  # noqa: E402
                     cross_check, default_out, paired, run_info, stats, time_quietly,
                     wait_seconds, write_json)

NAME = "bench_cpu_attn"
HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 8, 2, 32, 16
DTYPE = torch.float32
NUM_BLOCKS = 512
# Largest max |a - b| / max |b| between any two of the three outputs: all compute in fp32 (the
# differences are summation order, ~1e-6 here); a wrong mask, page or scale is off by O(1).
TOL = 1e-4
GOAL_CPU_OVER_SDPA = 1.2
GOAL_REF_OVER_CPU = 5.0

DEMO_DECODE_CTX = [40, 33, 56, 25]
SCENARIOS = {
    "decode_demo": {"context": DEMO_DECODE_CTX, "query": [1, 1, 1, 1]},
    "decode_long": {"context": [512] * 8, "query": [1] * 8},
    "prefill_demo": {"context": [0, 0, 0, 0], "query": [24, 17, 40, 9]},
    "mixed": {"context": DEMO_DECODE_CTX + [64, 0], "query": [1, 1, 1, 1, 32, 40]},
}


class Scenario:
    """One batch: a shuffled paged cache, its metadata, the op arguments and dense copies."""

    def __init__(self, name: str, context: list[int], query: list[int], seed: int = 0) -> None:
        from attn_ops.kv_cache import BlockAllocator, allocate_kv_cache, gather_tokens, \
            split_kv_cache
        from attn_ops.metadata import build_batch
        from attn_ops.spec import AttentionSpec

        self.name, self.context, self.query = name, context, query
        g = torch.Generator().manual_seed(seed)
        spec = AttentionSpec(num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                             dtype=DTYPE)
        alloc = BlockAllocator(NUM_BLOCKS, BLOCK_SIZE, shuffle=True, seed=seed)
        self.meta = build_batch(alloc, list(range(len(context))), context, query)
        self.cache = allocate_kv_cache(spec, NUM_BLOCKS, BLOCK_SIZE)
        self.cache.copy_(torch.randn(self.cache.shape, generator=g, dtype=DTYPE))
        self.q = torch.randn(self.meta.num_actual_tokens, HEADS, HEAD_DIM, generator=g,
                             dtype=DTYPE)
        self.scale = HEAD_DIM ** -0.5
        self.out_cpu = torch.empty_like(self.q)
        self.out_ref = torch.empty_like(self.q)

        # Dense copies for the SDPA anchor, made once, outside the timed region.
        k_cache, v_cache = split_kv_cache(self.cache, HEAD_DIM, HEAD_DIM)
        starts = self.meta.query_start_loc_cpu.tolist()
        self.seq_lens = self.meta.seq_lens_cpu.tolist()
        self.dense = []
        for i, s in enumerate(self.seq_lens):
            n = starts[i + 1] - starts[i]
            table = self.meta.block_table[i]
            k = gather_tokens(k_cache, table, s).transpose(0, 1).unsqueeze(0).contiguous()
            v = gather_tokens(v_cache, table, s).transpose(0, 1).unsqueeze(0).contiguous()
            q = self.q[starts[i]:starts[i + 1]].transpose(0, 1).unsqueeze(0).contiguous()
            is_causal, mask = False, None
            if n == s and n > 1:
                is_causal = True
            elif n > 1:  # bottom-right causal: query t sits at position s - n + t
                pos = torch.arange(s - n, s)[:, None]
                mask = torch.zeros(n, s, dtype=DTYPE).masked_fill_(
                    torch.arange(s)[None, :] > pos, float("-inf"))
            self.dense.append((q, k, v, mask, is_causal))
        self.query_lens = [starts[i + 1] - starts[i] for i in range(len(self.seq_lens))]

    # -- the three contenders ------------------------------------------------------------------

    def _args(self, out):
        m = self.meta
        return (self.q, self.cache, m.query_start_loc, m.seq_lens, m.block_table, out, None,
                None, None, None, None, self.scale, None, None, True)

    def fns(self):
        cpu_op = torch.ops.attn.cpu_attention.default
        ref_op = torch.ops.attn.reference_attention.default
        a_cpu, a_ref = self._args(self.out_cpu), self._args(self.out_ref)
        dense, scale = self.dense, self.scale
        sdpa = F.scaled_dot_product_attention

        def sdpa_dense():
            return [sdpa(query=q, key=k, value=v, attn_mask=mask, is_causal=causal, scale=scale,
                         enable_gqa=True) for q, k, v, mask, causal in dense]

        return {"CPU_ATTN": lambda: cpu_op(*a_cpu), "REFERENCE": lambda: ref_op(*a_ref),
                "SDPA-dense": sdpa_dense}

    def check(self) -> dict[str, dict]:
        """The three outputs against each other (:func:`_common.cross_check`, ``TOL``)."""
        f = self.fns()
        f["CPU_ATTN"]()
        f["REFERENCE"]()
        dense_out = torch.cat([o[0].transpose(0, 1) for o in f["SDPA-dense"]()], dim=0)
        return {"CPU_ATTN vs REFERENCE": cross_check(self.out_cpu, self.out_ref, TOL),
                "SDPA-dense vs REFERENCE": cross_check(dense_out, self.out_ref, TOL),
                "CPU_ATTN vs SDPA-dense": cross_check(self.out_cpu, dense_out, TOL)}

    # -- work counts ---------------------------------------------------------------------------

    def work(self) -> dict[str, float]:
        flops, nbytes, pairs = 0, 0, 0
        for s, n in zip(self.seq_lens, self.query_lens):
            visible = n * (s - n) + n * (n + 1) // 2
            pairs += visible
            flops += 4 * visible * HEADS * HEAD_DIM
            nbytes += (2 * s * KV_HEADS * HEAD_DIM + 2 * n * HEADS * HEAD_DIM) * 4
        return {"flops": flops, "bytes": nbytes, "visible_pairs": pairs}


def profile_cpu_attn(sc: Scenario, calls: int = 50) -> str:
    from torch.profiler import profile

    fn = sc.fns()["CPU_ATTN"]
    for _ in range(5):
        fn()
    with profile() as prof:
        for _ in range(calls):
            fn()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)


def main(argv: list[str] | None = None) -> int:
    parser = cpu_bench_parser(NAME, __doc__)
    parser.add_argument("--profile", action="store_true",
                        help="also print a torch.profiler table of CPU_ATTN per scenario")
    args = parser.parse_args(argv)

    import attn_ops.backends.cpu_attn  # noqa: F401  (registers torch.ops.attn.cpu_attention)
    import attn_ops.backends.reference  # noqa: F401

    rounds, target_s = (3, 0.002) if args.quick else (31, 0.02)
    info = run_info(NAME)
    print(f"{NAME}: torch {info['torch']}, {info['platform']}, {info['num_threads']} threads, "
          f"Hq={HEADS} Hkv={KV_HEADS} D={HEAD_DIM} {str(DTYPE)[6:]} block {BLOCK_SIZE}, "
          f"shuffled pages{' (quick)' if args.quick else ''}")
    wait_s = wait_seconds(args)
    monitor = CpuMonitor()

    results = {}
    with torch.inference_mode():
        for name, cfg in SCENARIOS.items():
            sc = Scenario(name, cfg["context"], cfg["query"])
            checks = sc.check()
            diffs = {k: c["max_abs_err"] for k, c in checks.items()}
            bad = [k for k, c in checks.items() if not c["agree"]]
            if bad:  # no timing and no ratio between outputs that disagree
                for k in bad:
                    print(f"{name}: {k}: {check_text(checks[k])}: mismatch, not timed")
                results[name] = {"context_lens": cfg["context"], "query_lens": cfg["query"],
                                 "max_abs_diff": diffs, "cross_check": checks, "mismatch": bad}
                continue
            fns = sc.fns()
            samples, how = time_quietly(fns, rounds=rounds, target_s=target_s, wait_s=wait_s,
                                        label=name)
            work = sc.work()
            timings = {}
            for k, xs in samples.items():
                st = stats(xs)
                timings[k] = {"us": {m: (v * 1e6 if m != "n" else v) for m, v in st.items()},
                              "gflops": work["flops"] / st["median"] / 1e9,
                              "gbytes_per_s": work["bytes"] / st["median"] / 1e9}
            ratio_cpu_sdpa = paired(samples["CPU_ATTN"], samples["SDPA-dense"], "/")
            ratio_ref_cpu = paired(samples["REFERENCE"], samples["CPU_ATTN"], "/")
            results[name] = {
                "context_lens": cfg["context"], "query_lens": cfg["query"],
                "seq_lens": sc.seq_lens, "num_tokens": sc.meta.num_actual_tokens,
                "work": work, "max_abs_diff": diffs, "cross_check": checks, "mismatch": [],
                "rounds": rounds, **how,
                "timings": timings,
                "cpu_attn_over_sdpa_dense": ratio_cpu_sdpa,
                "reference_over_cpu_attn": ratio_ref_cpu,
                "meets_goal_cpu_over_sdpa": ratio_cpu_sdpa["median"] <= GOAL_CPU_OVER_SDPA,
                "meets_goal_ref_over_cpu": ratio_ref_cpu["median"] >= GOAL_REF_OVER_CPU,
            }
            if args.profile:
                print(f"\n--- profile of CPU_ATTN, {name} ---\n{profile_cpu_attn(sc)}")

    others_total = monitor.others_cpu_fraction()
    print(f"\n{'scenario':<13} {'tok':>4} {'MFLOP':>7} {'KB':>6} | {'CPU_ATTN us':>11} "
          f"{'REFERENCE us':>12} {'SDPA-dense us':>13} | {'CPU/SDPA':>8} {'REF/CPU':>8} | "
          f"{'CPU GF/s':>8} {'SDPA GF/s':>9}")
    for name, r in results.items():
        if r["mismatch"]:
            print(f"{name:<13} mismatch ({', '.join(r['mismatch'])}): not timed")
            continue
        t = r["timings"]
        c, f, d = (t[k]["us"]["median"] for k in ("CPU_ATTN", "REFERENCE", "SDPA-dense"))
        a = r["cpu_attn_over_sdpa_dense"]["median"]
        b = r["reference_over_cpu_attn"]["median"]
        print(f"{name:<13} {r['num_tokens']:>4} {r['work']['flops'] / 1e6:7.2f} "
              f"{r['work']['bytes'] / 1e3:6.0f} | {c:11.1f} {f:12.1f} {d:13.1f} | "
              f"{a:7.2f}{'' if a <= GOAL_CPU_OVER_SDPA else '!'} "
              f"{b:7.2f}{'' if b >= GOAL_REF_OVER_CPU else '!'} | "
              f"{t['CPU_ATTN']['gflops']:8.2f} {t['SDPA-dense']['gflops']:9.2f}")
    print(f"goals: CPU_ATTN / SDPA-dense <= {GOAL_CPU_OVER_SDPA} and REFERENCE / CPU_ATTN >= "
          f"{GOAL_REF_OVER_CPU} ('!' marks a miss); ratios are medians of per-round ratios; "
          f"max |diff| of all outputs <= "
          f"{max(max(r['max_abs_diff'].values()) for r in results.values()):.1e} "
          f"(tolerance: {TOL:g} of the largest value)")
    noisy = [n for n, r in results.items()
             if r.get("others_cpu_fraction") is not None and r["others_cpu_fraction"] > NOISY]
    if noisy:
        print(f"WARNING: other processes were busy while timing {', '.join(noisy)}; those "
              "numbers are inflated -- rerun on a quiet machine")

    payload = {**info, "quick": args.quick,
               "shapes": {"num_heads": HEADS, "num_kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                          "dtype": str(DTYPE), "block_size": BLOCK_SIZE,
                          "num_blocks": NUM_BLOCKS, "pages": "BlockAllocator(shuffle=True)",
                          "layout": "NHD"},
               "grad_mode": "inference_mode",
               "others_cpu_fraction_during": others_total, "noisy_scenarios": noisy,
               "goals": {"cpu_attn_over_sdpa_dense_max": GOAL_CPU_OVER_SDPA,
                         "reference_over_cpu_attn_min": GOAL_REF_OVER_CPU},
               "formulas": {
                   "visible_pairs": "sum_i n_i*(s_i-n_i) + n_i*(n_i+1)/2",
                   "flops": "sum_i 4 * visible_i * Hq * D",
                   "bytes": "sum_i (2*s_i*Hkv*D + 2*n_i*Hq*D) * 4  (fp32; K,V read once, Q "
                            "read, O written)",
                   "gflops": "flops / median_time", "gbytes_per_s": "bytes / median_time"},
               "anchor": "per request, F.scaled_dot_product_attention(q [1,Hq,n,D], k/v "
                         "[1,Hkv,L,D] contiguous, pre-gathered before timing, enable_gqa=True, "
                         "is_causal for square prefill, prebuilt bottom-right float mask for "
                         "chunked prefill, no mask for decode)",
               "method": "median over rounds; each sample = mean of calls_per_sample calls; "
                         "the three variants interleaved per round",
               "scenarios": results}
    write_json(args.out or default_out(NAME, args.quick), payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
