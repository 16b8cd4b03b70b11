"""Plot a ``bench_ssm.py`` result: decode rows as TB/s against batch per kind (our op with and
without its conv update, the anchor's state update), prefill rows as M tokens/s per case.

    python benchmarks/plot_ssm.py benchmarks/results/bench_ssm_h200.json
"""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plot_gpu_attention import save  # noqa: E402

KINDS = {"gated_deltanet": ("Gated DeltaNet (16/32 heads x 128)", "fla"),
         "mamba2": ("Mamba2 (80 heads x 64, d_state 128)", "mamba_ssm")}
LABELS = {"ours": "ours", "ours_with_conv": "ours + conv update", "fla": "fla",
          "mamba_ssm": "mamba-ssm"}


def main(path: str) -> None:
    result = json.loads(Path(path).read_text())
    rows = result["rows"]
    decode = [r for r in rows if r["mode"] == "decode"]
    prefill = [r for r in rows if r["mode"] == "prefill"]
    panels = [(k, "decode") for k in KINDS if any(r["kind"] == k for r in decode)] + \
        [(k, "prefill") for k in KINDS if any(r["kind"] == k for r in prefill)]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
    for ax, (kind, mode) in zip(axes[0], panels):
        title, anchor = KINDS[kind]
        mine = [r for r in (decode if mode == "decode" else prefill) if r["kind"] == kind]
        if mode == "decode":
            for key in ("ours", "ours_with_conv", anchor):
                ax.plot([r["batch"] for r in mine], [r.get(f"{key}_tbs") for r in mine],
                        marker="o", label=LABELS[key])
            if any("copy_tbs" in r for r in mine):
                ax.plot([r["batch"] for r in mine], [r.get("copy_tbs") for r in mine],
                        color="grey", ls="--", label="copy of the state bytes")
            ax.axhline(4.27 * 0.8, color="grey", ls=":", label="80% of 4.27 TB/s")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("batch (one token a request)")
            ax.set_ylabel("TB/s (states read + written, inputs, outputs)")
        else:
            cases = [f"{r['batch']}x{r['len']}" for r in mine]
            for i, key in enumerate(("ours", anchor)):
                bars = ax.bar([j + (i - 0.5) * 0.4 for j in range(len(mine))],
                              [r.get(f"{key}_mtoks", float("nan")) for r in mine], 0.4,
                              label=LABELS[key])
                ax.bar_label(bars, fmt="%.1f", fontsize=7)
            ax.set_xticks(range(len(mine)), cases)
            ax.set_ylabel("M tokens/s (prefill from zero states)")
        ax.set_title(f"{title}: {mode}", fontsize=9)
        ax.legend(fontsize=7)
    save(fig, result, path, "bf16 inputs, fp32 states")


if __name__ == "__main__":
    main(sys.argv[1])
