"""Whole-model throughput on this machine's device: Parkade against transformers' `generate` (SDPA).

    python loadtest/model_bench.py [--model DIR] [--num-requests 64] [--device auto] ...

For a machine without the anchors (the GPU of `loadtest/device_check.sh`): without `--model`, a
Llama of `--hidden-size`/`--layers` is made from a transformers config with seeded random weights
and saved to a temp folder, so the real loading code runs. The workload mirrors the anchors' `main`
one (prompts uniform in [32, 512], outputs in [16, 256], greedy, EOS ignored, seeded). The naive
side is transformers `generate` with SDPA in static batches of `--hf-batch` (left padding, every
batch runs to its longest output); Parkade is its `Engine` with the default attention backend
(Triton on CUDA). Both warm up first. Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig


def make_model(folder: Path, hidden: int, layers: int, dtype: torch.dtype) -> Path:
    config = LlamaConfig(
        vocab_size=8192, hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 64 * 64,
        num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256),
        max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, pad_token_id=3,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=dtype).save_pretrained(folder)
    return folder


def make_workload(n: int, vocab: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    workload = []
    for _ in range(n):
        prompt = [rng.randrange(4, vocab) for _ in range(rng.randint(32, 512))]
        workload.append((prompt, rng.randint(16, 256)))
    return workload


def run_parkade(model: Path, workload: list[tuple[list[int], int]], device: str) -> dict:
    from parkade.engine.args import EngineArgs
    from parkade.engine.engine import Engine
    from parkade.schemas import SamplingParams

    kwargs = {"kv_cache_memory_bytes": 2 * 2**30} if device == "cpu" else {}
    engine = Engine(EngineArgs(model=model, device=device, **kwargs), skip_tokenizer_init=True)

    def go(batch: list[tuple[list[int], int]], tag: str) -> tuple[float, int]:
        for i, (prompt, n) in enumerate(batch):
            params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
            engine.add_request(f"{tag}{i}", {"prompt_token_ids": prompt}, params)
        start, tokens = time.perf_counter(), 0
        while engine.has_unfinished_requests():
            tokens += sum(len(o.outputs[0].token_ids) for o in engine.step() if o.finished)
        return time.perf_counter() - start, tokens

    go(workload[:4], "warmup-")
    wall, tokens = go(workload, "req-")
    backend = engine.core.executor.attention_backend.__name__.rsplit(".", 1)[-1]
    return {"wall_s": round(wall, 3), "output_tokens": tokens, "output_tok_per_s": round(tokens / wall, 1),
            "attention_backend": backend}  # fmt: skip


def run_hf(model: Path, workload: list[tuple[list[int], int]], device: str, batch_size: int) -> dict:
    hf = AutoModelForCausalLM.from_pretrained(model, attn_implementation="sdpa").to(device).eval()

    def go(batch_list: list[tuple[list[int], int]]) -> tuple[float, int]:
        start, useful = time.perf_counter(), 0
        for b in range(0, len(batch_list), batch_size):
            batch = batch_list[b : b + batch_size]
            width = max(len(p) for p, _ in batch)
            ids = torch.full((len(batch), width), 3, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, (p, _) in enumerate(batch):
                ids[i, width - len(p) :] = torch.tensor(p)
                mask[i, width - len(p) :] = 1
            new = max(n for _, n in batch)
            with torch.inference_mode():
                hf.generate(
                    input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=new,
                    min_new_tokens=new, do_sample=False, pad_token_id=3,
                )  # fmt: skip
            useful += sum(n for _, n in batch)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - start, useful

    go(workload[:2])
    wall, tokens = go(workload)
    return {"wall_s": round(wall, 3), "output_tokens": tokens, "output_tok_per_s": round(tokens / wall, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="default: a seeded random Llama")
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--hf-batch", type=int, default=8)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    with tempfile.TemporaryDirectory() as tmp:
        dtype = getattr(torch, args.dtype)
        model = args.model or make_model(Path(tmp) / "model", args.hidden_size, args.layers, dtype)
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        workload = make_workload(args.num_requests, vocab, args.seed)
        parkade = run_parkade(model, workload, device)
        hf = run_hf(model, workload, device, args.hf_batch)
    cpu = platform.processor() or platform.machine()
    name = torch.cuda.get_device_name() if device.startswith("cuda") else cpu
    print(json.dumps({
        "benchmark": "model_bench", "device": name, "settings": {k: str(v) for k, v in vars(args).items()},
        "parkade": parkade, "hf_generate_sdpa": hf,
        "parkade_over_hf": round(parkade["output_tok_per_s"] / hf["output_tok_per_s"], 2),
    }, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
