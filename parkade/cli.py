"""The `parkade` command.

parkade up [--model DIR] [engine and scheduling flags]
    run the broker (unless $KAFKA_BOOTSTRAP_SERVERS is set), tokenizer, scheduler, executor and
    the gateway (OpenAI HTTP API) until Ctrl-C
parkade generate "prompt" [generation flags]
    send one request to a running Parkade and stream the completion to stdout
parkade offline "prompt" [--model DIR] [engine and scheduling flags] [generation flags]
    run the in-process engine on one prompt and stream the completion to stdout
parkade tokenizer | scheduler | executor | gateway [--help]
    run one service (`parkade gateway --with-tokenizer`: the gateway and the tokenizer in one process)
parkade replica [--help]
    run one engine replica in one process: a scheduler and its executor (what `parkade up`
    starts for each replica, with the gateway and its tokenizer)
parkade trace REQUEST_ID
    one request's spans as a waterfall (after `parkade up --trace`)
parkade topics [--create] [--reap]
    list Parkade's topics and the clients' reply topics on the broker; --create: create the
    missing topics (each service also does, at start); --reap: delete the reply topics of
    clients gone for longer than --grace (each client also does, at start)
parkade --version

`generate` and `offline` take the same generation flags, with the same defaults. Without --model,
Parkade serves the stories260K model it ships with. Every --help shows the defaults. `generate`
and `topics` talk to the broker of --bootstrap-servers, else of $KAFKA_BOOTSTRAP_SERVERS, else
of the `parkade up` running on this machine.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib
import logging
import sys
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from parkade import up
from parkade.engine.args import ENGINE_ONLY_FIELDS, EngineArgs
from parkade.schemas import FinishReason, SamplingParams, TokenEvent
from parkade.services import SERVICES
from parkade.services.bus.replies import REAP_GRACE_S
from parkade.services.common.flags import add_flags, dataclass_flags, flag_values, struct_flags

if TYPE_CHECKING:
    from parkade.engine.outputs import RequestOutput

_SAMPLING_HELP = {
    "temperature": "0: greedy",
    "top_p": "keep the most likely tokens up to this probability mass",
    "top_k": "keep the k most likely tokens; 0 or -1: all",
    "min_p": "drop tokens less likely than min_p times the most likely",
    "repetition_penalty": "> 1 discourages tokens already in the prompt or output",
    "presence_penalty": "subtracted from the logit of every token already in the output",
    "frequency_penalty": "subtracted per occurrence in the output",
    "seed": "seed of this request's sampling; unset: the engine's generator",
    "max_tokens": "most tokens to generate",
    "min_tokens": "tokens to generate before EOS or a stop can end the request",
    "stop": "stop at this string (repeatable)",
    "stop_token_ids": "stop at this token id (repeatable)",
    "ignore_eos": "keep generating past EOS",
    "include_stop_str_in_output": "keep the stop string at the end of the text",
    "skip_special_tokens": "leave special tokens out of the text",
    "bad_words": "a word that may not be generated (repeatable)",
    "truncate_prompt_tokens": "keep only the prompt's last k tokens",
}
# One stream of text is shown: what needs another shape (samples, logprobs, maps) is left to
# the Python API and the topics.
_NOT_FLAGS = (
    "logprobs", "n", "prompt_logprobs", "spaces_between_special_tokens", "detokenize", "logit_bias",
    "allowed_token_ids", "bad_words_token_ids", "output_kind",
)  # fmt: skip
# NOTE: the CLI's one departure from SamplingParams' defaults: 16 tokens is short for a look.
_CLI_DEFAULTS = {"max_tokens": 64}
GENERATION_FLAGS = [
    dataclasses.replace(flag, default=_CLI_DEFAULTS.get(flag.name, flag.default))
    for flag in struct_flags(SamplingParams, _SAMPLING_HELP, exclude=_NOT_FLAGS)
]


def _sampling_params(command: str, args: argparse.Namespace) -> SamplingParams | None:
    """The request's SamplingParams, or None after printing what is wrong (exit 2)."""
    try:
        return SamplingParams(**flag_values(GENERATION_FLAGS, args))
    except ValueError as error:
        print(f"parkade {command}: {error}", file=sys.stderr)
        return None


async def _write_stream(prompt: str, events: AsyncIterator[tuple[str, Any]]) -> Any:
    """Write the prompt, then each text delta as it comes; -> the last item's payload."""
    sys.stdout.write(prompt)
    sys.stdout.flush()
    last = None
    async for delta, payload in events:
        sys.stdout.write(delta)
        sys.stdout.flush()
        last = payload
    sys.stdout.write("\n")
    return last


def _summary(finish_reason: str | None, num_tokens: int | None, request_id: str | None = None) -> None:
    tokens = "" if num_tokens is None else f", tokens={num_tokens}"
    request = "" if request_id is None else f", request_id={request_id}"
    print(f"[finish_reason={finish_reason}{tokens}{request}]", file=sys.stderr)


