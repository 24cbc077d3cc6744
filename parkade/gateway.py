"""`parkade gateway`: the gateway service, and with --with-tokenizer the tokenizer in its process.

    parkade gateway [--http-port 8000] [--model DIR] [gateway flags]
    parkade gateway --with-tokenizer [--router kv] [...]

With --with-tokenizer the tokenizer runs as `parkade tokenizer` runs it (its consumer group,
instance claim and metrics, on the gateway's model and tokenizer), beside the gateway on one
event loop. The gateway's own requests (and aborts) go to a requests topic of its own and their
token events to its reply topic, both in this process's memory: a request reaches the tokenizer,
and each step's events their streams, without a broker hop, and the broker no longer stores,
fetches and serves them. The tokenizer reads the requests topic on the broker too, and writes
every other client's events there, so that the replicas and Kafka clients see no difference. It
is the pipeline's one tokenizer: tokenizers sharing the topics by request id (`--tokenizers N`)
run apart.

`parkade up` runs the gateway this way unless --split-tokenizer or --tokenizers N > 1. A restart of
this process restarts both: the HTTP streams ended with their connections, and their requests
with the memory they were in (their replicas' events find no request: the tokenizer stops them,
as any orphan); the tokenizer resumes the broker's requests from its committed offsets, as alone.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from parkade.services.bus.serve import Service
from parkade.services.common.flags import add_flags, flag_values
from parkade.services.gateway import main as gateway_main
from parkade.services.gateway.handler import GatewayOptions
from parkade.services.tokenizer import main as tokenizer_main
from parkade.services.tokenizer.frontend import TokenizerOptions

# The tokenizer's own settings; its model, tokenizer, length limit and chat template trust are
# the gateway's (the same flags).
TOKENIZER_FLAGS = tokenizer_main.ROUTER_FLAGS


def build_tokenizer(options: GatewayOptions, router: dict[str, Any]) -> tuple[str, Service]:
    """The tokenizer service on the gateway's model (`router`: TOKENIZER_FLAGS' values), with its
    instance name; ValueError for settings that cannot work."""
    shared = {f.name: getattr(options, f.name) for f in dataclasses.fields(TokenizerOptions)}
    return "tokenizer", tokenizer_main.build_service(TokenizerOptions(**shared), **router)


def main(argv: list[str] | None = None) -> int:
    command = gateway_main.parser()
    command.add_argument(
        "--with-tokenizer",
        action="store_true",
        help="run the tokenizer service in this process too (see above): the pipeline's one tokenizer",
    )
    add_flags(command.add_argument_group("tokenizer (with --with-tokenizer)"), TOKENIZER_FLAGS)
    args = command.parse_args(argv)
    if not args.with_tokenizer:
        return gateway_main.run(command, args)
    router = flag_values(TOKENIZER_FLAGS, args)
    return gateway_main.run(command, args, lambda options: build_tokenizer(options, router))
