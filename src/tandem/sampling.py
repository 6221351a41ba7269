"""SamplingParams (validated on the host) and the on-device sampler."""

from __future__ import annotations

import copy
import enum
import functools
import logging
import math
from collections.abc import Collection
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal, TypeVar

import numpy as np
import torch

from tandem.config import check_bools, check_int
from tandem.inputs import Truncation
from tandem.model import fused
from tandem.repetition import RepetitionDetectionParams, as_params
from tandem.structured import StructuredOutputsParams

TruncationSide = Literal["left", "right"]
# a prompt's token ids, or its [tokens, hidden] embeddings
PromptRows = TypeVar("PromptRows", list[int], torch.Tensor)

logger = logging.getLogger(__name__)

MAX_LOGPROB_TOKEN_IDS = 128  # the width of token_logprobs.TokenLogprobBuffers' rows (vLLM's)
# samples per prompt (vLLM's VLLM_MAX_N_SEQUENCES default): one call must not queue millions of
# requests; the KV cache's own limit for a prompt is admission's (`Admission._check_n`)
MAX_N = 16384
MIN_SEED, MAX_SEED = -(2**63), 2**63 - 1  # an int64, as vLLM takes it; -1 means no seed
MAX_TOP_K = 2**31 - 1
MAX_TOKENS = 2**31 - 1  # past any context (where max_tokens is cut); min_tokens fits an int64
MAX_BAD_WORDS = 1024  # each is tokenized as the request is made, on the engine's thread
FLOAT32_MAX = 3.4028234663852886e38  # past it a float32 is inf: an inf penalty makes NaN logits
FLOAT32_TINY = 1.1754943508222875e-38  # the smallest normal float32 (below: 0 or denormal)
GREEDY_BELOW = 1e-5  # a temperature under it is greedy (0: those in (0, 0.01) are raised below)
MIN_TEMPERATURE = 1e-2  # vLLM's: a temperature in (0, it) samples at it
MAX_TEMPERATURE = 2.0  # vLLM's bound
LOGIT_BIAS_LIMIT = 100.0  # a bias is clamped to [-it, it], as vLLM's server clamps it


def check_seed(seed: Any) -> None:
    """Raise a ValueError unless `seed` is an int64, as vLLM takes a seed."""
    check_int("seed", seed, MIN_SEED)
    if seed > MAX_SEED:
        raise ValueError(f"seed must be <= {MAX_SEED}, got {seed}")


class RequestOutputKind(enum.Enum):
    """What each of AsyncLLM.generate's RequestOutputs carries (vLLM's names and values)."""

    CUMULATIVE = 0  # every output so far
    DELTA = 1  # only what is new since the last one
    FINAL_ONLY = 2  # nothing until the end, then everything


