"""Plot a ``bench_gpu_attention.py`` result: the selected backend against each anchor.

    python benchmarks/plot_gpu_attention.py benchmarks/results/bench_gpu_attention_h200.json
"""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

SERIES = {  # key in the JSON -> label ({selected}: the run's selected backend)
    "selected": "selected ({selected}) via torch.ops.attn",
    "selected_graph": "selected, CUDA-graph metadata",
    "flashinfer_tc": "FlashInfer direct, tensor-core decode",
    "flashinfer": "FlashInfer direct, CUDA-core decode",
    "fa4": "FlashAttention 4 direct",
    "fa3": "vLLM's FA3 direct",
    "fa3_op": "FLASH_ATTN on FA3 via torch.ops.attn",
}


def main(path: str) -> None:
    result = json.loads(Path(path).read_text())
    series = {k: v.format(selected=result.get("selected", "COMPOSITE_SM90"))
              for k, v in SERIES.items()}
    rows = result["rows"]
    decode = [r for r in rows if r["kind"] == "decode"]
    prefill = [r for r in rows if r["kind"] == "prefill"]
    ctxs = sorted({r["ctx"] for r in decode})
    panels = len(ctxs) + bool(prefill)  # (a run cut short may have no prefill rows)
    fig, axes = plt.subplots(1, panels, figsize=(4.2 * panels, 4))
    for ax, ctx in zip(axes, ctxs):
        points = sorted((r for r in decode if r["ctx"] == ctx), key=lambda r: r["batch"])
        for i, (key, label) in enumerate(series.items()):
            if f"{key}_tbs" in points[0]:
                ax.plot([r["batch"] for r in points], [r[f"{key}_tbs"] for r in points],
                        marker="o", label=label, color=f"C{i}")
        ax.axhline(4.27, color="gray", ls=":", lw=1)
        ax.set_xscale("log", base=2)
        ax.set_title(f"paged decode, ctx {ctx // 1024}k")
        ax.set_xlabel("batch")
        ax.set_ylabel("TB/s (copy bandwidth 4.27 dotted)")
    if prefill:
        prefill_bars(axes[-1], prefill, series)
    axes[0].legend(fontsize=7, loc="lower right")
    save(fig, result, path)


def prefill_bars(ax, prefill: list[dict], series: dict[str, str]) -> None:
    """TFLOP/s bars per prefill shape for each of ``series`` the rows have (colour = its
    position in ``series``, as in the line plots)."""
    names = [f"{r['batch']}x{r['seq'] // 1024}k" for r in prefill]
    present = [(i, k, label) for i, (k, label) in enumerate(series.items())
               if f"{k}_tflops" in prefill[0]]
    width = 0.8 / len(present)
    for j, (i, key, label) in enumerate(present):
        ax.bar([x + j * width for x in range(len(names))],
               [r[f"{key}_tflops"] for r in prefill], width, label=label, color=f"C{i}")
    ax.set_xticks([x + (len(present) - 1) * width / 2 for x in range(len(names))], names)
    ax.set_title("paged causal prefill")
    ax.set_ylabel("TFLOP/s")


def save(fig, result: dict, path: str, shapes: str | None = None) -> None:
    """Title with the run's device, shapes, date and commit; PNG next to the JSON."""
    shapes = shapes or f"bf16, 32/8 heads, head dim 128, page {result['page']}"
    fig.suptitle(f"{result['device']}, {shapes} ({result['date'][:10]}, {result['commit']})")
    fig.tight_layout()
    out = Path(path).with_suffix(".png")
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1])
