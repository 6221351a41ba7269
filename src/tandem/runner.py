"""Runs a built step on the device: H2D copy, carry-over, forward, sampling, D2H copy.

On CUDA each phase has its own non-default stream and the phases are ordered by events, so
launching a step returns at once and the CPU blocks only in `wait`, on the step's `d2h_done`:

    h2d_stream:     wait compute_done[slot] -> copy inputs  -> record h2d_done[slot]
    compute_stream: wait h2d_done[slot], d2h_done[slot], swap.done -> carry-over, forward,
                                                            sample -> record compute_done[slot]
    d2h_stream:     wait compute_done[slot] -> copy outputs -> record d2h_done[slot]

The two slots alternate, so these waits only ever order a slot against its own previous use.
Swap copies (swap.py) run on a fourth stream after every step launched before them.
On CPU the same calls run eagerly in program order.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable, Iterator

import numpy as np
import torch

from tandem import envs
from tandem.attention import AttentionBackend, AttentionMetadata, SharedPrefixes
from tandem.batch import StepBatch
from tandem.io_slot import IOSlot, carry_over
from tandem.model.decoder import Decoder
from tandem.parallel import TensorParallel
from tandem.penalties import PenaltyState
from tandem.piecewise import PiecewiseGraphs, bucket_for, token_buckets
from tandem.profiler import NoTimeline, Timeline
from tandem.prompt_logprobs import PromptLogprobStep
from tandem.prompt_logprobs import compute as compute_prompt_logprobs
from tandem.sampling import SamplingTensors, sample, top_logprobs_of
from tandem.swap import SwapCopy, Swapper

WAIT_POLL_S = 50e-6  # tensor parallelism: how often the step wait looks at the other ranks
# The library torch's CUDA matmuls go through in the captured decode graphs; eager steps
# (prefill) keep torch's own choice. TANDEM_BLAS=cublaslt: seed's steps were 2% shorter under
# it before split-K took over its o and down projections (BENCHMARKS.md, seventh run); since,
# latency is the same and small 0.6% slower (eighth run), so it is not the default. (The slow
# first runs first blamed on it were Triton compiles on a cold cache, eighth run.)
BLAS_LIBRARY = envs.blas()


@contextlib.contextmanager
def preferred_blas(library: str | None = None) -> Iterator[None]:
    """torch's preferred BLAS library is `library` (BLAS_LIBRARY by default) inside and as it
    was after."""
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(library or BLAS_LIBRARY)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(before)


class Runner:
    def __init__(
        self,
        model: Decoder,
        kv_caches: list[torch.Tensor],
        attend: AttentionBackend,
        device: torch.device,
        max_tokens: int,
        max_seqs: int,
        max_blocks: int,
        cuda_graphs: bool,
        tp: TensorParallel,
        piecewise: bool = False,
        cascade: bool = False,
        penalties: PenaltyState | None = None,
        swapper: Swapper | None = None,
    ):
        self.model = model
        self.penalties = penalties  # needed by steps with use_penalties
        self.tp = tp
        self.kv_caches = kv_caches
        self.attend = attend
        self.device = device
        self.slots = [IOSlot(i, max_tokens, max_seqs, max_blocks, device) for i in range(2)]
        self.cuda = device.type == "cuda"
        # decode-only steps of up to max_seqs rows replay a graph captured for the next size up
        self.graph_sizes = graph_batch_sizes(min(max_seqs, max_tokens)) if cuda_graphs else []
        # (slot, rows, use_filters, use_penalties, shared-prefix groups on/off) -> graph
        self.graphs: dict[tuple[int, int, bool, bool, bool], torch.cuda.CUDAGraph] = {}
        self.cascade = cascade  # the attention takes groups of rows that share blocks
        self.swapper = swapper  # preemption by swap: its copies run on a stream of their own
        # the other steps of up to max_tokens tokens: pieces between their attentions, padded to
        # the next bucket (piecewise.py; on CPU, uncaptured, the pieces run eagerly)
        self.pieces = (
            PiecewiseGraphs(model, kv_caches, attend, max_tokens, device) if piecewise else None
        )
        self.token_buckets = token_buckets(max_tokens) if piecewise else []
        if self.cuda:
            self.h2d_stream, self.compute_stream, self.d2h_stream = (
                torch.cuda.Stream(device) for _ in range(3)
            )
            self.h2d_done = [torch.cuda.Event() for _ in self.slots]
            self.compute_done = [torch.cuda.Event() for _ in self.slots]
            self.d2h_done = [torch.cuda.Event() for _ in self.slots]
            torch.cuda.synchronize(
                device
            )  # weights, cache and buffers were written on the default stream

    def release_graphs(self) -> None:
        """Free the captured graphs. Graphs that hold NCCL collectives keep the communicator
        busy: a process group cannot be destroyed while they live."""
        self.reset_graphs()
        self.graph_sizes = []  # any later step runs eagerly
        self.pieces, self.token_buckets = None, []

    def reset_graphs(self) -> None:
        """Free the captured graphs and their memory; `capture_graphs` makes them again (until
        then no step may run: the plan still names graph sizes). Sleep mode uses this."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        if self.pieces is not None:
            self.pieces.release()

    def padded_size(self, num_seqs: int, decode_only: bool, wants_logprobs: bool) -> int | None:
        """Rows of the graph that will run a step, or None when the step runs eagerly."""
        if (
            not decode_only
            or wants_logprobs
            or not self.graph_sizes
            or num_seqs > self.graph_sizes[-1]
        ):
            return None
        return next(size for size in self.graph_sizes if size >= num_seqs)

    def token_bucket(self, num_tokens: int) -> int | None:
        """Token rows of the pieces that will run a step not replayed whole (None: eagerly)."""
        return bucket_for(self.token_buckets, num_tokens)

    def swap(self, copies: list[SwapCopy], timeline: Timeline | NoTimeline) -> None:
        """Enqueue swap copies after the steps launched so far; the next step waits for them."""
        if copies:
            self.swapper.run(copies, self.compute_stream if self.cuda else None, timeline)

    def launch(self, batch: StepBatch, timeline: Timeline | NoTimeline) -> None:
        """Enqueue the step's copies and compute; returns without waiting for the device."""
        slot = batch.slot
        if not self.cuda:
            self._compute(batch)
            return
        i = slot.index
        timing = timeline.slot_events[i]
        with torch.cuda.stream(self.h2d_stream):
            self.h2d_stream.wait_event(self.compute_done[i])  # last reader of dev_in
            timing.start(0)
            slot.dev_in.copy_from(slot.host_in)
            if batch.prompt_logprobs is not None:
                slot.prompt_logprobs.copy_in(batch.prompt_logprobs.num_rows)
            timing.end(0)
            self.h2d_done[i].record()
        with torch.cuda.stream(self.compute_stream):
            self.compute_stream.wait_event(self.h2d_done[i])
            self.compute_stream.wait_event(self.d2h_done[i])  # last reader of dev_out
            if self.swapper is not None:
                self.swapper.fence(self.compute_stream)  # blocks swapped in or out for it
            timing.start(1)
            self._compute(batch)
            timing.end(1)
            self.compute_done[i].record()
        with torch.cuda.stream(self.d2h_stream):
            self.d2h_stream.wait_event(self.compute_done[i])
            timing.start(2)
            slot.host_out.copy_from(slot.dev_out)
            if batch.prompt_logprobs is not None:
                slot.prompt_logprobs.copy_out(
                    batch.prompt_logprobs.num_rows, batch.prompt_logprobs.num_top
                )
            timing.end(2)
            self.d2h_done[i].record()

    def wait(
        self, batch: StepBatch, check: Callable[[], None] | None = None
    ) -> dict[str, np.ndarray]:
        """Block until the step's outputs are in host memory; the step loop's only CPU wait.
        With `check` (tensor parallelism: are the other ranks alive?), poll and call it meanwhile,
        so a rank that died mid-step raises instead of leaving this wait stuck forever."""
        if self.cuda:
            done = self.d2h_done[batch.slot.index]
            while check is not None and not done.query():
                check()
                time.sleep(WAIT_POLL_S)
            done.synchronize()  # at once, if polled to completion
        return batch.slot.np_out

    def _compute(self, batch: StepBatch) -> None:
        if batch.penalty_admissions is not None:
            self.penalties.admit(*batch.penalty_admissions)
        shared = batch.num_shared_groups > 0
        if batch.graphed:
            key = (
                batch.slot.index,
                batch.num_seqs_padded,
                batch.use_filters,
                batch.use_penalties,
                shared,
            )
            self.graphs[key].replay()
            return
        self._forward_and_sample(
            batch.slot,
            batch.num_tokens,
            len(batch.requests),
            batch.decode_only,
            batch.use_filters,
            batch.num_top_logprobs,
            batch.query_start_loc,
            batch.seq_lens,
            batch.token_bucket,
            batch.use_penalties,
            batch.num_shared_groups if shared else None,
            batch.prompt_logprobs,
        )

    @torch.inference_mode()
    def _forward_and_sample(
        self,
        slot: IOSlot,
        num_tokens: int,
        num_seqs: int,
        decode_only: bool,
        use_filters: bool,
        num_top_logprobs: int | None,
        query_start_loc_host: list[int] | None,
        seq_lens_host: list[int] | None,
        token_bucket: int | None = None,
        use_penalties: bool = False,
        max_shared_groups: int | None = None,
        prompt_logprobs: PromptLogprobStep | None = None,
    ) -> None:
        """Everything the device does for one step; fixed shapes given its arguments, so capturable.
        With `token_bucket`, the forward pass runs as pieces padded to that many tokens; with
        `max_shared_groups`, decode rows that share leading blocks read them once per group; with
        `prompt_logprobs` (never captured), its prompt rows' logprobs follow the sampling."""
        x, out = slot.dev_in, slot.dev_out
        prev_sampled = self.slots[1 - slot.index].dev_out["sampled"]  # slots alternate every step
        meta = AttentionMetadata(
            slot_mapping=x["slot_mapping"][:num_tokens].long(),
            query_start_loc=x["query_start_loc"][: num_seqs + 1],
            seq_lens=x["seq_lens"][:num_seqs],
            block_tables=x["block_tables"][:num_seqs],
            decode_only=decode_only,
            query_start_loc_host=query_start_loc_host,
            seq_lens_host=seq_lens_host,
            seq_order=x["seq_order"][:num_seqs],  # mixed steps: of the leading one-token rows
            shared=None if max_shared_groups is None else shared_prefixes(x, max_shared_groups),
        )
        if token_bucket is not None:
            hidden = self.pieces.forward(
                slot.index, x, prev_sampled, token_bucket, num_tokens, meta
            )
            input_ids = None  # the first piece's own
        else:
            input_ids = carry_over(
                x["input_ids"][:num_tokens], x["carry_index"][:num_tokens], prev_sampled
            )
            hidden = self.model(
                input_ids, x["positions"][:num_tokens], self.kv_caches, meta, self.attend
            )
        # a decode step's rows are its sequences' last tokens already: no gather
        last = hidden[:num_seqs] if decode_only else hidden[x["logits_indices"][:num_seqs].long()]
        logits = self.model.compute_logits(last)
        # logprobs describe the model's own distribution, before min_tokens bans and filters
        logprobs = (
            logits.log_softmax(dim=-1, dtype=torch.float32)
            if num_top_logprobs is not None
            else None
        )
        if use_penalties:  # the step's tokens counted into the state, then the logits processed
            if input_ids is None:
                ids, carry = x["input_ids"][:num_tokens], x["carry_index"][:num_tokens]
                input_ids = carry_over(ids, carry, prev_sampled)
            self.penalties.update(x, input_ids)
            logits = self.penalties.apply(logits, x, num_seqs)
        if use_filters:  # the only steps with min_tokens bans (see StepBatch.use_filters)
            ban_tokens(logits, x["banned_ids"][:num_seqs], x["ban_rows"][:num_seqs])
        params = SamplingTensors(
            temperature=x["temperature"][:num_seqs],
            top_k=x["top_k"][:num_seqs],
            top_p=x["top_p"][:num_seqs],
            min_p=x["min_p"][:num_seqs],
            seeds=x["seeds"][:num_seqs],
            positions=x["sample_positions"][:num_seqs],
        )
        sampled = self.tp.broadcast(sample(logits, params, use_filters))  # rank 0's tokens rule
        out["sampled"][:num_seqs].copy_(sampled)
        if logprobs is not None:
            sampled_logprob, top_ids, top_logprobs = top_logprobs_of(
                logprobs, sampled, num_top_logprobs
            )
            out["sampled_logprob"][:num_seqs].copy_(sampled_logprob)
            out["top_ids"][:num_seqs, :num_top_logprobs].copy_(top_ids)
            out["top_logprobs"][:num_seqs, :num_top_logprobs].copy_(top_logprobs)
        if prompt_logprobs is not None:
            compute_prompt_logprobs(
                self.model, hidden, slot.prompt_logprobs, prompt_logprobs.num_rows,
                prompt_logprobs.num_top,
            )  # fmt: skip

    def capture_graphs(self, shared_pool: bool = True) -> None:
        """One graph per (slot, padded size, filters on/off, penalties on/off), and the pieces of
        the other steps per token bucket, all from one shared memory pool.

        Sharing is safe because graphs never run concurrently: every step runs on the compute
        stream after the previous one. Largest first, so smaller graphs fit in the pool it sized.
        (`shared_pool=False` gives each decode graph its own pool; benchmarks/graph_memory.py
        compares.)
        """
        shared = torch.cuda.graph_pool_handle()
        if self.pieces is not None:  # the larger activations: first
            inputs = [(s.dev_in, self.slots[1 - s.index].dev_out["sampled"]) for s in self.slots]
            self.pieces.capture(self.token_buckets, inputs, shared, self.compute_stream)
        with preferred_blas():
            self._capture_graphs(shared, shared_pool)
        torch.cuda.synchronize(self.device)

    def _capture_graphs(self, shared, shared_pool: bool) -> None:
        for size in reversed(self.graph_sizes):
            for slot in self.slots:
                for variant in self._graph_variants():
                    use_filters, use_penalties, cascade = variant
                    groups = max(1, size // 2) if cascade else None  # a group has 2 rows or more
                    args = (slot, size, size, True, use_filters, None, None, None, None)
                    args += (use_penalties, groups)
                    with torch.cuda.stream(self.compute_stream):
                        self._forward_and_sample(*args)  # warm-up: kernels chosen, workspaces made
                    graph = torch.cuda.CUDAGraph()
                    pool = shared if shared_pool else None
                    with torch.cuda.graph(graph, pool=pool, stream=self.compute_stream):
                        self._forward_and_sample(*args)
                    self.graphs[(slot.index, size, *variant)] = graph

    def _graph_variants(self) -> list[tuple[bool, bool, bool]]:
        """(use_filters, use_penalties, shared groups) of the decode graphs: penalties where the
        engine keeps penalty state, shared groups where the attention takes them."""
        penalties = (False, True) if self.penalties is not None else (False,)
        cascade = (False, True) if self.cascade else (False,)
        return list(itertools.product((False, True), penalties, cascade))


def shared_prefixes(x: dict[str, torch.Tensor], max_groups: int) -> SharedPrefixes:
    """The slot's shared-prefix groups (shared_prefix.py), up to `max_groups` of them."""
    return SharedPrefixes(
        prefix_lens=x["prefix_lens"],
        group_rows=x["group_rows"],
        group_starts=x["group_starts"][: max_groups + 1],
        group_prefix=x["group_prefix"][:max_groups],
        num_groups=x["num_groups"],
        max_groups=max_groups,
    )


def graph_batch_sizes(max_seqs: int) -> list[int]:
    """E.g. 40 -> [1, 2, 4, 8, 16, 32, 40]: powers of two to 16, then multiples of 16, then the max."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_seqs] + list(range(16, max_seqs, 16))
    return [*sizes, max_seqs]


def ban_tokens(logits: torch.Tensor, banned_ids: torch.Tensor, ban_rows: torch.Tensor) -> None:
    """Set banned ids' logits to -inf in rows flagged by ban_rows (rows pad their id list by repetition)."""
    ids = banned_ids.long()
    kept = logits.gather(1, ids)
    logits.scatter_(1, ids, torch.where(ban_rows[:, None] > 0, float("-inf"), kept))
