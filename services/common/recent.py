"""`RecentIds`: a bounded memory of ids, for handlers that must drop redelivered duplicates."""

from __future__ import annotations

from collections import OrderedDict

# Finished request ids remembered per handler. NOTE: a duplicate that arrives after this many
# other requests finished is not recognised; at-least-once redelivery comes much sooner.
REMEMBER_FINISHED = 100_000


class RecentIds:
    """The last `capacity` ids added, in insertion order, each with an optional value (where it
    came from); the oldest is forgotten first."""

    def __init__(self, capacity: int = REMEMBER_FINISHED) -> None:
        self.capacity = capacity
        self._ids: OrderedDict[str, object] = OrderedDict()

    def add(self, item: str, value: object = None) -> None:
        self._ids[item] = value
        self._ids.move_to_end(item)
        if len(self._ids) > self.capacity:
            self._ids.popitem(last=False)

    def get(self, item: str) -> object:
        return self._ids.get(item)

    def __contains__(self, item: object) -> bool:
        return item in self._ids

    def __len__(self) -> int:
        return len(self._ids)
