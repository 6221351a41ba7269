"""Admission: a prompt and its parameters made into a checked `Request` before anything is
queued (`Engine.make_request`). Every user error of a request is raised here, a ValueError or
TypeError naming the field and the limit, so a bad request never reaches the step loop and
harms no other; and what a request carries beside its ids (its grammar's matcher, its banned
words' ids, its detokenizer) is made here once."""

from __future__ import annotations

import numbers
import threading
from collections.abc import Iterable

import torch

from tandem import penalties
from tandem.config import EngineConfig, ModelConfig, cdiv
from tandem.io_slot import MAX_BANNED_IDS
from tandem.lora.adapters import AdapterCache
from tandem.lora.request import LoRARequest
from tandem.pooling import ModelPooling, PoolingParams
from tandem.prefix_cache import PrefixCache
from tandem.prompt_embeds import cache_key as embeds_key
from tandem.prompt_embeds import checked as checked_embeds
from tandem.reasoning import ThinkTokens
from tandem.request import Request, check_request_types
from tandem.sampling import SamplingParams, truncate_prompt
from tandem.structured import BACKEND as GRAMMAR_BACKEND
from tandem.structured import GrammarBackend
from tandem.token_logprobs import check_vocab as check_token_logprob_ids
from tandem.tokenizer import IncrementalDetokenizer, Tokenizer, decode_after


