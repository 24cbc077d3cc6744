"""The `parkade` command.

parkade offline "prompt" [--model DIR] [--max-tokens N] [--temperature T] [--seed S]
    run the in-process engine on one prompt and stream the completion to stdout
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

# The trained demo model that ships beside the repository (see shared/models/stories260K).
DEFAULT_MODEL = Path(__file__).resolve().parent.parent.parent / "shared/models/stories260K/hf"


def _offline(args: argparse.Namespace) -> int:
    from parkade import AsyncLLM, SamplingParams

    model = Path(args.model) if args.model else DEFAULT_MODEL
    if not (model / "config.json").exists():
        print(f"parkade: no model at {model}; pass --model DIR (a Hugging Face folder)", file=sys.stderr)
        return 2
    params = SamplingParams(
        temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed, stop=tuple(args.stop)
    )

    async def run() -> None:
        engine = AsyncLLM(model, max_model_len=args.max_model_len)
        sys.stdout.write(args.prompt)
        printed = 0
        async for output in engine.generate(args.prompt, params):
            text = output.outputs[0].text
            sys.stdout.write(text[printed:])
            sys.stdout.flush()
            printed = len(text)
        completion = output.outputs[0]
        num_tokens = len(completion.token_ids)
        sys.stdout.write(f"\n[finish_reason={completion.finish_reason}, tokens={num_tokens}]\n")
        await engine.shutdown()

    asyncio.run(run())
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="parkade", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    offline = sub.add_parser("offline", help="generate with the in-process engine")
    offline.add_argument("prompt")
    offline.add_argument("--model", help="Hugging Face model folder (default: stories260K beside the repo)")
    offline.add_argument("--max-tokens", type=int, default=64)
    offline.add_argument("--temperature", type=float, default=0.0)
    offline.add_argument("--seed", type=int, default=None)
    offline.add_argument("--stop", action="append", default=[])
    offline.add_argument("--max-model-len", type=int, default=None)
    offline.set_defaults(func=_offline)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
