"""Runs a built step on the device: H2D copy, carry-over, forward, sampling, D2H copy.

On CUDA each phase has its own non-default stream and the phases are ordered by events, so
launching a step returns at once and the CPU blocks only in `wait`, on the step's `d2h_done`:

    h2d_stream:     wait compute_done[slot] -> copy inputs  -> record h2d_done[slot]
                    (masked steps, later) copy token masks  -> record mask_ready[slot]
    compute_stream: wait h2d_done[slot], d2h_done[slot], swap.done -> block copies,
                    carry-over, forward
                    (masked steps) wait mask_ready[slot]
                    sample                                  -> record compute_done[slot]
    d2h_stream:     wait compute_done[slot] -> copy outputs -> record d2h_done[slot]

A step is two launches, its forward pass (up to the logits) and its sampling. Both are enqueued
at once, except in a step whose sampling waits for the host: one with structured-output rows
(structured.py), whose sampling is launched once the CPU has that step's token masks, or one of
an engine whose custom logits processors read output ids (logits_processors.py), after reading
back the step before (engine.py). CUDA
graphs follow the split: a forward graph per (slot, size, shared-prefix groups on/off, LoRA
products on/off) writes
the logits into one buffer, and small sampling graphs per (slot, size, filters, penalties,
masks) read them. The two slots alternate, so these waits only ever order a slot against its
own previous use. Swap copies (swap.py) run on a fourth stream after every step launched
before them. On CPU the same calls run eagerly in program order.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import time
from collections.abc import Callable, Iterator

import numpy as np
import torch

from tandem import envs
from tandem.attention import AttentionBackend, AttentionMetadata, SharedPrefixes, rotated_before
from tandem.batch import StepBatch
from tandem.io_slot import IOSlot, carry_over
from tandem.kv_cache import copy_blocks
from tandem.logits_processors import LogitsProcessors
from tandem.model.decoder import Decoder
from tandem.parallel import TensorParallel
from tandem.penalties import PenaltyState
from tandem.piecewise import PiecewiseGraphs, bucket_for, token_buckets
from tandem.pooling import compute as compute_pooled
from tandem.profiler import NoTimeline, Timeline
from tandem.prompt_embeds import PromptEmbedStep
from tandem.prompt_logprobs import compute as compute_prompt_logprobs
from tandem.sampling import (
    SamplingTensors,
    draw,
    processed_logits,
    sample,
    sampled_logprobs,
    top_logprobs,
)
from tandem.structured import apply_masks
from tandem.swap import SwapCopy, Swapper
from tandem.token_logprobs import TokenLogprobStep
from tandem.token_logprobs import gather as gather_token_logprobs

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
        graph_sizes: list[int],
        tp: TensorParallel,
        piecewise: bool = False,
        cascade: bool = False,
        penalties: PenaltyState | None = None,
        swapper: Swapper | None = None,
        mask_vocab_size: int | None = None,
        logprobs_mode: str = "raw_logprobs",
        prompt_embeds: bool = False,
        logits_processors: LogitsProcessors | None = None,
        max_top: int = 20,
    ):
        """`max_top`: the most top ids a position's logprobs return (`logprobs_width`)."""
        self.model = model
        self.logprobs_mode = logprobs_mode  # config.LOGPROBS_MODES: what sample logprobs hold
        # custom processors (logits_processors.py): every step's sampling runs them, eagerly
        self.logits_processors = logits_processors
        self.penalties = penalties  # needed by steps with use_penalties
        self.tp = tp
        self.kv_caches = kv_caches
        self.attend = attend
        self.device = device
        # with mask_vocab_size, each slot holds token-mask rows and steps may take masks
        self.masks = mask_vocab_size is not None
        # the pooled rows' width, and a classifier's scores' (pooling requests)
        hidden, labels = model.cfg.hidden_size, model.cfg.num_labels
        lora = model.lora is not None  # the slots carry each token's adapter slot
        # prompts of embeddings: the slots carry their rows, in the model's dtype
        embeds_dtype = model.embed_tokens.weight.dtype if prompt_embeds else None
        args = (max_tokens, max_seqs, max_blocks, device, mask_vocab_size, hidden, labels)
        self.slots = [IOSlot(i, *args, lora, embeds_dtype, max_top) for i in range(2)]
        self.cuda = device.type == "cuda"
        # decode-only steps of up to max_seqs rows replay a graph captured for the next size up
        self.graph_sizes = graph_sizes  # e.g. graph_batch_sizes; [] without whole graphs
        # ("forward", slot, rows, shared-prefix groups on/off, LoRA products on/off) and
        # ("sample", slot, rows, use_filters, use_penalties, use_mask) -> graph
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        # [graph_sizes[-1], vocab] in the LM head's dtype: a forward graph's logits, which the
        # sampling graph replayed after it reads (made at capture)
        self.logits: torch.Tensor | None = None
        # an eager step's forward outputs (hidden, logits, input ids) until its sampling runs
        self.forwarded: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None
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
            self.mask_ready = [torch.cuda.Event() for _ in self.slots]
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

    def padded_size(self, num_seqs: int, decode_only: bool, needs_hidden: bool) -> int | None:
        """Rows of the graph that will run a step, or None when the step runs eagerly.
        `needs_hidden`: prompt logprobs read the hidden states, which a graph does not keep."""
        if (
            not decode_only
            or needs_hidden
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
        """Enqueue the step's H2D copy and forward pass, and its sampling and D2H copy unless
        the step's sampling waits for the host (then `launch_sampling`, later); returns without
        waiting."""
        slot = batch.slot
        if not self.cuda:
            self._forward_step(batch)
            if not batch.sampling_waits:
                self._sample_step(batch)
            return
        i = slot.index
        timing = timeline.slot_events[i]
        with torch.cuda.stream(self.h2d_stream):
            self.h2d_stream.wait_event(self.compute_done[i])  # last reader of dev_in
            timing.start(0)
            slot.dev_in.copy_from(slot.host_in)
            if batch.prompt_logprobs is not None:
                slot.prompt_logprobs.copy_in(batch.prompt_logprobs.num_rows)
            if batch.token_logprobs is not None:
                slot.token_logprobs.copy_in(batch.token_logprobs)
            if batch.pooling is not None:
                slot.pooling.copy_in(len(batch.pooling.requests))
            if batch.prompt_embeds is not None:
                slot.prompt_embeds.copy_in(batch.prompt_embeds)
            timing.end(0)
            self.h2d_done[i].record()
        with torch.cuda.stream(self.compute_stream):
            self.compute_stream.wait_event(self.h2d_done[i])
            self.compute_stream.wait_event(self.d2h_done[i])  # last reader of dev_out
            if self.swapper is not None:
                self.swapper.fence(self.compute_stream)  # blocks swapped in or out for it
            timing.start(1)
            self._forward_step(batch)
        if not batch.sampling_waits:
            self._sample_and_copy_out(batch, timing)

    def launch_sampling(self, batch: StepBatch, timeline: Timeline | NoTimeline) -> None:
        """Enqueue the sampling of a step that waited for the host (its masks filled into the
        slot's host rows, or its processors' rows current): the masks' H2D copy, then the
        sampling after that copy alone (the forward pass runs meanwhile), then the D2H copy."""
        if not self.cuda:
            self._sample_step(batch)
            return
        i = batch.slot.index
        timing = timeline.slot_events[i]
        if batch.use_mask:
            with torch.cuda.stream(self.h2d_stream):
                batch.slot.masks.copy_in(batch.num_seqs_padded)
                self.mask_ready[i].record()
        with torch.cuda.stream(self.compute_stream):
            timing.start(3)
            if batch.use_mask:
                self.compute_stream.wait_event(self.mask_ready[i])
            timing.end(3)
        self._sample_and_copy_out(batch, timing)

    def abandon(self, batch: StepBatch) -> None:
        """A step whose sampling will not run on: its slot's events recorded after what it
        enqueued, so the slot's next step waits for it as for a step read back, and the device
        waited for, so the slot's host buffers may be rewritten (an error's path alone)."""
        if not self.cuda:
            return
        i = batch.slot.index
        with torch.cuda.stream(self.compute_stream):
            self.compute_done[i].record()
        with torch.cuda.stream(self.d2h_stream):
            self.d2h_stream.wait_event(self.compute_done[i])
            self.d2h_done[i].record()
        torch.cuda.synchronize(self.device)

    def _sample_and_copy_out(self, batch: StepBatch, timing) -> None:
        slot, i = batch.slot, batch.slot.index
        with torch.cuda.stream(self.compute_stream):
            self._sample_step(batch)
            timing.end(1)
            self.compute_done[i].record()
        with torch.cuda.stream(self.d2h_stream):
            self.d2h_stream.wait_event(self.compute_done[i])
            timing.start(2)
            slot.host_out.copy_from(slot.dev_out)
            if batch.num_top_logprobs:
                slot.top_logprobs.copy_out(len(batch.requests), batch.num_top_logprobs)
            if batch.prompt_logprobs is not None:
                slot.prompt_logprobs.copy_out(
                    batch.prompt_logprobs.num_rows, batch.prompt_logprobs.num_top
                )
            if batch.token_logprobs is not None:
                slot.token_logprobs.copy_out(batch.token_logprobs)
            if batch.pooling is not None:
                slot.pooling.copy_out(len(batch.pooling.requests))
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

    def _forward_step(self, batch: StepBatch) -> None:
        if batch.num_copies:  # before the forward, outside any graph: the copies' count varies
            x = batch.slot.dev_in
            n = batch.num_copies
            copy_blocks(self.kv_caches, x["copy_src"][:n], x["copy_dst"][:n])
        if batch.penalty_admissions is not None:
            self.penalties.admit(*batch.penalty_admissions)
        lora = self.model.lora
        if lora is not None:
            for lora_slot, adapter in batch.adapter_loads:  # after every step launched before
                lora.load(lora_slot, adapter)
            lora.active = batch.uses_lora  # eager steps; a decode graph of its kind below
        shared = batch.num_shared_groups > 0
        if batch.graphed:
            key = ("forward", batch.slot.index, batch.num_seqs_padded, shared, batch.uses_lora)
            self.graphs[key].replay()
            if not batch.sampling_graphed:  # sampled eagerly from the graph's logits
                self.forwarded = (None, self.logits[: len(batch.requests)], None)
            return
        self.forwarded = self._forward(
            batch.slot,
            batch.num_tokens,
            len(batch.requests),
            batch.decode_only,
            batch.query_start_loc,
            batch.seq_lens,
            batch.token_bucket,
            batch.num_shared_groups if shared else None,
            embeds=batch.prompt_embeds,
        )

    def _sample_step(self, batch: StepBatch) -> None:
        if batch.sampling_graphed:
            key = (batch.slot.index, batch.num_seqs_padded)
            key += (batch.use_filters, batch.use_penalties, batch.use_mask)
            self.graphs[("sample", *key)].replay()
            return
        hidden, logits, input_ids = self.forwarded
        self.forwarded = None
        if self.logits_processors is not None:  # the rows' changes, on the compute stream
            self.logits_processors.update(batch.requests)
        self._sample(
            batch.slot,
            logits,
            input_ids,
            batch.num_tokens,
            len(batch.requests),
            batch.use_filters,
            batch.num_top_logprobs,
            batch.use_penalties,
            batch.use_mask,
            batch.token_logprobs,
        )
        if batch.prompt_logprobs is not None:  # never captured
            compute_prompt_logprobs(
                self.model, hidden, batch.slot.prompt_logprobs, batch.prompt_logprobs.num_rows,
                batch.prompt_logprobs.num_top,
            )  # fmt: skip
        if batch.pooling is not None:  # never captured
            compute_pooled(
                hidden, batch.slot.pooling, len(batch.pooling.requests), self.model.score
            )

    @torch.inference_mode()
    def _forward(
        self,
        slot: IOSlot,
        num_tokens: int,
        num_seqs: int,
        decode_only: bool,
        query_start_loc_host: list[int] | None,
        seq_lens_host: list[int] | None,
        token_bucket: int | None = None,
        max_shared_groups: int | None = None,
        logits_out: torch.Tensor | None = None,
        embeds: PromptEmbedStep | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The step's forward pass up to its rows' logits: (hidden states, logits, input ids
        after the carry-over, or None when the pieces made them). Fixed shapes given its
        arguments, so capturable. With `token_bucket`, the forward pass runs as pieces padded to
        that many tokens; with `max_shared_groups`, decode rows that share leading blocks read
        them once per group; with `logits_out` (the graphs' buffer), the logits land there;
        `embeds` (eager steps only): token rows whose embeddings the prompt gave."""
        x = slot.dev_in
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
            if self.model.lora is not None and self.model.lora.active:
                self.model.lora.select(x["lora_slots"][:num_tokens])
            given = None if embeds is None else slot.prompt_embeds.device(embeds)
            positions = x["positions"][:num_tokens]
            hidden = self.model(
                input_ids, positions, self.kv_caches, meta, self.attend, embeds=given
            )
        # a decode step's rows are its sequences' last tokens already: no gather
        last = hidden[:num_seqs] if decode_only else hidden[x["logits_indices"][:num_seqs].long()]
        if logits_out is None:
            return hidden, self.model.compute_logits(last), input_ids
        return hidden, self.model.compute_logits(last, out=logits_out), input_ids

    @torch.inference_mode()
    def _sample(
        self,
        slot: IOSlot,
        logits: torch.Tensor,
        input_ids: torch.Tensor | None,
        num_tokens: int,
        num_seqs: int,
        use_filters: bool,
        num_top_logprobs: int | None,
        use_penalties: bool = False,
        use_mask: bool = False,
        token_logprobs: TokenLogprobStep | None = None,
    ) -> None:
        """[num_seqs, vocab] logits -> the slot's sampled tokens (and logprobs); fixed shapes
        given its arguments, so capturable. `input_ids` (None: made again from the slot) feed
        the penalty state; `use_mask` applies the slot's token masks first; `token_logprobs`
        (steps with logprobs only, never captured) gathers the logprobs of the ids rows name."""
        x, out = slot.dev_in, slot.dev_out
        if use_mask:  # rows without a constraint have all-ones masks
            # first, as vLLM applies a grammar's bitmask before its sampler: raw logprobs are
            # those of the tokens the grammar allows
            apply_masks(logits, slot.masks.device[:num_seqs])
        # raw logprobs describe the model's own distribution, before penalties and bans: the
        # bans below change the logits in place unless penalties copied them first
        raw = self.logprobs_mode.startswith("raw")
        wanted = num_top_logprobs is not None
        processors = self.logits_processors  # custom ones may change the logits in place too
        changed_in_place = processors is not None or (use_filters and not use_penalties)
        source = sampled = None
        if wanted and raw:
            source = logits.clone() if changed_in_place else logits
        if processors is not None:
            logits = processors.before_penalties(logits)
        if use_penalties:  # the step's tokens counted into the state, then the logits processed
            if input_ids is None:
                ids, carry = x["input_ids"][:num_tokens], x["carry_index"][:num_tokens]
                input_ids = carry_over(ids, carry, self.slots[1 - slot.index].dev_out["sampled"])
            self.penalties.update(x, input_ids)
            logits = self.penalties.apply(logits, x, num_seqs)
        if use_filters:  # the only steps with min_tokens bans (see StepBatch.use_filters)
            ban_tokens(logits, x["banned_ids"][:num_seqs], x["ban_rows"][:num_seqs])
        temperature = x["temperature"][:num_seqs]
        if processors is not None:
            logits, temperature = processors.after_temperature(logits, temperature)
        params = SamplingTensors(
            temperature=temperature,
            top_k=x["top_k"][:num_seqs],
            top_p=x["top_p"][:num_seqs],
            min_p=x["min_p"][:num_seqs],
            seeds=x["seeds"][:num_seqs],
            positions=x["sample_positions"][:num_seqs],
        )
        if wanted and not raw:  # what the sampler draws from (a float32 tensor of its own)
            source = processed_logits(logits, params, use_filters)
            # with filters those values are sorted once already: the tokens drawn from them
            sampled = draw(logits, source, params) if use_filters else None
        if sampled is None:
            sampled = sample(logits, params, use_filters)
        sampled = self.tp.broadcast(sampled)  # rank 0's tokens rule
        out["sampled"][:num_seqs].copy_(sampled)
        if source is None:
            return
        shift = sampled_logprobs(
            source, sampled, self.logprobs_mode, out["sampled_logprob"][:num_seqs],
            out["sampled_rank"][:num_seqs],
        )  # fmt: skip
        if num_top_logprobs:
            slot.top_logprobs.write(*top_logprobs(source, shift, num_top_logprobs))
        if token_logprobs is not None:
            gather_token_logprobs(source, shift, slot.token_logprobs, token_logprobs)

    def capture_graphs(self, shared_pool: bool = True) -> None:
        """Per slot and padded size, the forward graphs (shared-prefix groups on/off) and the
        sampling graphs (filters, penalties, masks on/off), and the pieces of the other steps
        per token bucket, all from one shared memory pool.

        Sharing is safe because graphs never run concurrently: every step runs on the compute
        stream after the previous one. Largest first, so smaller graphs fit in the pool it sized.
        (`shared_pool=False` gives each graph its own pool; benchmarks/graph_memory.py compares.)
        """
        with torch.cuda.stream(self.compute_stream):  # the warm-ups' inputs: padding rows
            for slot in self.slots:
                slot.reset_device()
        shared = torch.cuda.graph_pool_handle()
        if self.model.lora is not None:  # the pieces run every step: with LoRA's products
            self.model.lora.active = True
        if self.pieces is not None:  # the larger activations: first
            inputs = [(s.dev_in, self.slots[1 - s.index].dev_out["sampled"]) for s in self.slots]
            self.pieces.capture(self.token_buckets, inputs, shared, self.compute_stream)
        with preferred_blas():
            self._capture_graphs(shared, shared_pool)
        torch.cuda.synchronize(self.device)

    def _capture_graphs(self, shared, shared_pool: bool) -> None:
        def capture(key: tuple, run: Callable[[], object]) -> None:
            with torch.cuda.stream(self.compute_stream):
                run()  # warm-up: kernels chosen, workspaces made
                if key[0] == "forward" and key[1] == 0:  # a step with prefill's decode rows
                    with rotated_before(self.attend):  # take the decode kernel at this size
                        run()  # too: compiled here, not in the first such step
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=shared if shared_pool else None,
                                  stream=self.compute_stream):  # fmt: skip
                run()
            self.graphs[key] = graph

        largest = self.graph_sizes[-1] if self.graph_sizes else 0
        lora = self.model.lora
        # with LoRA adapters, a decode graph with their products and one without (a step whose
        # rows name no adapter); the pieces always have them
        lora_kinds = (True, False) if lora is not None else (False,)
        for size in reversed(self.graph_sizes):
            for slot in self.slots:
                for cascade, with_lora in itertools.product(
                    (False, True) if self.cascade else (False,), lora_kinds
                ):
                    groups = max(1, size // 2) if cascade else None  # a group has 2 rows or more
                    args = (slot, size, size, True, None, None, None, groups)
                    if lora is not None:
                        lora.active = with_lora
                    if self.logits is None:  # its shape and dtype: the LM head's own
                        with torch.cuda.stream(self.compute_stream):
                            logits = self._forward(*args)[1]
                            self.logits = logits.new_empty(largest, logits.shape[1])
                    out = self.logits[:size]
                    forward = functools.partial(self._forward, *args, logits_out=out)
                    capture(("forward", slot.index, size, cascade, with_lora), forward)
                for variant in self._sampling_variants():
                    use_filters, use_penalties, use_mask = variant
                    args = (slot, self.logits[:size], None, size, size, use_filters, None)
                    sample_ = functools.partial(self._sample, *args, use_penalties, use_mask)
                    capture(("sample", slot.index, size, *variant), sample_)

    def _sampling_variants(self) -> list[tuple[bool, bool, bool]]:
        """(use_filters, use_penalties, use_mask) of the sampling graphs: penalties where the
        engine keeps penalty state, masks where the slots hold mask rows; none where custom
        logits processors run in every step's sampling (their code is not captured)."""
        if self.logits_processors is not None:
            return []
        penalties = (False, True) if self.penalties is not None else (False,)
        masks = (False, True) if self.masks else (False,)
        return list(itertools.product((False, True), penalties, masks))


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
