"""The instances topic: each running service says, every second, that it is there.

A service that starts listens for a while before it serves: another instance of the same service
on the same topics (`since` older than its own) means a second one would jam the pipeline (two
consumers in one group, two schedulers planning for one executor), so it refuses to start.
"""

from __future__ import annotations

import msgspec


class InstanceHeartbeat(msgspec.Struct, frozen=True, kw_only=True, tag="instance_heartbeat"):
    service: str  # tokenizer, scheduler, executor
    instance_id: str
    since: int = -1  # the offset of its first heartbeat (-1 on that one): the older one stays
    host: str = ""
    pid: int = 0
