"""StepPlan -> the host buffers of one IO slot, with vectorized numpy."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tandem import penalties
from tandem.io_slot import MAX_BANNED_IDS, IOSlot, fill_padding, fill_token_padding
from tandem.lora.adapters import Adapter
from tandem.pooling import PoolingStep
from tandem.pooling import plan_rows as plan_pooled_rows
from tandem.prompt_embeds import PromptEmbedStep
from tandem.prompt_embeds import plan_rows as plan_embed_rows
from tandem.prompt_logprobs import PromptLogprobStep, plan_rows
from tandem.request import Request
from tandem.sampling import fold_seed
from tandem.scheduler import StepPlan
from tandem.shared_prefix import CopiedBlocks, group_shared_prefixes, shared_kv_tokens
from tandem.token_logprobs import TokenLogprobStep
from tandem.token_logprobs import plan_rows as plan_token_rows


@dataclass
class StepBatch:
    """What the CPU remembers about one launched step until its outputs are read back."""

    step: int
    slot: IOSlot
    requests: list[Request]
    samples: np.ndarray  # [num_seqs] bool: this row's last token ends the known sequence
    num_tokens: int
    num_seqs_padded: int  # rows the device computes: a graph's size, or num_seqs when eager
    decode_only: bool
    # some row filters (top-k/p, min-p) or bans ids (min_tokens): the general sampler's step
    use_filters: bool
    num_top_logprobs: int | None  # None when no request asked for logprobs
    seq_lens: list[int]
    query_start_loc: list[int]
    graphed: bool  # replays a forward graph of num_seqs_padded rows (and see sampling_graphed)
    # otherwise, the token rows of the pieces that run it (piecewise.py), or None: eagerly
    token_bucket: int | None = None
    num_copies: int = 0  # cached blocks copied on write before the forward (copy_src/dst)
    num_shared_groups: int = 0  # groups of decode rows sharing leading blocks (shared_prefix.py)
    shared_kv_tokens: int = 0  # KV tokens those groups do not read again
    use_penalties: bool = False  # some row keeps penalty state (penalties.py)
    # (state rows, their requests) that penalized requests took for this step: reset first
    penalty_admissions: tuple[list[int], list[Request]] | None = None
    # (slot, adapter): LoRA adapters loaded before the forward (lora/adapters.py)
    adapter_loads: list[tuple[int, Adapter]] = field(default_factory=list)
    uses_lora: bool = False  # some row runs under a LoRA adapter
    prompt_logprobs: PromptLogprobStep | None = None  # rows at prompt positions that want them
    pooling: PoolingStep | None = None  # embedding requests' last prompt tokens (pooling.py)
    token_logprobs: TokenLogprobStep | None = None  # rows that name logprob_token_ids
    prompt_embeds: PromptEmbedStep | None = None  # token rows given as embeddings (eager)
    # rows that sample under a structured-output constraint: their token masks (structured.py)
    mask_rows: list[int] = field(default_factory=list)
    # rows whose sampling needs the host to have read back the token each has in flight: the
    # mask rows, or every row where custom logits processors read output ids; the step's
    # sampling is then launched once the CPU has read the step before (engine.py)
    host_rows: list[int] = field(default_factory=list)
    sampling_launched: bool = True
    # custom logits processors change its logits (logits_processors.py): sampled eagerly
    custom_logits: bool = False

    @property
    def use_mask(self) -> bool:
        return bool(self.mask_rows)

    @property
    def sampling_waits(self) -> bool:
        return bool(self.host_rows)

    @property
    def sampling_graphed(self) -> bool:
        """Whether a sampling graph follows the forward graph. A step with logprobs samples
        eagerly from the forward graph's logits: its outputs' widths (top logprobs, named ids)
        vary from step to step; so does one with custom logits processors (user code)."""
        return self.graphed and self.num_top_logprobs is None and not self.custom_logits


class RunningRows:
    """A numpy row per running request: its block table, appended to as the scheduler grows it,
    and what never changes while it runs (prompt length, sampling inputs), written once when it
    takes the row. A step then gathers its requests' rows instead of reading each request."""

    def __init__(self, max_seqs: int, max_blocks: int):
        self.table = np.zeros((max_seqs, max_blocks), dtype=np.int32)  # [rows, max_blocks_per_seq]
        self.length = np.zeros(max_seqs, dtype=np.int32)
        self.prompt_len = np.zeros(max_seqs, dtype=np.int64)
        self.temperature = np.zeros(max_seqs, dtype=np.float32)
        self.top_p = np.zeros(max_seqs, dtype=np.float32)
        self.min_p = np.zeros(max_seqs, dtype=np.float32)
        self.top_k = np.zeros(max_seqs, dtype=np.int32)
        self.seed = np.zeros(max_seqs, dtype=np.int32)  # folded to 32 bits
        self.logprobs = np.zeros(max_seqs, dtype=np.int32)  # -1 when not asked for
        self.min_tokens = np.zeros(max_seqs, dtype=np.int64)
        self.needs_filter = np.zeros(max_seqs, dtype=bool)
        self.presence_penalty = np.zeros(max_seqs, dtype=np.float32)
        self.frequency_penalty = np.zeros(max_seqs, dtype=np.float32)
        self.repetition_penalty = np.ones(max_seqs, dtype=np.float32)
        self.needs_penalties = np.zeros(max_seqs, dtype=bool)
        self.constrained = np.zeros(max_seqs, dtype=bool)  # masked rows: see `take`
        self.pooled = np.zeros(max_seqs, dtype=bool)  # embedding requests (pooling.py)
        # its adapter's slot (lora/adapters.py)
        self.lora_slot = np.full(max_seqs, -1, dtype=np.int32)
        # its admission's copy on write (Request.copied_block): the index, -1 for none, and the
        # copied publication
        self.copy_index = np.full(max_seqs, -1, dtype=np.int32)
        self.copy_publication = np.full(max_seqs, -1, dtype=np.int64)
        self.admitted: tuple[list[int], list[Request]] = ([], [])  # penalized, since the last step
        self.free_rows = list(range(max_seqs - 1, -1, -1))
        self.row_of: dict[str, int] = {}

    def rows(self, requests: list[Request]) -> np.ndarray:
        rows = np.empty(len(requests), dtype=np.int64)
        for i, request in enumerate(requests):
            row = self.row_of.get(request.request_id)
            if row is None:
                row = self.row_of[request.request_id] = self.free_rows.pop()
                self.length[row] = 0
                self._write_constants(row, request)
            known, blocks = self.length[row], request.block_table
            if len(blocks) > known:
                self.table[row, known : len(blocks)] = blocks[known:]
                self.length[row] = len(blocks)
            rows[i] = row
        return rows

    def release(self, request: Request) -> None:
        row = self.row_of.pop(request.request_id, None)
        if row is not None:
            self.free_rows.append(row)

    def take_admitted(self) -> tuple[list[int], list[Request]] | None:
        admitted, self.admitted = self.admitted, ([], [])
        return admitted if admitted[0] else None

    def _write_constants(self, row: int, request: Request) -> None:
        params = request.params
        assert request.seed is not None, "the engine draws the seed when it queues the request"
        self.prompt_len[row] = request.num_prompt_tokens
        self.temperature[row] = 0.0 if params.greedy else params.temperature
        # greedy: no filter, as vLLM's (a step that filters other rows leaves its logprobs be)
        self.top_p[row] = 1.0 if params.greedy else params.top_p
        self.min_p[row] = 0.0 if params.greedy else params.min_p
        self.top_k[row] = 0 if params.greedy else params.top_k
        self.seed[row] = fold_seed(request.seed)
        self.logprobs[row] = -1 if params.logprobs is None else params.num_top_logprobs
        self.min_tokens[row] = params.min_tokens
        self.needs_filter[row] = params.needs_filter
        self.presence_penalty[row] = params.presence_penalty
        self.frequency_penalty[row] = params.frequency_penalty
        self.repetition_penalty[row] = params.repetition_penalty
        self.needs_penalties[row] = params.needs_penalties
        self.constrained[row] = request.masked  # its masks come from the host (structured.py)
        self.pooled[row] = request.pooling is not None
        self.lora_slot[row] = request.lora_slot
        self.copy_index[row], self.copy_publication[row] = request.copied_block or (-1, -1)
        if params.needs_penalties:
            self.admitted[0].append(row)
            self.admitted[1].append(request)


