"""A generation request as the scheduler and the engine see it."""

from __future__ import annotations

import enum
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tandem.inputs import check_keys
from tandem.sampling import SamplingParams

if TYPE_CHECKING:
    import numpy as np
    import torch
    import xgrammar

    from tandem.lora.request import LoRARequest
    from tandem.pooling import PoolingParams
    from tandem.tokenizer import IncrementalDetokenizer, Tokenizer


# text, {"prompt": text}, {"prompt_token_ids": [...]} or {"prompt_embeds": tensor}; a dict may
# add {"cache_salt": str} (inputs.py: vLLM's TextPrompt, TokensPrompt and EmbedsPrompt)
Prompt = str | dict[str, Any]


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted with its KV in host memory (swap.py)
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int | None  # the sampling seed: params.seed, or drawn by the engine when queued
    prompt: str | None = None
    cache_salt: str | None = None  # shares cached blocks only with requests of this salt
    # a prompt given as embeddings (prompt_embeds.py): [prompt tokens, hidden] on the CPU, in
    # the model dtype (its prompt_token_ids are placeholders), and its prefix-cache key
    prompt_embeds: torch.Tensor | None = None
    embeds_key: bytes = b""
    lora_request: LoRARequest | None = None  # its adapter (lora/); None: the base model
    lora_slot: int = -1  # while running, the device slot of its adapter (-1: none)
    # vLLM's: under scheduling_policy "priority", lower values are served first, then earlier
    # arrivals (its place in the order requests were queued: Scheduler.add)
    priority: int = 0
    arrival: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop", "length" or "abort"
    # what stopped it, as vLLM says: the stop string or the stop_token_ids id (EOS: None)
    stop_reason: int | str | None = None
    # Tokens whose KV is in the cache or being written by a step already launched.
    num_computed_tokens: int = 0
    # Sampled by a launched step, not yet read back (async batching: at most one).
    num_pending_tokens: int = 0
    # Row of this request in the previous step's sampled ids (the carry-over source).
    pending_row: int = -1
    block_table: list[int] = field(default_factory=list)
    output_text: str = ""
    detokenizer: IncrementalDetokenizer | None = None  # kept only when text is needed per token
    logprobs: list[dict[int, float]] | None = None  # [] from the start with params.logprobs
    sampled_ranks: list[int] = field(default_factory=list)  # each output token's, with logprobs
    # with params.prompt_logprobs: one entry per prompt position, None for the first (and for
    # positions not computed yet); prompt_logprobs_end is 1 + the last position filled
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_ranks: list[int | None] | None = None  # each prompt token's rank, beside its entry
    prompt_logprobs_end: int = 1
    # a pooling request (pooling.py): its params, and its output once its prompt is computed
    # (the embedding, or a classifier's probabilities)
    pooling: PoolingParams | None = None
    pooled: list[float] | None = None
    num_preemptions: int = 0
    # prefix caching: the keys of its full blocks so far, how many of its blocks are published,
    # and the prompt tokens its first admission found cached
    block_keys: list[bytes] = field(default_factory=list)
    num_published_blocks: int = 0
    # False: its KV predates a weight update, here or on the host, and is never published (until
    # it is recomputed)
    publishes: bool = True
    num_cached_tokens: int | None = None
    # vLLM's: once its prompt is computed, the prompt tokens its published blocks hold past
    # those it found cached (what it wrote into the prefix cache)
    num_cache_creation_tokens: int | None = None
    scheduled_time: float | None = None  # time.perf_counter() at its first admission
    # (index, publication) where its admission copied a cached block on write: the block at
    # that index of its table holds that publication's first block_size - 1 slots
    copied_block: tuple[int, int] | None = None
    bad_words_token_ids: list[list[int]] = field(
        default_factory=list
    )  # params.bad_words, tokenized
    # params.structured_outputs' matcher (structured.py), advanced by every output token read
    matcher: xgrammar.GrammarMatcher | None = None
    token_filter: np.ndarray | None = None  # [ceil(vocab / 32)] int32, ANDed into its masks
    # while set, the request thinks (reasoning.py): its grammar waits for this token, </think>
    reasoning_end_id: int | None = None
    thinking_left: int | None = None  # thinking_token_budget's rest: at 0, </think> is forced

    @property
    def given_prompt_ids(self) -> list[int]:
        """The prompt's ids as outputs report them: none for a prompt of embeddings."""
        return [] if self.prompt_embeds is not None else self.prompt_token_ids

    @property
    def masked(self) -> bool:
        """Its rows sample under token masks from the host: a grammar, or a thinking budget."""
        return self.matcher is not None or self.thinking_left is not None

    def __post_init__(self) -> None:
        if self.params.logprobs is not None:  # a request aborted before its first token has []
            self.logprobs = []
        if self.wants_prompt_logprobs:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)
            self.prompt_ranks = [None] * len(self.prompt_token_ids)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Every prompt position must be computed by the model, so such a request takes no
        blocks from the prefix cache (their positions would have no logprobs)."""
        return self.params.prompt_logprobs is not None

    @property
    def prompt_logprobs_done(self) -> bool:
        return self.prompt_logprobs_end >= len(self.prompt_token_ids)

    # while swapped: the host block holding each block of its table (swap.py)
    host_blocks: list[int] = field(default_factory=list)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Known tokens plus those sampled but not yet read back."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids) + self.num_pending_tokens

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def tokens(self, start: int, end: int) -> list[int]:
        """Known tokens [start, end) of prompt + outputs, without copying the whole sequence."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]


