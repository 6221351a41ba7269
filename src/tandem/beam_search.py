"""Beam search, as vLLM's `LLM.beam_search` runs it: one token a round for every live beam.

Each round generates one token for every live beam of the prompts in flight, with the top
2 x beam_width logprobs (the model's own distribution), extends each beam by each of those
tokens, and keeps the beam_width best by cumulative logprob. A beam that reaches an
end-of-sequence token, or the context length, is complete; after max_tokens rounds the live
beams join the complete ones, and the beam_width best of those by score (cumulative logprob /
length ** length_penalty, an EOS not counted in the length) are the answer. The beams of a
prompt share its blocks in the prefix cache, so a round computes about one token per beam.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from tandem.config import check_bools, check_int
from tandem.lora.request import LoRARequest, per_prompt
from tandem.outputs import Logprob
from tandem.request import Prompt, prompt_list, split_prompt
from tandem.sampling import MAX_TEMPERATURE, SamplingParams

if TYPE_CHECKING:
    from tandem.llm import LLM


@dataclass
class BeamSearchParams:
    """vLLM's fields."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0  # each round's sampled token joins its top 2 x beam_width
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False  # taken for vLLM's signature: no stop strings here
    structured_outputs: Any = None

    def validate(self) -> None:
        check_int("beam_width", self.beam_width, 1)
        check_int("max_tokens", self.max_tokens, 1)
        if self.structured_outputs is not None:
            raise ValueError("beam search does not take structured_outputs here; use generate")
        for name in ("temperature", "length_penalty"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise ValueError(f"{name} must be a number, got {value!r}")
            if not math.isfinite(value):  # a NaN score would rank the beams at random
                raise ValueError(f"{name} must be finite, got {value!r}")
        if not 0 <= self.temperature <= MAX_TEMPERATURE:  # SamplingParams' (vLLM's) bound
            raise ValueError(
                f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}"
            )
        check_bools(self, "ignore_eos", "include_stop_str_in_output")  # "no" would be true


@dataclass
class BeamSearchSequence:
    """A beam: the prompt's tokens and its own, each of its tokens' logprobs (the round's top
    ones), and their sum."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None  # the whole sequence's, prompt included (vLLM's)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """A prompt's best beams, best first (at most beam_width)."""

    sequences: list[BeamSearchSequence]


def score(beam: BeamSearchSequence, eos_token_ids: tuple[int, ...], length_penalty: float) -> float:
    """Cumulative logprob over the length (the whole sequence's, less a final EOS) to the
    power length_penalty, as transformers' and vLLM's beam scorers."""
    length = len(beam.tokens) - (beam.tokens[-1] in eos_token_ids)
    return beam.cum_logprob / length**length_penalty


def beam_search(
    llm: LLM,
    prompts: Sequence[Prompt],
    params: BeamSearchParams,
    use_tqdm: bool = False,
    concurrency_limit: int | None = None,
    lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
) -> list[BeamSearchOutput]:
    """The prompts' best beams; `concurrency_limit` prompts searched at a time (all: None);
    `lora_request` as `LLM.generate` takes it, each prompt's beams under its adapter."""
    if not isinstance(params, BeamSearchParams):
        raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}")
    prompts = prompt_list(prompts)
    if concurrency_limit is not None:
        check_int("concurrency_limit", concurrency_limit, 1)
    engine = llm.engine
    starts = [_prompt_tokens(engine.tokenizer, prompt) for prompt in prompts]
    loras = per_prompt(lora_request, len(starts))
    size = concurrency_limit or max(len(starts), 1)
    searches = [  # every prompt checked before any is searched
        BeamSearch(starts[first : first + size], params, engine, first, loras[first : first + size])
        for first in range(0, len(starts), size)
    ]
    outputs = []
    for search in searches:
        for _ in tqdm(range(params.max_tokens), desc="beam search", disable=not use_tqdm):
            if not (beams := search.next_round()):
                break
            prompts = [{"prompt_token_ids": tokens} for tokens in beams]
            answers = llm.generate(prompts, search.round_params, False, search.round_loras())
            search.advance([answer.outputs[0].logprobs[0] for answer in answers])
        outputs += search.best(engine.tokenizer)
    return outputs