# ---- the broker -------------------------------------------------------------------------------
def _add_broker_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of every command that talks to a broker (resolved by `_broker`)."""
    parser.add_argument(
        "--bootstrap-servers", default=None, help="default: $KAFKA_BOOTSTRAP_SERVERS, else `parkade up`'s"
    )
    parser.add_argument("--topic-prefix", default=None, help="default: `parkade up`'s, else parkade.")


def _broker(command: str, args: argparse.Namespace) -> tuple[str, str] | None:
    """(bootstrap servers, topic prefix) for `command`, found the one way every command finds
    them (`parkade.client.find_broker`); None after saying in one line why not (exit 2)."""
    from parkade.client import NoBrokerError, find_broker
    from parkade.services.bus.runtime import connection_settings_ok

    try:
        broker = find_broker(args.bootstrap_servers, args.topic_prefix)
    except NoBrokerError as error:
        print(f"parkade {command}: {error}", file=sys.stderr)
        return None
    return broker if connection_settings_ok(command) else None


# ---- parkade offline -------------------------------------------------------------------------
# NOTE: not the engine's `seed`: here --seed seeds the one request, which is what a single prompt
# needs. Nor the vLLM arguments only `LLM(...)` takes (ENGINE_ONLY_FIELDS): as flags of a one-prompt
# command they would mean nothing.
ENGINE_FLAGS = dataclass_flags(EngineArgs, exclude=("seed", *ENGINE_ONLY_FIELDS))


def _offline(args: argparse.Namespace) -> int:
    params = _sampling_params("offline", args)
    if params is None:
        return 2
    from parkade import AsyncLLM

    try:
        engine = AsyncLLM(**flag_values(ENGINE_FLAGS, args))
    except ValueError as error:
        print(f"parkade offline: {error}", file=sys.stderr)
        return 2

    async def deltas() -> AsyncIterator[tuple[str, RequestOutput]]:
        printed = 0
        async for output in engine.generate(args.prompt, params):
            text = output.outputs[0].text
            yield text[printed:], output
            printed = len(text)

    async def run() -> RequestOutput:
        try:
            return await _write_stream(args.prompt, deltas())
        finally:
            await engine.shutdown()

    try:
        output = asyncio.run(run())
    except ValueError as error:  # the prompt cannot run (too long for max_model_len, ...)
        print(f"parkade offline: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    completion = output.outputs[0]
    _summary(completion.finish_reason, len(completion.token_ids))
    return 0


# ---- parkade generate ------------------------------------------------------------------------
def _generate(args: argparse.Namespace) -> int:
    params = _sampling_params("generate", args)
    if params is None:
        return 2
    broker = _broker("generate", args)
    if broker is None:
        return 2
    bootstrap, prefix = broker
    try:
        return asyncio.run(_stream(bootstrap, prefix, args.prompt, params, args.timeout))
    except KeyboardInterrupt:
        return 130


async def _stream(
    bootstrap: str, prefix: str, prompt: str, params: SamplingParams, timeout_s: float | None
) -> int:
    """Send one request and write its text to stdout as it comes; -> exit code (1 on an error event)."""
    from aiokafka.errors import KafkaConnectionError

    from parkade.client import Client, PipelineGoneError

    # aiokafka logs every failed reconnection; the user gets one line from us instead.
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
    client = Client(bootstrap, prefix)
    try:
        await client.start()
    except KafkaConnectionError as e:
        await client.stop()
        print(f"parkade generate: cannot reach the broker at {bootstrap}: {e}", file=sys.stderr)
        return 1
    request_id = uuid.uuid4().hex

    async def deltas() -> AsyncIterator[tuple[str, TokenEvent]]:
        async for event in client.generate(prompt=prompt, sampling_params=params, request_id=request_id):
            yield event.text, event

    try:
        async with asyncio.timeout(timeout_s):
            event = await _write_stream(prompt, deltas())
    except TimeoutError:
        await client.cancel(request_id)
        print(f"\nparkade generate: no answer within {timeout_s}s; request cancelled", file=sys.stderr)
        return 1
    except PipelineGoneError as error:
        print(f"\nparkade generate: {error}", file=sys.stderr)
        return 1
    except asyncio.CancelledError:  # Ctrl-C
        await client.cancel(request_id)
        raise
    finally:
        await client.stop()
    if event.error is not None or event.finish_reason is FinishReason.ERROR:
        print(f"parkade generate: error: {event.error}", file=sys.stderr)
        return 1
    _summary(
        event.finish_reason, event.usage.completion_tokens if event.usage is not None else None, request_id
    )
    return 0


# ---- parkade trace -----------------------------------------------------------------------------
def _trace(args: argparse.Namespace) -> int:
    from parkade import trace
    from parkade.home import parkade_home

    return trace.main(args.request_id, args.file or parkade_home() / up.TRACE_FILE)


# ---- parkade topics --------------------------------------------------------------------------
def _topics(args: argparse.Namespace) -> int:
    from parkade.schemas import topics
    from parkade.services.bus.kafka import BrokerUnreachableError, KafkaBus, TopicLayoutError, wait_for_broker
    from parkade.services.bus.replies import is_reply_topic, reap

    broker = _broker("topics", args)
    if broker is None:
        return 2
    bootstrap, prefix = broker
    names = topics.all_topic_names(prefix)

    async def run() -> tuple[list[str], list[str]]:
        await wait_for_broker(bootstrap, timeout_s=args.broker_wait)
        bus = KafkaBus(bootstrap, client_id="parkade-topics")
        try:
            if args.create:
                await bus.create_topics(names)
            deleted = await reap(bus, prefix, grace_s=args.grace) if args.reap else []
            return deleted, sorted(t for t in await bus.list_topics() if is_reply_topic(t, prefix))
        finally:
            await bus.close()

    try:
        deleted, replies = asyncio.run(run())
    except BrokerUnreachableError as error:
        print(f"parkade topics: cannot reach the broker at {bootstrap}: {error}", file=sys.stderr)
        return 1
    except TopicLayoutError as error:
        print(f"parkade topics: {error}", file=sys.stderr)
        return 2
    except TimeoutError:
        print(f"parkade topics: the broker at {bootstrap} did not answer in time; try again", file=sys.stderr)
        return 1
    print("\n".join([*names, *replies]))
    if args.reap:
        print(
            f"[deleted {len(deleted)} reply topics of clients gone for over {args.grace:g} s]",
            file=sys.stderr,
        )
    return 0


# ---- the command -----------------------------------------------------------------------------
def _service(name: str, argv: list[str]) -> int:
    """Run one service's `main` with the rest of the command line."""
    return importlib.import_module(f"parkade.services.{name}.main").main(argv)


