"""Where CUDA-graph decode time goes at small batches: each contender captured in a CUDA graph,
its replays profiled kernel by kernel (torch.profiler, CUPTI), beside the replay time.

At B=1 ctx 4k FLASHINFER's graph decode gave 1.07 TB/s where the same kernel planned eagerly
(decode_kernel's chunks) gave 1.73 and FlashInfer's own graph mode 1.43
(bench_cudagraph_decode_h200.json at ee1ac50): this lists the kernels of each. (At ee1ac50:
the graph plan's kernel 9.2 us against 7.3 eagerly, and two small kernels zeroing the padding
rows, 3.3 us more; ``ours_graph_chunks`` there: decode_kernel's fixed chunks on FlashInfer's
padded grid, 9.9 us. ``ours_graph_fi_rule``: ``flashinfer.GRAPH_ONE_CTA_PER_SM`` off.)

    python benchmarks/exp/exp_graph_decode.py [--out PATH]
"""

from __future__ import annotations

import collections
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_cudagraph_decode import flashinfer_graph_mode, graph_flashinfer_rule  # noqa: E402
from bench_gpu_attention import Batch, decode_bytes, ours  # noqa: E402

POINTS = ((1, 4096), (4, 1024), (1, 32768), (8, 8192))


def profile(fn, replays: int = 50) -> tuple[float, list[tuple[str, float, int]]]:
    """(replay µs, [(kernel, µs per replay, launches per replay)]) of ``fn`` as a graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(20):
        g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(200):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    replay_us = start.elapsed_time(end) * 1e3 / 200
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            g.replay()
        torch.cuda.synchronize()
    per = collections.defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name[:90]][0] += e.device_time / replays
            per[e.name[:90]][1] += 1
    return replay_us, [(k, v[0], v[1] // replays) for k, v in per.items()]


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    rows = []
    for bsz, ctx in POINTS:
        b = Batch(bsz, ctx, 1, 128, gen)
        fns = {"ours": ours(b, "FLASHINFER"), "ours_graph": ours(b, "FLASHINFER", graph=True),
               "ours_graph_fi_rule": graph_flashinfer_rule(b),
               "flashinfer_graph": flashinfer_graph_mode(b),
               "triton_graph": ours(b, "TRITON_ATTN", graph=True)}
        for name, fn in fns.items():
            us, kernels = profile(fn)
            tbs = decode_bytes(bsz, ctx) / us / 1e6
            print(f"B={bsz} ctx={ctx} {name}: replay {us:.1f} us ({tbs:.2f} TB/s)", flush=True)
            for k, t, n in kernels:
                print(f"    {t:7.2f} us x{n}  {k}")
            rows.append({"batch": bsz, "ctx": ctx, "contender": name, "replay_us": us,
                         "kernels": kernels})
        del b, fns
    out = os.path.join(os.environ.get("OUT", "/tmp"), "exp_graph_decode_h200.json")
    with open(out, "w") as f:
        json.dump({"commit": os.environ.get("ATTN_OPS_COMMIT"), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