@dataclass
class SamplingParams:
    """How one request samples and when it stops; mirrors vLLM's fields."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: as many as max_model_len leaves room for
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    # each output position's logprobs of exactly these ids (and of the sampled token) in place of
    # the top `logprobs`; logprobs becomes their count
    logprob_token_ids: list[int] | None = None
    # the logprob of every prompt token after the first, plus the top `prompt_logprobs` ids
    prompt_logprobs: int | None = None
    # logprobs and prompt_logprobs as one FlatLogprobs each (flat lists) in place of a list of
    # {id: Logprob} dicts: vLLM's, for fewer objects for the garbage collector to walk
    flat_logprobs: bool = False
    detokenize: bool = True  # False: outputs carry token ids only, their text stays ""
    skip_special_tokens: bool = True
    # vLLM's; only its default: special tokens decode as the tokenizer's decoder joins them
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # logits processors (penalties.py): over output tokens, over prompt and output tokens
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None  # token id -> bias added to its logit
    allowed_token_ids: list[int] | None = None  # the only ids that may be sampled
    bad_words: list[str] = field(default_factory=list)  # never completed in the output
    # the output follows a JSON schema, regex, choice or grammar (structured.py)
    structured_outputs: StructuredOutputsParams | None = None
    # keep only k of the prompt's tokens (-1: as many as max_model_len leaves room for)
    truncate_prompt_tokens: int | None = None
    # vLLM's: "left" keeps the prompt's last k tokens, "right" its first k; None: the model's
    # side, as vLLM's tokenizer has it (left for a generation, right for pooling)
    truncation_side: TruncationSide | None = None
    # what AsyncLLM.generate yields; the offline LLM.generate returns final outputs whatever it is
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # True: no blocks from the prefix cache (its own are still published for others); None: as
    # vLLM, True with prompt_logprobs (which never read the cache, whatever this says)
    skip_reading_prefix_cache: bool | None = None
    # vLLM's free-form arguments for custom sampling code: carried with the request, unused here
    extra_args: dict[str, Any] | None = None
    # finish once the output ends in a repeated n-gram (repetition.py); a dict of its fields too
    repetition_detection: RepetitionDetectionParams | None = None
    # with reasoning_parser: after this many thinking tokens, </think> is the only one allowed
    thinking_token_budget: int | None = None
    # vLLM's: the caller keeps this object to one request, so `clone` may copy it shallowly
    skip_clone: bool = False

    def __post_init__(self) -> None:
        for f in fields(self):  # numpy scalars (an RL config's) as the Python numbers they hold
            if f.name != "extra_args":
                setattr(self, f.name, _python_numbers(getattr(self, f.name)))
        self.stop = _as_list("stop", self.stop, "a string or a list of strings", str)
        self.stop_token_ids = _as_list("stop_token_ids", self.stop_token_ids, "a list of token ids")
        self.bad_words = _as_list("bad_words", self.bad_words, "a string or a list of strings", str)
        if self.top_k == -1:
            self.top_k = 0
        for name in ("logprobs", "prompt_logprobs"):  # vLLM's ints take True as 1
            if isinstance(getattr(self, name), bool):
                setattr(self, name, int(getattr(self, name)))
        if _is_number(self.temperature) and 0 < self.temperature < MIN_TEMPERATURE:
            _warn_once(
                f"temperatures in (0, {MIN_TEMPERATURE}) sample at {MIN_TEMPERATURE}, as in "
                "vLLM (smaller ones overflow the logits); 0 is greedy"
            )
            self.temperature = MIN_TEMPERATURE
        if self.seed == -1:  # as vLLM: the engine draws one
            self.seed = None
        if type(self.thinking_token_budget) is int and self.thinking_token_budget == -1:
            self.thinking_token_budget = None  # vLLM's "unlimited" (an int, as it checks)
        if self.max_tokens is None:  # each request is cut where it fills max_model_len
            self.max_tokens = MAX_TOKENS
        if self.skip_reading_prefix_cache is None:
            self.skip_reading_prefix_cache = self.prompt_logprobs is not None
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        self.repetition_detection = as_params(self.repetition_detection)
        if self.logprob_token_ids is not None:
            self.logprob_token_ids = _as_list(
                "logprob_token_ids", self.logprob_token_ids, "a list of token ids"
            )
            if not self.logprob_token_ids:  # as vLLM's server: an empty list asks for nothing
                self.logprob_token_ids = None
            elif self.logprobs is None:
                self.logprobs = len(self.logprob_token_ids)
        self.validate()

    def validate(self) -> None:
        check_int("n", self.n, 1)
        if self.n > MAX_N:
            raise ValueError(f"n must be <= {MAX_N}, got {self.n}")
        if not _is_number(self.temperature) or not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(
                f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature!r}"
            )
        if self.temperature < GREEDY_BELOW and self.n > 1:  # n identical answers (vLLM's check)
            raise ValueError(f"n must be 1 when using greedy sampling, got {self.n}")
        check_bools(
            self, "ignore_eos", "detokenize", "skip_special_tokens", "include_stop_str_in_output",
            "skip_reading_prefix_cache", "flat_logprobs", "spaces_between_special_tokens",
            "skip_clone",
        )  # fmt: skip
        if not (self.spaces_between_special_tokens or self.skip_special_tokens):
            raise ValueError(
                "spaces_between_special_tokens=False needs skip_special_tokens=True here (where "
                "vLLM's has no effect either): tandem decodes special tokens as the tokenizer "
                "does"
            )
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        check_int("top_k", self.top_k, -1, "(0 or -1 disables it)")
        if self.top_k > MAX_TOP_K:  # it travels in an int32; past the vocabulary it keeps all
            raise ValueError(f"top_k must be <= {MAX_TOP_K}, got {self.top_k}")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None:
            check_seed(self.seed)
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens != -1:
            check_int("truncate_prompt_tokens", self.truncate_prompt_tokens, 1, "or -1")
        if self.truncation_side not in (None, "left", "right"):
            raise ValueError(
                f"truncation_side must be 'left', 'right' or None, got {self.truncation_side!r}"
            )
        check_int("max_tokens", self.max_tokens, 0)
        if self.max_tokens > MAX_TOKENS:
            raise ValueError(f"max_tokens must be <= {MAX_TOKENS}, got {self.max_tokens}")
        if self.max_tokens == 0 and self.prompt_logprobs is None:
            raise ValueError(
                "max_tokens must be >= 1 unless prompt_logprobs is set (max_tokens=0 only scores "
                "the prompt)"
            )
        check_int("min_tokens", self.min_tokens, 0)
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"
            )
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if self.stop and not self.detokenize:
            raise ValueError(
                "stop strings are matched in the text, which detokenize=False leaves out; set "
                "detokenize=True or use stop_token_ids"
            )
        for token_id in self.stop_token_ids:
            check_int("stop_token_ids", token_id, 0)
        if self.logprobs is not None:  # vLLM's -1: the whole vocabulary (max_logprobs caps it)
            check_int("logprobs", self.logprobs, -1, "(-1: the whole vocabulary)")
        if self.logprob_token_ids is not None:
            self._validate_logprob_token_ids()
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise ValueError(f"extra_args must be a dict, got {type(self.extra_args).__name__}")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(
                "output_kind must be a RequestOutputKind (CUMULATIVE, DELTA or FINAL_ONLY), got "
                f"{self.output_kind!r}"
            )
        self._validate_logits_processors()
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise ValueError(
                    "structured_outputs must be a StructuredOutputsParams, got "
                    f"{type(self.structured_outputs).__name__}"
                )
            self.structured_outputs.validate()

    def _validate_logprob_token_ids(self) -> None:
        ids = self.logprob_token_ids
        if not isinstance(ids, list) or not 1 <= len(ids) <= MAX_LOGPROB_TOKEN_IDS:
            raise ValueError(
                f"logprob_token_ids must be a list of 1 to {MAX_LOGPROB_TOKEN_IDS} token ids, got "
                f"{ids!r}"[:300]
            )
        for token_id in ids:
            check_int("logprob_token_ids", token_id, 0)
        if self.logprobs != len(ids):
            raise ValueError(
                "when both logprobs and logprob_token_ids are set, logprobs must equal "
                f"len(logprob_token_ids); got logprobs={self.logprobs}, "
                f"len(logprob_token_ids)={len(ids)}"
            )

    def _validate_logits_processors(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        rp = self.repetition_penalty
        if not _is_number(rp) or not math.isfinite(rp) or not FLOAT32_TINY <= rp <= FLOAT32_MAX:
            raise ValueError(
                f"repetition_penalty must be a finite number > 0 (within [{FLOAT32_TINY:.4g}, "
                f"{FLOAT32_MAX:.4g}], it travels as a float32), got {rp!r}"
            )
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(
                    f"logit_bias must map token ids to biases, got {self.logit_bias!r}"
                )
            for token_id, bias in self.logit_bias.items():
                check_int("logit_bias", token_id, 0, "(token ids as keys)")
                if not _is_number(bias) or math.isnan(bias):
                    raise ValueError(f"logit_bias values must be numbers, got {bias!r}")
            # clamped to [-100, 100] as vLLM's server clamps them (-1e9 or -inf: a ban in effect)
            self.logit_bias = {
                token_id: min(max(float(bias), -LOGIT_BIAS_LIMIT), LOGIT_BIAS_LIMIT)
                for token_id, bias in self.logit_bias.items()
            }
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, list | tuple) or not self.allowed_token_ids:
                raise ValueError(
                    f"allowed_token_ids must be a non-empty list of token ids, got "
                    f"{self.allowed_token_ids!r}"
                )
            for token_id in self.allowed_token_ids:
                check_int("allowed_token_ids", token_id, 0)
        if len(self.bad_words) > MAX_BAD_WORDS:
            raise ValueError(
                f"bad_words takes at most {MAX_BAD_WORDS} words, got {len(self.bad_words)}"
            )
        if any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
            raise ValueError(
                f"bad_words must be a list of non-blank strings, got {self.bad_words!r}"
            )
        for word in self.bad_words:  # the tokenizer takes UTF-8: no lone surrogate
            if not word.isascii():
                try:
                    word.encode("utf-8")
                except UnicodeEncodeError:
                    raise ValueError(f"bad_words must be UTF-8 text, got {word!r}") from None
        if self.thinking_token_budget is not None:
            check_int("thinking_token_budget", self.thinking_token_budget, 0)
        if self.prompt_logprobs is not None:
            check_int("prompt_logprobs", self.prompt_logprobs, -1, "(-1: the whole vocabulary)")

    def clone(self) -> SamplingParams:
        """A deep copy: changing its lists, dicts or constraint leaves this one as it is (with
        skip_clone, as vLLM's, a shallow one: the caller shares them with no other request)."""
        return copy.copy(self) if self.skip_clone else copy.deepcopy(self)

    @staticmethod
    def from_optional(**fields: Any) -> SamplingParams:
        """vLLM's: the fields given a value other than None, the rest at their defaults
        (max_tokens None too: what the context leaves); logit_bias's keys as ints (a JSON
        body's are strings)."""
        given = {
            name: value
            for name, value in fields.items()
            if value is not None or name == "max_tokens"
        }
        if isinstance(given.get("logit_bias"), dict):
            given["logit_bias"] = {int(t): bias for t, bias in given["logit_bias"].items()}
        return SamplingParams(**given)

    def with_truncation(self, cut: Truncation) -> SamplingParams:
        """These params cutting the prompt as `cut` says (LLM's tokenization_kwargs); a
        ValueError where they cut it otherwise."""
        if (
            None not in (cut.keep, self.truncate_prompt_tokens)
            and cut.keep != self.truncate_prompt_tokens
        ):
            raise ValueError(
                f"truncate_prompt_tokens is {self.truncate_prompt_tokens} in the SamplingParams "
                f"and {cut.keep} in tokenization_kwargs: give one"
            )
        if None not in (cut.side, self.truncation_side) and cut.side != self.truncation_side:
            raise ValueError(
                f"truncation_side is {self.truncation_side!r} in the SamplingParams and "
                f"{cut.side!r} in tokenization_kwargs: give one"
            )
        return replace(
            self,
            truncate_prompt_tokens=self.truncate_prompt_tokens if cut.keep is None else cut.keep,
            truncation_side=cut.side or self.truncation_side,
        )

    @property
    def num_top_logprobs(self) -> int | None:
        """The top ids, in rank order, of each output position's logprobs (None: no logprobs;
        0 with logprob_token_ids, whose ids are the ones named)."""
        return 0 if self.logprob_token_ids is not None else self.logprobs

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def needs_filter(self) -> bool:
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0)

    @property
    def needs_token_history(self) -> bool:
        """The penalties see every prompt and output token as the steps feed it (penalties.py),
        so none of them may come from the prefix cache."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.bad_words
        )

    @property
    def needs_penalties(self) -> bool:
        """Any logits processor of penalties.py is on: the request keeps device state."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.allowed_token_ids is not None
            or self.bad_words
        )


