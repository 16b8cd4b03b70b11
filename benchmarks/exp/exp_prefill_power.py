"""Experiment (not a benchmark of record): what holds a 1x8k causal prefill on the H200 back?
Issue 3 asks >= 650 TFLOP/s; FA4's best tile gives about 625 in ``do_bench_cudagraph``.

FA4 (dense K/V, varlen call) with its default sm90 tile and with FLASH_ATTN's tall tile
(``flash_attn.SM90_TALL_TILE``) runs back to back for ``SECONDS`` each, while a thread samples
``nvidia-smi``: SM clock, board power, temperature and the active clock-throttle reasons
(``0x4``: software power cap). Prints one line per tile and writes
``$OUT/exp_prefill_power.json``.

    source .gpu/bootstrap.sh && python benchmarks/exp/exp_prefill_power.py
"""
import json
import os
import subprocess
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from attn_ops.backends.flash_attn import SM90_TALL_TILE  # noqa: E402

S, HQ, HKV, D = 8192, 32, 8, 128
SECONDS, SAMPLES = 4.5, 8
QUERY = "clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active"


def sustained(fn) -> tuple[float, list[str]]:
    """Milliseconds per call of ``fn`` run back to back for SECONDS, and the nvidia-smi
    samples taken meanwhile (about one every 0.6 s)."""
    samples = []

    def poll():
        for _ in range(SAMPLES):
            time.sleep(0.5)
            samples.append(subprocess.run(
                ["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader"],
                capture_output=True, text=True).stdout.strip())

    fn()
    torch.cuda.synchronize()
    sampler = threading.Thread(target=poll)
    sampler.start()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    calls, t0 = 0, time.time()
    start.record()
    while time.time() - t0 < SECONDS:
        for _ in range(50):
            fn()
        calls += 50
        torch.cuda.synchronize()
    end.record()
    torch.cuda.synchronize()
    sampler.join()
    return start.elapsed_time(end) / calls, samples


def main() -> None:
    from flash_attn.cute.interface import _flash_attn_fwd

    q = torch.randn(S, HQ, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(S, HKV, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    cu = torch.tensor([0, S], device="cuda", dtype=torch.int32)
    flops = 4 * S * S * HQ * D / 2
    rows = []
    for name, tile in (("default", {}), ("tall", SM90_TALL_TILE)):
        ms, samples = sustained(lambda tile=tile: _flash_attn_fwd(
            q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=S, max_seqlen_k=S,
            causal=True, **tile))
        rows.append(dict(tile=name, ms=ms, tflops=flops / ms / 1e9, nvidia_smi=samples))
        print(f"{name} {flops / ms / 1e9:.0f} TFLOP/s sustained", samples[-3:], flush=True)
    out = os.path.join(os.environ.get("OUT", "."), "exp_prefill_power.json")
    with open(out, "w") as f:
        json.dump(dict(experiment="exp_prefill_power", device=torch.cuda.get_device_name(),
                       query=QUERY, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
