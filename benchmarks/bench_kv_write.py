"""The cost of request isolation in the KV-cache write (GPU): ``torch.ops.attn.kv_cache_update``
zeroes, in each page a write enters (row 0), the rows the write does not fill. Side by side in
one run, per decode batch (one new token per request; 8 KV heads x 128, bf16):

* ``ours_typical``     -- our op, slots at random positions: a token enters a page with
  probability 1 / page;
* ``ours_no_entry``    -- our op, no token at row 0 (the write alone);
* ``ours_all_enter``   -- our op, every token at row 0 (worst case: a page cleared per token);
* ``index_put``        -- the same write as a torch ``index_put_`` without the rule (anchor).

Every contender's written rows are first checked against the step's K and V (exactly; a
contender that wrote other values is reported with its errors and listed in ``mismatch``).
Timed as CUDA-graph replays (``triton.testing.do_bench_cudagraph`` medians), contenders of a
point interleaved over ``--rounds``.

    python benchmarks/bench_kv_write.py [--rounds R] [--out PATH]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import check_text, cross_check, run_info, write_json  # noqa: E402

HKV, D, DTYPE = 8, 128, torch.bfloat16
POINTS = ((64, 16), (256, 16), (64, 128), (256, 128), (1024, 128))  # (batch, page)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per point")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."),
                                                      "bench_kv_write_h200.json"),
                        help="result JSON path")
    args = parser.parse_args()
    from triton.testing import do_bench_cudagraph

    from attn_ops.kv_cache import kv_cache_update

    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for batch, page in POINTS:
        blocks = batch * 4
        cache = torch.randn(blocks, 2, page, HKV, D, device="cuda", dtype=DTYPE)
        k = torch.randn(batch, HKV, D, device="cuda", dtype=DTYPE, generator=gen)
        v = torch.randn_like(k)
        owned = torch.randperm(blocks, device="cuda", generator=gen)[:batch]
        rows_in_page = {
            "typical": torch.randint(0, page, (batch,), device="cuda", generator=gen),
            "no_entry": torch.randint(1, page, (batch,), device="cuda", generator=gen),
            "all_enter": torch.zeros(batch, dtype=torch.int64, device="cuda")}
        slots = {n: owned * page + r for n, r in rows_in_page.items()}
        k_cache, v_cache = cache[:, 0], cache[:, 1]

        def index_put(s=slots["typical"]):
            b, o = s // page, s % page
            k_cache[b, o] = k
            v_cache[b, o] = v

        fns = {f"ours_{n}": (lambda s=s: kv_cache_update(key=k, value=v, kv_cache=cache,
                                                         slot_mapping=s, k_scale=None,
                                                         v_scale=None))
               for n, s in slots.items()}
        fns["index_put"] = index_put
        # every contender must write k and v at its slots (ours also clears entered pages'
        # tails, which index_put does not: only the written rows are compared, exactly)
        checks = {}
        for n, fn in fns.items():
            s = slots[n[len("ours_"):]] if n.startswith("ours_") else slots["typical"]
            cache.zero_()
            fn()
            written = torch.stack([k_cache[s // page, s % page], v_cache[s // page, s % page]])
            checks[n] = cross_check(written, torch.stack([k, v]), 0.0)
            if not checks[n]["agree"]:
                print(f"B={batch} page={page} {n}: {check_text(checks[n])}", flush=True)
        samples = {n: [] for n in fns}
        names = list(fns)
        for r in range(args.rounds):
            for n in names[r % len(names):] + names[:r % len(names)]:
                samples[n].append(do_bench_cudagraph(fns[n], rep=20, return_mode="median"))
        us = {n: statistics.median(v) * 1e3 for n, v in samples.items()}
        written = 2 * batch * HKV * D * 2  # K and V rows, bytes
        rows.append({"batch": batch, "page": page, "us": us, "bytes_written": written,
                     "cross_check": checks,
                     "mismatch": [n for n, c in checks.items() if not c["agree"]]})
        print(f"B={batch:<5} page={page:<4} " + "  ".join(f"{n} {t:.2f} us" for n, t in
                                                     us.items()), flush=True)
    write_json(args.out, {**run_info("bench_kv_write"), "device": torch.cuda.get_device_name(),
                          "rounds": args.rounds, "rows": rows,
                          "method": "median over rotating rounds of do_bench_cudagraph medians"})


if __name__ == "__main__":
    main()
