"""What generation returns, shaped like vLLM's outputs, and the AsyncLLM stream's fold into them:

StreamOutput deltas of sample k ──OutputCollector.add──> samples[k]
OutputCollector.take ──> RequestOutput per SamplingParams.output_kind
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Generic, TypeVar, overload

from tandem.sampling import RequestOutputKind, SamplingParams
from tandem.tokenizer import Tokenizer

if TYPE_CHECKING:
    import torch

    from tandem.async_llm import StreamOutput
    from tandem.lora.request import LoRARequest


Pooled = TypeVar("Pooled")  # a pooling request's output: PoolingOutput, EmbeddingOutput, ...


class Logprob(float):
    """A token's logprob, a float that also reads as vLLM's Logprob: `.logprob`, `.rank` (the
    tokens at least as likely, itself included: 1 for the most likely) and `.decoded_token` (the
    token's text alone; None with detokenize=False)."""

    __slots__ = ("decoded_token", "rank")

    def __new__(
        cls, logprob: float, rank: int | None = None, decoded_token: str | None = None
    ) -> Logprob:
        self = float.__new__(cls, logprob)  # not super(): this runs once per entry
        self.rank = rank
        self.decoded_token = decoded_token
        return self

    @property
    def logprob(self) -> float:
        return float(self)

    def __repr__(self) -> str:
        return (
            f"Logprob(logprob={float(self)!r}, rank={self.rank!r}, "
            f"decoded_token={self.decoded_token!r})"
        )


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None  # the sum of logprobs' sampled entries; None without them
    # per output token: the sampled token, then the top `logprobs` ids in rank order (vLLM's)
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop string or stop token id; None for EOS
    lora_request: LoRARequest | None = None  # the LoRA adapter it ran under

    def finished(self) -> bool:
        """vLLM's: whether this sample has ended (it has a finish reason)."""
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """vLLM's, its fields in vLLM's order (code that builds one positionally reads the same)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    # with SamplingParams.prompt_logprobs: per prompt position, None for the first
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool = True
    metrics: RequestStateStats | None = None  # AsyncLLM's (vLLM's); None offline, as vLLM's
    lora_request: LoRARequest | None = None  # the LoRA adapter it ran under
    encoder_prompt: str | None = None  # a decoder-only model's: None
    encoder_prompt_token_ids: list[int] | None = None
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    num_cache_creation_tokens: int = 0  # prompt tokens it wrote into the prefix cache
    kv_transfer_params: dict[str, Any] | None = None  # no KV moves between engines: None


@dataclass
class PoolingOutput:
    data: torch.Tensor | None  # float32: an embedding, or class probabilities; None if aborted


@dataclass
class PoolingRequestOutput(Generic[Pooled]):
    """vLLM's output of a pooling call (`LLM.encode`: a PoolingOutput) for one prompt; the
    subclasses below are those of `embed`, `classify` and `score` (one per pair, its prompt the
    pair's: two embedded texts' ids, a pad token between them)."""

    request_id: str
    outputs: Pooled
    prompt_token_ids: list[int]
    num_cached_tokens: int = 0  # vLLM's order: before finished
    finished: bool = True


@dataclass
class EmbeddingOutput:
    # L2-normalized unless the request's PoolingParams say not; None if it was aborted
    embedding: list[float] | None

    @property
    def hidden_size(self) -> int:
        return len(self.embedding or ())


@dataclass
class EmbeddingRequestOutput(PoolingRequestOutput[EmbeddingOutput]):
    """vLLM's output of `LLM.embed`: one prompt's vector."""


@dataclass
class ClassificationOutput:
    probs: list[float] | None  # softmax (one label: sigmoid) unless use_activation=False

    @property
    def num_classes(self) -> int:
        return len(self.probs or ())


@dataclass
class ClassificationRequestOutput(PoolingRequestOutput[ClassificationOutput]):
    """vLLM's output of `LLM.classify`: one prompt's class probabilities."""


@dataclass
class ScoringOutput:
    score: float | None  # see scoring.py; None if it was aborted


@dataclass
class ScoringRequestOutput(PoolingRequestOutput[ScoringOutput]):
    """vLLM's output of `LLM.score`: one pair's score."""


TokenText = Callable[[int], str | None]


def token_text(tokenizer: Tokenizer | None) -> TokenText:
    """A token's text alone, as vLLM decodes a logprob's token (special tokens kept)."""
    if tokenizer is None:
        return no_text
    return functools.cache(lambda token_id: tokenizer.decode([token_id], skip_special_tokens=False))


def no_text(token_id: int) -> None:
    return None


def cumulative_logprob(
    entries: list[dict[int, float]], token_ids: list[int], start: float = 0
) -> float:
    """`start` plus the sampled tokens' logprobs, added in order (so deltas sum as the whole)."""
    return sum((entry[t] for entry, t in zip(entries, token_ids, strict=True)), start)


def sample_logprobs(
    entries: list[dict[int, float]],
    token_ids: list[int],
    ranks: list[int],
    num_top: int,
    text: TokenText,
    flat: bool = False,
) -> SampleLogprobs:
    """Each output position's entry with its Logprob objects; `flat`: as one FlatLogprobs."""
    return _built(entries, token_ids, ranks, num_top, text, flat)


def prompt_logprobs(
    entries: list[dict[int, float] | None],
    token_ids: list[int],
    ranks: list[int | None],
    num_top: int,
    text: TokenText,
    flat: bool = False,
) -> PromptLogprobs:
    """As `sample_logprobs`, with None for the first prompt position."""
    return _built(entries, token_ids, ranks, num_top, text, flat)


def _built(entries, token_ids, ranks, num_top, text, flat):
    entries_and_tokens = zip(entries, token_ids, ranks, strict=True)
    if flat:
        out = FlatLogprobs()
        for entry, token, rank in entries_and_tokens:
            out.add_entry(entry, num_top, token, rank, text)
        return out
    return [
        None if entry is None else _logprobs(entry, num_top, token, rank, text)
        for entry, token, rank in entries_and_tokens
    ]


def _logprobs(
    entry: dict[int, float],
    num_top: int,
    token: int,
    token_rank: int | None,
    text: TokenText,
) -> dict[int, Logprob]:
    """An entry's ids are the top `num_top` in rank order, then `token` unless among them; the
    token's own rank is `token_rank` where known. As vLLM's: `token` first, then the others in
    rank order."""
    out = {token: None}
    for rank, (t, value) in enumerate(entry.items(), 1):  # a loop: it runs once per prompt token
        out[t] = Logprob(value, rank if rank <= num_top else None, text(t))
    if token_rank is not None:
        out[token].rank = token_rank
    return out


@dataclass
class FlatLogprobs(Sequence):
    """A request's logprobs in vLLM's flat form (`SamplingParams.flat_logprobs`): position p's
    ids, values, ranks and texts are items start_indices[p]:end_indices[p] of six flat lists,
    and indexing p builds its {id: Logprob} then (None for a position without an entry: a
    prompt's first). The garbage collector walks the six lists, where list[dict[int, Logprob]]
    gives it a dict and a Logprob per entry (a rollout's 131k: full collections of 40-200 ms)."""

    start_indices: list[int] = field(default_factory=list)
    end_indices: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    ranks: list[int | None] = field(default_factory=list)
    decoded_tokens: list[str | None] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.start_indices)

    @overload
    def __getitem__(self, index: int) -> dict[int, Logprob] | None: ...
    @overload
    def __getitem__(self, index: slice) -> FlatLogprobs: ...
    def __getitem__(self, index):
        if isinstance(index, slice):
            out = FlatLogprobs()
            for p in range(*index.indices(len(self))):
                out.append(self[p])
            return out
        start, end = self.start_indices[index], self.end_indices[index]
        if start == end:
            return None
        columns = (self.token_ids, self.logprobs, self.ranks, self.decoded_tokens)
        t, value, rank, text = (column[start:end] for column in columns)
        return {i: Logprob(v, r, d) for i, v, r, d in zip(t, value, rank, text, strict=True)}

    def append(self, entry: dict[int, Logprob] | None) -> None:
        """One more position: an entry as the list form holds it, or None."""
        self.start_indices.append(len(self.token_ids))
        for token_id, logprob in (entry or {}).items():
            self.token_ids.append(token_id)
            self.logprobs.append(float(logprob))
            self.ranks.append(logprob.rank)
            self.decoded_tokens.append(logprob.decoded_token)
        self.end_indices.append(len(self.token_ids))

    def add_entry(
        self,
        entry: dict[int, float] | None,
        num_top: int,
        token: int,
        token_rank: int | None,
        text: TokenText,
    ) -> None:
        """One more position from the engine's entry, ranked and ordered as `_logprobs` ranks
        and orders it (`token` first)."""
        self.start_indices.append(len(self.token_ids))
        if not entry:  # a position without one (a prompt's first)
            self.end_indices.append(len(self.token_ids))
            return
        first = len(self.token_ids)  # the token's place, filled when the loop meets it
        self.token_ids.append(token)
        self.logprobs.append(0.0)
        self.ranks.append(None)
        self.decoded_tokens.append(None)
        for rank, (t, value) in enumerate(entry.items(), 1):
            own_rank = rank if rank <= num_top else None
            if t == token:
                self.logprobs[first] = value
                self.ranks[first] = own_rank if token_rank is None else token_rank
                self.decoded_tokens[first] = text(t)
            else:
                self.token_ids.append(t)
                self.logprobs.append(value)
                self.ranks.append(own_rank)
                self.decoded_tokens.append(text(t))
        self.end_indices.append(len(self.token_ids))

    def __iadd__(self, other: Iterable[dict[int, Logprob] | None]) -> FlatLogprobs:
        if not isinstance(other, FlatLogprobs):
            for entry in other:
                self.append(entry)
            return self
        shift = len(self.token_ids)
        self.start_indices += [i + shift for i in other.start_indices]
        self.end_indices += [i + shift for i in other.end_indices]
        for name in ("token_ids", "logprobs", "ranks", "decoded_tokens"):
            getattr(self, name).extend(getattr(other, name))
        return self

    def __add__(self, other: Iterable[dict[int, Logprob] | None]) -> FlatLogprobs:
        out = self.copy()
        out += other
        return out

    def copy(self) -> FlatLogprobs:
        return FlatLogprobs(*(list(getattr(self, f.name)) for f in fields(self)))


