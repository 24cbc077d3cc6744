"""The waiting queue, under one of two policies.

`fcfs`: arrival order; a preempted request returns to the head.
`priority`: lowest `(priority, arrival_time)` first (vLLM's rule); a preempted request keeps
its place by that key, which puts it ahead of everything that arrived after it.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator

from parkade.services.scheduler.config import SchedulingPolicy
from parkade.services.scheduler.request import Request


class WaitingQueue:
    def __init__(self, policy: SchedulingPolicy = SchedulingPolicy.FCFS) -> None:
        self.policy = SchedulingPolicy(policy)
        self._fcfs = self.policy is SchedulingPolicy.FCFS
        self._fifo: deque[Request] = deque()
        self._heap: list[tuple[tuple[int, float, str], Request]] = []
        self.num_tokens = 0  # of the requests queued (a waiting request's tokens do not change)

    def add(self, request: Request) -> None:
        self.num_tokens += request.num_tokens
        if self._fcfs:
            self._fifo.append(request)
        else:
            heapq.heappush(self._heap, (request.sort_key(), request))

    def add_preempted(self, request: Request) -> None:
        self.num_tokens += request.num_tokens
        if self._fcfs:
            self._fifo.appendleft(request)
        else:
            heapq.heappush(self._heap, (request.sort_key(), request))

    def peek(self) -> Request:
        return self._fifo[0] if self._fcfs else self._heap[0][1]

    def pop(self) -> Request:
        request = self._fifo.popleft() if self._fcfs else heapq.heappop(self._heap)[1]
        self.num_tokens -= request.num_tokens
        return request

    def remove(self, request: Request) -> None:
        self.num_tokens -= request.num_tokens
        if self._fcfs:
            self._fifo.remove(request)
        else:
            self._heap = [item for item in self._heap if item[1] is not request]
            heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._fifo) + len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        if self._fcfs:
            return iter(self._fifo)
        return iter(request for _, request in sorted(self._heap, key=lambda item: item[0]))