class BeamSearch:
    """The search of a few prompts, a round at a time: `next_round` gives every live beam's
    tokens, each to be generated one token with `round_params`; `advance` takes each one's top
    logprobs, in that order. The driver (LLM.beam_search, the server's) runs the rounds."""

    def __init__(
        self,
        starts: list[list[int]],
        params: BeamSearchParams,
        engine: Any,
        first: int = 0,
        loras: list[LoRARequest | None] | None = None,
    ):
        params.validate()
        if 2 * params.beam_width > engine.logprobs_width:
            raise ValueError(
                f"beam_width must be at most {engine.logprobs_width // 2} (each round reads the "
                f"top 2 x beam_width logprobs, at most max_logprobs={engine.logprobs_width}: an "
                f"engine argument), got {params.beam_width}"
            )
        for index, tokens in enumerate(starts, first):
            if not tokens:
                raise ValueError(f"prompts[{index}] has no tokens")
            if len(tokens) >= engine.max_model_len:
                raise ValueError(
                    f"prompts[{index}] has {len(tokens)} tokens; max_model_len="
                    f"{engine.max_model_len} leaves none to generate"
                )
        self.params, self.limit = params, engine.max_model_len
        self.eos_token_ids = engine.eos_token_ids
        self.ends = () if params.ignore_eos else engine.eos_token_ids  # what completes a beam
        self.round_params = SamplingParams(
            max_tokens=1, logprobs=2 * params.beam_width, temperature=params.temperature
        )
        loras = loras or [None] * len(starts)
        self.searches = [_Search(tokens, lora) for tokens, lora in zip(starts, loras, strict=True)]

    def key(self, beam: BeamSearchSequence) -> float:
        return score(beam, self.eos_token_ids, self.params.length_penalty)

    def next_round(self) -> list[list[int]]:
        """Every live beam's tokens (none: the search is over); a beam the context cannot
        extend is complete first."""
        for search in self.searches:
            for beam in search.beams:
                if len(beam.tokens) >= self.limit:
                    beam.finish_reason = "length"
                    search.complete.append(beam)
            search.beams = [b for b in search.beams if len(b.tokens) < self.limit]
        return [beam.tokens for search in self.searches for beam in search.beams]

    def round_loras(self) -> list[LoRARequest | None]:
        """The LoRA adapter of each beam `next_round` gave, in its order."""
        return [search.lora for search in self.searches for _ in search.beams]

    def advance(self, tops: list[dict[int, Logprob]]) -> None:
        """Each live beam extended by each of its top tokens; the beam_width best kept."""
        tops_of = iter(tops)
        for search in self.searches:
            candidates = []
            for beam in search.beams:
                top = next(tops_of)
                for token, logprob in top.items():
                    candidate = BeamSearchSequence(
                        [*beam.tokens, token],
                        [*beam.logprobs, top],
                        beam.cum_logprob + float(logprob),
                    )
                    if token in self.ends:
                        candidate.finish_reason = "stop"
                        search.complete.append(candidate)
                    else:
                        candidates.append(candidate)
            # as vLLM's: the live beams by their sum of logprobs (one length; the length penalty
            # ranks the answer in `best`, where a last EOS, kept under ignore_eos, is not counted)
            ranked = sorted(candidates, key=lambda beam: beam.cum_logprob, reverse=True)
            search.beams = ranked[: self.params.beam_width]

    def best(self, tokenizer: Any) -> list[BeamSearchOutput]:
        """Each prompt's beam_width best beams, complete or live, with their text."""
        outputs = []
        for search in self.searches:
            for beam in search.beams:  # live after the last round
                beam.finish_reason = "length"
            ranked = sorted(search.complete + search.beams, key=self.key, reverse=True)
            best = ranked[: self.params.beam_width]
            for beam in best:
                beam.text = tokenizer.decode(beam.tokens) if tokenizer is not None else None
            outputs.append(BeamSearchOutput(best))
        return outputs


@dataclass
class _Search:
    """One prompt's live and complete beams."""

    prompt: list[int]
    lora: LoRARequest | None = None  # its adapter, None: the base model
    beams: list[BeamSearchSequence] = field(init=False)
    complete: list[BeamSearchSequence] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.beams = [BeamSearchSequence(list(self.prompt))]


def _prompt_tokens(tokenizer, prompt: Prompt) -> list[int]:
    """A prompt's token ids, a text encoded as the engine encodes one."""
    text, ids = split_prompt(prompt)
    if ids is not None:
        return list(ids)
    if tokenizer is None:
        raise ValueError("this model has no tokenizer.json; pass prompt_token_ids instead of text")
    return tokenizer.encode(text)
