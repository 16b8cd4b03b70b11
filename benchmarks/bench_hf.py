"""HF transformers with attn_ops against its own implementations, in one run: plain
``generate`` (``"attn_ops"`` over the cache ``generate`` makes for it -- attn_ops pages -- and
over HF's ``DynamicCache`` asked for by name, against ``"sdpa"``) at several batch sizes,
and continuous batching (``generate_batch`` with ``"paged|attn_ops"`` against
``"paged|sdpa"``) where the installed transformers accepts a third-party paged name.

``attn_ops`` replays its decode steps from per-layer CUDA graphs on a GPU (``attn_ops.hf.cache``),
``attn_ops_eager`` runs them eagerly (``hf.cache(..., cuda_graphs=False)``).

Model: an 8-layer Llama-3-8B-shaped ``LlamaForCausalLM`` (hidden 4096, 32 / 8 heads of 128,
MLP 14336, vocab 32000), bf16, random weights. Plain ``generate``: ``batch`` prompts of ``ctx``
tokens, ``new`` greedy tokens; decode tokens/s = batch x (new - 1) / (time - time of a
1-token generate), the best of two rounds that each time every contender once in turn.
``generate_batch``: ``requests`` prompts of ``ctx`` tokens, ``new`` and ``2 x new`` greedy
tokens each (HF's scheduler, its default config but the sizes below, page 256);
tokens/s = requests x 2 new / time, decode tokens/s = requests x new / (time at 2 new - time at
new), and attn_ops' layers' paged mode (``describe``: in place over HF's pages, or why not).
Every contender's tokens are cross-checked against sdpa's: both models' logits teacher-forced
over sdpa's sequence differ by ``logit_err``, and a request whose greedy tokens part from
sdpa's must part at a near-tie (sdpa's margin between the two tokens within twice that
error; random weights give nearly flat logits, so bf16 rounding decides some argmaxes). A
ratio is printed only where the contender agrees.

    python benchmarks/bench_hf.py [--batches 1 8 64] [--ctx 2048] [--new 32] [--requests 64]
        [--layers 8] [--quick] [--profile [B ...]] [--backends BACKEND ...] [--out PATH]

``--backends``: more plain-``generate`` contenders, ``attn_ops:BACKEND`` -- a model of the same
weights whose every layer is forced to ``BACKEND`` -- in the same rounds and cross-checks, so
the selector's choice is compared with another backend in one run.

``--profile [B ...]``: before the rows, each contender's host time at batch sizes ``B`` (none
given: the first of ``--batches``; a ``generate`` of ``new`` tokens under cProfile: the
functions with the most time of their own, then attn_ops', FlashInfer's and Triton's launch
functions by time with their callees, then ``torch.profiler``'s ops and CUDA runtime calls by
host time of their own and kernels by device time; every contender in one
``profile_hf_b<B>.txt`` beside ``--out``, with each one's op-by-op host difference from sdpa's
in the same run), its decode steps timed on the host clock without a profiler (the period,
the forward's host time, its attention calls', the time between forwards:
:func:`step_timeline`; every contender in two interleaved rounds before any profiler runs,
the faster kept) and, on a GPU, the host-device synchronizations of its decode steps
(``torch.cuda.set_sync_debug_mode``: each distinct place that synchronizes, counted).
"""

from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import ratio_text, run_info, write_json  # noqa: E402


def _model(impl: str, layers: int, quick: bool, device: str, dtype, state=None):
    import transformers

    kw = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
              num_key_value_heads=8, head_dim=128, vocab_size=32000)
    if quick:
        kw = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=101)
    config = transformers.LlamaConfig(**kw, num_hidden_layers=layers, pad_token_id=0,
                                      max_position_embeddings=8192, attn_implementation=impl)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(device, dtype).eval()
    if state is not None:
        model.load_state_dict(state)
    return model


