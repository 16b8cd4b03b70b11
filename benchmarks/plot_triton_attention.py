"""Plot a ``bench_triton_attention.py`` result: decode latency against batch at 32k (a cliff
would show as a jump), decode bandwidth per context, prefill throughput.

    python benchmarks/plot_triton_attention.py benchmarks/results/bench_triton_attention_h200.json
"""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plot_gpu_attention import prefill_bars, save  # noqa: E402

SERIES = {"triton": "TRITON_ATTN via torch.ops.attn", "flashinfer": "FlashInfer direct (CUDA-core)",
          "flashinfer_tc": "FlashInfer direct (tensor-core)"}


def main(path: str) -> None:
    result = json.loads(Path(path).read_text())
    decode = [r for r in result["rows"] if r["kind"] == "decode"]
    prefill = [r for r in result["rows"] if r["kind"] == "prefill"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    at32k = sorted((r for r in decode if r["ctx"] == 32768), key=lambda r: r["batch"])
    for i, (key, label) in enumerate(SERIES.items()):
        axes[0].plot([r["batch"] for r in at32k], [r[f"{key}_ms"] * 1e3 for r in at32k],
                     marker="o", label=label, color=f"C{i}")
    axes[0].set(xscale="log", yscale="log", xlabel="batch", ylabel="µs per call",
                title="decode latency, ctx 32k")
    axes[0].legend(fontsize=7)
    for j, ctx in enumerate(sorted({r["ctx"] for r in decode})):
        pts = sorted((r for r in decode if r["ctx"] == ctx), key=lambda r: r["batch"])
        for i, key in enumerate(("triton", "flashinfer")):
            axes[1].plot([r["batch"] for r in pts], [r[f"{key}_tbs"] for r in pts],
                         marker="o", ls="-" if key == "triton" else ":", color=f"C{j + 3}",
                         label=f"{key} ctx {ctx // 1024}k")
    axes[1].axhline(4.27, color="gray", ls=":", lw=1)
    axes[1].set(xscale="log", xlabel="batch", ylabel="TB/s (copy 4.27 dotted)",
                title="paged decode bandwidth")
    axes[1].legend(fontsize=6)
    prefill_bars(axes[2], prefill, SERIES)
    axes[2].legend(fontsize=7)
    save(fig, result, path)

if __name__ == "__main__":
    main(sys.argv[1])
