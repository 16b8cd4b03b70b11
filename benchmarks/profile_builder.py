"""Where the host time of the FlashInfer metadata builder goes, stage by stage, next to
FlashInfer's own ``BatchDecodeWithPagedKVCacheWrapper.plan`` (tensor cores) on the same batch.

    python benchmarks/profile_builder.py [--out PATH]

Decode batches of 256 and 64 requests, ctx 4k, pages of 128 and 16; per-stage means over 200
repetitions (microseconds). The whole builder is timed on steps alternating two batches a page
apart (every step a new page count, as when requests cross page boundaries) and on one batch.
The builder copies nothing: its tables come with the common metadata's one upload, so the
common metadata's build is timed too, with its upload next to five separate uploads.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import host_us, run_info  # noqa: E402
from bench_gpu_attention import SPEC, Batch  # noqa: E402


def mean_us(fn) -> float:
    return host_us(fn, n=200)


def upload_parts(host: list) -> dict[str, float]:
    """The upload's calls one by one (``attn_ops.metadata.pack_upload``: a pinned block from
    the caching host allocator, filled in numpy, copied without blocking)."""
    total = sum(a.size for a in host)
    staged = torch.empty(total, dtype=torch.int32, pin_memory=True)
    view = staged.numpy()
    return {
        "  torch.empty pinned": mean_us(
            lambda: torch.empty(total, dtype=torch.int32, pin_memory=True)),
        "  np.concatenate into it": mean_us(
            lambda: np.concatenate([a.reshape(-1) for a in host], out=view)),
        "  .to(cuda, non_blocking)": mean_us(lambda: staged.to("cuda", non_blocking=True)),
        "  torch.empty on the device": mean_us(
            lambda: torch.empty(total, dtype=torch.int32, device="cuda")),
    }


def five_uploads(host: list) -> None:
    """Five uploads, an array at a time, each through its own pinned block (the anchor for
    ``build_common_metadata``'s one)."""
    for a in host:
        staged = torch.empty(a.shape, dtype=torch.from_numpy(a[:0]).dtype, pin_memory=True)
        staged.numpy()[...] = a
        staged.to("cuda", non_blocking=True)


def stages(b: Batch, other: Batch) -> dict[str, float]:
    """``b``'s stages; ``other``: the same requests a page longer (a step that must replan
    where the plan depends on page counts)."""
    import flashinfer

    from attn_ops.backends import flashinfer as fi
    from attn_ops.backends import flashinfer_plan
    from attn_ops.backends.flashinfer_plan import PART, PartPlan
    from attn_ops.metadata import (build_common_metadata, last_page_len, pack_upload,
                                   prefill_offsets, sizes_not_specialized)
    from attn_ops.routing import Kernel

    impl = fi.FlashInferBackend(SPEC)
    impl.build_metadata(b.meta)
    m = b.meta
    # (a planner of its own: the plans timed here leave the builder's workspaces alone)
    planner = impl.make_planner(m.seq_lens.device)
    seq, qsl = m.seq_lens_cpu, m.query_start_loc_cpu
    indptr, indices = m.block_csr()
    last = last_page_len(seq.numpy(), m.block_size)
    mod = flashinfer_plan.flashinfer_module(Kernel.FLASHINFER_FA2, SPEC.dtype, SPEC.cache_dtype,
                                            SPEC.head_dim, SPEC.v_head_dim, False, False)
    args = [qsl, torch.from_numpy(indptr), seq, int(qsl[-1]), m.num_reqs, SPEC.num_heads,
            SPEC.kv_heads, m.block_size, False, SPEC.head_dim, SPEC.v_head_dim, True, -1, -1,
            False, 0, 0]
    ws = planner.decode_ws
    float_ws = flashinfer_plan.float_workspace(ws.device.device)
    # (FlashInfer's compiled module takes positional arguments only: ``args`` are the ones our
    # builder passes it)
    raw = mod.plan(float_ws, ws.device, ws.hosts[0], *args)
    metas = [m, other.meta]

    def step():  # every call a new step, alternating the two batches
        metas.reverse()
        flashinfer_plan._PLANS.pop(metas[0], None)
        impl.build_metadata(metas[0])

    def same():
        flashinfer_plan._PLANS.pop(m, None)
        impl.build_metadata(m)

    n, seq_list = m.num_reqs, seq.tolist()
    part = PartPlan(Kernel.FLASHINFER_FA2, n, n, 0, False, 8, 0, 0, 0, 0, 0, 0, None, False,
                    None, tuple(range(15)))
    slots = m.slot_mapping.cpu().numpy()
    positions = m.positions.cpu().numpy()
    table = m.block_table_cpu.numpy()
    common_host = [qsl.numpy(), seq.numpy(), table, indptr, last, indices]
    ws_f = torch.zeros(128 << 20, dtype=torch.uint8, device="cuda")
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(float_workspace_buffer=ws_f,
                                                            kv_layout="NHD",
                                                            use_tensor_cores=True)
    d_indptr, d_indices, d_last = (torch.from_numpy(a).cuda() for a in (indptr, indices, last))
    return {
        "build_metadata, a page more every other step": mean_us(step),
        "build_metadata, the same batch": mean_us(same),
        "mod.plan (FlashInfer C++)": mean_us(
            lambda: mod.plan(float_ws, ws.device, ws.hosts[0], *args)),
        "plan[:] (read the plan vector)": mean_us(lambda: raw[:]),
        "PART.encode (a part's plan vector)": mean_us(lambda: PART.encode(part)),
        "mark_unbacked (one tensor)": mean_us(lambda: sizes_not_specialized(seq)),
        "FlashInferMetadata(...)": mean_us(lambda: fi.FlashInferMetadata(*[seq] * 9)),
        # (the block table as the allocator's numpy rows, as build_batch passes it)
        "common metadata: build_common_metadata (checks, CSR, one upload)": mean_us(
            lambda: build_common_metadata([1] * n, seq_list, table, m.block_size,
                                          m.num_blocks, device="cuda")),
        "common metadata: last_page_len": mean_us(lambda: last_page_len(seq.numpy(), m.block_size)),
        "common metadata: pack_upload (its one copy)": mean_us(lambda: pack_upload(
            (slots, positions), (*common_host, *prefill_offsets(qsl.numpy(), indptr, n)), "cuda")),
        **upload_parts([slots.view(np.int32), positions.view(np.int32), *common_host]),
        "common metadata as five uploads": mean_us(
            lambda: five_uploads([qsl.numpy(), seq.numpy(), table, slots, positions])),
        "anchor: FlashInfer wrapper.plan (tensor cores, device CSR given)": mean_us(
            lambda: wrapper.plan(indptr=d_indptr, indices=d_indices, last_page_len=d_last,
                                 num_qo_heads=SPEC.num_heads, num_kv_heads=SPEC.kv_heads,
                                 head_dim=SPEC.head_dim, page_size=m.block_size,
                                 q_data_type=SPEC.dtype, kv_data_type=SPEC.dtype)),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."),
                                                      "profile_builder_h200.json"))
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    results = {}
    for page in (128, 16):
        for batch in (256, 64):
            key = f"B={batch} ctx=4096 page={page}"
            b = Batch(batch, 4096, 1, page, gen)
            results[key] = stages(b, Batch(batch, 4096 + page, 1, page, gen))
            print(key, {k: round(v, 1) for k, v in results[key].items()}, flush=True)
    info = run_info("profile_builder")
    info.update(device=torch.cuda.get_device_name(), results=results)
    with open(args.out, "w") as f:
        json.dump(info, f, indent=1)


if __name__ == "__main__":
    main()