def _forced_model(backend: str, layers: int, quick: bool, device: str, dtype, state):
    """A model running ``"attn_ops"`` whose every layer runs ``backend``: its layers are built
    at their first call under the config :func:`attn_ops.hf.register` was given, so one
    forward under ``AttentionConfig(backend=backend)`` builds them (the registration is then
    restored; layers built keep theirs)."""
    from attn_ops import AttentionConfig, hf

    model = _model("attn_ops", layers, quick, device, dtype, state)
    hf.register(AttentionConfig(backend=backend))
    try:
        with torch.no_grad():
            model(torch.ones(1, 2, dtype=torch.long, device=device))
    finally:
        hf.register()
    return model


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def _once(fn, device):
    """(seconds of one call, from an idle device to its end; the result)."""
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    return time.perf_counter() - t0, out


def _timed(fn, device, repeats: int = 2):
    """(best seconds of ``repeats`` calls after one warm-up, the last result)."""
    out = fn()
    best = float("inf")
    for _ in range(repeats):
        seconds, out = _once(fn, device)
        best = min(best, seconds)
    return best, out


def teacher_forced(model, prompts, ref_new) -> torch.Tensor:
    """``model``'s logits (fp32, CPU) at the ``n`` positions that chose ``ref_new`` [B, n],
    the reference's greedy tokens after ``prompts`` [B, ctx], fed that sequence."""
    n = ref_new.shape[1]
    seq = torch.cat([prompts, ref_new.to(prompts.device)], 1)[:, :-1]
    with torch.no_grad():
        return model(seq, logits_to_keep=n).logits.float().cpu()


def agreement(want, got, ref_new, new) -> dict:
    """A model's greedy tokens ``new`` [B, n] against the reference's ``ref_new``, from both
    models' :func:`teacher_forced` logits over the reference's sequence (``want``, ``got``):
    they differ by at most ``logit_err``; the requests whose tokens equal the reference's, and
    the largest margin the reference gave its token over the model's where a request first
    parts from it. ``agrees``: each parting is a near-tie (margin <= 2 x logit_err) and
    logit_err is within bf16's reach."""
    err = (got - want).abs().max().item()
    parted = new != ref_new
    margin = 0.0
    for r in parted.any(1).nonzero().flatten().tolist():
        j = int(parted[r].int().argmax())
        margin = max(margin, (want[r, j, ref_new[r, j]] - want[r, j, new[r, j]]).item())
    scale = want.abs().max().item()
    return {"same_requests": int((~parted.any(1)).sum()), "requests": int(new.shape[0]),
            "logit_err": err, "parting_margin": margin,
            "agrees": margin <= 2 * err and err <= 0.05 * max(scale, 1e-6)}


def _agreement_text(check: dict) -> str:
    return (f"{check['same_requests']}/{check['requests']} same, logit err "
            f"{check['logit_err']:.1e}, parting margin {check['parting_margin']:.1e}: "
            + ("agree" if check["agrees"] else "DISAGREE"))


def _decode_rates(models: dict, ids, new: int, device, rounds: int = 2) -> dict:
    """Each contender's ``(decode tokens/s, seconds, tokens)`` of a greedy ``generate`` of
    ``new`` tokens (an exception's text where it fails): batch x (new - 1) over its time less
    a 1-token generate's, each the best of ``rounds`` rounds that time every contender once in
    turn after one warm-up each -- so whatever state the process drifts into as it runs
    (allocator, caches, clocks) falls on all of them alike, not on whichever runs last."""
    fns, out, best = {}, {}, {}
    for name, model in models.items():
        fns[name] = (_generate_fn(model, name, ids, new), _generate_fn(model, name, ids, 1))
        try:
            out[name] = fns[name][0]()
            fns[name][1]()
        except Exception as e:  # noqa: BLE001 -- recorded; the others go on
            out[name] = f"{type(e).__name__}: {str(e)[:200]}"
        best[name] = [float("inf"), float("inf")]
    for _ in range(rounds):
        for name, (full, first) in fns.items():
            if isinstance(out[name], str):
                continue
            seconds, out[name] = _once(full, device)
            best[name][0] = min(best[name][0], seconds)
            best[name][1] = min(best[name][1], _once(first, device)[0])
    return {name: out[name] if isinstance(out[name], str) else
            (ids.shape[0] * (new - 1) / max(best[name][0] - best[name][1], 1e-9),
             best[name][0], out[name]) for name in models}


