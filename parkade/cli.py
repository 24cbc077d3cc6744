"""The `parkade` command.

parkade up [--model DIR] [--topic-prefix P] [--port N]
    run broker (unless $KAFKA_BOOTSTRAP_SERVERS is set), tokenizer, scheduler and executor here
parkade generate "prompt" [--max-tokens N] [--temperature T] [--top-p P] [--seed S] [--stop STR]...
    send one request to a running Parkade and stream the completion to stdout
parkade tokenizer | scheduler | executor [--help]
    run one service (what `parkade up` starts)
parkade offline "prompt" [--model DIR] [--max-tokens N] [--temperature T] [--seed S]
    run the in-process engine on one prompt and stream the completion to stdout
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import os
import sys
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from parkade import up

if TYPE_CHECKING:
    from parkade.schemas import SamplingParams

SERVICES = ("tokenizer", "scheduler", "executor")

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


def _find_broker(args: argparse.Namespace) -> tuple[str, str] | None:
    """Bootstrap servers and topic prefix: --bootstrap-servers, else $KAFKA_BOOTSTRAP_SERVERS, else
    the state file of a running `parkade up`."""
    from parkade.schemas.topics import DEFAULT_PREFIX

    bootstrap = args.bootstrap_servers or os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    if bootstrap:
        return bootstrap, args.topic_prefix or DEFAULT_PREFIX
    state = up.read_state()
    if state is None:
        return None
    return state["bootstrap_servers"], args.topic_prefix or state["topic_prefix"]


def _generate(args: argparse.Namespace) -> int:
    from parkade import SamplingParams

    found = _find_broker(args)
    if found is None:
        print(
            "parkade generate: no broker: start one with `parkade up`, or pass --bootstrap-servers "
            "or set KAFKA_BOOTSTRAP_SERVERS",
            file=sys.stderr,
        )
        return 2
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            seed=args.seed,
            stop=tuple(args.stop),
        )
    except ValueError as e:
        print(f"parkade generate: {e}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_stream(*found, args.prompt, params, args.timeout))
    except KeyboardInterrupt:
        return 130


async def _stream(
    bootstrap: str, prefix: str, prompt: str, params: SamplingParams, timeout_s: float | None
) -> int:
    """Send one request and write its text to stdout as it comes; -> exit code (1 on an error event)."""
    from aiokafka.errors import KafkaConnectionError

    from parkade.client import Client

    client = Client(bootstrap, prefix)
    try:
        await client.start()
    except KafkaConnectionError as e:
        print(f"parkade generate: cannot reach the broker at {bootstrap}: {e}", file=sys.stderr)
        return 1
    request_id = uuid.uuid4().hex
    try:
        async with asyncio.timeout(timeout_s):
            async for event in client.generate(prompt=prompt, sampling_params=params, request_id=request_id):
                sys.stdout.write(event.text)
                sys.stdout.flush()
    except TimeoutError:
        await client.cancel(request_id)
        print(f"\nparkade generate: no answer within {timeout_s}s; request cancelled", file=sys.stderr)
        return 1
    except asyncio.CancelledError:  # Ctrl-C
        await client.cancel(request_id)
        raise
    finally:
        await client.stop()
    sys.stdout.write("\n")
    if event.error is not None or event.finish_reason == "error":
        print(f"parkade generate: error: {event.error}", file=sys.stderr)
        return 1
    usage = f", tokens={event.usage.completion_tokens}" if event.usage is not None else ""
    print(f"[finish_reason={event.finish_reason}{usage}]", file=sys.stderr)
    return 0


def _service(name: str, argv: list[str]) -> int:
    """Run one service's `main` with the rest of the command line."""
    return importlib.import_module(f"parkade.services.{name}.main").main(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # NOTE: a service parses its own arguments (and its own --help).
    if argv and argv[0] in SERVICES:
        return _service(argv[0], argv[1:])
    parser = argparse.ArgumentParser(
        prog="parkade",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.split("\n")[2:]),
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name in SERVICES:
        sub.add_parser(name, help=f"run the {name} service (parkade {name} --help)", add_help=False)
    up_parser = sub.add_parser("up", help="run Parkade on this machine until Ctrl-C")
    up.add_arguments(up_parser)
    up_parser.set_defaults(func=up.main)
    generate = sub.add_parser("generate", help="stream a completion from a running Parkade")
    generate.add_argument("prompt")
    generate.add_argument("--max-tokens", type=int, default=64)
    generate.add_argument("--temperature", type=float, default=1.0, help="0: greedy (default: 1.0)")
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--seed", type=int, default=None)
    generate.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    generate.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the whole answer")
    generate.add_argument(
        "--bootstrap-servers", default=None, help="default: $KAFKA_BOOTSTRAP_SERVERS, else `parkade up`"
    )
    generate.add_argument("--topic-prefix", default=None, help="default: parkade. (or that of `parkade up`)")
    generate.set_defaults(func=_generate)
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
