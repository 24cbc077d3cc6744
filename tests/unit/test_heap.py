"""A service's start-up heap is frozen out of the garbage collector once it serves (heap.py)."""

from __future__ import annotations

import gc
import weakref

import pytest

from parkade.services.bus import runtime
from parkade.services.common.heap import freeze_startup_heap


@pytest.fixture
def unfrozen():
    gc.unfreeze()
    gc.disable()  # no collection but the one under test: it alone may free the garbage below
    yield
    gc.enable()
    gc.unfreeze()  # the test process's objects back in the collector's care


def test_freezing_collects_first_then_moves_every_live_object_out(unfrozen) -> None:
    class Cycle:
        def __init__(self) -> None:
            self.me = self

    garbage = weakref.ref(Cycle())  # start-up's garbage: a frozen cycle would never be freed
    kept = [Cycle() for _ in range(100)]
    frozen = freeze_startup_heap()
    assert garbage() is None
    assert frozen == gc.get_freeze_count() > len(kept)
    assert all(o is not kept[0] for o in gc.get_objects())  # no generation the collector walks


def test_a_service_freezes_its_heap_when_it_says_it_is_ready(unfrozen, capsys) -> None:
    runtime._announce_ready("scheduler")()
    assert capsys.readouterr().out == "READY scheduler\n"
    assert gc.get_freeze_count() > 1000