def plain_rows(args, models, device) -> list[dict]:
    rows = []
    g = torch.Generator().manual_seed(1)
    for batch in args.batches:
        ids = torch.randint(1, models["sdpa"].config.vocab_size, (batch, args.ctx),
                            generator=g).to(device)
        row, tokens = {"batch": batch, "ctx": args.ctx, "new": args.new}, {}
        for name, got in _decode_rates(models, ids, args.new, device).items():
            if isinstance(got, str):
                row[f"{name}_error"] = got
                print(f"B={batch} {name}: {got}", flush=True)
                continue
            rate, full, out = got
            tokens[name] = out[:, args.ctx:].cpu()
            row[f"{name}_decode_tok_s"], row[f"{name}_s"] = rate, full
        forced = {}  # (once a model: attn_ops over its pages and over HF's cache is one)

        def logits_of(model):
            if id(model) not in forced:
                forced[id(model)] = teacher_forced(model, ids, tokens["sdpa"])
            return forced[id(model)]

        for name in tokens:
            if name == "sdpa" or "sdpa" not in tokens:
                continue
            check = row[f"{name}_check"] = agreement(
                logits_of(models["sdpa"]), logits_of(models[name]), tokens["sdpa"],
                tokens[name])
            row[f"{name}_vs_sdpa"] = (row[f"{name}_decode_tok_s"] / row["sdpa_decode_tok_s"]
                                      if check["agrees"] else None)
        rows.append(row)
        print(f"generate B={batch:<3d} " + "  ".join(
            f"{n} {row[f'{n}_decode_tok_s']:9.1f} tok/s" for n in tokens) + "  " + ", ".join(
            f"{n} {ratio_text(row.get(f'{n}_vs_sdpa'))} ({_agreement_text(row[f'{n}_check'])})"
            for n in tokens if f"{n}_check" in row), flush=True)
    return rows


def _generate_fn(model, name, ids, new):
    import inspect

    from attn_ops import hf

    # (transformers 5.2x names generate's cache argument cache=, earlier ones past_key_values=)
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters \
        else "past_key_values"

    def run():
        extra = {"cache_implementation": "dynamic"} if name == "attn_ops_dynamic" else {}
        if name == "attn_ops_eager":  # (the cache generate makes by default, graphs off)
            extra = {cache_arg: hf.cache(model, ids.shape[0], ids.shape[1] + new,
                                         cuda_graphs=False)}
        with torch.no_grad():
            return model.generate(ids, max_new_tokens=new, do_sample=False, pad_token_id=0,
                                  **extra)
    return run


def profile_hosts(args, models, device) -> dict:
    """Each contender's host profile and device synchronizations (``--profile``), by batch
    size."""
    found = {}
    for batch in args.profile or args.batches[:1]:
        found[batch] = _profile_batch(args, models, device, batch)
    return found


