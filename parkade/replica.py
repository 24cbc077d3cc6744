"""`parkade replica`: one engine replica in one process, its scheduler and its executor.

    parkade replica [--replica R] [--model DIR] [executor flags] [scheduler flags]

The two services as `parkade scheduler` and `parkade executor` run them, each claimed on the
instances topic and with its own consumer group, but the replica's step topics (step-plans and
step-results) stay in this process's memory: a step's plan and its result never go through the
broker, as in vLLM's engine core. Requests still come from the tokenized topic and their tokens
go to the generated topic, so the tokenizers, the gateway and every client see no difference.

`parkade up` runs each replica this way unless --split-replicas. Run the two services apart where
they must live apart (an executor on another host); a restart of this process restarts both,
and the scheduler recomputes its requests on the fresh executor (docs/design.md, "Engine
replicas and routing").
"""

from __future__ import annotations

from parkade.schemas import topics
from parkade.schemas.routing import check_replica_name
from parkade.services.bus.runtime import run_service, service_parser
from parkade.services.bus.serve import Service
from parkade.services.common.flags import add_flags, flag_values
from parkade.services.executor import main as executor_main
from parkade.services.executor.options import ExecutorOptions
from parkade.services.scheduler import main as scheduler_main

FLAGS = [*executor_main.FLAGS, *scheduler_main.FLAGS]


def local_topics(replica: str) -> tuple[str, str]:
    """The step topics (unprefixed) that a replica in one process keeps in memory."""
    plans, results = topics.STEP_PLANS, topics.STEP_RESULTS
    return topics.replica_topic(plans, replica), topics.replica_topic(results, replica)


def main(argv: list[str] | None = None) -> int:
    parser = service_parser("replica", __doc__, replica=True)
    add_flags(parser.add_argument_group("executor"), executor_main.FLAGS)
    add_flags(parser.add_argument_group("scheduler"), scheduler_main.FLAGS)
    args = parser.parse_args(argv)

    def build() -> dict[str, Service]:
        replica = check_replica_name(args.replica)
        scheduler = scheduler_main.build_service(args)  # first: its settings are checked without a model
        options = ExecutorOptions(**flag_values(executor_main.FLAGS, args))
        return {"scheduler": scheduler, "executor": executor_main.build_service(options, replica=replica)}

    return run_service("replica", parser, args, build, local_topics=local_topics(args.replica))
