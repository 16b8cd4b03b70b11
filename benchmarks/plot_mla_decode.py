"""Plot a ``bench_mla_decode.py`` result: our MLA ops, FlashMLA and FlashInfer's MLA kernels
alone and as vLLM runs them, by batch, one panel per (heads, context) -- TB/s of latent cache read at 16 heads
(memory-bound), TFLOP/s at 128 (compute-bound).

    python benchmarks/plot_mla_decode.py benchmarks/results/bench_mla_decode_h200.json
"""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plot_gpu_attention import save  # noqa: E402

CONTENDERS = {"composite_mla_sm90_op": "COMPOSITE_MLA_SM90 op (selected)",
              "flashinfer_mla_op": "FLASHINFER_MLA op", "flashmla_op": "FLASHMLA op",
              "triton_mla_op": "TRITON_MLA op", "vllm_flashmla": "FlashMLA as vLLM runs it",
              "vllm_flashinfer_fa3": "FlashInfer fa3 as vLLM runs it",
              "flashmla": "FlashMLA kernel", "flashinfer_fa3": "FlashInfer fa3 kernel",
              "flashinfer_fa2": "FlashInfer fa2 kernel"}


def main(path: str) -> None:
    result = json.loads(Path(path).read_text())
    rows = result["rows"]
    panels = sorted({(r["heads"], r["ctx"]) for r in rows})
    fig, axes = plt.subplots(2, len(panels) // 2 or 1, figsize=(3.2 * max(1, len(panels) // 2), 6),
                             squeeze=False)
    for ax, (heads, ctx) in zip(axes.flat, panels):
        unit = "tbs" if heads <= 32 else "tflops"
        mine = sorted((r for r in rows if (r["heads"], r["ctx"]) == (heads, ctx)),
                      key=lambda r: r["batch"])
        for key, label in CONTENDERS.items():
            if f"{key}_{unit}" in mine[0]:
                ax.plot([r["batch"] for r in mine], [r[f"{key}_{unit}"] for r in mine],
                        marker="o", ms=3, label=label)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{heads} heads, ctx {ctx}", fontsize=9)
        ax.set_xlabel("batch", fontsize=8)
        ax.set_ylabel("TB/s" if unit == "tbs" else "TFLOP/s", fontsize=8)
        ax.tick_params(labelsize=7)
    axes.flat[0].legend(fontsize=6)
    save(fig, result, path, f"MLA decode 512 + 64 latent, bf16, page {result['page']}")


if __name__ == "__main__":
    main(sys.argv[1])
