"""Plot a ``bench_model_decode.py`` result: milliseconds per decode step of each backend in each
mode, against the byte floor and HF transformers' eager step (shown only where HF's logits
agreed with ours in the run's cross-check).

    python benchmarks/plot_model_decode.py benchmarks/results/bench_model_decode_h200.json
"""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plot_gpu_attention import save  # noqa: E402

MODES = {"eager_ms": "eager", "compiled_no_passes_ms": "compiled, no passes",
         "compiled_ms": "compiled + passes", "graphed_ms": "+ CUDA graph (synchronous step)",
         "graphed_pipelined_ms": "+ CUDA graph (steps back to back)",
         "replay_only_ms": "graph replay alone"}


def main(path: str) -> None:
    result = json.loads(Path(path).read_text())
    rows = result["rows"]
    shape, hf_name = (("DeepSeek-V2-Lite-shaped MLA", "DeepseekV3ForCausalLM")
                      if result.get("mla") else ("Llama-3-8B", "LlamaForCausalLM"))
    fig, ax = plt.subplots(figsize=(11, 4.5))
    width = 0.8 / len(MODES)
    for i, (key, label) in enumerate(MODES.items()):
        xs = [j + (i - len(MODES) / 2 + 0.5) * width for j in range(len(rows))]
        ys = [r.get(key, float("nan")) for r in rows]
        bars = ax.bar(xs, ys, width, label=label)
        ax.bar_label(bars, fmt="%.1f", fontsize=7)
    ax.axhline(rows[0]["floor_ms"], color="k", ls="--",
               label=f"floor: weights + KV at 4.27 TB/s ({rows[0]['floor_ms']:.2f} ms)")
    hf = result.get("hf", {}).get("eager_dynamic_cache_ms")
    if hf and result["hf"].get("agree", True):  # (left out where its outputs disagreed)
        ax.axhline(hf, color="r", ls=":", label=f"HF {hf_name} eager ({hf:.1f} ms)")
    ax.set_xticks(range(len(rows)), [r["backend"] for r in rows])
    ax.set_ylabel("ms per decode step")
    ax.set_yscale("log")
    ax.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.08))
    save(fig, result, path, f"{result['layers']} {shape} layers, batch {result['batch']}, "
                            f"ctx {result['ctx']}, bf16")

if __name__ == "__main__":
    main(sys.argv[1])