def _profile_batch(args, models, device, batch: int) -> dict:
    import cProfile
    import io
    import pstats
    import warnings

    ids = torch.randint(1, models["sdpa"].config.vocab_size, (batch, args.ctx),
                        generator=torch.Generator().manual_seed(3)).to(device)
    found, sections, host_ops = {}, [], {}
    runs = {name: _generate_fn(model, name, ids, args.new) for name, model in models.items()}
    for run in runs.values():
        run()
        _sync(device)
    # (the timelines first, in interleaved rounds, each contender's faster one kept: before
    # any profiler has run in the process, and with its drift falling on all contenders alike)
    timelines: dict[str, dict] = {}
    for _ in range(2):
        for name, model in models.items():
            got = step_timeline(model, runs[name])
            if name not in timelines or got["step_ms"] < timelines[name]["step_ms"]:
                timelines[name] = got
    for name in models:
        run, timeline = runs[name], timelines[name]
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        run()
        prof.disable()
        _sync(device)
        seconds = time.perf_counter() - t0
        text = io.StringIO()
        stats = pstats.Stats(prof, stream=text)
        stats.sort_stats("tottime").print_stats(30)
        # (then where the attention path's time goes, callees included)
        stats.sort_stats("cumulative").print_stats("attn_ops|flashinfer|triton/runtime", 40)
        kernels, host_ops[name] = _torch_profile(run, device)
        text.write(kernels)
        sections.append(f"===== {name}, batch {batch}\n" + text.getvalue())
        syncs: dict[str, int] = {}
        allocator = {}
        if device == "cuda":  # (one generate's synchronizing places, and its caching
            # allocator's trips to the driver: a cudaMalloc / cudaFree, or a retry after freeing
            # its cache, stalls the host and, for a free, the device -- invisible to the sync
            # debug mode)
            keys = ("num_device_alloc", "num_device_free", "num_alloc_retries",
                    "num_sync_all_streams")
            before = torch.cuda.memory_stats()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    run()
                finally:
                    torch.cuda.set_sync_debug_mode(0)
            _sync(device)
            after = torch.cuda.memory_stats()
            allocator = {k: after.get(k, 0) - before.get(k, 0) for k in keys}
            for w in caught:
                if "synchroniz" in str(w.message):
                    where = f"{os.path.relpath(w.filename)}:{w.lineno}"
                    syncs[where] = syncs.get(where, 0) + 1
        found[name] = {"profiled_s": seconds, "syncs": syncs, "allocator": allocator,
                       "timeline": timeline}
        top = [line for line in text.getvalue().splitlines()
               if line.strip()[:1].isdigit() and ("{" in line or ".py:" in line)][:8]
        print(f"profile B={batch} {name}: decode step {timeline['step_ms']:.3f} ms = forward "
              f"{timeline['forward_ms']:.3f} (attention calls {timeline['attention_ms']:.3f}, "
              f"{timeline['attention_calls']} a step) + between forwards "
              f"{timeline['between_ms']:.3f} (medians, host clock, no profiler); "
              f"{seconds * 1e3:.1f} ms for {args.new} tokens under "
              f"cProfile; {sum(syncs.values())} synchronizations; allocator {allocator}"
              + "".join(f"\n    sync x{n} at {w}" for w, n in sorted(syncs.items()))
              + "".join(f"\n    {line}" for line in top), flush=True)
    for name in (n for n in host_ops if n != "sdpa" and "sdpa" in host_ops):
        sections.append(_host_difference(name, host_ops[name], host_ops["sdpa"]))
    folder = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"profile_hf_b{batch}.txt")  # (one file: a call returns few)
    with open(path, "w") as f:
        f.write("\n\n".join(sections))
    for row in found.values():
        row["profile"] = path
    return found


def step_timeline(model, run) -> dict:
    """One ``run`` (a ``generate``) timed on the host clock at the model's forward calls and
    its attention function's calls -- no profiler, no synchronization added: the medians over
    the decode steps (every forward after the prefill) of the period from one forward's start
    to the next (``step_ms``), the forward's own host time (``forward_ms``; it returns when
    its launches are queued, unless something in it waits on the device), the attention
    calls' host time within it and the time between forwards (``between_ms``: generate's own
    Python, and its wait on the device where it reads the step's tokens)."""
    import statistics

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = model.config.get_text_config(decoder=True)._attn_implementation
    spans, calls = [], []
    attention = ALL_ATTENTION_FUNCTIONS[name]

    def timed(*a, **k):
        t0 = time.perf_counter()
        try:
            return attention(*a, **k)
        finally:
            calls.append((t0, time.perf_counter()))

    def before(module, args, kwargs):
        spans.append([time.perf_counter(), None])

    def after(module, args, kwargs, out):
        spans[-1][1] = time.perf_counter()

    hooks = [model.register_forward_pre_hook(before, with_kwargs=True),
             model.register_forward_hook(after, with_kwargs=True)]
    ALL_ATTENTION_FUNCTIONS[name] = timed
    try:
        run()
    finally:
        ALL_ATTENTION_FUNCTIONS[name] = attention
        for hook in hooks:
            hook.remove()
    decode = spans[1:]  # (the first forward is the prefill)
    if len(decode) < 2:
        return {"step_ms": float("nan"), "forward_ms": float("nan"),
                "attention_ms": float("nan"), "between_ms": float("nan"),
                "attention_calls": 0, "steps": len(decode)}
    step = [b[0] - a[0] for a, b in zip(decode, decode[1:])]
    forward = [e - s for s, e in decode]
    inside = [sum(e - s for s, e in calls if start <= s and e <= end) for start, end in decode]
    n_calls = sum(1 for s, e in calls if decode[0][0] <= s and e <= decode[0][1])
    ms = lambda xs: statistics.median(xs) * 1e3  # noqa: E731
    return {"step_ms": ms(step), "forward_ms": ms(forward), "attention_ms": ms(inside),
            "between_ms": ms([b[0] - a[1] for a, b in zip(decode, decode[1:])]),
            "attention_calls": n_calls, "steps": len(decode)}