class Admission:
    """What an engine checks a request against: its limits, tokenizer and optional parts."""

    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        tokenizer: Tokenizer | None,
        eos_token_ids: tuple[int, ...],
        max_model_len: int,
        num_blocks: int,
        cache: PrefixCache,
        adapter_cache: AdapterCache | None,
        model_pooling: ModelPooling,
        think_tokens: ThinkTokens | None,
        masks: bool,
        dtype: torch.dtype,
    ):
        self.config, self.model_config = config, model_config
        self.tokenizer, self.eos_token_ids = tokenizer, eos_token_ids
        self.max_model_len = max_model_len
        self.block_size, self.num_blocks = config.block_size, num_blocks
        self.cache = cache  # its `enabled` may change (the benchmark's runs without caching)
        self.adapter_cache = adapter_cache  # None: enable_lora is off
        self.model_pooling = model_pooling  # how the model pools: refusals, Matryoshka
        self.think_tokens = think_tokens  # a reasoning model's <think> / </think>, or None
        self.masks = masks  # the runner applies token masks (structured outputs)
        self.dtype = dtype  # the model's: prompt embeddings are kept in it
        self._grammars: GrammarBackend | None = None  # made by the first constrained request
        self._grammars_lock = threading.Lock()

    def request(
        self,
        request_id: str,
        params: SamplingParams,
        prompt: str | None = None,
        prompt_token_ids: list[int] | None = None,
        stream_text: bool = False,
        cache_salt: str | None = None,
        pooling: PoolingParams | None = None,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
        prompt_embeds: object = None,
    ) -> Request:
        """A checked Request, not yet queued; `stream_text` grows output_text with every token
        (unless params.detokenize is False); `cache_salt` shares cached blocks only with
        requests of the same salt (vLLM's); with `pooling`, an embedding request (pooling.py:
        `params` one greedy token, which carries it); with `lora_request`, run under that LoRA
        adapter (read here: its errors are raised here); `priority`: `check_priority`; with
        `prompt_embeds` ([tokens, hidden] tensor), a prompt of embeddings (prompt_embeds.py)."""
        check_request_types(request_id, params)
        params.validate()
        self.check_priority(priority)
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError(f"cache_salt must be a non-empty string, got {cache_salt!r:.80}")
        params = self._num_logprobs(params)
        if lora_request is not None:
            self._check_lora(lora_request)
        if pooling is not None:
            self._check_pooling(pooling, params)
        elif self.model_config.num_labels:
            raise ValueError(
                "this model is a sequence classifier (no LM head): use LLM.classify, or "
                "LLM.embed for its hidden states"
            )
        if params.stop and self.tokenizer is None:
            raise ValueError(
                "stop strings need the model's tokenizer.json; pass stop_token_ids instead"
            )
        embeds = None
        if prompt_embeds is not None:
            embeds = self._check_embeds(prompt_embeds, prompt, prompt_token_ids, params, pooling)
            prompt_token_ids = [0] * len(embeds)  # placeholders: the embeddings take their place
        if prompt_token_ids is None:
            if not isinstance(prompt, str):
                raise ValueError(
                    f"prompt must be a string or token ids, got {type(prompt).__name__}"
                )
            if self.tokenizer is None:
                raise ValueError(
                    "no tokenizer here (skip_tokenizer_init=True, or the model has no "
                    "tokenizer.json); pass prompt_token_ids instead of text"
                )
        # the longest prompt: a generation leaves room for a token, pooling needs none
        most = self.max_model_len - (pooling is None)
        keep = params.truncate_prompt_tokens
        if keep is not None and keep > self.max_model_len:  # vLLM's check
            raise ValueError(
                f"truncate_prompt_tokens ({keep}) is greater than max_model_len "
                f"({self.max_model_len})"
            )
        # as vLLM's tokenizer, where the request names no side: a generation keeps the
        # prompt's last tokens, pooling its first
        side = params.truncation_side or ("left" if pooling is None else "right")
        if prompt_token_ids is None:  # a text: where no side is named, vLLM's tokenizer cuts
            # it, the special tokens kept (a last-token embedder's EOS among them)
            cut = None if params.truncation_side or keep is None else most if keep == -1 else keep
            prompt_token_ids = self.tokenizer.encode(prompt, max_length=cut, side=side)
        # a numpy array or a torch tensor as its Python ints (a tensor's items are tensors)
        ids = prompt_token_ids.tolist() if hasattr(prompt_token_ids, "tolist") else prompt_token_ids
        if not isinstance(ids, Iterable) or isinstance(ids, str | bytes | dict):
            raise ValueError(f"prompt_token_ids must be a list of token ids, got {ids!r:.80}")
        prompt_token_ids = self._check_token_ids(truncate_prompt(list(ids), keep, most, side), most)
        self._check_n(params, len(prompt_token_ids))
        if embeds is not None:  # cut as their placeholder ids
            embeds = truncate_prompt(embeds, keep, most, side)
        for token_id in params.stop_token_ids:
            if token_id >= self.model_config.vocab_size:
                raise ValueError(
                    f"stop_token_ids must be in [0, {self.model_config.vocab_size}), got {token_id}"
                )
        if (
            params.min_tokens
            and len(self.eos_token_ids) + len(params.stop_token_ids) > MAX_BANNED_IDS
        ):
            raise ValueError(
                f"with min_tokens, at most {MAX_BANNED_IDS - len(self.eos_token_ids)} stop_token_ids are supported"
            )
        check_token_logprob_ids(params.logprob_token_ids, self.model_config.vocab_size)
        bad_words = self._bad_words_token_ids(params)
        penalties.check_request(params, bad_words, self.model_config.vocab_size)
        request = Request(
            request_id, prompt_token_ids, params, params.seed, prompt=prompt, cache_salt=cache_salt
        )
        request.priority = int(priority)
        if embeds is not None:
            request.prompt_embeds, request.embeds_key = embeds, embeds_key(embeds)
        request.bad_words_token_ids = bad_words
        request.pooling = pooling
        request.lora_request = lora_request
        if params.structured_outputs is not None:
            grammars = self.grammars()
            request.matcher = grammars.matcher(grammars.compile(params.structured_outputs))
            request.token_filter = grammars.token_filter(params.structured_outputs)
        if params.thinking_token_budget is not None:
            if self.think_tokens is None or not self.masks:
                raise ValueError(
                    "thinking_token_budget needs reasoning_parser and the structured-output "
                    f"backend ({GRAMMAR_BACKEND}), which forces </think> through token masks"
                )
            request.thinking_left = params.thinking_token_budget
        if (
            request.masked
            and self.think_tokens is not None
            and not self.think_tokens.ended(prompt_token_ids)
        ):
            request.reasoning_end_id = self.think_tokens.end  # thinking: no grammar until it
        if params.detokenize and (params.stop or stream_text):
            request.detokenizer = self.detokenizer(request)
        return request

    def _check_embeds(
        self,
        embeds: object,
        prompt: str | None,
        prompt_token_ids: list[int] | None,
        params: SamplingParams,
        pooling: PoolingParams | None,
    ) -> torch.Tensor:
        """A prompt of embeddings, checked and kept as the engine reads it."""
        if not self.config.enable_prompt_embeds:
            raise ValueError(
                "prompt_embeds need enable_prompt_embeds=True (--enable-prompt-embeds)"
            )
        if prompt is not None or prompt_token_ids is not None:
            raise ValueError("a prompt is text, token ids or embeddings: give one of them")
        if params.repetition_penalty != 1.0:  # vLLM's counts the prompt's tokens
            raise ValueError("repetition_penalty counts a prompt's tokens; prompt_embeds have none")
        if params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs score a prompt's tokens; prompt_embeds have none")
        if pooling is not None:
            raise ValueError("prompt_embeds are for generation, not pooling")
        return checked_embeds(embeds, self.model_config.hidden_size, self.dtype)

    def _check_lora(self, lora_request: LoRARequest) -> None:
        """TypeError/ValueError unless the engine can run the adapter, which it reads now."""
        if not isinstance(lora_request, LoRARequest):
            raise TypeError(
                f"lora_request must be a tandem.LoRARequest, got {type(lora_request).__name__}"
            )
        if self.adapter_cache is None:
            raise ValueError(
                f"lora_request names adapter {lora_request.lora_name!r}, but this engine runs no "
                "LoRA adapters: start it with enable_lora=True"
            )
        self.adapter_cache.get(lora_request)

    def check_priority(self, priority: int) -> None:
        """vLLM's per-request priority: any int under scheduling_policy "priority" (lower is
        served first), 0 alone under "fcfs"."""
        if not isinstance(priority, numbers.Integral) or isinstance(priority, bool):
            raise TypeError(f"priority must be an int, got {type(priority).__name__}")
        if priority != 0 and self.config.scheduling_policy == "fcfs":
            raise ValueError(
                f"priority is {priority}, but scheduling_policy is 'fcfs', which serves every "
                "request at priority 0; start the engine with scheduling_policy='priority' "
                "(--scheduling-policy priority)"
            )

    def _check_pooling(self, pooling: PoolingParams, params: SamplingParams) -> None:
        if params.n != 1 or params.max_tokens != 1:
            raise ValueError("an embedding request is carried by SamplingParams(max_tokens=1)")
        pooling.validate(self.model_config.hidden_size, self.model_config.num_labels)
        self.model_pooling.check(pooling)

    def grammars(self) -> GrammarBackend:
        """The structured-output backend over this model's tokenizer (built on first use, by
        whichever thread asks first: AsyncLLM compiles off the engine thread)."""
        with self._grammars_lock:
            return self._grammar_backend()

    def _grammar_backend(self) -> GrammarBackend:
        if self._grammars is None:
            if self.tokenizer is None:
                raise ValueError(
                    "structured_outputs need the model's tokenizer.json (the grammar is compiled "
                    "against its vocabulary)"
                )
            try:
                self._grammars = GrammarBackend(
                    self.tokenizer,
                    self.model_config.vocab_size,
                    list(self.eos_token_ids),
                    self.config.structured_outputs_config.disable_any_whitespace,
                )
            except ImportError:
                raise ValueError(
                    f"structured_outputs need {GRAMMAR_BACKEND}: pip install 'tandem[structured]'"
                ) from None
        return self._grammars

    def _bad_words_token_ids(self, params: SamplingParams) -> list[list[int]]:
        if not params.bad_words:
            return []
        if self.tokenizer is None:
            raise ValueError("bad_words need the model's tokenizer.json; use logit_bias instead")
        return penalties.bad_word_token_ids(self.tokenizer, params.bad_words)

    def _num_logprobs(self, params: SamplingParams) -> SamplingParams:
        """`params`, checked against vLLM's max_logprobs (the most top ids a request may ask
        for); a copy with the vocabulary's size for a count of -1 (vLLM's: all of it)."""
        vocab = self.model_config.vocab_size
        most = self.config.logprobs_width(vocab)
        asked = {"logprobs": params.num_top_logprobs, "prompt_logprobs": params.prompt_logprobs}
        for name, num in asked.items():
            if num is not None and (vocab if num == -1 else num) > most:
                raise ValueError(
                    f"{name} asks for {num} top ids, more than max_logprobs="
                    f"{self.config.max_logprobs} allows (an engine argument; -1: the whole "
                    f"vocabulary of {vocab})"
                )
        if -1 not in asked.values():
            return params
        params = params.clone()
        if asked["logprobs"] == -1:
            params.logprobs = vocab
        if asked["prompt_logprobs"] == -1:
            params.prompt_logprobs = vocab
        return params

    def _check_token_ids(self, ids: list[int], most: int) -> list[int]:
        if not ids:
            raise ValueError("prompt is empty; give at least one token")
        vocab = self.model_config.vocab_size
        # Python ints in range, the usual prompt, are checked by C loops (type() is int leaves
        # out bool): 256 requests of 900-token prompts took 334 ms checked token by token on a
        # 2-core CPU, 32 ms checked so.
        plain = set(map(type, ids)) == {int} and min(ids) >= 0 and max(ids) < vocab
        if not plain:
            bad = next((t for t in ids if not _is_token_id(t) or not 0 <= t < vocab), None)
            if bad is not None:
                raise ValueError(f"prompt_token_ids must be integers in [0, {vocab}), got {bad!r}")
            ids = [int(t) for t in ids]
        if len(ids) > most:
            raise ValueError(
                f"prompt has {len(ids)} tokens but max_model_len is {self.max_model_len}; "
                f"shorten it to at most {most} tokens or raise max_model_len"
            )
        return ids

    def _check_n(self, params: SamplingParams, prompt_len: int) -> None:
        """The n samples of a prompt must fit in the KV cache together: its cached blocks once,
        plus each sample's own blocks up to its last token but one (the last sampled token
        never gets KV)."""
        size = self.block_size
        shared = (prompt_len - 1) // size if self.cache.enabled else 0
        longest = min(prompt_len + params.max_tokens, self.max_model_len)
        own = cdiv(longest - 1, size) - shared
        limit = (self.num_blocks - shared) // own if own else params.n
        if params.n > limit:
            raise ValueError(
                f"n={params.n} samples of this {prompt_len}-token prompt with max_tokens="
                f"{params.max_tokens} cannot fit in the KV cache together ({self.num_blocks} "
                f"blocks of {size} tokens); n can be at most {limit} here"
            )

    def detokenizer(self, request: Request) -> IncrementalDetokenizer | None:
        if self.tokenizer is None:
            return None
        return IncrementalDetokenizer(
            self.tokenizer, text_before(request), request.params.skip_special_tokens
        )

    def text_after_prompt(self, request: Request, ids: list[int]) -> str:
        """The output `ids`' whole text, as the detokenizer's deltas add it up (tokenizer: set)."""
        assert self.tokenizer is not None
        skip = request.params.skip_special_tokens
        return decode_after(self.tokenizer, text_before(request), ids, skip)


def text_before(request: Request) -> list[int]:
    """The ids an output's text reads after: the prompt's (a prompt of embeddings has none:
    its ids are placeholders)."""
    return [] if request.prompt_embeds is not None else request.prompt_token_ids


def _is_token_id(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