class BatchBuilder:
    def __init__(
        self,
        block_size: int,
        max_seqs: int,
        max_blocks: int,
        eos_ids: tuple[int, ...],
        shared_group_rows: int = 0,
        publication: np.ndarray | None = None,
        custom_logits: bool = False,
        processors_read_outputs: bool = False,
    ):
        self.block_size = block_size
        self.running_rows = RunningRows(max_seqs, max_blocks)
        self.eos_ids = eos_ids
        # most rows of a shared-prefix group; 0: the attention reads every row's whole context
        self.shared_group_rows = shared_group_rows
        # the prefix cache's publication numbers of its blocks (PrefixCache.publication), which
        # tell the copies of one cached block: their copied slots are shared too
        self.publication = publication
        self.custom_logits = custom_logits  # the engine has custom logits processors
        self.processors_read_outputs = processors_read_outputs  # ... that read output ids

    def build(
        self,
        plan: StepPlan,
        slot: IOSlot,
        step: int,
        graph_size: int | None,
        token_bucket: int | None = None,
    ) -> StepBatch:
        """Fill `slot`'s host inputs for `plan`. Pending tokens become placeholders plus a carry index.

        With `graph_size`, rows past the plan are filled as padding: they write no KV (slot -1),
        attend to one slot, and sample greedily; nothing reads their output. With
        `token_bucket`, token rows past the plan's up to that count are padding likewise.
        """
        x = slot.np_in
        requests = plan.requests
        num_seqs = len(requests)
        num_new = np.asarray(plan.num_new_tokens, dtype=np.int64)
        # scheduler already advanced num_computed_tokens past this step
        computed_after = np.fromiter((r.num_computed_tokens for r in requests), np.int64, num_seqs)
        start = computed_after - num_new
        num_tokens = int(num_new.sum())

        qsl = x["query_start_loc"]
        qsl[0] = 0
        np.cumsum(num_new, out=qsl[1 : num_seqs + 1])
        # E.g. num_new [2, 3] -> seq_of_token [0, 0, 1, 1, 1], offset [0, 1, 0, 1, 2]
        seq_of_token = np.repeat(np.arange(num_seqs), num_new)
        offset = np.arange(num_tokens) - qsl[seq_of_token]
        positions = start[seq_of_token] + offset
        x["positions"][:num_tokens] = positions

        rows = self.running_rows.rows(requests)
        tables = self.running_rows.table[rows]  # [num_seqs, max_blocks]
        x["block_tables"][:num_seqs] = tables
        blocks = tables[seq_of_token, positions // self.block_size]
        x["slot_mapping"][:num_tokens] = blocks * self.block_size + positions % self.block_size
        x["seq_lens"][:num_seqs] = computed_after
        x["logits_indices"][:num_seqs] = qsl[1 : num_seqs + 1] - 1

        num_copies = len(plan.copies)
        x["copy_src"][:num_copies] = [copy.src for copy in plan.copies]
        x["copy_dst"][:num_copies] = [copy.dst for copy in plan.copies]

        self._fill_token_ids(x, requests, start, num_new, qsl)
        uses_lora = False
        if "lora_slots" in x:
            lora_slots = self.running_rows.lora_slot[rows]
            x["lora_slots"][:num_tokens] = lora_slots[seq_of_token]
            uses_lora = bool((lora_slots >= 0).any())
        prompt_logprobs = plan_rows(requests, start, num_new, qsl, slot.prompt_logprobs)
        embeds = slot.prompt_embeds
        embed_rows = (
            None if embeds is None else plan_embed_rows(requests, start, num_new, qsl, embeds)
        )
        num_outputs = np.fromiter((r.num_output_tokens for r in requests), np.int64, num_seqs)
        samples = computed_after == self.running_rows.prompt_len[rows] + num_outputs
        pooled = np.flatnonzero(self.running_rows.pooled[rows] & samples)
        pooling = plan_pooled_rows(requests, pooled, qsl, slot.pooling) if len(pooled) else None
        use_filters, num_top_logprobs = self._fill_sampling(x, requests, rows, num_outputs)
        token_logprobs = (  # only steps with logprobs may have rows that name ids
            plan_token_rows(requests, slot.token_logprobs) if num_top_logprobs is not None else None
        )
        use_penalties = bool(self.running_rows.needs_penalties[rows].any())
        if use_penalties:
            self._fill_penalties(x, rows, seq_of_token, positions, computed_after)
        if graph_size is not None:
            fill_padding(x, num_seqs, graph_size)
            if use_penalties:
                penalties.fill_padding(x, num_seqs, graph_size, graph_size)
        if token_bucket is not None:
            fill_token_padding(x, num_tokens, token_bucket)
        # decode attention starts the longest contexts first: all rows of a decode step, or the
        # one-token rows that lead a mixed step (those go to the decode kernel too)
        decodes = graph_size or num_seqs if num_tokens == num_seqs else int(np.argmax(num_new != 1))
        x["seq_order"][:decodes] = np.argsort(-x["seq_lens"][:decodes], kind="stable")
        num_groups = 0
        if self.shared_group_rows:
            real = min(decodes, num_seqs)
            copies = None
            if self.publication is not None:
                copied = self.running_rows.copy_index[rows[:real]]
                if (copied >= 0).any():
                    publication = self.running_rows.copy_publication[rows[:real]]
                    copies = CopiedBlocks(copied, publication, self.publication)
            num_groups = group_shared_prefixes(
                tables[:real], computed_after[:real], self.block_size, self.shared_group_rows, x,
                copies,
            )  # fmt: skip
            x["prefix_lens"][real:decodes] = 0
        # rows that sample under a constraint (a planned request is never finished)
        mask_rows = np.flatnonzero(self.running_rows.constrained[rows] & samples).tolist()
        return StepBatch(
            step=step,
            slot=slot,
            requests=requests,
            samples=samples,
            num_tokens=num_tokens,
            num_seqs_padded=graph_size or num_seqs,
            decode_only=num_tokens == num_seqs,
            use_filters=use_filters,
            num_top_logprobs=num_top_logprobs,
            seq_lens=computed_after.tolist(),
            query_start_loc=qsl[: num_seqs + 1].tolist(),
            graphed=graph_size is not None,
            token_bucket=token_bucket,
            num_copies=num_copies,
            num_shared_groups=num_groups,
            shared_kv_tokens=shared_kv_tokens(x, num_groups),
            use_penalties=use_penalties,
            penalty_admissions=self.running_rows.take_admitted(),
            adapter_loads=plan.adapter_loads,
            uses_lora=uses_lora,
            prompt_logprobs=prompt_logprobs,
            pooling=pooling,
            token_logprobs=token_logprobs,
            prompt_embeds=embed_rows,
            mask_rows=mask_rows,
            host_rows=list(range(num_seqs)) if self.processors_read_outputs else mask_rows,
            custom_logits=self.custom_logits,
        )

    def _fill_token_ids(self, x, requests: list[Request], start, num_new, qsl) -> None:
        """Known tokens are copied; a token still in flight is 0 plus its row in the previous output."""
        num_tokens = int(qsl[len(requests)])
        ids, carry = x["input_ids"], x["carry_index"]
        carry[:num_tokens] = -1
        for i, request in enumerate(requests):
            first = int(qsl[i])
            if request.num_pending_tokens:
                assert num_new[i] == 1, (
                    "a request with a token in flight computes exactly that token"
                )
                ids[first] = 0
                carry[first] = request.pending_row
            else:
                ids[first : first + num_new[i]] = request.tokens(
                    int(start[i]), int(start[i] + num_new[i])
                )

    def _fill_penalties(self, x, rows: np.ndarray, seq_of_token, positions, computed_after) -> None:
        kept = self.running_rows
        state_rows = np.where(kept.needs_penalties[rows], rows, len(kept.needs_penalties))
        gathered = (
            kept.presence_penalty[rows],
            kept.frequency_penalty[rows],
            kept.repetition_penalty[rows],
        )
        penalties.fill_step_inputs(
            x, state_rows, seq_of_token, positions, kept.prompt_len[rows], computed_after, gathered
        )

    def _fill_sampling(
        self, x, requests: list[Request], rows: np.ndarray, num_outputs: np.ndarray
    ) -> tuple[bool, int | None]:
        n, kept = len(requests), self.running_rows
        x["temperature"][:n] = kept.temperature[rows]
        x["top_k"][:n] = kept.top_k[rows]
        x["top_p"][:n] = kept.top_p[rows]
        x["min_p"][:n] = kept.min_p[rows]
        x["seeds"][:n] = kept.seed[rows]
        x["sample_positions"][:n] = num_outputs
        x["ban_rows"][:n] = 0
        bans = False
        for i in np.flatnonzero(num_outputs < kept.min_tokens[rows]).tolist():
            params = requests[i].params
            banned = (*self.eos_ids, *params.stop_token_ids)  # EOS under ignore_eos too, as vLLM
            if not banned:
                continue
            assert len(banned) <= MAX_BANNED_IDS
            x["banned_ids"][i, :] = banned[0]
            x["banned_ids"][i, : len(banned)] = banned
            x["ban_rows"][i] = 1
            bans = True
        most_logprobs = int(kept.logprobs[rows].max(initial=-1))
        use_filters = bans or bool(kept.needs_filter[rows].any())
        return use_filters, (most_logprobs if most_logprobs >= 0 else None)


class StepFailed(RuntimeError):
    """A step's sampling raised (a custom logits processor's error, its `__cause__`): the step
    was abandoned and its requests (`failed`) aborted; the engine serves on. `updated`: what
    the steps read back before it updated, which the caller still hands on."""

    def __init__(self, error: Exception, failed: list[Request]):
        super().__init__(f"a step's sampling failed and its requests were aborted: {error!r}")
        self.failed = failed
        self.updated: list[Request] = []
