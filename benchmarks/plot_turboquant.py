"""Plot a ``bench_turboquant.py`` result: each decode point's step time per contender (bf16,
fp8, every TurboQuant preset on the CUDA decode and on TRITON_ATTN's read, the copy of the
4bit_nc slots' bytes), CUDA-graph replays (bars) with the preset's target (bf16's time x its
slot bytes / bf16's x the slack) marked. A contender whose cross-check disagreed at a point is
left out there.

    python benchmarks/plot_turboquant.py benchmarks/results/bench_turboquant_cuda_h100.json
"""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plot_gpu_attention import save  # noqa: E402


def _cuda(name: str, data: dict) -> bool:
    """Whether contender ``name`` read on the CUDA decode: a ``cuda`` contender (earlier
    files), or the op where the file says its decodes took it (``op_read``)."""
    if name.endswith(" cuda"):
        return True
    return (name.startswith("TURBOQUANT") and not name.endswith(" triton")
            and data.get("op_read") == "cuda")


def main(path: str) -> None:
    data = json.loads(Path(path).read_text())
    rows = data["decode"]
    fig, axes = plt.subplots(1, len(rows), figsize=(6.5 * len(rows), 4.8), squeeze=False)
    for ax, row in zip(axes[0], rows):
        names = [n for n in row["graph_ms"]
                 if row.get("cross_check", {}).get(n, {"agree": True})["agree"]]
        us = [row["graph_ms"][n] * 1e3 for n in names]
        colors = ["tab:orange" if _cuda(n, data) else "tab:gray" if n == "copy"
                  else "tab:blue" for n in names]
        ax.barh(range(len(names)), us, color=colors)
        for i, n in enumerate(names):
            base = n.removesuffix(" cuda").removesuffix(" triton")
            if base in row.get("target_ms", {}):
                ax.plot([row["target_ms"][base] * 1e3] * 2, [i - 0.4, i + 0.4], color="black")
        ax.set_yticks(range(len(names)), [n.replace("TURBOQUANT:", "TQ ") for n in names])
        ax.invert_yaxis()
        ax.set_xlabel("decode step, us (CUDA-graph replays; black: the preset's target)")
        ax.set_title(f"B={row['batch']}, ctx={row['ctx']}")
    save(fig, data, path, "TurboQuant decode, 32/8 heads x 128 (orange: the CUDA decode)")


if __name__ == "__main__":
    main(sys.argv[1])
