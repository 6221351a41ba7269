"""Continuous batching policy: which requests run this step, and how many tokens each."""

from __future__ import annotations

import time
from bisect import insort
from dataclasses import dataclass, field

from tandem.config import cdiv
from tandem.kv_cache import BlockAllocator, BlockCopy
from tandem.lora.adapters import Adapter, AdapterSlots
from tandem.prefix_cache import PrefixCache
from tandem.queues import ArrivalQueue, PriorityQueue, by_priority
from tandem.request import Request, Status
from tandem.swap import SwapManager


@dataclass
class StepPlan:
    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(
        default_factory=list
    )  # per request, tokens computed this step
    preempted: list[Request] = field(default_factory=list)
    # copy-on-write of cached blocks, run before the step's forward (prefix_cache.py)
    copies: list[BlockCopy] = field(default_factory=list)
    # LoRA adapters loaded into device slots before the step's forward (lora/adapters.py)
    adapter_loads: list[tuple[int, Adapter]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.requests)

    def single_tokens_first(self) -> None:
        """Every row of one token before the longer ones, each kind in its planned order. The
        attention gives a step's leading one-token rows to the decode kernel; behind a longer row
        one would take a prefill program's tile of query rows to use one of them (rollout: the
        samples admitted after a prompt's last chunk, about 5 ms of an 8,192-token step). A plan
        already in that order, as every decode step is, is left as it is without sorting."""
        ones = self.num_new_tokens.count(1)
        if self.num_new_tokens[:ones].count(1) == ones:
            return
        order = sorted(range(len(self.requests)), key=lambda i: self.num_new_tokens[i] != 1)
        self.requests = [self.requests[i] for i in order]
        self.num_new_tokens = [self.num_new_tokens[i] for i in order]


