"""What generation returns, shaped like vLLM's outputs."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from tandem.tokenizer import Tokenizer


class Logprob(float):
    """A token's logprob, a float that also reads as vLLM's Logprob: `.logprob`, `.rank` (1 for
    the most likely token; None for a prompt token outside the top k, whose rank is not computed)
    and `.decoded_token` (the token's text alone; None with detokenize=False)."""

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
    # per output token: the top `logprobs` ids in rank order, then the sampled token
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop string or stop token id; None for EOS


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    # with SamplingParams.prompt_logprobs: per prompt position, None for the first
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


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
) -> list[dict[int, Logprob]]:
    entries_and_tokens = zip(entries, token_ids, ranks, strict=True)
    return [
        _logprobs(entry, num_top, token, rank, text) for entry, token, rank in entries_and_tokens
    ]


def prompt_logprobs(
    entries: list[dict[int, float] | None], token_ids: list[int], num_top: int, text: TokenText
) -> list[dict[int, Logprob] | None]:
    return [
        None if entry is None else _logprobs(entry, num_top, token, None, text)
        for entry, token in zip(entries, token_ids, strict=True)
    ]


def _logprobs(
    entry: dict[int, float],
    num_top: int,
    token: int,
    token_rank: int | None,
    text: TokenText,
) -> dict[int, Logprob]:
    """An entry's ids are the top `num_top` in rank order, then `token` unless among them; the
    token's own rank is `token_rank` where known."""
    out = {}
    for rank, (t, value) in enumerate(entry.items(), 1):  # a loop: it runs once per prompt token
        out[t] = Logprob(value, rank if rank <= num_top else None, text(t))
    if token_rank is not None:
        out[token].rank = token_rank
    return out