def _host_difference(name: str, ours: dict, sdpa: dict, rows: int = 25) -> str:
    """The ops whose host time of their own differs most between ``name``'s run and sdpa's,
    same process, same machine (torch.profiler; ms over the profiled generate, calls)."""
    lines = [f"===== {name} against sdpa: host time of their own, ms (calls)"]
    ops = sorted(set(ours) | set(sdpa), key=lambda op: -abs(ours.get(op, (0, 0))[0]
                                                            - sdpa.get(op, (0, 0))[0]))
    for op in ops[:rows]:
        (a, na), (b, nb) = ours.get(op, (0.0, 0)), sdpa.get(op, (0.0, 0))
        lines.append(f"{a - b:+9.2f}  {name} {a:8.2f} ({na:5d})  sdpa {b:8.2f} ({nb:5d})  {op}")
    total_a = sum(v[0] for v in ours.values())
    total_b = sum(v[0] for v in sdpa.values())
    lines.append(f"{total_a - total_b:+9.2f}  {name} {total_a:8.2f}  sdpa {total_b:8.2f}  (all)")
    return "\n".join(lines)


def _torch_profile(run, device) -> tuple[str, dict]:
    """``run`` under ``torch.profiler``: the ops and the CUDA runtime calls (launches, copies,
    synchronizations) by host time of their own, and the kernels by device time -- what
    cProfile cannot see: the host time spent inside C++ and waiting on the device; and
    ``{op: (host ms of its own, calls)}``."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        run()
    _sync(device)
    table = prof.key_averages()
    text = "\n\ntorch.profiler, by host time of their own:\n" + table.table(
        sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60)
    if device == "cuda":
        text += "\ntorch.profiler, by device time:\n" + table.table(
            sort_by="self_device_time_total", row_limit=15, max_name_column_width=60)
    return text, {e.key: (e.self_cpu_time_total / 1e3, e.count) for e in table}


def batch_row(args, state, device, dtype) -> dict:
    """``generate_batch`` with paged|attn_ops against paged|sdpa (where it registers)."""
    import transformers

    from attn_ops import hf

    note = hf.register().paged_note
    if note:
        print(f"generate_batch: skipped ({note})", flush=True)
        return {"skipped": note}
    g = torch.Generator().manual_seed(2)
    vocab = 101 if args.quick else 32000
    prompts = [torch.randint(1, vocab, (args.ctx,), generator=g).tolist()
               for _ in range(args.requests)]
    page = {"block_size": 256} if hasattr(transformers.ContinuousBatchingConfig(),
                                          "block_size") else {"page_size": 256}
    cb = transformers.ContinuousBatchingConfig(
        num_blocks=args.requests * (-(-(args.ctx + 2 * args.new) // 256)) + 8,
        max_batch_tokens=max(8192, args.ctx), **page)
    row, tokens, models = {"requests": args.requests, "ctx": args.ctx, "new": args.new}, {}, {}
    for name in ("sdpa", "attn_ops"):
        model = _model(name, args.layers, args.quick, device, dtype, state)
        seconds = {}
        try:
            for new in (args.new, 2 * args.new):
                config = transformers.GenerationConfig(max_new_tokens=new, do_sample=False,
                                                       eos_token_id=-1, pad_token_id=0)
                seconds[new], out = _timed(lambda: model.generate_batch(
                    prompts, generation_config=config, continuous_batching_config=cb,
                    warmup=False), device, repeats=1)
        except Exception as e:  # noqa: BLE001 -- recorded
            row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            print(f"generate_batch {name}: {row[f'{name}_error']}", flush=True)
            continue
        # (HF names request i "req_i", in the order of the prompts)
        order = sorted(out, key=lambda rid: int(str(rid).rsplit("_", 1)[-1]))
        tokens[name] = torch.tensor([list(out[rid].generated_tokens) for rid in order])
        models[name] = model
        row[f"{name}_tok_s"] = args.requests * 2 * args.new / seconds[2 * args.new]
        row[f"{name}_decode_tok_s"] = args.requests * args.new / max(
            seconds[2 * args.new] - seconds[args.new], 1e-9)
        if name == "attn_ops":
            row["attn_ops_paged_modes"] = sorted({
                line.split("paged|attn_ops: ")[1] for line in hf.describe(model).splitlines()
                if "paged|attn_ops: " in line})
    if len(tokens) == 2:
        prompt_ids = torch.tensor(prompts, device=device)
        check = row["attn_ops_check"] = agreement(
            *(teacher_forced(models[n], prompt_ids, tokens["sdpa"]) for n in ("sdpa", "attn_ops")),
            tokens["sdpa"], tokens["attn_ops"])
        for what in ("tok_s", "decode_tok_s"):
            row[f"attn_ops_vs_sdpa_{what}"] = (row[f"attn_ops_{what}"] / row[f"sdpa_{what}"]
                                               if check["agrees"] else None)
        print(f"generate_batch {args.requests} x {args.ctx}: paged|sdpa "
              f"{row['sdpa_tok_s']:.1f} tok/s (decode {row['sdpa_decode_tok_s']:.1f}), "
              f"paged|attn_ops {row['attn_ops_tok_s']:.1f} tok/s (decode "
              f"{row['attn_ops_decode_tok_s']:.1f}): "
              f"{ratio_text(row['attn_ops_vs_sdpa_tok_s'])}, decode "
              f"{ratio_text(row['attn_ops_vs_sdpa_decode_tok_s'])} ({_agreement_text(check)}); "
              f"{row['attn_ops_paged_modes']}", flush=True)
    return row


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--ctx", type=int, default=2048)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="tiny shapes on the CPU (CI)")
    parser.add_argument("--profile", type=int, nargs="*", default=None, metavar="B",
                        help="each contender's host profile and device synchronizations first, "
                        "at batch sizes B (none given: the first of --batches)")
    parser.add_argument("--backends", nargs="*", default=[], metavar="BACKEND",
                        help="more plain-generate contenders, attn_ops:BACKEND: the same "
                        "weights with every layer forced to BACKEND (e.g. TRITON_ATTN), timed "
                        "in the same rounds as the selector's choice")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."),
                                                      "bench_hf_h200.json"))
    args = parser.parse_args()
    from attn_ops import hf

    hf.register()
    device = "cuda" if torch.cuda.is_available() and not args.quick else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if args.quick:
        args.batches, args.ctx, args.new, args.requests, args.layers = [1, 3], 12, 4, 4, 2
    sdpa = _model("sdpa", args.layers, args.quick, device, dtype)
    state = sdpa.state_dict()
    models = {"sdpa": sdpa, "attn_ops": _model("attn_ops", args.layers, args.quick, device,
                                               dtype, state)}
    if hf.cache_supported(models["attn_ops"]) is None:  # (else "attn_ops" is over HF's cache)
        if device == "cuda":  # (its decode steps without the per-layer graphs)
            models["attn_ops_eager"] = models["attn_ops"]
        models["attn_ops_dynamic"] = models["attn_ops"]
    for backend in args.backends:
        models[f"attn_ops:{backend}"] = _forced_model(backend, args.layers, args.quick, device,
                                                      dtype, state)
    info = run_info("bench_hf")
    info.update(quick=args.quick, device=torch.cuda.get_device_name() if device == "cuda"
                else "cpu")
    if args.profile is not None:
        info["profile"] = profile_hosts(args, models, device)
    info["plain"] = plain_rows(args, models, device)
    # (each attn_ops model's first layer: its spec and the backend it runs)
    info["layers"] = {name: hf.describe(model).splitlines()[0] for name, model in models.items()
                      if name == "attn_ops" or name.startswith("attn_ops:")}
    for name, line in info["layers"].items():
        print(f"{name}: {line[:200]}", flush=True)
    write_json(args.out, info)
    del models, sdpa
    info["generate_batch"] = batch_row(args, state, device, dtype)
    write_json(args.out, info)


if __name__ == "__main__":
    main()
