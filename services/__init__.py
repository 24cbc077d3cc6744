"""Parkade's services and the libraries they share (`parkade.services`).

Deployable services, each started as `parkade <name>`; `main.py` is a service's only I/O edge
(Kafka, signals, environment), `handler.py` its message handler without I/O, and every other
module of the folder the component's core, which the in-process engine (`parkade.engine`) runs
too:

    tokenizer/   front end: prompts -> EngineRequests, GeneratedTokens -> token events
    scheduler/   page table and token-level admission; no torch, no I/O
    executor/    the model, the physical KV block pool and the sampler
    gateway/     the OpenAI HTTP API: a Kafka client of the requests and tokens topics

Libraries the services share:

    bus/         the message bus (Kafka, in memory), the consume-commit loop, service start-up
    common/      reading model folders, command-line flags from option classes, bounded id sets

Imports run one way: a service imports libraries (`bus`, `common`, `parkade.schemas`,
`parkade.kernels`, and `parkade.models`, the data package of the shipped model) and its own
folder, never another service's folder; nothing here imports the in-process engine or the
command line (`tests/unit/test_architecture.py` checks it).
"""

SERVICES = ("tokenizer", "scheduler", "executor", "gateway")
# The services a request passes through; the gateway is a client of them.
PIPELINE = ("tokenizer", "scheduler", "executor")
