"""A step's matmuls on a CPU: Parkade's packed-linear kernel (`kernels/linear_cpu.py`: AMX, or
AVX512-BF16 without it) against oneDNN.

Every matmul of one forward step of a model (per layer q/k/v in one, o, gate/up in one, down; then
the head), random bf16 weights of the model's shapes, for several row counts: the weights are
read from DRAM as in a decode step (together far larger than the cache, for models of ~100M
parameters up). Three ways: `kernel` (this kernel, weights packed once), `onednn_packed` (oneDNN on
weights prepacked as inductor's freezing does, what `linear_cpu` hands steps of more than the
kernel's max_rows) and `onednn` (`F.linear` on the plain weight). Prints JSON: ms per step and GB/s
of weights.

    .venv/bin/python loadtest/linear_bench.py --model /path/to/model --rows 1 16 64 256 1024
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from parkade.kernels import linear_cpu
from parkade.services.common.model_config import ModelConfig
from parkade.services.executor.cpu_paths import cpu_description

SMALL_LLAMA = {"hidden": 768, "q": 768, "kv": 256, "inter": 2048, "layers": 12, "vocab": 8192}


def step_shapes(dims: dict[str, int]) -> list[tuple[int, int]]:
    """(out, in) of each matmul of a step, in order."""
    h = dims["hidden"]
    layer = [(dims["q"] + 2 * dims["kv"], h), (h, dims["q"]), (2 * dims["inter"], h), (h, dims["inter"])]
    return layer * dims["layers"] + [(dims["vocab"], h)]


def model_dims(path: str | None) -> dict[str, int]:
    if path is None:
        return SMALL_LLAMA
    c = ModelConfig.from_pretrained(path)
    return {
        "hidden": c.hidden_size, "q": c.num_attention_heads * c.head_dim,
        "kv": c.num_key_value_heads * c.head_dim, "inter": c.intermediate_size,
        "layers": c.num_hidden_layers, "vocab": c.vocab_size,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="a model folder (its config.json); default: small-llama's shapes")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 32, 64, 128, 256, 512, 2048])
    parser.add_argument("--repeat", type=int, default=5, help="steps timed per way and row count (best kept)")
    args = parser.parse_args()
    if not linear_cpu.serves(torch.bfloat16):
        raise SystemExit("no packed-linear kernel serves on this CPU (no AMX, no AVX512-BF16, or turned off)")
    chosen = linear_cpu.kernel()
    weights = [0.02 * torch.randn(n, k, dtype=torch.bfloat16) for n, k in step_shapes(model_dims(args.model))]
    packed = [linear_cpu.pack_weight(w) for w in weights]
    prepacked = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]
    weight_bytes = sum(w.numel() * w.element_size() for w in weights)
    onednn_linear = torch.ops.mkldnn._linear_pointwise
    ways = {
        "kernel": lambda x, i: linear_cpu.linear(x, packed[i], weights[i], None, weights[i].shape[0]),
        "onednn_packed": lambda x, i: onednn_linear(x, prepacked[i], None, "none", [], ""),
        "onednn": lambda x, i: F.linear(x, weights[i]),
    }
    rows_out = []
    for m in args.rows:
        inputs = {k: torch.randn(m, k, dtype=torch.bfloat16) for k in {w.shape[1] for w in weights}}
        row: dict[str, object] = {"rows": m}
        for name, way in ways.items():
            if name == "kernel" and m > chosen.max_rows:
                continue  # linear() hands these to oneDNN: the `onednn_packed` column
            best = float("inf")
            for _ in range(args.repeat + 1):  # the first is a warm-up
                start = time.perf_counter()
                for i, w in enumerate(weights):
                    way(inputs[w.shape[1]], i)
                best = min(best, time.perf_counter() - start)
            row[f"{name}_ms"] = round(best * 1e3, 2)
            row[f"{name}_weights_gb_s"] = round(weight_bytes / best / 1e9, 1)
        rows_out.append(row)
        print(json.dumps(row), flush=True)
    summary = {
        "cpu": cpu_description(), "torch_threads": torch.get_num_threads(),
        "weight_mb": round(weight_bytes / 1e6, 1), "kernel": chosen.name,
        "max_rows": chosen.max_rows, "rows": rows_out,
    }  # fmt: skip
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