class Scheduler:
    """Admission in the policy's order, decode and chunked prefill mixed under a token budget;
    preemption by recompute or by swap.

    Under "fcfs" (first come, first served), running requests are served oldest first; when
    blocks run out, the most recently admitted is preempted. By recompute, its blocks are freed
    (what they cached stays cached) and it returns to the front of the queue to recompute what
    the cache no longer holds. By swap (swap.py: chosen per victim, for those whose recompute
    costs more than the copies), its KV goes to host memory and it waits in `swapped`; swapped
    requests resume, oldest first, before anything new is admitted.
    Under "priority" (vLLM's), every queue and `running` itself are in (priority, arrival)
    order: the most important are served first, the victim is the least important, newest
    running request, a preempted one goes back to its place in that order, and waiting and
    swapped requests take turns by it. Nothing is preempted to admit a request.
    An admitted request starts after its longest cached prefix (prefix_cache.py); blocks computed
    earlier in the same step count, so the samples of one prompt prefill it once. One whose last
    token's block is cached whole computes that token alone, in a copy of the block; when the
    block was computed in this same step, it waits for the next (admission goes on behind it).
    A request of a LoRA adapter holds its adapter's device slot while it runs (lora/adapters.py);
    where every slot is held by other adapters it waits likewise, admission going on behind it.
    """

    def __init__(
        self,
        allocator: BlockAllocator,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_prefix_caching: bool = True,
        swap: SwapManager | None = None,
        policy: str = "fcfs",
        adapters: AdapterSlots | None = None,
    ):
        self.allocator = allocator
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.cache = PrefixCache(allocator, block_size, enable_prefix_caching)
        self.priority = policy == "priority"
        queue = PriorityQueue if self.priority else ArrivalQueue
        self.waiting: ArrivalQueue | PriorityQueue = queue()
        # the last admitted at the end ("priority": in by_priority order): the victim is the last
        self.running: list[Request] = []
        self.swap = swap or SwapManager(allocator, 0)
        self.swap.watch_reuse()  # after the cache's hook: copies out before the cache forgets
        self.swapped: ArrivalQueue | PriorityQueue = queue()
        self.num_arrivals = 0
        self.num_preemptions = 0
        self.num_block_copies = 0  # copy-on-write admissions, over the engine's life
        self.admitting = True  # False: the waiting queue is held (pause_generation's "wait")
        self.adapters = adapters  # LoRA's device slots, held by running requests

    def add(self, request: Request) -> None:
        request.arrival = self.num_arrivals
        self.num_arrivals += 1
        self.waiting.add(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def has_started_work(self) -> bool:
        """Whether a request has been admitted and not finished: running or swapped out."""
        return bool(self.running or self.swapped)

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        self.cache.start_schedule()
        budget = self.max_num_batched_tokens
        for request in list(self.running):
            if budget == 0:
                break
            if request.status is not Status.RUNNING:
                continue  # preempted earlier in this loop
            num_new = min(self.num_to_compute(request), budget)
            if num_new == 0:
                continue
            if not self._reserve_blocks(request, num_new, plan):
                continue
            self._plan(plan, request, num_new)
            budget -= num_new
        if not plan.preempted:
            budget = self._resume(plan, budget)
            if self.admitting and (not self.swapped or self.priority):
                self._admit(plan, budget)
        if self.adapters is not None:
            plan.adapter_loads = self.adapters.take_loads()
        plan.single_tokens_first()
        return plan

    def num_to_compute(self, request: Request) -> int:
        """Tokens still to be fed through the model; 0 once nothing more can be sampled."""
        num_tokens = request.num_tokens
        if request.params.max_tokens == 0:  # scoring: the rows that predict prompt tokens only
            return max(request.num_prompt_tokens - 1 - request.num_computed_tokens, 0)
        if request.pooling is not None:  # its whole prompt, max_model_len tokens at most
            return max(request.num_prompt_tokens - request.num_computed_tokens, 0)
        # max_tokens outputs, or max_model_len in all, whichever comes first
        limit = min(len(request.prompt_token_ids) + request.params.max_tokens, self.max_model_len)
        if num_tokens >= limit:
            return 0
        return num_tokens - request.num_computed_tokens

    def _plan(self, plan: StepPlan, request: Request, num_new: int) -> None:
        """Run `num_new` of the request's tokens this step; its finished blocks become findable."""
        plan.requests.append(request)
        plan.num_new_tokens.append(num_new)
        request.num_computed_tokens += num_new
        self.cache.publish(request)
        if request.num_cache_creation_tokens is None and not self.num_to_compute(request):
            request.num_cache_creation_tokens = self.cache.num_created(request)

    def _resume(self, plan: StepPlan, budget: int) -> int:
        """Swap requests back in, in the queue's order, while their blocks fit; returns the
        budget left."""
        while self.swapped and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.swapped[0]
            if request.num_pending_tokens:
                break  # swapped with a token still in flight; resume once it is read back
            if (
                self.priority
                and self.admitting
                and self.waiting
                and by_priority(self.waiting[0]) < by_priority(request)
            ):
                break  # a waiting request ranks first: admitted first
            num_new = min(self.num_to_compute(request), budget)
            total = cdiv(request.num_computed_tokens + num_new, self.block_size)
            grown = total - len(request.host_blocks)
            if not self.allocator.can_allocate(self.swap.device_blocks_needed(request) + grown):
                break
            if not self._adapter_fits(request):
                break
            self.swapped.popleft()
            self._take_adapter(request)
            request.block_table = self.swap.swap_in(request) + self.allocator.allocate(grown)
            self._run(request)
            self._plan(plan, request, num_new)
            budget -= num_new
        return budget

    def _admit(self, plan: StepPlan, budget: int) -> None:
        # their copy source is written by this step, or their adapter finds every slot held by
        # others: admitted from a later step, in their order
        deferred = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if request.num_pending_tokens:
                break  # preempted with a token still in flight; admit once it is read back
            if self.swapped and by_priority(self.swapped[0]) < by_priority(request):
                break  # "priority": a swapped request ranks first, resumed first
            if not self._adapter_fits(request):
                deferred.append(self.waiting.popleft())
                continue
            cached, source = self.cache.match(request)
            if source is not None and not self.cache.copyable(source):
                deferred.append(self.waiting.popleft())
                continue
            if not self._admit_one(plan, request, cached, source, budget):
                break
            budget -= plan.num_new_tokens[-1]
        for request in reversed(deferred):  # "fcfs": the first deferred at the front again
            self.waiting.put_back(request)
        # the copy sources were held only so that no admission reused one; later writers of
        # them are steps launched after this one, whose copies run first
        self.allocator.free([copy.src for copy in plan.copies])

    def _admit_one(
        self, plan: StepPlan, request: Request, cached: list[int], source: int | None, budget: int
    ) -> bool:
        """Admit the waiting head after its cached blocks (and a copy of `source`, the cached
        block of its last token); False when its blocks do not fit."""
        size = self.block_size
        num_cached = len(cached) * size + (size - 1 if source is not None else 0)
        # a scoring request (max_tokens=0) skips its last token, which predicts no prompt token
        end = (
            request.num_prompt_tokens - 1 if request.params.max_tokens == 0 else request.num_tokens
        )
        num_new = min(end - num_cached, budget)
        needed = cdiv(num_cached + num_new, size) - len(cached)
        held = cached if source is None else [*cached, source]
        if not self.allocator.can_allocate(needed + self.allocator.num_free_among(held)):
            return False
        self.waiting.popleft()
        self._take_adapter(request)
        self.cache.count(request, num_cached)
        self.allocator.take(held)
        request.block_table = cached + self.allocator.allocate(needed)
        request.copied_block = None
        if source is not None:
            plan.copies.append(BlockCopy(source, request.block_table[len(cached)]))
            request.copied_block = (len(cached), int(self.cache.publication[source]))
            self.num_block_copies += 1
        request.num_computed_tokens = num_cached
        request.num_published_blocks = len(cached)
        if request.num_cached_tokens is None:  # its first admission
            request.num_cached_tokens = num_cached
            request.scheduled_time = time.perf_counter()
        self._run(request)
        self._plan(plan, request, num_new)
        return True

    def _run(self, request: Request) -> None:
        request.status = Status.RUNNING
        if self.priority:
            insort(self.running, request, key=by_priority)
        else:
            self.running.append(request)

    def _adapter_fits(self, request: Request) -> bool:
        """Whether the request's LoRA adapter (if any) has a device slot or can take one."""
        lora = request.lora_request
        return lora is None or self.adapters.can_acquire(lora)

    def _take_adapter(self, request: Request) -> None:
        if request.lora_request is not None:
            request.lora_slot = self.adapters.acquire(request.lora_request)

    def _reserve_blocks(self, request: Request, num_new: int, plan: StepPlan) -> bool:
        """Grow the request's block table to cover this step, preempting the last running
        requests if needed (the newest; "priority": the least important, newest)."""
        needed = cdiv(request.num_computed_tokens + num_new, self.block_size) - len(
            request.block_table
        )
        if needed <= 0:
            return True  # most decode steps: the last block still has room
        while not self.allocator.can_allocate(needed):
            victim = self.running[-1]
            self.preempt(victim)
            plan.preempted.append(victim)
            if victim is request:
                return False
        request.block_table.extend(self.allocator.allocate(needed))
        return True

    def preempt(self, request: Request, recompute: bool = False) -> None:
        """Stop a running request: by swap where the swap policy says so, unless `recompute`
        (its KV is stale), else back to the queue (its front; "priority": its place) to
        recompute its KV."""
        self.running.remove(request)
        self.cache.publish(request)
        if not recompute and self.swap.should_swap(request):
            self.swap.swap_out(request)
            request.status = Status.SWAPPED
            self.swapped.put_back(request)
        else:
            request.num_computed_tokens, request.publishes = 0, True
            request.status = Status.WAITING
            self.waiting.put_back(request)
        self._release_blocks(request)
        request.num_preemptions += 1
        self.num_preemptions += 1

    def recompute_swapped(self) -> None:
        """Every swapped request to the front of the queue ("priority": to its place), in the
        order they would resume, to recompute its KV: its host copy is dropped (stale after a
        weight update)."""
        while self.swapped:
            request = self.swapped.pop()
            self.swap.release(request)
            request.num_computed_tokens, request.publishes = 0, True
            request.status = Status.WAITING
            self.waiting.put_back(request)

    def finish(self, request: Request, reason: str) -> None:
        """Retire a request (stop, length or abort) and return its blocks."""
        if request.status is Status.RUNNING:
            self.running.remove(request)
            self._release_blocks(request)
        elif request.status is Status.WAITING:
            self.waiting.remove(request)
        elif request.status is Status.SWAPPED:
            self.swapped.remove(request)
            self.swap.release(request)
        request.status = Status.FINISHED
        request.finish_reason = reason

    def _release_blocks(self, request: Request) -> None:
        """Publish what the request completed, then free its blocks, last first, and give
        back its adapter's slot."""
        if request.lora_slot >= 0:
            self.adapters.release(request.lora_slot)
            request.lora_slot = -1
        self.cache.publish(request)
        self.allocator.free(request.block_table[::-1])
        request.block_table = []
        request.num_published_blocks = 0
