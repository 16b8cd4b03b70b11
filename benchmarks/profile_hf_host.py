"""The host time of ``attn_ops.hf.cache``'s graphed decode step, on a CPU: what each attention
call costs the host when a layer's write and attention replay from a CUDA graph.

    python benchmarks/profile_hf_host.py [--batches 1 8 64] [--layers 8] [--runs 3] [--out PATH]

A CPU stand-in, not a GPU measurement: HF transformers' ``generate`` on a tiny Llama (the CI
tests' shapes) runs with an ``hf.cache`` whose decode steps take the graph path as on a GPU --
the step padded into graph buffers, each backend's graph metadata built, every layer's inputs
copied into its graph's -- but with CUDA graphs that do nothing when captured or replayed (the
first step of a layer runs its ops eagerly, as the warm-up does; later steps return the
captured output). Reported per batch, the minimum over ``--runs`` generations: the step's first
attention call (which makes the step's plan), the median of the other layers' calls, sdpa's
call on the same weights (its attention computed, on the CPU) and the decode step's time of
each. The outputs of the stand-in are not the model's (the replays compute nothing).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import warnings

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import run_info, write_json  # noqa: E402


class _Graph:  # (a CUDA graph that captures and replays nothing)
    def capture_begin(self, **kwargs):
        pass

    def capture_end(self):
        pass

    def replay(self):
        pass

    def pool(self):
        return None


class _Stream:
    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream):
        pass


def _stand_in() -> None:
    """CUDA graphs and streams replaced by objects that do nothing; every attention layer
    declared to replay uniform decodes, its backend's graph metadata the padded batch itself;
    the cache's decode steps on the graph path on any device."""
    import attn_ops.backend as backend
    import attn_ops.layers.attention as attention
    from attn_ops.capabilities import CUDAGraphSupport
    from attn_ops.hf import owned_cache

    torch.cuda.CUDAGraph = _Graph
    torch.cuda.Stream = _Stream
    torch.cuda.stream = lambda stream: contextlib.nullcontext()
    torch.cuda.current_stream = lambda *args: _Stream()
    attention.Attention.cudagraph_support = property(
        lambda self: CUDAGraphSupport.UNIFORM_SINGLE_TOKEN_DECODE)
    backend.AttentionBackend.graph_metadata = lambda self, padded, graphs: padded
    owned_cache._Steps._graphs_on = staticmethod(lambda device: True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."),
                                                      "profile_hf_host_cpu.json"))
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from attn_ops import hf
    from bench_hf import _model

    _stand_in()
    hf.register()
    torch.set_num_threads(1)
    sdpa = _model("sdpa", args.layers, True, "cpu", torch.float32)
    ours = _model("attn_ops", args.layers, True, "cpu", torch.float32, sdpa.state_dict())
    calls: dict[str, list[float]] = {"attn_ops": [], "sdpa": []}
    for name in calls:
        fn = ALL_ATTENTION_FUNCTIONS[name]

        def timed(*a, _fn=fn, _name=name, **k):
            t0 = time.perf_counter()
            out = _fn(*a, **k)
            calls[_name].append(time.perf_counter() - t0)
            return out

        ALL_ATTENTION_FUNCTIONS[name] = timed
    n, layers = args.new_tokens, args.layers
    rows = []
    for b in args.batches:
        ids = torch.randint(1, 101, (b, args.prompt), generator=torch.Generator().manual_seed(b))

        def generate(model, cache):
            extra = {"past_key_values": hf.cache(model, b, args.prompt + n)} if cache else {}
            with torch.no_grad():
                model.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=0, **extra)

        generate(ours, True)
        best = None
        for _ in range(args.runs):
            for c in calls.values():
                c.clear()
            t0 = time.perf_counter()
            generate(sdpa, False)
            t1 = time.perf_counter()
            generate(ours, True)
            t2 = time.perf_counter()
            # (the decode steps' calls: the prefill's layers first)
            ours_steps = np.array(calls["attn_ops"][layers:]).reshape(-1, layers)
            got = dict(sdpa_step_ms=(t1 - t0) / n * 1e3, attn_ops_step_ms=(t2 - t1) / n * 1e3,
                       sdpa_call_us=float(np.median(calls["sdpa"][layers:])) * 1e6,
                       first_call_us=float(np.median(ours_steps[:, 0])) * 1e6,
                       other_calls_us=float(np.median(ours_steps[:, 1:])) * 1e6)
            best = got if best is None else {k: min(v, best[k]) for k, v in got.items()}
        rows.append(dict(batch=b, **best))
        print(f"B={b:<3} step: sdpa {best['sdpa_step_ms']:.2f} ms, attn_ops (graph path, "
              f"stand-in) {best['attn_ops_step_ms']:.2f} ms | attention call: sdpa "
              f"{best['sdpa_call_us']:.0f} us, attn_ops first layer {best['first_call_us']:.0f} "
              f"us, other layers {best['other_calls_us']:.0f} us")
    info = run_info("profile_hf_host")
    info.update(layers=layers, prompt=args.prompt, new_tokens=n, runs=args.runs, rows=rows,
                method="CPU stand-in: CUDA graphs that do nothing, the graph path forced on; "
                       "minimum over runs of each figure")
    write_json(args.out, info)


if __name__ == "__main__":
    main()