# what CompletionOutput.logprobs and RequestOutput.prompt_logprobs hold (vLLM's names)
SampleLogprobs = list[dict[int, Logprob]] | FlatLogprobs
PromptLogprobs = list[dict[int, Logprob] | None] | FlatLogprobs


@dataclass
class _Sample:
    """One sample's output as the next RequestOutput carries it: all of it so far, or (DELTA)
    what came since the last one."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestStateStats:
    """vLLM's `RequestOutput.metrics` of an AsyncLLM request, one object updated as its outputs
    come (every output of the request carries it): the wall-clock arrival, and on the engine's
    clock (time.perf_counter() seconds) when it was queued, first admitted and got its first
    and latest tokens; `first_token_latency` from queued to the first token."""

    num_generation_tokens: int = 0  # over its n samples
    arrival_time: float = 0.0  # time.time()
    queued_ts: float = 0.0
    scheduled_ts: float = 0.0
    first_token_ts: float = 0.0
    last_token_ts: float = 0.0
    first_token_latency: float = 0.0
    is_corrupted: bool = False  # vLLM's NaN-logits flag: tandem's sampler never sees NaN


class OutputCollector:
    """Folds the StreamOutputs of one request's n samples into vLLM's RequestOutputs, as
    `params.output_kind` says: each carries the samples that changed since the last one, whole
    so far (CUMULATIVE) or only what is new (DELTA); FINAL_ONLY gives one, every sample, at the
    end. Request-wide fields (num_cached_tokens, prompt_logprobs) are sample 0's."""

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        params: SamplingParams,
        text: TokenText,
        lora_request: LoRARequest | None = None,
        stats: RequestStateStats | None = None,
    ):
        self.request_id = request_id
        self.prompt = prompt
        self.lora_request = lora_request
        self.stats = stats  # updated from the outputs' times, where given
        self.kind = params.output_kind
        self.num_top, self.num_prompt_top = params.num_top_logprobs, params.prompt_logprobs
        self.text = text if params.detokenize else no_text
        self.flat = params.flat_logprobs
        with_logprobs = params.logprobs is not None
        self.samples = [
            _Sample(
                logprobs=(FlatLogprobs() if self.flat else []) if with_logprobs else None,
                cumulative_logprob=0 if with_logprobs else None,
            )
            for _ in range(params.n)
        ]
        self.changed: set[int] = set()  # samples with outputs since the last RequestOutput
        self.num_unfinished = params.n
        self.prompt_token_ids: list[int] = []
        self.num_cached_tokens = 0
        self.num_cache_creation_tokens = 0
        self.prompt_logprobs: PromptLogprobs | None = None

    @property
    def finished(self) -> bool:
        return self.num_unfinished == 0

    def add(self, index: int, output: StreamOutput) -> None:
        """Take in what sample `index` gained in one step."""
        if output.prompt_token_ids is not None:  # a sample's first output
            self.prompt_token_ids = output.prompt_token_ids
        if index == 0:
            self.num_cached_tokens = output.num_cached_tokens
            self.num_cache_creation_tokens = output.num_cache_creation_tokens
            if output.prompt_logprobs is not None:
                self.prompt_logprobs = prompt_logprobs(
                    output.prompt_logprobs,
                    self.prompt_token_ids,
                    output.prompt_ranks,
                    self.num_prompt_top,
                    self.text,
                    self.flat,
                )
        if self.stats is not None:
            self._timed(output)
        sample = self.samples[index]
        sample.text += output.text
        sample.token_ids += output.token_ids
        if sample.logprobs is not None:
            sample.logprobs += sample_logprobs(
                output.logprobs, output.token_ids, output.sampled_ranks, self.num_top, self.text,
                self.flat,
            )  # fmt: skip
            sample.cumulative_logprob = cumulative_logprob(
                output.logprobs, output.token_ids, sample.cumulative_logprob
            )
        if output.finished:
            sample.finish_reason, sample.stop_reason = output.finish_reason, output.stop_reason
            self.num_unfinished -= 1
        self.changed.add(index)

    def _timed(self, output: StreamOutput) -> None:
        stats = self.stats
        if output.scheduled_time is not None and not stats.scheduled_ts:
            stats.scheduled_ts = output.scheduled_time
        if output.token_ids:
            if not stats.first_token_ts:
                stats.first_token_ts = output.time
                stats.first_token_latency = output.time - stats.queued_ts
            stats.last_token_ts = max(stats.last_token_ts, output.time)
            stats.num_generation_tokens += len(output.token_ids)

    def take(self) -> RequestOutput | None:
        """The RequestOutput of what was added since the last one; None while FINAL_ONLY waits."""
        if self.kind is RequestOutputKind.FINAL_ONLY and not self.finished:
            return None
        final_only = self.kind is RequestOutputKind.FINAL_ONLY
        indexes = range(len(self.samples)) if final_only else sorted(self.changed)
        self.changed.clear()
        output = RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[self._completion(k) for k in indexes],
            finished=self.finished,
            num_cached_tokens=self.num_cached_tokens,
            num_cache_creation_tokens=self.num_cache_creation_tokens,
            prompt_logprobs=self.prompt_logprobs,
            lora_request=self.lora_request,
            metrics=self.stats,
        )
        if self.kind is RequestOutputKind.DELTA:  # sent once
            self.prompt_logprobs = None
        return output

    def _completion(self, index: int) -> CompletionOutput:
        sample = self.samples[index]
        completion = CompletionOutput(
            index=index,
            text=sample.text,
            token_ids=sample.token_ids,
            cumulative_logprob=sample.cumulative_logprob,
            logprobs=sample.logprobs,
            finish_reason=sample.finish_reason,
            stop_reason=sample.stop_reason,
            lora_request=self.lora_request,
        )
        if self.kind is RequestOutputKind.DELTA:  # the next one starts empty
            sample.text, sample.token_ids = "", []
            sample.logprobs = None if sample.logprobs is None else type(sample.logprobs)()
        else:  # the sample grows on: this output keeps what it has now
            completion.token_ids = list(sample.token_ids)
            completion.logprobs = None if sample.logprobs is None else sample.logprobs.copy()
        return completion
