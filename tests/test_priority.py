"""vLLM's scheduling_policy="priority": lower priorities are served first, then earlier
arrivals; the least important running request is the one preempted. "fcfs" is unchanged."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tandem import LLM
from tandem.async_llm import AsyncLLM
from tandem.cli import build_parser, engine_kwargs
from tandem.kv_cache import BlockAllocator
from tandem.request import Request
from tandem.sampling import SamplingParams
from tandem.scheduler import Scheduler, StepPlan
from tandem.server.app import build_app
from tandem.swap import SwapManager
from test_server import running

BLOCK = 4

# ---- the scheduler alone ---------------------------------------------------------------------


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


def step_until_preempted(scheduler: Scheduler) -> StepPlan:
    for _ in range(8):
        plan = step(scheduler)
        if plan.preempted:
            return plan
    pytest.fail("nothing was preempted")


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
    """a (priority 0) and b (2) admitted, then c (1) a step later, in 6 blocks of 4."""
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
    plan = step_until_preempted(scheduler)
    assert names(plan.preempted) == victim
    assert sorted(names(scheduler.running)) == list(running)
    assert names(plan.requests) == running  # the victim's blocks went to the others


@pytest.mark.parametrize(("policy", "waiting"), [("fcfs", "cde"), ("priority", "dbe")])
def test_a_preempted_request_goes_back_to_its_place_in_the_waiting_order(policy, waiting):
    """fcfs puts its victim (c) at the front of the queue; priority puts b (2) between the
    requests that came after it, d (1) and e (3)."""
    scheduler = three_running(policy)
    queue(scheduler, 1, 3)  # d and e wait: every sequence slot is taken
    step_until_preempted(scheduler)
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


# ---- the engine on the tiny model ------------------------------------------------------------

PROMPTS = [{"prompt_token_ids": list(range(3 + 7 * i, 20 + 9 * i))} for i in range(5)]
PRIORITIES = [2, 0, 1, -1, 0]
BY_PRIORITY = [3, 1, 4, 2, 0]  # the prompts' indices by (priority, arrival)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(make_tiny) -> str:
    return str(make_tiny("llama"))


def run_queued(llm: LLM, priority: list[int] | None = None) -> tuple[list[Request], list[str]]:
    """PROMPTS queued at once and run to the end: their requests in input order, and the ids
    in the order they finished."""
    ids = llm.enqueue(PROMPTS, GREEDY, priority=priority)
    requests = [llm.engine.requests[rid] for rid in ids]
    finished = []
    while llm.engine.has_unfinished():
        finished += [r.request_id for r in llm.engine.step() if r.finished]
    return requests, finished


@pytest.mark.parametrize("async_batching", [False, True], ids=["sync", "async"])
def test_one_at_a_time_requests_finish_in_priority_order_with_the_tokens_of_fcfs(
    folder, async_batching
):
    engine_args = {"max_model_len": 96, "max_num_seqs": 1, "async_batching": async_batching}
    fcfs, fcfs_order = run_queued(LLM(folder, **engine_args))
    requests, order = run_queued(
        LLM(folder, scheduling_policy="priority", **engine_args), PRIORITIES
    )
    assert fcfs_order == [r.request_id for r in fcfs]
    assert order == [requests[i].request_id for i in BY_PRIORITY]
    assert [r.output_token_ids for r in requests] == [r.output_token_ids for r in fcfs]


@pytest.mark.parametrize("async_batching", [False, True], ids=["sync", "async"])
def test_under_block_pressure_the_most_important_request_is_never_preempted(folder, async_batching):
    """96 token slots for about 190 tokens: requests are preempted (by recompute, so the
    victims' tokens are recomputed), never the one of priority -1, and the greedy tokens are
    fcfs's."""
    engine_args = {"max_model_len": 96, "num_blocks": 12, "block_size": 8,
                   "max_num_batched_tokens": 24, "preemption_mode": "recompute",
                   "async_batching": async_batching}  # fmt: skip
    fcfs, _ = run_queued(LLM(folder, **engine_args))
    llm = LLM(folder, scheduling_policy="priority", **engine_args)
    requests, _ = run_queued(llm, PRIORITIES)
    assert llm.engine.scheduler.num_preemptions > 0
    assert requests[3].num_preemptions == 0 and fcfs[3].num_preemptions > 0
    assert [r.output_token_ids for r in requests] == [r.output_token_ids for r in fcfs]
    assert llm.engine.allocator.num_free == llm.engine.num_blocks


def test_async_generate_takes_any_int_priority_under_the_priority_policy(folder):
    llm = AsyncLLM.from_model(
        folder, max_model_len=96, max_num_seqs=1, scheduling_policy="priority"
    )

    async def finish_order() -> list[str]:
        """Five requests that reach the engine between the same two steps; one runs at a time."""
        streams = await llm.add_requests(
            [(f"r{i}", GREEDY, None, p["prompt_token_ids"], None, priority)
             for i, (p, priority) in enumerate(zip(PROMPTS, PRIORITIES, strict=True))]
        )  # fmt: skip
        order = []

        async def drain(stream) -> None:
            async for output in stream:
                if output.finished:
                    order.append(stream.request_id)

        await asyncio.gather(*(drain(stream) for stream in streams))
        return order

    async def tokens(priority: int) -> list[int]:
        outputs = [o async for o in llm.generate(PROMPTS[0], GREEDY, "g", priority=priority)]
        return outputs[-1].outputs[0].token_ids

    try:
        assert asyncio.run(finish_order()) == [f"r{i}" for i in BY_PRIORITY]
        assert asyncio.run(tokens(-7)) == asyncio.run(tokens(2**40))
        with pytest.raises(TypeError, match="priority must be an int"):
            asyncio.run(tokens(1.5))
    finally:
        llm.shutdown()


@pytest.mark.parametrize("priority", [[0, 1.5], [True, 0], ["1", 0], 1])
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_priority_that_is_no_int_is_a_type_error_that_queues_nothing(folder, policy, priority):
    llm = LLM(folder, max_model_len=64, scheduling_policy=policy)
    for call in (llm.generate, llm.enqueue):
        with pytest.raises(TypeError, match="priority must be"):
            call(["Hello there", "Paged attention"], GREEDY, priority=priority)
    assert not llm.engine.has_unfinished()


def test_a_priority_under_fcfs_is_a_value_error_naming_the_policy_and_queues_nothing(folder):
    llm = LLM(folder, max_model_len=64)
    for call in (llm.generate, llm.enqueue):
        with pytest.raises(ValueError, match="scheduling_policy='priority'"):
            call(["Hello there", "Paged attention"], GREEDY, priority=[0, -1])
    assert not llm.engine.has_unfinished()


def test_one_priority_per_prompt(folder):
    llm = LLM(folder, max_model_len=64, scheduling_policy="priority")
    with pytest.raises(ValueError, match="got 1 priorities for 2 prompts"):
        llm.generate(["Hello there", "Paged attention"], GREEDY, priority=[1])
    assert not llm.engine.has_unfinished()


def test_the_cli_takes_the_scheduling_policy(folder, capsys):
    parse = build_parser().parse_args
    args = parse(["generate", folder, "a prompt", "--scheduling-policy", "priority"])
    assert engine_kwargs(args)["scheduling_policy"] == "priority"
    assert engine_kwargs(parse(["generate", folder, "a prompt"]))["scheduling_policy"] == "fcfs"
    with pytest.raises(SystemExit):
        parse(["generate", folder, "a prompt", "--scheduling-policy", "lottery"])
    assert "'fcfs', 'priority'" in capsys.readouterr().err


# ---- the server --------------------------------------------------------------------------------


def test_the_server_takes_any_int_priority_under_the_priority_policy(folder):
    """vLLM's extra field `priority` on the generation endpoints, the token-in one and beam
    search; the render endpoints pass it on."""
    llm = AsyncLLM.from_model(folder, max_model_len=96, scheduling_policy="priority")
    completion = {"prompt": "Our scheduler reads", "max_tokens": 4, "temperature": 0}
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}

    def post(url: str, path: str, body: dict) -> dict:
        response = httpx.post(f"{url}{path}", json=body, timeout=60)
        assert response.status_code == 200, response.text
        return response.json()

    try:
        with running(build_app(llm, "tiny")) as url:
            text = post(url, "/v1/completions", completion)["choices"][0]["text"]
            for priority in (-3, 7):
                answer = post(url, "/v1/completions", {**completion, "priority": priority})
                assert answer["choices"][0]["text"] == text
                post(url, "/v1/chat/completions", {**chat, "priority": priority})
                beams = {**completion, "use_beam_search": True, "n": 2, "priority": priority}
                assert len(post(url, "/v1/completions", beams)["choices"]) == 2
                [rendered] = post(
                    url, "/v1/completions/render", {**completion, "priority": priority}
                )
                assert rendered["priority"] == priority
                post(url, "/inference/v1/generate", rendered)
            response = httpx.post(f"{url}/v1/completions", json={**completion, "priority": 0.5})
            assert response.status_code == 400 and response.json()["error"]["param"] == "priority"
    finally:
        llm.shutdown()