def seeded(params: SamplingParams, k: int) -> SamplingParams:
    """The k-th of n samples: seed + k when seeded, as vLLM seeds them."""
    if params.seed is None or k == 0:
        return params
    return replace(params, seed=(params.seed + k) % (MAX_SEED + 1))


def _as_list(name: str, value: object, allowed: str, lone: type | None = None) -> list:
    """None as [], a lone `lone` (a string) as [it], any other collection as a list of its items."""
    if value is None:
        return []
    if lone is not None and isinstance(value, lone):
        return [value]
    if isinstance(value, str | bytes | dict) or not isinstance(value, Collection):
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
    return list(value)


@functools.cache
def _warn_once(message: str) -> None:
    logger.warning(message)


def _python_numbers(value: Any) -> Any:
    """`value` with numpy scalars, also in a list, tuple or dict, as Python ones."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, list | tuple):
        return type(value)(_python_numbers(v) for v in value)
    if isinstance(value, dict):
        return {_python_numbers(k): _python_numbers(v) for k, v in value.items()}
    return value


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def fold_seed(seed: int) -> int:
    """A 64-bit seed (negative: its two's complement) as a signed 32-bit value for the int32 input
    buffer: the low half, mixed with the high half times an odd constant, so that a seed below
    2**32 keeps its value and -1 - k does not fold onto k."""
    high = (seed >> 32) & 0xFFFFFFFF
    folded = (seed ^ (high * 0x9E3779B9)) & 0xFFFFFFFF
    return folded - (1 << 32) if folded >= 1 << 31 else folded


def _mul32(h: torch.Tensor, c: int) -> torch.Tensor:
    """(h * c) mod 2**32 for h in [0, 2**32), without overflowing int64."""
    return ((h & 0xFFFF) * c + ((((h >> 16) * c) & 0xFFFF) << 16)) & 0xFFFFFFFF


def _mix32(h: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finalizer with full avalanche (murmur3's constants)."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def gumbel_noise(
    seeds: torch.Tensor, positions: torch.Tensor, token_ids: torch.Tensor
) -> torch.Tensor:
    """Gumbel(0, 1) noise that depends only on (seed, output position, token id).

    A counter-based hash instead of a generator keeps a seeded request's tokens independent of
    its batch neighbours and of preemption, and needs no host synchronization.
    seeds, positions: [rows] int, 32-bit values; token_ids: [rows, vocab] or [vocab] int64.
    """
    row_key = _mix32((seeds.long() & 0xFFFFFFFF) ^ _mix32(positions.long() & 0xFFFFFFFF))[:, None]
    h = _mix32((row_key + _mul32(token_ids.long(), 0x9E3779B9)) & 0xFFFFFFFF)
    return -torch.log(-torch.log(uniform(h)))


def uniform(h: torch.Tensor) -> torch.Tensor:
    """32-bit hashes -> float32 uniform in (0, 1), both ends excluded exactly: the top 23 bits
    plus a half, over 2**23, is at most 1 - 2**-24, a float32 below 1. With 24 bits the top
    value rounded to 1.0, whose noise is +inf: one hash in 2**24, so about one row in 130 of a
    128K vocabulary sampled that token whatever its logit (a masked one's -inf + inf is NaN,
    which argmax takes too)."""
    return ((h >> 9).float() + 0.5) * (1.0 / (1 << 23))


@dataclass
class SamplingTensors:
    """Per-row sampling parameters on the device: [rows] each."""

    temperature: torch.Tensor  # float32, 0 means greedy
    top_k: torch.Tensor  # int32, 0 means off
    top_p: torch.Tensor  # float32
    min_p: torch.Tensor  # float32
    seeds: torch.Tensor  # int32, the request's seed folded to 32 bits (see `fold_seed`)
    positions: torch.Tensor  # int32, index of the output token being sampled


def sample(logits: torch.Tensor, t: SamplingTensors, use_filters: bool) -> torch.Tensor:
    """[rows, vocab] logits (any float dtype, computed in float32) -> [rows] int64 token ids;
    greedy rows take the argmax."""
    if not use_filters and fused.use_kernels(logits):
        from tandem.sampling_kernel import gumbel_argmax

        return gumbel_argmax(logits, t.temperature, t.seeds, t.positions)
    logits = logits.float()
    greedy = t.temperature == 0
    scaled = logits / torch.where(greedy, 1.0, t.temperature)[:, None]
    if use_filters:
        scaled, token_ids = scaled.sort(dim=-1, descending=True)
        scaled = _filter_sorted(scaled, t)
    else:
        token_ids = torch.arange(logits.shape[-1], device=logits.device)
    choice = (scaled + gumbel_noise(t.seeds, t.positions, token_ids)).argmax(dim=-1)
    sampled = (
        token_ids[choice] if token_ids.dim() == 1 else token_ids.gather(1, choice[:, None])[:, 0]
    )
    return torch.where(greedy, logits.argmax(dim=-1), sampled)


def draw(logits: torch.Tensor, processed: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """The token `sample` draws, from `processed_logits`' values of the logits (a logprob step
    in a processed mode has them): the noise depends on the token id alone, so the Gumbel-max
    choice in vocabulary order is the one `sample` makes in sorted order, without its sort.
    Greedy rows take the logits' own argmax."""
    token_ids = torch.arange(processed.shape[-1], device=processed.device)
    choice = (processed + gumbel_noise(t.seeds, t.positions, token_ids)).argmax(dim=-1)
    return torch.where(t.temperature == 0, logits.float().argmax(dim=-1), choice)