def check_request_types(request_id: Any, params: Any) -> None:
    """Raise a TypeError unless `request_id` is a string and `params` a SamplingParams (whose
    fields `params.validate()` checks)."""
    if not isinstance(request_id, str):
        raise TypeError(f"request_id must be a string, got {type(request_id).__name__}")
    if not isinstance(params, SamplingParams):
        raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")


def split_prompt(prompt: Prompt) -> tuple[str | None, list[int] | None]:
    """(text, token ids) of a prompt in any of vLLM's three forms; one of the two may be None.
    (A prompt of embeddings, {"prompt_embeds": tensor}, has neither: `prompt_embeds`.)"""
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, list | tuple) and _token_ids(prompt):  # vLLM takes [ids] as one
        return None, list(prompt)
    if isinstance(prompt, dict) and "prompt_embeds" in prompt:  # beside them, nothing else
        check_keys(prompt)
        return prompt.get("prompt"), prompt.get("prompt_token_ids")
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        check_keys(prompt)
        return prompt.get("prompt"), prompt["prompt_token_ids"]
    if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
        check_keys(prompt)
        return prompt["prompt"], None
    raise ValueError(
        "a prompt is a string, a list of token ids, {'prompt': text} or "
        f"{{'prompt_token_ids': [...]}}, got {prompt!r:.80}"
    )


def without_special_tokens(prompt: Prompt, tokenizer: Tokenizer | None) -> Prompt:
    """A text prompt as its token ids without the tokenizer's special tokens (vLLM's
    add_special_tokens=False), its text kept for the outputs; any other prompt, or any prompt
    where there is no tokenizer (the engine's error then), as given."""
    # e.g. "Hi" -> {"prompt": "Hi", "prompt_token_ids": [13347]} (no BOS)
    text, ids = split_prompt(prompt)
    if text is None or ids is not None or tokenizer is None:
        return prompt
    fields = prompt if isinstance(prompt, dict) else {"prompt": text}
    return {**fields, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}


def _token_ids(prompt: Sequence) -> bool:
    """Whether a list is one prompt's token ids (ints; the engine checks their range)."""
    return bool(prompt) and all(
        isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in prompt
    )


def prompt_list(prompts: Prompt | Sequence[Prompt]) -> Sequence[Prompt]:
    """The prompts of a call as a list: one prompt (a string, a dict, a list of token ids, or
    anything that is not a sequence, such as bytes, which `split_prompt` then refuses by name)
    becomes a list of one."""
    if isinstance(prompts, str | bytes | dict) or not isinstance(prompts, Sequence):
        return [prompts]
    if isinstance(prompts, list | tuple) and _token_ids(prompts):  # one prompt of token ids
        return [prompts]
    return prompts


def prompt_embeds(prompt: Prompt) -> Any:
    """A prompt dict's "prompt_embeds" as given (the engine checks it), else None."""
    return prompt.get("prompt_embeds") if isinstance(prompt, dict) else None


def prompt_cache_salt(prompt: Prompt) -> Any:
    """A prompt dict's "cache_salt" as given (the engine checks it), else None."""
    return prompt.get("cache_salt") if isinstance(prompt, dict) else None