def _subcommand(
    sub: Any, name: str, help_text: str, func: Callable[[argparse.Namespace], int]
) -> argparse.ArgumentParser:
    parser = sub.add_parser(
        name, help=help_text, description=help_text, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.set_defaults(func=func)
    return parser


_SERVICE_HELP = {
    "tokenizer": "run the tokenizer service: requests in, token events out (parkade tokenizer --help)",
    "scheduler": "run the scheduler service: plans each engine step (parkade scheduler --help)",
    "executor": "run the executor service: runs the model for each step (parkade executor --help)",
    "gateway": "run the gateway service: the OpenAI HTTP API (parkade gateway --help)",
}


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("parkade")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="parkade",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.split("\n")[2:]),
    )
    parser.add_argument("--version", action="version", version=f"parkade {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in SERVICES:
        sub.add_parser(name, help=_SERVICE_HELP[name], add_help=False)
    sub.add_parser(
        "replica",
        help="run one engine replica in one process: a scheduler and its executor, their steps in "
        "memory (parkade replica --help)",
        add_help=False,
    )
    up.add_arguments(
        _subcommand(sub, "up", "run the broker and every service (gateway too) until Ctrl-C", up.main)
    )

    generate = _subcommand(sub, "generate", "stream a completion from a running Parkade", _generate)
    generate.add_argument("prompt")
    add_flags(generate.add_argument_group("generation"), GENERATION_FLAGS)
    generate.add_argument(
        "--timeout", type=float, default=300.0, help="seconds to wait for the whole answer (default: 300)"
    )
    _add_broker_flags(generate)

    trace = _subcommand(sub, "trace", "one request's spans as a waterfall (parkade up --trace)", _trace)
    trace.add_argument("request_id")
    trace.add_argument("--file", type=Path, default=None, help="default: $PARKADE_HOME/traces.jsonl")

    topics_ = _subcommand(
        sub,
        "topics",
        "list the topics and the clients' reply topics; --create, --reap",
        _topics,
    )
    topics_.add_argument("--create", action="store_true", help="create the missing topics")
    topics_.add_argument(
        "--reap", action="store_true", help="delete the reply topics of clients gone for over --grace"
    )
    topics_.add_argument(
        "--grace",
        type=float,
        default=REAP_GRACE_S,
        help=f"seconds without a heartbeat before a reply topic is reaped (default: {REAP_GRACE_S:g})",
    )
    _add_broker_flags(topics_)
    topics_.add_argument(
        "--broker-wait", type=float, default=60.0, help="seconds to wait for the broker (default: 60)"
    )

    offline = _subcommand(sub, "offline", "generate with the in-process engine (no Kafka)", _offline)
    offline.add_argument("prompt")
    add_flags(offline.add_argument_group("generation"), GENERATION_FLAGS)
    add_flags(offline.add_argument_group("engine"), ENGINE_FLAGS)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # NOTE: a service parses its own arguments (and its own --help).
    if argv and argv[0] == "gateway":  # with --with-tokenizer, the tokenizer in its process
        from parkade import gateway

        return gateway.main(argv[1:])
    if argv and argv[0] in SERVICES:
        return _service(argv[0], argv[1:])
    if argv and argv[0] == "replica":
        from parkade import replica

        return replica.main(argv[1:])
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
