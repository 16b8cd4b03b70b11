"""Plot a ``bench_mla_sparse.py`` result: one sparse MLA layer's decode step (indexer + sparse
attention) against dense MLA by context, one panel per batch (µs, log scale), the indexer's
part drawn alone.

    python benchmarks/plot_mla_sparse.py benchmarks/results/bench_mla_sparse_h200.json
"""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plot_gpu_attention import save  # noqa: E402


def main(path: str) -> None:
    result = json.loads(Path(path).read_text())
    rows = [r for r in result["rows"] if r["mode"] == "decode"]
    batches = sorted({r["batch"] for r in rows})
    keys = sorted({k[:-3] for r in rows for k, v in r.items()
                   if k.endswith("_us") and isinstance(v, float)},
                  key=lambda k: (not k.startswith("sparse_step_"), k))
    if len({r["ctx"] for r in rows}) == 1:  # one context: a bar a contender, per batch
        return bars(result, rows, batches, [k for k in keys if not k.startswith("sparse_attn_")],
                    path)
    fig, axes = plt.subplots(1, len(batches), figsize=(3.4 * len(batches), 3.4), squeeze=False)
    for ax, batch in zip(axes.flat, batches):
        mine = sorted((r for r in rows if r["batch"] == batch), key=lambda r: r["ctx"])
        for key in keys:
            pts = [(r["ctx"], r[f"{key}_us"]) for r in mine if f"{key}_us" in r]
            if pts and not key.startswith("sparse_attn_"):
                style = "--" if key.startswith("dense_") else ":" if key == "indexer" else "-"
                ax.plot(*zip(*pts), style, marker="o", ms=3, label=key)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"batch {batch}", fontsize=9)
        ax.set_xlabel("context (tokens)", fontsize=8)
        ax.set_ylabel("µs per layer step (CUDA-graph replay)", fontsize=8)
        ax.tick_params(labelsize=7)
    axes.flat[0].legend(fontsize=6)
    save(fig, result, path, SHAPES)


SHAPES = ("sparse MLA decode, 128 heads, 512 + 64 latent, top-k 2048, fp8 index keys, "
          "page 64")


def bars(result: dict, rows: list[dict], batches: list[int], keys: list[str],
         path: str) -> None:
    """One panel a batch: each contender's µs per layer step at the run's one context."""
    fig, axes = plt.subplots(1, len(batches), figsize=(4.2 * len(batches), 3.6), squeeze=False)
    for ax, batch in zip(axes.flat, batches):
        row = next(r for r in rows if r["batch"] == batch)
        present = [k for k in keys if f"{k}_us" in row]
        ax.barh(range(len(present)), [row[f"{k}_us"] for k in present],
                color=[f"C{keys.index(k)}" for k in present])
        ax.set_yticks(range(len(present)), present, fontsize=7)
        ax.invert_yaxis()
        ax.set_title(f"batch {batch}, context {row['ctx'] // 1024}k", fontsize=9)
        ax.set_xlabel("µs per layer step (CUDA-graph replay)", fontsize=8)
        ax.tick_params(axis="x", labelsize=7)
    save(fig, result, path, SHAPES)


if __name__ == "__main__":
    main(sys.argv[1])
