"""Compile time against depth: TinyLlama with 4 and 32 layers (alternating sliding-window
layers), compiled whole (``torch.compile(model, fullgraph=True)``) and by layer
(``TinyLlama.compile_layers``: regional compilation), each in a fresh process with empty
Inductor/Triton caches; the time to the first output of one prefill step, and how many graphs
Dynamo compiled. Goal: 32 layers in at most 1.2x the time of 4.

    python benchmarks/bench_compile_time.py [--quick] [--out PATH]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import cpu_bench_parser, default_out, run_info, write_json  # noqa: E402

CHILD = r'''
import json, sys, time, torch
from torch._dynamo.utils import counters
from attn_ops import build_step_metadata
from attn_ops.metadata import build_batch
from attn_ops.models.llama import Generator, ModelConfig, TinyLlama
mode, layers, backend = sys.argv[1], int(sys.argv[2]), sys.argv[3]
torch.manual_seed(0)
cfg = ModelConfig(num_layers=layers, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                  intermediate_size=128, vocab_size=128, sliding_window=12,
                  sliding_window_every=2)
model = TinyLlama(cfg).eval()
gen = Generator(model, 64, max_model_len=128)
gen.add(0, [1, 2, 3, 4, 5])
meta = build_batch(gen.allocator, [0], [0], [5], max_blocks_per_req=gen.max_blocks_per_req)
step = build_step_metadata(model, meta)
fn = torch.compile(model, fullgraph=True, dynamic=True, backend=backend) if mode == "whole" \
    else model.compile_layers(backend=backend)
t0 = time.perf_counter()
with torch.no_grad():
    fn(torch.tensor([1, 2, 3, 4, 5]), meta.positions, gen.kv_caches, step)
print(json.dumps({"seconds": time.perf_counter() - t0,
                  "graphs": counters["stats"]["unique_graphs"]}))
'''


def run(mode: str, layers: int, backend: str) -> dict:
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache,
               "TRITON_CACHE_DIR": os.path.join(cache, "triton")}
        res = subprocess.run([sys.executable, "-c", CHILD, mode, str(layers), backend], env=env,
                             capture_output=True, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    args = cpu_bench_parser("bench_compile_time", __doc__).parse_args()
    depths = (1,) if args.quick else (4, 32)
    # (--quick: a smoke run of the script -- Dynamo's fullgraph trace without Inductor's C++
    # builds, which cost most of a CPU run)
    backend = "aot_eager" if args.quick else "inductor"
    rows = []
    for mode in ("layers",) if args.quick else ("layers", "whole"):
        times = {d: run(mode, d, backend) for d in depths}
        ratio = times[depths[-1]]["seconds"] / times[depths[0]]["seconds"]
        rows.append({"mode": mode, **{f"{d}_layers": times[d] for d in depths},
                     "ratio": ratio})
        print(f"{mode:7s} " + "  ".join(f"{d} layers {t['seconds']:.1f} s ({t['graphs']} graphs)"
                                        for d, t in times.items())
              + f"  ratio {ratio:.2f}", flush=True)
    info = run_info("bench_compile_time")
    info.update(quick=args.quick, backend=backend, rows=rows,
                method="fresh process and empty Inductor cache "
                "per point; time to the first output of one 5-token prefill step")
    out = args.out or default_out("bench_compile_time", args.quick)
    write_json(out, info)


if __name__ == "__main__":
    main()