def _filter_sorted(scaled: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Mask (to -inf) tokens outside min-p, top-k and top-p, in vLLM's order: min-p on the whole
    distribution, then top-k, then top-p within what those keep; `scaled` is sorted descending
    per row."""
    vocab = scaled.shape[-1]
    top_k = torch.where((t.top_k > 0) & (t.top_k < vocab), t.top_k, vocab)
    # vLLM's and transformers' top-k: every token at least the k-th's value (ties with it kept)
    kth = scaled.gather(1, (top_k[:, None] - 1).long())
    whole = scaled.softmax(dim=-1)
    kept = (scaled >= kth) & (whole >= t.min_p[:, None] * whole[:, :1])
    probs = scaled.masked_fill(~kept, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # E.g. [0.5, 0.3, 0.2] -> [0, 0.5, 0.8]
    keep = kept & ((mass_before < t.top_p[:, None]) | (t.top_p[:, None] >= 1))
    return scaled.masked_fill(~keep, float("-inf"))


def processed_logits(logits: torch.Tensor, t: SamplingTensors, use_filters: bool) -> torch.Tensor:
    """[rows, vocab] logits (after penalties, bans and masks) -> float32 as `sample` draws from
    them: divided by each row's temperature (greedy rows by 1), and with filters -inf outside
    each row's top-k, top-p and min-p."""
    scaled = logits.float() / torch.where(t.temperature == 0, 1.0, t.temperature)[:, None]
    if not use_filters:
        return scaled
    ordered, token_ids = scaled.sort(dim=-1, descending=True)
    return torch.empty_like(scaled).scatter_(1, token_ids, _filter_sorted(ordered, t))


def sampled_logprobs(
    values: torch.Tensor,
    sampled: torch.Tensor,
    mode: str,
    value_out: torch.Tensor,
    rank_out: torch.Tensor,
) -> torch.Tensor:
    """[rows, vocab] values sample logprobs are taken from (raw or processed logits, by `mode`,
    LOGPROBS_MODES) -> value_out [rows] = each sampled id's logprob (`*_logprobs`) or logit,
    rank_out [rows] = the ids at least as likely, itself included (vLLM's rank). Returns each
    row's shift ([rows] float32: its logsumexp, or 0 for `*_logits`): any id's reported value is
    its value less the shift."""
    logprobs = mode.endswith("logprobs")
    if fused.use_kernels(values):  # one read of the values, no [rows, vocab] float32 copy
        from tandem.sampling_kernel import sampled_logprobs as fused_sampled_logprobs

        return fused_sampled_logprobs(values, sampled, logprobs, value_out, rank_out)
    x = values.float()
    target = x.gather(1, sampled[:, None])[:, 0]
    shift = torch.logsumexp(x, dim=-1) if logprobs else torch.zeros_like(target)
    value_out.copy_(target - shift)
    rank_out.copy_((x >= target[:, None]).sum(dim=-1))
    return shift


def top_logprobs(
    values: torch.Tensor, shift: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The top `num_top` ids of each row of values and their reported values (float32, less
    the rows' shift from `sampled_logprobs`)."""
    top, ids = values.topk(num_top, dim=-1)
    return ids, top.float() - shift[:, None]


def truncate_prompt(
    prompt: PromptRows, keep: int | None, most: int, side: TruncationSide
) -> PromptRows:
    """A prompt's ids (or [tokens, hidden] embeddings) cut to `keep` tokens
    (SamplingParams.truncate_prompt_tokens, as vLLM's), its last on `side` "left" and its
    first on "right"; -1 keeps `most`, the longest prompt the engine takes (max_model_len - 1
    for a generation, which needs room for a new token; max_model_len to pool); None keeps all."""
    # E.g. [1, 2, 3, 4], keep 2: left -> [3, 4], right -> [1, 2]
    if keep is None:
        return prompt
    keep = most if keep == -1 else keep
    if len(prompt) <= keep:
        return prompt
    return prompt[:keep] if side == "right" else prompt[-keep:]
