"""The simulated executor's cost model against published measurements: predicted beside published.

    python loadtest/sim_validation.py

Each row is one published number (docs/benchmarks.md, "Validation of the cost model", gives the
sources) and what Parkade predicts for the same setting: from the cost model alone (a step's
time), or from an in-process run of Parkade's real scheduler over the simulated executor
(`LLM(simulate=...)`, times summed from the predicted step times, not the wall clock: the
simulated GPU's time). The workloads are rebuilt from what the sources state (fixed prompt and
output lengths where the source gives averages). Prints one JSON document.
"""

from __future__ import annotations

import json
import platform
import random

from parkade import LLM, SamplingParams
from parkade.services.common.simulation import GPUS, MODELS
from parkade.services.executor.cost_model import CostModel, StepWork

MAX_NUM_BATCHED_TOKENS = 8192  # vLLM V1's default on these GPUs (chunked prefill)


def ttft(cost: CostModel, prompt: int, chunk: int = MAX_NUM_BATCHED_TOKENS) -> float:
    """A prompt alone, prefilled in chunks of `chunk` tokens (one step each)."""
    return sum(
        cost.step_time(StepWork.of([(start, min(chunk, prompt - start), start + chunk >= prompt)]))
        for start in range(0, prompt, chunk)
    )


def lengths(n: int, mean: int, spread: bool, seed: int) -> list[int]:
    """`n` lengths of mean `mean`: all equal, or (`spread`) exponential as chat datasets' are
    roughly (ShareGPT's has a long tail), between 4 and 8 x the mean."""
    if not spread:
        return [mean] * n
    rng = random.Random(seed)
    return [min(8 * mean, max(4, round(rng.expovariate(1 / mean)))) for _ in range(n)]


def engine_run(gpu: str, n: int, prompt_len: int, output_len: int, *, spread: bool = False) -> dict:
    """`n` requests at once through Parkade's scheduler on the simulated GPU (vLLM's defaults:
    256 sequences, 8,192 tokens a step): the simulated time of the whole run (the steps'
    predicted times, summed)."""
    prompt_lens, output_lens = lengths(n, prompt_len, spread, 1), lengths(n, output_len, spread, 2)
    llm = LLM(
        simulate=f"{gpu}:llama-3-8b",
        simulate_speedup=1e9,  # no waiting: the times are the predicted ones
        max_num_seqs=256,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
    )
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 500) for _ in range(p)]} for p in prompt_lens]
    params = [SamplingParams(max_tokens=o, ignore_eos=True, temperature=0.0) for o in output_lens]
    executor = llm.engine.core.executor
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == output_lens
    return {
        "seconds": executor.stats.predicted_s,
        "steps": executor.stats.steps,
        "output_tokens": sum(output_lens),
    }


def rows() -> list[dict]:
    h100 = CostModel(GPUS["h100"], MODELS["llama-3-8b"])
    out = []

    def row(source: str, setting: str, metric: str, published: float, predicted: float) -> None:
        out.append(
            {
                "source": source,
                "setting": setting,
                "metric": metric,
                "published": published,
                "predicted": round(predicted, 4),
                "predicted_over_published": round(predicted / published, 3),
            }
        )

    for context in (256, 32_768, 131_072):
        published = 6.44 + 4.37e-5 * context
        tpot = h100.decode_step_time(1, context) * 1e3
        row("A", f"H100, batch 1, context {context}", "time between tokens, ms", round(published, 2), tpot)
    for prompt, published in ((33_000, 1.3), (82_000, 5.1), (131_000, 10.1)):
        row("A", f"H100, one {prompt}-token prompt", "time to first token, s", published, ttft(h100, prompt))
    # 8 requests of ~20k-token prompts and ~2k outputs: a decode step halfway through (the
    # published median also counts steps that carry another request's prefill chunk).
    row(
        "A",
        "H100, 8 decoding at ~21k context",
        "time between tokens, ms",
        15.18,
        h100.decode_step_time(8, 21_000) * 1e3,
    )
    for spread, shape in ((False, "all 202 in / 179 out"), (True, "exponential lengths, means 202 / 179")):
        run = engine_run("h100", 500, 202, 179, spread=spread)
        tokens_per_s = run["output_tokens"] / run["seconds"]
        row("B", f"H100, 500 requests at once, {shape}", "output tokens/s", 6500, tokens_per_s)
        run = engine_run("h200", 200, 202, 179, spread=spread)
        row("C", f"H200, 200 requests at once, {shape}", "requests/s", 22.57, 200 / run["seconds"])
    run = engine_run("h200", 8, 32, 128)
    row("C", "H200, batch 8, 32 in / 128 out", "end-to-end latency, ms", 833.4, run["seconds"] * 1e3)
    return out


def main() -> None:
    print(
        json.dumps(
            {
                "benchmark": "simulator_validation",
                "model": "llama-3-8b (bf16), default efficiencies",
                "machine": platform.machine(),
                "rows": rows(),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
