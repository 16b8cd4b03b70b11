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
    keys = sorted({k[:-3] for r in rows for k in r if k.endswith("_us")},
                  key=lambda k: (not k.startswith("sparse_step_"), k))
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
    save(fig, result, path, "sparse MLA decode, 128 heads, 512 + 64 latent, top-k 2048, "
         "bf16 latents, fp8 index keys, page 64")


if __name__ == "__main__":
    main(sys.argv[1])
