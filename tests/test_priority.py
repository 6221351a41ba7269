"""vLLM's scheduling_policy="priority": lower priorities are served first, then earlier
arrivals; the least important running request is the one preempted. "fcfs" is unchanged."""

from __future__ import annotations

import pytest

from tandem.kv_cache import BlockAllocator
from tandem.request import Request
from tandem.sampling import SamplingParams
from tandem.scheduler import Scheduler, StepPlan
from tandem.swap import SwapManager

BLOCK = 4

# ---- the scheduler alone ----------------------------------------------------------------------


def make_scheduler(
    policy: str, num_blocks: int = 16, max_num_seqs: int = 3, host_blocks: int = 0
) -> Scheduler:
    """With `host_blocks`, victims swap to the host while those last."""
    allocator = BlockAllocator(num_blocks)
    swap = SwapManager(allocator, host_blocks, "swap") if host_blocks else None
    return Scheduler(allocator, BLOCK, max_num_seqs, 64, 64, swap=swap, policy=policy)


def queue(scheduler: Scheduler, *priorities: int, prompt_len: int = BLOCK) -> list[Request]:
    """A request per priority, queued in that order and named a, b, c, ... by arrival; no two
    prompts share a block."""
    requests = []
    for priority in priorities:
        index = scheduler.num_arrivals
        params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
        prompt = [100 * (index + 1) + j for j in range(prompt_len)]
        request = Request(chr(ord("a") + index), prompt, params, seed=0)
        request.priority = priority
        scheduler.add(request)
        requests.append(request)
    return requests


def step(scheduler: Scheduler) -> StepPlan:
    """Schedule, then give each request that computed its known tokens one more, as the engine
    does when it reads the step back."""
    plan = scheduler.schedule()
    for request in plan.requests:
        if request.num_computed_tokens == request.num_tokens:
            request.output_token_ids.append(7)
    return plan


def names(requests) -> str:
    return "".join(r.request_id for r in requests)


@pytest.mark.parametrize(("policy", "order"), [("fcfs", "abcdef"), ("priority", "dfbcae")])
def test_waiting_requests_are_admitted_by_priority_then_arrival(policy, order):
    """d came fourth but ranks first (-2); b and c, a and e share a priority and keep their
    arrival order. fcfs takes them as they came, whatever their priorities."""
    scheduler = make_scheduler(policy, max_num_seqs=1)
    queue(scheduler, 3, 1, 1, -2, 3, 0)
    admitted = []
    while scheduler.has_work():
        [request] = step(scheduler).requests
        admitted.append(request)
        scheduler.finish(request, "stop")
    assert names(admitted) == order


def three_running(policy: str) -> Scheduler:
    """a (priority 0) and b (2) admitted, then c (1): a block each and room for three more."""
    scheduler = make_scheduler(policy, num_blocks=6)
    queue(scheduler, 0, 2)
    step(scheduler)
    queue(scheduler, 1)
    step(scheduler)
    assert names(scheduler.running) == ("acb" if policy == "priority" else "abc")
    return scheduler


@pytest.mark.parametrize(("policy", "victim", "running"), [("fcfs", "c", "ab"),
                                                           ("priority", "b", "ac")])  # fmt: skip
def test_under_block_pressure_the_victim_is_the_least_important_running_request(
    policy, victim, running
):
    """a and b grow into their third blocks with none free: fcfs preempts the newest (c),
    priority the least important (b, admitted before c)."""
    scheduler = three_running(policy)
    for _ in range(8):
        plan = step(scheduler)
        if plan.preempted:
            break
    assert names(plan.preempted) == victim
    assert sorted(names(scheduler.running)) == list(running)
    assert names(plan.requests) == running  # the victim's blocks went to the others


@pytest.mark.parametrize(("policy", "waiting"), [("fcfs", "cde"), ("priority", "dbe")])
def test_a_preempted_request_goes_back_to_its_place_in_the_waiting_order(policy, waiting):
    """fcfs puts its victim (c) at the front of the queue; priority puts b (2) between the
    requests that came after it, d (1) and e (3)."""
    scheduler = three_running(policy)
    queue(scheduler, 1, 3)  # d and e wait: every sequence slot is taken
    while not step(scheduler).preempted:
        pass
    assert names(scheduler.waiting) == waiting


def swap_out_a_then_b(policy: str) -> Scheduler:
    """a (priority 0) and b (2) swapped out, a first; 3 free blocks: room for one of them to
    come back with the block its next token needs."""
    scheduler = make_scheduler(policy, num_blocks=3, max_num_seqs=2, host_blocks=8)
    a, b = queue(scheduler, 0, 2)
    step(scheduler)
    scheduler.preempt(a)
    scheduler.preempt(b)
    assert names(scheduler.swapped) == ("ab" if policy == "priority" else "ba")
    return scheduler


@pytest.mark.parametrize(("policy", "resumed"), [("fcfs", "b"), ("priority", "a")])
def test_swapped_requests_resume_by_priority(policy, resumed):
    scheduler = swap_out_a_then_b(policy)
    assert names(step(scheduler).requests) == resumed


@pytest.mark.parametrize(("policy", "scheduled"), [("fcfs", "b"), ("priority", "c")])
def test_a_waiting_request_that_ranks_before_the_swapped_ones_is_admitted_first(policy, scheduled):
    """Under fcfs nothing is admitted while a request is swapped out; under priority, c (-1)
    goes before a (0)."""
    scheduler = swap_out_a_then_b(policy)
    queue(scheduler, -1)
    assert names(step(scheduler).requests) == scheduled


@pytest.mark.parametrize(("waiting_priority", "prompt_len", "held"),
                         [(-1, 4 * BLOCK, 0), (1, BLOCK, 2)])  # fmt: skip
def test_the_order_between_swapped_and_waiting_requests_is_strict(
    waiting_priority, prompt_len, held
):
    """The first in (priority, arrival) order does not fit, and the next would: it waits too.
    c (-1) needs 4 blocks of the 3 free, a (0) would take 2; or a needs 2 of the 1 free (2
    held elsewhere), c (1) would take 1."""
    scheduler = swap_out_a_then_b("priority")
    scheduler.allocator.allocate(held)
    queue(scheduler, waiting_priority, prompt_len=prompt_len)
    assert not step(scheduler).requests


def test_nothing_is_preempted_to_admit_a_more_important_request():
    scheduler = make_scheduler("priority", num_blocks=3)
    queue(scheduler, 5, prompt_len=2 * BLOCK)  # a: two blocks, and the third for its output
    step(scheduler)
    queue(scheduler, -1)
    for _ in range(3):
        plan = step(scheduler)
        assert names(plan.requests) == "a" and not plan.preempted
    assert names(scheduler.waiting) == "b"
