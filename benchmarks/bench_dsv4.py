"""DeepSeek-V4's decode step on the H200: one layer of each kind (sliding-window, compressed-
sparse C4A, heavily compressed C128A) at long contexts, beside a dense MLA layer at the same
context and FlashMLA's V4 sparse decode where vLLM's build of it is here, in one run.

V4-Flash shapes: 64 heads, one K = V head of 512 (448 + 64 rotated), window 128 with a sink a
head, C4A's indexer 64 x 128 top-512, vLLM's 584-byte fp8 entries in pages of 64 (the window's
pages behind it released to -1, as ``BlockAllocator.release_before`` leaves them) and planar
fp8 index keys (132 bytes). ``batch`` requests of ``ctx`` cached tokens, one new token each, at
position ``ctx``. Contenders (CUDA-graph replays, ``eager_us`` beside; the projections and the
compressor are the model's and are timed apart as ``writes``):

* ``swa`` / ``c128a`` -- DSV4_TRITON's attention op (window; window + every entry);
* ``c4a_indexer`` -- its indexer (scores over the ``(ctx + 1) / 4`` entries, device top-k);
  ``c4a_attn`` -- the attention over the window and the 512 picks; ``c4a`` -- both, the step;
* ``writes`` -- the window entry and C4A's two compressor steps (DSV4_TRITON's kernels);
* ``op_flashmla_<kind>`` -- DSV4_FLASHMLA's op (the index lists built on the device, then
  FlashMLA's decode), where FlashMLA imports; ``op_flashmla_c4a_step`` -- the indexer and
  that op, the C4A step as selected there (its floor ratio ``op_flashmla_c4a_step_floor_ratio``);
* ``flashmla_<kind>`` -- FlashMLA's ``flash_mla_with_kvcache`` as vLLM calls it for V4
  (window slots as ``indices``, the compressed slots as ``extra_indices_in_kvcache``, the sink
  as ``attn_sink``), where ``vllm.third_party.flashmla`` imports;
* ``dense_mla`` -- an MLA layer of 64 heads (V3's 512 + 64 latent, bf16, the selected
  backend) over the same ``ctx``: what a V4 layer replaces.

Cross-checks: each kind's output against DSV4_REFERENCE (the torch oracle) on the same inputs,
and FlashMLA's against ours; a ratio to FlashMLA is printed only where it agreed. The key-read
floor of a C4A step is ``batch x ((ctx + 1) / 4 x 132 + (512 + 128) x 584)`` bytes at the copy
bandwidth measured in the run (``c4a_floor_ratio``: step time over it). ``kv_bytes_per_token``:
each kind's cache bytes a context token costs, and the dense layer's (656 in fp8_ds_mla).

    python benchmarks/bench_dsv4.py [--batches 1 8 32] [--ctxs 131072 1048576] [--rounds 2]
        [--out PATH] [--quick]
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (cross_check, ratio_text, run_info, time_graph_and_eager,  # noqa: E402
                     write_json)

HEADS, D, ROPE, WINDOW, PAGE = 64, 512, 64, 128, 64
INDEX_HEADS, INDEX_DIM, TOPK = 64, 128, 512
ENTRY, INDEX_ENTRY = 584, INDEX_DIM + 4
TOLERANCE = 2e-2  # (bf16 outputs over fp8 entries: see bench_gpu_attention.TOLERANCE)


def _fill(cache, count_per_req: int, table, writer, dim: int, gen, device) -> None:
    """Every request's first ``count_per_req`` rows of a paged cache written (random unit
    vectors through ``writer``), in chunks."""
    page = PAGE
    for r in range(table.shape[0]):
        for e0 in range(0, count_per_req, 1 << 16):
            e = torch.arange(e0, min(e0 + (1 << 16), count_per_req), device=device)
            x = torch.randn(e.shape[0], dim, generator=gen).to(device)
            writer(x, cache, table[r].long()[e // page] * page + e % page)


def case(batch: int, ctx: int, gen: torch.Generator, device: str, dtype: torch.dtype,
         dense: bool) -> tuple[dict, dict, dict]:
    """``(fns, checks, facts)`` of one point."""
    from attn_ops.backends.deepseek_v4.backend import (compress_write, triton_attention,
                                                       triton_entry_write, triton_indexer_topk)
    from attn_ops.backends.deepseek_v4.cache import entry_write, index_write
    from attn_ops.backends.deepseek_v4.reference import dsv4_attention_reference
    from attn_ops.routing import DeviceFacts, dsv4_launch
    from attn_ops.tuning import default_tuning

    length = ctx + 1
    b = batch
    qsl = torch.arange(b + 1, dtype=torch.int32, device=device)
    seq = torch.full((b,), length, dtype=torch.int32, device=device)
    # the window: the last ceil(W / page) + 1 pages a request holds, -1 behind them
    cols = -(-length // PAGE)
    held = min(cols, -(-WINDOW // PAGE) + 1)
    window = torch.zeros(b * held, PAGE * ENTRY, dtype=torch.uint8, device=device)
    table = torch.full((b, cols), -1, dtype=torch.int32)
    table[:, cols - held:] = torch.randperm(b * held, generator=gen).view(b, held).int()
    table = table.to(device)
    first = max(0, length - WINDOW) // PAGE * PAGE  # (the window's pages, from their start)
    for r in range(b):
        pos = torch.arange(first, length, device=device)
        entry_write(torch.randn(pos.shape[0], D, generator=gen).to(device), window,
                    table[r].long()[pos // PAGE] * PAGE + pos % PAGE, PAGE)
    caches, tables = {}, {}
    for kind, ratio in (("c4a", 4), ("c128a", 128)):
        n = length // ratio
        pages = max(1, -(-n // PAGE))
        caches[kind] = torch.zeros(b * pages, PAGE * ENTRY, dtype=torch.uint8, device=device)
        tables[kind] = torch.randperm(b * pages, generator=gen).view(b, pages).int().to(device)
        _fill(caches[kind], n, tables[kind], lambda x, c, s: entry_write(x, c, s, PAGE), D, gen,
              device)
    n4 = length // 4
    index_pages = max(1, -(-n4 // PAGE))
    index_cache = torch.zeros(b * index_pages, PAGE * INDEX_ENTRY, dtype=torch.uint8,
                              device=device)
    index_table = torch.randperm(b * index_pages, generator=gen).view(b, index_pages).int().to(
        device)
    _fill(index_cache, n4, index_table, index_write, INDEX_DIM, gen, device)
    q = (torch.randn(b, HEADS, D, generator=gen)).to(device, dtype)
    sinks = torch.randn(HEADS, generator=gen).to(device)
    q_index = torch.randn(b, INDEX_HEADS, INDEX_DIM, generator=gen).to(device, dtype)
    weights = (torch.randn(b, INDEX_HEADS, generator=gen) * INDEX_HEADS ** -0.5).to(device)
    scale = D ** -0.5
    sms = DeviceFacts.of(torch.device(device)).num_sms
    tuning = default_tuning().mla

    def launch(keys):
        return list(dsv4_launch(b, HEADS, keys, sms, tuning))

    picks = triton_indexer_topk(q_index, weights, index_cache, qsl, seq, index_table, 4, TOPK)
    l_swa, l_c4, l_c128 = (launch(WINDOW), launch(WINDOW + TOPK),
                           launch(WINDOW + tables["c128a"].shape[1] * PAGE))
    fns = {
        "swa": lambda: triton_attention(q, window, qsl, seq, table, sinks, scale, WINDOW, ROPE,
                                        None, None, 0, None, l_swa),
        "c4a_indexer": lambda: triton_indexer_topk(q_index, weights, index_cache, qsl, seq,
                                                   index_table, 4, TOPK),
        "c4a_attn": lambda: triton_attention(q, window, qsl, seq, table, sinks, scale, WINDOW,
                                             ROPE, caches["c4a"], tables["c4a"], 4, picks,
                                             l_c4),
        "c4a": lambda: triton_attention(
            q, window, qsl, seq, table, sinks, scale, WINDOW, ROPE, caches["c4a"],
            tables["c4a"], 4, triton_indexer_topk(q_index, weights, index_cache, qsl, seq,
                                                  index_table, 4, TOPK), l_c4),
        "c128a": lambda: triton_attention(q, window, qsl, seq, table, sinks, scale, WINDOW,
                                          ROPE, caches["c128a"], tables["c128a"], 128, None,
                                          l_c128),
    }
    # the writes of a C4A layer's step: its window entry and two compressor steps (the state
    # slots hold a partial group; the step's token completes a group when (ctx + 1) % 4 == 0)
    kv_new = torch.randn(b, D, generator=gen).to(device, dtype)
    c_in = [torch.randn(b, 2 * w, generator=gen).to(device, dtype) for w in (D, D, INDEX_DIM,
                                                                             INDEX_DIM)]
    bias = [torch.randn(4, 2 * w, generator=gen).to(device, dtype) for w in (D, INDEX_DIM)]
    states = [torch.randn(b, 8, 4 * w, generator=gen).to(device) for w in (D, INDEX_DIM)]
    norms = [torch.ones(w, device=device, dtype=dtype) for w in (D, INDEX_DIM)]
    rope = torch.randn(length + 1, ROPE, generator=gen).to(device)
    slots = table[:, -1].long() * PAGE + ctx % PAGE
    sidx = torch.arange(b, dtype=torch.int32, device=device)

    def writes():
        triton_entry_write(kv_new, window, slots, False)
        compress_write(c_in[0], c_in[1], bias[0], states[0], qsl, seq, sidx, tables["c4a"], 4,
                       True, norms[0], 1e-6, rope, caches["c4a"], False)
        compress_write(c_in[2], c_in[3], bias[1], states[1], qsl, seq, sidx, index_table, 4,
                       True, norms[1], 1e-6, rope, index_cache, True)
    fns["writes"] = writes
    checks, outputs = {}, {k: fns[k]().float() for k in ("swa", "c4a_attn", "c128a")}
    refs = {"swa": (None, None, 0, None), "c4a_attn": (caches["c4a"], tables["c4a"], 4, picks),
            "c128a": (caches["c128a"], tables["c128a"], 128, None)}
    for kind, extra in refs.items():  # (the torch oracle over the same caches and picks)
        want = dsv4_attention_reference(q.float(), window, qsl, seq, table, sinks, scale,
                                        WINDOW, *extra)
        checks[f"{kind}_vs_reference"] = cross_check(outputs[kind], want, TOLERANCE)
    fns.update(flashmla(q, window, table, sinks, caches, tables, picks, length, outputs, checks))
    if any(k.startswith("flashmla_") for k in fns):  # (FlashMLA here: DSV4_FLASHMLA's op too)
        from attn_ops.backends.deepseek_v4.flashmla import flashmla_attention

        for kind, extra in refs.items():
            name = f"op_flashmla_{kind.removesuffix('_attn')}"
            fn = (lambda extra=extra: flashmla_attention(q, window, qsl, seq, table, sinks,
                                                         scale, WINDOW, *extra))
            try:
                checks[name] = cross_check(fn().float(), outputs[kind], TOLERANCE)
                fns[name] = fn
            except Exception as e:  # noqa: BLE001 -- recorded; the others go on
                checks[name] = {"agree": False, "parts": {},
                                "error": f"{type(e).__name__}: {str(e)[:200]}"}
        if "op_flashmla_c4a" in fns:  # (the C4A step as selected where FlashMLA imports)
            fns["op_flashmla_c4a_step"] = lambda: flashmla_attention(
                q, window, qsl, seq, table, sinks, scale, WINDOW, caches["c4a"], tables["c4a"],
                4, triton_indexer_topk(q_index, weights, index_cache, qsl, seq, index_table, 4,
                                       TOPK))
    facts = {"c4a_key_bytes": b * (n4 * INDEX_ENTRY + (TOPK + min(WINDOW, length)) * ENTRY),
             "kv_bytes_per_token": {"c4a": ENTRY / 4 + INDEX_ENTRY / 4, "c128a": ENTRY / 128,
                                    "swa": 0.0, "dense_mla_fp8_ds_mla": 656,
                                    "dense_mla_bf16": 1152},
             "window_bytes_per_request": held * PAGE * ENTRY}
    if dense:
        fns["dense_mla"] = dense_mla(b, ctx, gen, device)
    return fns, checks, facts


def flashmla(q, window, table, sinks, caches, tables, picks, length, outputs, checks) -> dict:
    """FlashMLA's V4 sparse decode per kind as vLLM calls it (where its build imports here),
    each cross-checked against ours; ``{}`` where it is absent."""
    from attn_ops.providers import FLASHMLA

    try:
        _, fm = FLASHMLA.require("bench_dsv4")
    except Exception as e:  # noqa: BLE001 -- the anchor is optional: recorded, not timed
        checks["flashmla"] = {"agree": False, "parts": {}, "error": str(e)[:200]}
        return {}
    b, dev = q.shape[0], q.device
    pos = length - 1
    win = torch.arange(max(0, pos - WINDOW + 1), pos + 1, device=dev)
    w_idx = (table.long()[:, win // PAGE] * PAGE + win % PAGE).int()
    w_idx = torch.nn.functional.pad(w_idx, (0, WINDOW - w_idx.shape[1]), value=-1)[:, None]
    w_len = torch.full((b,), win.shape[0], dtype=torch.int32, device=dev)

    def global_slots(entries, tab):
        ok = entries >= 0
        e = entries.long().clamp(min=0)
        s = tab.long().gather(1, e // PAGE) * PAGE + e % PAGE
        width = -(-entries.shape[1] // 128) * 128
        s = torch.where(ok, s, -1).int()
        return torch.nn.functional.pad(s, (0, width - s.shape[1]), value=-1)[:, None], \
            ok.sum(1).int()

    visible128 = length // 128
    dense128 = torch.arange(visible128, device=dev).expand(b, visible128)
    extras = {"swa": None, "c4a_attn": global_slots(picks, tables["c4a"]),
              "c128a": global_slots(dense128, tables["c128a"]) if visible128 else None}
    kv = {"swa": None, "c4a_attn": caches["c4a"], "c128a": caches["c128a"]}

    def fp8(cache):
        return cache.view(torch.float8_e4m3fn).view(cache.shape[0], PAGE, 1, ENTRY)

    fns = {}
    for kind, extra in extras.items():
        meta = fm.get_mla_metadata()[0]
        kwargs = dict(q=q[:, None], k_cache=fp8(window), block_table=None, cache_seqlens=None,
                      head_dim_v=D, tile_scheduler_metadata=meta, num_splits=None,
                      softmax_scale=D ** -0.5, causal=False, is_fp8_kvcache=True,
                      indices=w_idx, attn_sink=sinks.float(), topk_length=w_len)
        if extra is not None:
            kwargs.update(extra_k_cache=fp8(kv[kind]), extra_indices_in_kvcache=extra[0],
                          extra_topk_length=extra[1])
        name = f"flashmla_{kind.removesuffix('_attn')}"
        try:
            fn = (lambda kwargs=kwargs: fm.flash_mla_with_kvcache(**kwargs)[0][:, 0])
            checks[name] = cross_check(fn().float(), outputs[kind], TOLERANCE)
            fns[name] = fn
        except Exception as e:  # noqa: BLE001 -- recorded; the other contenders go on
            checks[name] = {"agree": False, "parts": {}, "error": f"{type(e).__name__}: "
                            f"{str(e)[:200]}"}
            print(f"{name}: {checks[name]['error']}", flush=True)
    return fns


def dense_mla(batch: int, ctx: int, gen, device: str):
    """A dense MLA layer's decode over ``ctx`` cached tokens (64 heads, bf16 latents, the
    selected backend, metadata built before capture)."""
    from attn_ops import AttentionSpec, MLAAttention
    from attn_ops.metadata import CommonAttentionMetadata

    length = ctx + 1
    pages = -(-length // PAGE)
    table = torch.randperm(batch * pages, generator=gen).int().view(batch, pages).to(device)
    seq = torch.full((batch,), length, dtype=torch.int32, device=device)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=device)
    slot = table[:, -1].long() * PAGE + ctx % PAGE
    common = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.cpu(), seq_lens=seq, seq_lens_cpu=seq.cpu(),
        block_table=table, slot_mapping=slot, num_actual_tokens=batch, max_query_len=1,
        max_seq_len=length, num_decodes=batch, num_decode_tokens=batch, block_size=PAGE,
        block_table_cpu=table.cpu(), num_blocks=batch * pages)
    layer = MLAAttention(AttentionSpec.mla(HEADS, dtype=torch.bfloat16,
                                           block_size=PAGE)).to(device)
    layer.load_kv_b_proj((torch.randn(HEADS * 256, 512, generator=gen) / 512 ** 0.5).to(
        device, torch.bfloat16))
    latent = torch.randn(batch * pages, PAGE, 576, device=device, dtype=torch.bfloat16)
    q = torch.randn(batch, HEADS, 192, device=device, dtype=torch.bfloat16)
    kv_c = torch.randn(batch, 512, device=device, dtype=torch.bfloat16)
    k_pe = torch.randn(batch, 64, device=device, dtype=torch.bfloat16)
    built = layer.impl.build_metadata(common)
    return lambda: layer(q, kv_c, k_pe, latent, built)


def copy_bandwidth(device: str) -> float:
    """Bytes a second of a 1 GiB device copy (read + write), as CUDA-graph replays."""
    from _common import graph_ms

    x = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    return 2 * x.numel() / (graph_ms(lambda: y.copy_(x)) * 1e-3)


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--ctxs", type=int, nargs="+", default=[131072, 1048576])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--no-dense", action="store_true")
    parser.add_argument("--quick", action="store_true",
                        help="tiny shapes, checks only (any machine: Triton's interpreter)")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."),
                                                      "bench_dsv4_h200.json"))
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda:
        if not args.quick:
            parser.error("the timed run needs a GPU (--quick runs the checks anywhere)")
        os.environ.setdefault("TRITON_INTERPRET", "1")
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    if args.quick:
        args.batches, args.ctxs = [2], [300]
    gen = torch.Generator().manual_seed(0)
    bandwidth = copy_bandwidth(device) if cuda else float("nan")
    rows = []
    info = run_info("bench_dsv4")
    for batch in args.batches:
        for ctx in args.ctxs:
            fns, checks, facts = case(batch, ctx, gen, device, dtype,
                                      dense=cuda and not args.no_dense)
            if cuda:
                graph, eager, errors = time_graph_and_eager(fns, args.rounds)
            else:  # (every contender run once: the script's paths, untimed)
                graph, eager, errors = {}, {}, {}
                for fn in fns.values():
                    fn()
            floor_ms = facts["c4a_key_bytes"] / bandwidth * 1e3
            fm_ratio = {k: (graph[k] / graph[o] if checks[k].get("agree") and k in graph
                            and o in graph else None)
                        for k, o in (("flashmla_swa", "swa"), ("flashmla_c4a", "c4a_attn"),
                                     ("flashmla_c128a", "c128a")) if k in checks}
            # (over its floor only where C4A's output agreed with the oracle; n/a untimed)
            c4a_ok = all(c.get("agree") for k, c in checks.items() if k.startswith("c4a"))
            floor_ratio = (graph.get("c4a", float("nan")) / floor_ms) if c4a_ok else None
            fm_step_ok = c4a_ok and checks.get("op_flashmla_c4a", {}).get("agree", False)
            fm_floor_ratio = (graph["op_flashmla_c4a_step"] / floor_ms
                              if fm_step_ok and "op_flashmla_c4a_step" in graph else None)
            row = {"batch": batch, "ctx": ctx, "graph_us": {k: v * 1e3 for k, v in graph.items()},
                   "eager_us": {k: v * 1e3 for k, v in eager.items()}, "cross_check": checks,
                   "errors": errors, "c4a_floor_us": floor_ms * 1e3,
                   "c4a_floor_ratio": floor_ratio,
                   "op_flashmla_c4a_step_floor_ratio": fm_floor_ratio,
                   "flashmla_time_over_ours": fm_ratio, **facts}
            rows.append(row)
            print(f"B={batch:<3d} ctx={ctx:<8d} " + "  ".join(
                f"{k} {v * 1e3:8.1f} us" for k, v in graph.items())
                + f"  C4A step {ratio_text(floor_ratio)} its key-read floor"
                + (f" ({ratio_text(fm_floor_ratio)} with DSV4_FLASHMLA's op); "
                   if "op_flashmla_c4a_step" in fns else "; ")
                + (", ".join(f"{k} time / ours {ratio_text(v)}" for k, v in fm_ratio.items())
                   or f"FlashMLA absent ({checks['flashmla']['error'][:60]})")
                + "; checks " + ", ".join(f"{k} {'ok' if c.get('agree') else 'MISMATCH'}"
                                          for k, c in checks.items() if k != "flashmla"),
                flush=True)
            info.update(quick=args.quick, rows=rows, copy_bytes_per_s=bandwidth,
                        device=torch.cuda.get_device_name() if cuda else "cpu")
            write_json(args.out, info)
            del fns
            if cuda:
                torch.cuda.empty_cache()
    if any(not c.get("agree") for r in rows for k, c in r["cross_check"].items()
           if k.endswith("_vs_reference")):
        raise SystemExit("DSV4_TRITON disagreed with the reference: see the JSON's cross_check")


if __name__ == "__main__":
    main()
