"""A batch of requests over one long shared prefix on a hybrid model, with and without the
prefix cache: the tokens each run computes, its time to every request's first token, and
whether the cached run's first-token logits are the uncached run's.

Model (GPU): a Qwen3-Next-shaped hybrid -- hidden 2048, ``--layers`` 8 with every 4th an
attention layer (16 query / 2 KV heads of 256, paged, bf16), the others ``--kind``'s
recurrent layers (Gated DeltaNet 16 key / 32 value heads of 128; Mamba2 64 heads x 64, d_state
128; Mamba1 d_inner 4096, d_state 16; lightning attention 16 heads of 128; fp32 states),
dense MLP 5120, vocab 32000 (the model returns every token's logits: a 151936 vocab would
need 10x their memory at these step sizes). ``--batch`` 32 requests of a ``--prefix`` 8192-token
shared prefix and ``--suffix`` 64 tokens of their own, all added before the first step.

* ``uncached``: every request prefills its whole prompt, ``--step-tokens`` tokens a request
  a step (chunked prefill).
* ``cached``: the prefix cache on (state checkpoints every ``--checkpoint-every`` blocks and
  at each prompt's last full block). The first request prefills; the others wait for its
  checkpoint at the end of the shared prefix, take its KV blocks and states, and compute
  their suffixes.

Both runs step until every request has its first generated token; eager steps (the model's
prefill is compute-bound: no graphs). Reported: tokens computed, steps, wall time to the last
first token (device synchronized), and per request the first-token logits of the cached run
against the uncached one (max |diff| over max |logit|; same greedy token). Speedup =
uncached / cached time, printed only where every request's logits agreed.

    python benchmarks/bench_prefix_cache.py [--kind gated_deltanet] [--batch 32]
        [--prefix 8192] [--suffix 64] [--layers 8] [--step-tokens 1024]
        [--checkpoint-every 64] [--quick] [--out PATH]

``--quick``: CPU, tiny model and prompts (keeps the script working in CI).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import run_info, write_json  # noqa: E402

# Largest max |cached - uncached| / max |uncached| of a request's first-token logits: the two
# runs cut the prefix into different steps (bf16 activations, chunked recurrences), so their
# logits differ by a few bf16 ulps; fp32 (--quick) by rounding only.
TOLERANCE = {torch.bfloat16: 5e-2, torch.float32: 1e-4}


def config(args, dtype):
    from attn_ops.backends.ssm.spec import (GatedDeltaNetSpec, LightningSpec, Mamba1Spec,
                                           Mamba2Spec)
    from attn_ops.models.hybrid import HybridConfig

    if args.quick:
        return HybridConfig(vocab_size=128, hidden_size=64, num_layers=4, num_heads=4,
                            num_kv_heads=2, head_dim=16, intermediate_size=128, dtype=dtype,
                            max_position=args.prefix + args.suffix + 8, linear_kind=args.kind)
    return HybridConfig(
        vocab_size=32000, hidden_size=2048, num_layers=args.layers, num_heads=16,
        num_kv_heads=2, head_dim=256, intermediate_size=5120, dtype=dtype,
        max_position=args.prefix + args.suffix + 8, linear_kind=args.kind,
        gdn=GatedDeltaNetSpec(num_k_heads=16, num_v_heads=32, head_k_dim=128, head_v_dim=128,
                              dtype=dtype),
        mamba2=Mamba2Spec(num_heads=64, head_dim=64, d_state=128, n_groups=1, dtype=dtype),
        mamba1=Mamba1Spec(d_inner=4096, d_state=16, dtype=dtype), mamba1_dt_rank=128,
        lightning=LightningSpec(num_heads=16, head_dim=128, dtype=dtype))


def serve(model, prompts, args, device, prefix_caching: bool) -> dict:
    """Every request of ``prompts`` to its first generated token: the run's counts and time
    and each request's first-token logits."""
    from attn_ops.models.hybrid import HybridGenerator

    bs = model.block_size
    longest = max(len(p) for p in prompts.values()) + 2
    blocks = len(prompts) * -(-longest // bs) + 8
    gen = HybridGenerator(model, blocks, 2 * len(prompts) + 8, max_model_len=longest,
                          device=device, prefix_caching=prefix_caching,
                          checkpoint_every=args.checkpoint_every)
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for r, p in prompts.items():
        gen.add(r, p)
    first, steps = {}, 0
    while len(first) < len(prompts):
        last = gen.step(max_new_tokens=args.step_tokens)
        steps += 1
        for r, row in zip(gen.step_ids, last):
            if r not in first and gen.requests[r][1] == len(prompts[r]):
                first[r] = row.clone()
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return {"tokens_computed": gen.tokens_computed, "steps": steps, "seconds": seconds,
            "computed_on_add": dict(gen.computed_on_add), "first": first}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kind", default="gated_deltanet",
                        choices=["gated_deltanet", "mamba2", "mamba1", "lightning"])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prefix", type=int, default=8192)
    parser.add_argument("--suffix", type=int, default=64)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--step-tokens", type=int, default=1024)
    parser.add_argument("--checkpoint-every", type=int, default=64)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."),
                                                      "bench_prefix_cache.json"))
    args = parser.parse_args()
    device = "cpu" if args.quick or not torch.cuda.is_available() else "cuda"
    if args.quick:
        args.batch, args.prefix, args.suffix, args.step_tokens = 4, 100, 5, 32
        args.checkpoint_every = 2
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    from attn_ops import AttentionConfig
    from attn_ops.models.hybrid import HybridModel

    cfg = config(args, dtype)
    torch.manual_seed(0)
    with torch.device(device):
        model = HybridModel(cfg, AttentionConfig(backend="CPU_ATTN" if device == "cpu"
                                                 else None)).to(dtype).eval()
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(cfg.vocab_size, (args.prefix,), generator=g).tolist()
    prompts = {r: shared + torch.randint(cfg.vocab_size, (args.suffix,), generator=g).tolist()
               for r in range(args.batch)}
    serve(model, {0: shared[:2 * model.block_size + 1]}, args, device, False)  # (warm-up)
    runs = {name: serve(model, prompts, args, device, name == "cached")
            for name in ("uncached", "cached")}
    errors, same_token = {}, {}
    for r in prompts:
        a, b = runs["cached"]["first"][r].float(), runs["uncached"]["first"][r].float()
        errors[r] = ((a - b).abs().max() / b.abs().max()).item()
        same_token[r] = bool(a.argmax() == b.argmax())
    agree = max(errors.values()) <= TOLERANCE[dtype]
    row = {name: {k: v for k, v in run.items() if k != "first"} for name, run in runs.items()}
    row["logits_max_rel_err"] = max(errors.values())
    row["same_first_token"] = sum(same_token.values())
    row["agree"] = agree
    row["speedup"] = runs["uncached"]["seconds"] / runs["cached"]["seconds"] if agree else None
    for name in ("uncached", "cached"):
        run = runs[name]
        print(f"{args.kind:14s} {name:9s} {run['tokens_computed']:8d} tokens computed in "
              f"{run['steps']:3d} steps, {run['seconds'] * 1e3:9.1f} ms to every first token",
              flush=True)
    print(f"{args.kind:14s} first-token logits: max rel err {row['logits_max_rel_err']:.1e} "
          f"(tolerance {TOLERANCE[dtype]:.0e}), same greedy token {row['same_first_token']}/"
          f"{args.batch}; speedup " + (f"{row['speedup']:.2f}x" if agree else "- (mismatch)"),
          flush=True)
    info = run_info("bench_prefix_cache")
    info.update(quick=args.quick, device=torch.cuda.get_device_name() if device == "cuda"
                else "cpu", kind=args.kind, batch=args.batch, prefix=args.prefix,
                suffix=args.suffix, layers=cfg.num_layers, step_tokens=args.step_tokens,
                checkpoint_every=args.checkpoint_every, block_size=model.block_size,
                dtype=str(dtype), tolerance=TOLERANCE[dtype], rows=[row])
    write_json(args.out, info)


if __name__ == "__main__":
    main()
