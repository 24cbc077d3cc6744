"""Where an id is still mentioned inside a service: a walk of its object graph.

A leak of per-request state is a key nobody removes. Rather than list a service's tables (and
miss the one added next year), walk everything the service holds and report each place where a
string equal to the id sits, as a path (`.live['r']`, `.scheduler.kv.block_tables['r']`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

_LEAVES = (str, bytes, int, float, bool, type(None))


def mentions(root: Any, needles: set[str], *, skip: tuple[str, ...] = ()) -> list[str]:
    """Paths from `root` to every string in `needles`. Descends into containers and into objects
    of Parkade's own classes (not into tensors, tokenizers or the tracing SDK), skipping the
    attributes named in `skip` (the bounded memories of ended ids)."""
    found: list[str] = []
    seen: set[int] = set()
    stack: list[tuple[str, Any]] = [("", root)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if value in needles:
                found.append(path)
            continue
        if isinstance(value, _LEAVES) or id(value) in seen:
            continue
        seen.add(id(value))
        stack.extend(_children(path, value, skip))
    return sorted(found)


def _children(path: str, value: Any, skip: tuple[str, ...]) -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict):
        for key, item in value.items():
            yield (f"{path}[{key!r}]", key)
            yield (f"{path}[{key!r}]", item)
    elif isinstance(value, list | tuple | set | frozenset) or type(value).__name__ == "deque":
        for index, item in enumerate(value):
            yield (f"{path}[{index}]", item)
    elif type(value).__module__.startswith("parkade"):
        for name in _attributes(value):
            if name not in skip:
                yield (f"{path}.{name}", getattr(value, name, None))


def _attributes(value: Any) -> list[str]:
    names = list(getattr(value, "__dict__", {}))
    for cls in type(value).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        names += [slots] if isinstance(slots, str) else list(slots)
    return names
