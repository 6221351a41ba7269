"""The scheduler's queues of waiting and swapped requests, one class per scheduling policy."""

from __future__ import annotations

from bisect import insort
from collections import deque
from collections.abc import Iterator
from operator import attrgetter

from tandem.request import Request

by_priority = attrgetter("priority", "arrival")  # scheduling_policy "priority"'s order


def _reversed_priority(request: Request) -> tuple[int, int]:
    return -request.priority, -request.arrival


class ArrivalQueue(deque[Request]):
    """First come, first served ("fcfs"): requests in arrival order; one put back (preempted,
    or deferred at admission) goes to the front, to be served first again."""

    add = deque.append
    put_back = deque.appendleft


class PriorityQueue:
    """vLLM's "priority" policy: requests by (priority, arrival), the lowest first; one put back
    takes its place in that order again. A list kept in reverse order with bisect: the head is
    at its end, taken without moving the others."""

    def __init__(self) -> None:
        self._last_first: list[Request] = []

    def add(self, request: Request) -> None:
        insort(self._last_first, request, key=_reversed_priority)

    put_back = add

    def __getitem__(self, index: int) -> Request:
        return self._last_first[-1 - index]

    def popleft(self) -> Request:
        """Take the head, the request served next."""
        return self._last_first.pop()

    def pop(self) -> Request:
        """Take the request served last."""
        return self._last_first.pop(0)

    def remove(self, request: Request) -> None:
        self._last_first.remove(request)

    def __iter__(self) -> Iterator[Request]:
        return reversed(self._last_first)

    def __len__(self) -> int:
        return len(self._last_first)
