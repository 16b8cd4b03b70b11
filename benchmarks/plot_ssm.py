"""Plot a ``bench_ssm.py`` result: decode rows as TB/s against batch per kind (our op with and
without its conv update, each anchor layout's state update, the copy), as CUDA-graph replays
(solid) and eager calls (dashed); prefill rows as M tokens/s per case, graph (solid bars) and
eager (hatched). An anchor whose cross-check disagreed at a point is left out there (its
numbers are of another computation).

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

KINDS = {"gated_deltanet": "Gated DeltaNet (16/32 heads x 128)",
         "mamba2": "Mamba2 (80 heads x 64, d_state 128)",
         "mamba1": "Mamba1 (5120 channels, d_state 16)",
         "lightning": "lightning attention (64 heads of 128)"}
LABELS = {"ours_with_conv": "ours + conv update", "copy": "copy of the state bytes"}


def value(row: dict, timing: str, unit: str, name: str) -> float:
    """``name``'s rate at ``row`` (``graph`` / ``eager``), NaN where it did not run or its
    cross-check disagreed. (Rows of older results: flat ``<name>_<unit>`` fields, graph only.)"""
    check = row.get("cross_check", {}).get(name)
    if check is not None and not check["agree"]:
        return float("nan")
    if f"graph_{unit}" in row:
        return row[f"{timing}_{unit}"].get(name, float("nan"))
    return row.get(f"{name}_{unit}", float("nan")) if timing == "graph" else float("nan")


def names(rows: list[dict], unit: str) -> list[str]:
    found = []
    for r in rows:
        keys = list(r[f"graph_{unit}"]) if f"graph_{unit}" in r else \
            [k[:-len(unit) - 1] for k in r if k.endswith("_" + unit)]
        found += [k for k in keys if k not in found]
    return found


def main(path: str) -> None:
    result = json.loads(Path(path).read_text())
    rows = [r for r in result["rows"] if "failed" not in r]
    decode = [r for r in rows if r["mode"] == "decode"]
    prefill = [r for r in rows if r["mode"] == "prefill"]
    panels = [(k, "decode") for k in KINDS if any(r["kind"] == k for r in decode)] + \
        [(k, "prefill") for k in KINDS if any(r["kind"] == k for r in prefill)]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
    for ax, (kind, mode) in zip(axes[0], panels):
        mine = [r for r in (decode if mode == "decode" else prefill) if r["kind"] == kind]
        if mode == "decode":
            for i, name in enumerate(names(mine, "tbs")):
                color = "grey" if name == "copy" else f"C{i}"
                for timing, style in (("graph", "-"), ("eager", "--")):
                    ys = [value(r, timing, "tbs", name) for r in mine]
                    if all(y != y for y in ys):
                        continue
                    ax.plot([r["batch"] for r in mine], ys, marker="o", ls=style, color=color,
                            label=f"{LABELS.get(name, name)} ({timing})")
            ax.axhline(4.27 * 0.8, color="grey", ls=":", label="80% of 4.27 TB/s")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("batch (one token a request)")
            ax.set_ylabel("TB/s (states read + written, inputs, outputs)")
        else:
            cases = [f"{r['batch']}x{r['len']}" for r in mine]
            series = names(mine, "mtoks")
            width = 0.8 / (2 * len(series))
            for i, name in enumerate(series):
                for j, (timing, hatch) in enumerate((("graph", None), ("eager", "//"))):
                    xs = [c + (2 * i + j - len(series) + 0.5) * width for c in range(len(mine))]
                    bars = ax.bar(xs, [value(r, timing, "mtoks", name) for r in mine], width,
                                  color=f"C{i}", hatch=hatch, alpha=0.6 if hatch else 1.0,
                                  label=f"{name} ({timing})")
                    ax.bar_label(bars, fmt="%.1f", fontsize=6)
            ax.set_xticks(range(len(mine)), cases)
            ax.set_ylabel("M tokens/s (prefill from zero states)")
        ax.set_title(f"{KINDS[kind]}: {mode}", fontsize=9)
        ax.legend(fontsize=6)
    save(fig, result, path, "bf16 inputs, fp32 states; anchors that disagreed left out")


if __name__ == "__main__":
    main(sys.argv[1])
