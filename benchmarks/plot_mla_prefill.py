"""Plot a ``bench_mla_prefill.py`` result: TFLOP/s of the MHA-form MLA prefill per case -- our
kernel glue (FA4, FlashInfer ragged), the layer's whole op (context in chunks and in one), and
the kernels called directly.

    python benchmarks/plot_mla_prefill.py benchmarks/results/bench_mla_prefill_h200.json
"""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plot_gpu_attention import save  # noqa: E402

CONTENDERS = {"glue_fa4": "our glue: FA4", "glue_flashinfer": "our glue: FlashInfer ragged",
              "layer_op": "layer op (context in 4k chunks)",
              "layer_op_one_chunk": "layer op (context in one chunk)",
              "fa4_direct": "FA4 (direct)", "flashinfer_ragged": "FlashInfer ragged (direct)"}


def main(path: str) -> None:
    result = json.loads(Path(path).read_text())
    rows = result["rows"]
    present = [k for k in CONTENDERS if any(f"{k}_tflops" in r for r in rows)]
    fig, ax = plt.subplots(figsize=(11, 4.5))
    width = 0.8 / len(present)
    for i, key in enumerate(present):
        xs = [j + (i - len(present) / 2 + 0.5) * width for j in range(len(rows))]
        bars = ax.bar(xs, [r.get(f"{key}_tflops", float("nan")) for r in rows], width,
                      label=CONTENDERS[key])
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_xticks(range(len(rows)), [r["case"] for r in rows])
    ax.set_ylabel("TFLOP/s (causal, QK 192 / V 128)")
    ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.08))
    save(fig, result, path, "MLA prefill, MHA form, 128 heads, bf16")


if __name__ == "__main__":
    main(sys.argv[1])
