"""`parkade replica`: one engine replica in one process, its scheduler and its executor.

    parkade replica [--replica R] [--model DIR] [executor flags] [scheduler flags]

The two services as `parkade scheduler` and `parkade executor` run them, each claimed on the
instances topic and with its own consumer group, but the replica's step topics (step-plans and
step-results) stay in this process's memory: a step's plan and its result never go through the
broker, as in vLLM's engine core. Requests still come from the tokenized topic and their tokens
go to the generated topic, so the tokenizers, the gateway and every client see no difference.

`parkade up` runs each replica this way unless --split-replicas. Run the two services apart where
they must live apart (an executor on another host); a restart of this process restarts both,
and the scheduler recomputes its requests on the fresh executor (docs/design.md, "Processes").
"""

from __future__ import annotations

import argparse

from parkade.schemas import topics
from parkade.schemas.routing import check_replica_name
from parkade.services.bus.runtime import run_service, service_parser
from parkade.services.bus.serve import STREAM_FETCH_WAIT_MS, Service
from parkade.services.common.flags import add_flags, flag_values
from parkade.services.executor import main as executor_main
from parkade.services.executor.options import ExecutorOptions
from parkade.services.scheduler import main as scheduler_main

FLAGS = [*executor_main.FLAGS, *scheduler_main.FLAGS]
# The scheduler's fetch wait on the broker (its tokenized topic) while it has work in flight. Apart
# from its executor it waits 2 ms (BUSY_FETCH_WAIT_MS), since each step's result comes that way;
# here a result comes from memory, and a longer wait only delays a new request's admission by up to
# half of it (Tansu looks again after half the time left) for fewer fetches. Measured on `parkade
# up` under vLLM's client (tiny-llama, 64 prompts of 256 tokens, 2 vCPUs), three stacks each,
# alternated: 10 ms against 2, output 3,534-3,719 tok/s against 3,157-3,466, mean TTFT 276-301 ms
# against 289-309, the replica's CPU 2.19-2.36 s a round against 2.34-2.61, the broker's 0.54-0.62
# against 0.62-0.71.
REQUESTS_FETCH_WAIT_MS = STREAM_FETCH_WAIT_MS


def local_topics(replica: str) -> tuple[str, str]:
    """The step topics (unprefixed) that a replica in one process keeps in memory."""
    plans, results = topics.STEP_PLANS, topics.STEP_RESULTS
    return topics.replica_topic(plans, replica), topics.replica_topic(results, replica)


def parser() -> argparse.ArgumentParser:
    """The command line: the bus options, --replica, and both services' flags."""
    parser = service_parser("replica", __doc__, replica=True)
    add_flags(parser.add_argument_group("executor"), executor_main.FLAGS)
    add_flags(parser.add_argument_group("scheduler"), scheduler_main.FLAGS)
    return parser


def build_services(args: argparse.Namespace) -> dict[str, Service]:
    """The replica's scheduler and executor for parsed flags (the executor loads its model);
    ValueError for settings that cannot work."""
    replica = check_replica_name(args.replica)
    scheduler = scheduler_main.build_service(args)  # first: its settings are checked without a model
    scheduler.busy_fetch_wait_ms = REQUESTS_FETCH_WAIT_MS
    options = ExecutorOptions(**flag_values(executor_main.FLAGS, args))
    return {"scheduler": scheduler, "executor": executor_main.build_service(options, replica=replica)}


def main(argv: list[str] | None = None) -> int:
    command = parser()
    args = command.parse_args(argv)
    local = local_topics(args.replica)
    return run_service("replica", command, args, lambda: build_services(args), local_topics=local)
