"""Offline batch generation, shaped like vLLM's `LLM` so switching is one import."""

from __future__ import annotations

import gc
import itertools
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import jinja2
import torch
from tqdm import tqdm

from tandem import scoring
from tandem.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from tandem.config import EngineConfig, ModelConfig, check_flags
from tandem.engine import Engine, check_pause_mode
from tandem.inputs import Truncation, check_mm_processor_kwargs, truncation
from tandem.lora.request import LoRARequest, check_one_adapter_per_id, per_prompt
from tandem.metrics import Metric, engine_metrics
from tandem.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    FlatLogprobs,
    PoolingOutput,
    PoolingRequestOutput,
    PromptLogprobs,
    RequestOutput,
    SampleLogprobs,
    ScoringRequestOutput,
    TokenText,
    cumulative_logprob,
    no_text,
    prompt_logprobs,
    sample_logprobs,
    token_text,
)
from tandem.pooling import PoolingParams, pooling_carrier
from tandem.request import (
    Prompt,
    Request,
    prompt_cache_salt,
    prompt_embeds,
    prompt_list,
    split_prompt,
    without_special_tokens,
)
from tandem.sampling import SamplingParams, seeded
from tandem.tokenizer import Tokenizer, content_format, developer_as_system, template_message
from tandem.weight_transfer import request_field, required_field
from tandem.weights import NamedTensors

# vLLM's use_tqdm: show a progress bar or not, or the tqdm-like factory that makes it (called
# as tqdm is, e.g. functools.partial(tqdm, leave=False))
UseTqdm = bool | Callable[..., Any]


def progress_bar(use_tqdm: UseTqdm, **kwargs: Any) -> Any:
    if callable(use_tqdm):
        return use_tqdm(**kwargs)
    return tqdm(**kwargs, disable=not use_tqdm)


@dataclass
class LoglikelihoodOutput:
    """How likely a continuation is after its context."""

    logprob: float  # the sum over the continuation's tokens
    is_greedy: bool  # every continuation token was the model's most likely token
    token_logprobs: list[float]


class LLM:
    """`LLM(model=folder_or_preset, **engine_args)`; see EngineConfig for the arguments."""

    def __init__(self, model: str, **engine_args: Any):
        self.engine = Engine(EngineConfig(model=model, **engine_args))
        self._ids = itertools.count()  # next() is atomic: generate may run in several threads
        # the engine is stepped under this lock, so the RL hooks below, called from another
        # thread while `generate` runs, land between two steps; `_resumed` wakes a paused loop
        self._lock = threading.RLock()
        self._resumed = threading.Condition(self._lock)
        # hooks waiting for the lock; the stepping thread lets them take it first (`_hook`)
        self._asking = threading.Condition()
        self._num_asking = 0
        self._enqueued: list[tuple[str, list[Request]]] = []  # `enqueue`d, not yet returned

    @classmethod
    def from_engine_args(cls, engine_args: EngineConfig) -> LLM:
        """vLLM's: an LLM of these settings (`tandem.EngineArgs`, that is EngineConfig)."""
        return cls(**{f.name: getattr(engine_args, f.name) for f in fields(engine_args)})

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes (nothing to do on one device)."""
        self.engine.shutdown()

    def get_world_size(self, include_dp: bool = True) -> int:
        """The processes serving this LLM, as vLLM's: its tensor-parallel ranks (one LLM has no
        pipeline or data parallelism; Ray's replicas are LLMs of their own)."""
        del include_dp
        return self.engine.config.tensor_parallel_size

    def get_tokenizer(self) -> Tokenizer | None:
        """The model's tokenizer, called as transformers' is (None for a model without one)."""
        return self.engine.tokenizer

    @property
    def llm_engine(self) -> Engine:
        """vLLM's name for the engine, as scripts read it: `llm.llm_engine.model_config
        .max_model_len`, `llm.llm_engine.get_tokenizer()`."""
        return self.engine

    @property
    def model_config(self) -> ModelConfig:
        """vLLM's: the model's config, its `max_model_len` the context the engine serves."""
        return self.engine.model_config

    def start_profile(self, profile_prefix: str | None = None) -> None:
        """vLLM's: every rank's profiler on (the engine's profiler_config), between two steps;
        with `profile_prefix`, each rank's trace file is `<prefix>_tp<rank>.pt.trace.json`."""
        self.collective_rpc("start_profile", args=(profile_prefix,))

    def stop_profile(self) -> list[str | None]:
        """vLLM's: every rank's profiler off; each rank's trace file (None: the CUDA profiler)."""
        return self.collective_rpc("stop_profile")

    def get_metrics(self) -> list[Metric]:
        """vLLM's: the engine's counters and gauges now (tokens made, requests finished by
        reason, preemptions, prefix-cache queries and hits, running and waiting requests, KV
        cache usage), named as the server's /metrics names them."""
        with self._hook():  # between two steps of a generate on another thread
            return engine_metrics(self.engine.stats())

    # ---- RL hooks (safe from another thread: applied between two steps) ------------------

    @contextmanager
    def _hook(self) -> Iterator[None]:
        """The step lock for a hook, taken before the stepping thread's next step: `_step` waits
        until every hook that asked has had it. A plain lock is not fair: the stepping thread,
        releasing it and taking it back at once, could keep a hook out for a whole generation."""
        with self._asking:
            self._num_asking += 1
        try:
            self._lock.acquire()
        finally:
            with self._asking:
                self._num_asking -= 1
                self._asking.notify_all()
        try:
            yield
        finally:
            self._lock.release()

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list:
        """vLLM's: an Engine method's name, or a function taking the engine first, run on
        every tensor-parallel rank between steps (see rpc.py); each rank's result."""
        with self._hook():
            return self.engine.collective_rpc(method, timeout, args, kwargs)

    def apply_model(self, func: Callable[[Any], Any]) -> list:
        """vLLM's: `func(model)` on every rank's model, between steps; each rank's result."""
        with self._hook():
            return self.engine.apply_model(func)

    def update_weights(self, request: NamedTensors | dict | Any) -> None:
        """Copy (Hugging Face name, tensor) pairs into the weights in place (see Engine); or,
        given vLLM's `{"update_info": {...}}` (or a WeightTransferUpdateRequest), receive the
        tensors it announces from the trainer (see weight_transfer/)."""
        update_info = request_field(request, "update_info")
        with self._hook():
            if update_info is None:
                self.engine.update_weights(request)
            else:
                self.engine.receive_weights(update_info)

    def init_weight_transfer_engine(self, request: dict | Any) -> None:
        """Join the trainer's process group: `{"init_info": {"master_address", "master_port",
        "rank_offset", "world_size"}}` (vLLM's); returns once every member has joined."""
        init_info = required_field(request, "init_info")
        with self._hook():
            self.engine.init_weight_transfer_engine(init_info)

    def start_weight_update(self) -> None:
        """No step runs from now until `finish_weight_update`: none reads a half-sent model."""
        with self._hook():
            self.engine.start_weight_update()

    def finish_weight_update(self) -> None:
        with self._hook():
            self.engine.finish_weight_update()
            self._resumed.notify_all()

    def update_weights_from_path(self, path: str | Path) -> None:
        with self._hook():
            self.engine.update_weights_from_path(path)

    def reset_mm_cache(self) -> None:
        """vLLM's: tandem serves text models alone, so there is no multi-modal cache."""

    def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        """Forget every cached prompt block, e.g. after weights changed outside `update_weights`
        (which forgets them itself); blocks held by running requests stay theirs, unless
        `reset_running_requests` (vLLM's): then those requests recompute their KV too.
        `reset_connector` is vLLM's (tandem has no KV connector). True, as vLLM's: it cannot
        fail."""
        check_flags(reset_running_requests=reset_running_requests, reset_connector=reset_connector)
        with self._hook():
            self.engine.reset_prefix_cache(reset_running_requests)
        return True

    def pause_generation(self, mode: str = "keep", clear_cache: bool = False) -> None:
        """Stop stepping: "keep" holds the requests (a running `generate` waits), "abort" ends
        them, "wait" returns once a running `generate`'s admitted requests have finished (its
        others wait for `resume_generation`). With `clear_cache` (AsyncLLM's default, vLLM's),
        once paused the prefix cache is emptied and kept requests recompute their KV: weights
        written meanwhile outside `update_weights` are the ones used."""
        with self._hook():
            self.engine.pause_generation(mode, clear_cache)
            while self.engine.is_paused and not self.engine.paused:  # "wait": until drained
                self._resumed.wait()

    def resume_generation(self, recompute_kv: bool = False) -> None:
        with self._hook():
            self.engine.resume_generation(recompute_kv)
            self._resumed.notify_all()

    def sleep(self, level: int = 1, mode: str = "keep") -> int:
        """Free the KV cache and the weights' device memory (see Engine.sleep; level 0 only
        holds the steps); bytes freed. Requests of a `generate` running on another thread go
        on after `wake_up` ("keep"), end now ("abort"), or finish first ("wait"; its others
        wait for the wake-up), as AsyncLLM.sleep and vLLM's."""
        check_pause_mode(mode)
        if mode == "wait":
            self.pause_generation("wait")
        with self._hook():
            self.engine.drain()
            if mode == "abort":
                for request_id in list(self.engine.requests):
                    self.engine.abort(request_id)
            freed = self.engine.sleep(level)
            self.engine.resume_on_wake = mode == "wait"  # the pause was the sleep's
            self._resumed.notify_all()  # a waiting generate whose requests ended
            return freed

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Take back the memory of the parts named ("weights", "kv_cache"; None: both, and the
        steps a level 0 sleep held: vLLM's "scheduling")."""
        with self._hook():
            self.engine.wake_up(tags)
            self._resumed.notify_all()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: UseTqdm = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: list[int] | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text, {"prompt": text} or {"prompt_token_ids": [...]}, a
        dict with an optional "cache_salt"); outputs in input order. `lora_request`: one LoRA
        adapter for all, or one per prompt (None: the base model; needs enable_lora=True).
        `priority` is vLLM's, one per prompt (scheduling_policy "priority": lower first; "fcfs":
        0s alone). `tokenization_kwargs`: vLLM's, its `truncate_prompt_tokens` alone;
        `mm_processor_kwargs` (vLLM's): None or {} alone."""
        check_mm_processor_kwargs(mm_processor_kwargs)
        groups = self._requests_for(
            prompts, sampling_params, lora_request, priority, tokenization_kwargs
        )
        return self._run(groups, use_tqdm)

    def enqueue(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: list[int] | None = None,
        use_tqdm: UseTqdm = True,
        tokenization_kwargs: dict[str, Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> list[str]:
        """Queue prompts without running them, as vLLM's (its argument order, which is not
        `generate`'s): `wait_for_completion` runs them (a `generate` in between runs them too).
        Their request ids, in input order."""
        del use_tqdm  # queueing shows no progress
        check_mm_processor_kwargs(mm_processor_kwargs)
        groups = self._requests_for(
            prompts, sampling_params, lora_request, priority, tokenization_kwargs
        )
        with self._hook():
            self._enqueue_all([request for _, group in groups for request in group])
            self._enqueued += groups
        return [rid for rid, _ in groups]

    def wait_for_completion(
        self, output_type: type | tuple[type, ...] | None = None, *, use_tqdm: UseTqdm = True
    ) -> list[RequestOutput]:
        """Run every `enqueue`d request to its end; their outputs in the order queued."""
        if output_type is not None and not issubclass(RequestOutput, output_type):
            raise TypeError(f"this engine's outputs are RequestOutputs, not {output_type!r}")
        with self._hook():
            self._check_can_step()
            groups, self._enqueued = self._enqueued, []
        return self._run(groups, use_tqdm, queued=True)

    def _generate(
        self,
        prompts: Sequence[Prompt],
        params: list[SamplingParams],
        use_tqdm: UseTqdm,
        loras: list[LoRARequest | None] | None = None,
    ) -> list[tuple[str, list[Request]]]:
        groups = self._make_requests(prompts, params, loras)
        self._run(groups, use_tqdm, outputs=False)
        return groups

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: UseTqdm = True,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """vLLM's embeddings (pooling.py): each prompt's last token's final hidden state,
        L2-normalized unless its PoolingParams say not (`dimensions` keeps the first values);
        outputs in input order. The prompts run through the step loop beside any others."""
        cut = truncation(tokenization_kwargs, truncate_prompt_tokens)
        requests = self._pool(prompts, pooling_params, "embed", cut, use_tqdm, lora_request)
        return [EmbeddingRequestOutput(**_pooled(r, EmbeddingOutput)) for r in requests]

    def classify(
        self,
        prompts: Prompt | Sequence[Prompt],
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: UseTqdm = True,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> list[ClassificationRequestOutput]:
        """vLLM's classification with a sequence classifier (reward models among them): each
        prompt's last token's final hidden state through the checkpoint's score head, as
        probabilities (softmax; sigmoid for one label) unless `use_activation=False`."""
        cut = truncation(tokenization_kwargs, truncate_prompt_tokens)
        requests = self._pool(prompts, pooling_params, "classify", cut, use_tqdm, lora_request)
        return [ClassificationRequestOutput(**_pooled(r, ClassificationOutput)) for r in requests]

    def encode(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: UseTqdm = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        pooling_task: str | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> list[PoolingRequestOutput]:
        """vLLM's pooling of each prompt: `pooling_task` "embed" (`embed`'s vector) or
        "classify" (`classify`'s probabilities); None: "classify" for a sequence classifier, else
        "embed". Each output's `outputs.data` is a float32 tensor. Per-token pooling
        ("token_embed", "token_classify") is a ValueError: a prompt pools its last token."""
        task = pooling_task or ("classify" if self.engine.model_config.num_labels else "embed")
        if task not in ("embed", "classify"):
            raise ValueError(
                f"pooling_task must be 'embed' or 'classify' (a prompt pools its last token), "
                f"got {pooling_task!r}"
            )
        cut = truncation(tokenization_kwargs, truncate_prompt_tokens)
        requests = self._pool(prompts, pooling_params, task, cut, use_tqdm, lora_request)
        return [PoolingRequestOutput(**_pooled(r, pooled_tensor)) for r in requests]

    def _pool(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None,
        task: str,
        cut: Truncation,
        use_tqdm: UseTqdm,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
    ) -> list[Request]:
        """Run the prompts as pooling requests of `task` (pooling.py), in input order."""
        prompts = self._tokenized(prompt_list(prompts), cut)
        loras = per_prompt(lora_request, len(prompts))
        check_one_adapter_per_id(loras)  # before any is read (as `_make_requests`)
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            pooling_params = [pooling_params or PoolingParams()] * len(prompts)
        if len(pooling_params) != len(prompts):
            raise ValueError(f"got {len(pooling_params)} pooling_params for {len(prompts)} prompts")
        groups = []
        for prompt, pooling, lora in zip(prompts, pooling_params, loras, strict=True):
            if not isinstance(pooling, PoolingParams):
                raise TypeError(
                    f"pooling_params must be PoolingParams, got {type(pooling).__name__}"
                )
            carrier = pooling_carrier(pooling.truncation(cut.keep), cut.side)
            text, ids = split_prompt(prompt)
            rid = str(next(self._ids))
            request = self.engine.make_request(
                rid, carrier, text, ids, cache_salt=prompt_cache_salt(prompt),
                pooling=pooling.for_task(task), lora_request=lora,
            )  # fmt: skip
            groups.append((rid, [request]))
        self._run(groups, use_tqdm, outputs=False)
        return [request for _, [request] in groups]

    def score(
        self,
        data_1: str | Sequence[str],
        data_2: str | Sequence[str],
        /,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: UseTqdm = True,
        pooling_params: PoolingParams | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> list[ScoringRequestOutput]:
        """vLLM's scores of text pairs (scoring.py): 1:1, 1:N or N:N, one output per pair. A
        classifier of one label (a cross-encoder) scores each pair as one prompt; any other
        model by the cosine similarity of the two texts' embeddings. `lora_request` as
        `generate` takes it, one per pair."""
        firsts, seconds = scoring.pairs(data_1, data_2)
        if pooling_params is not None and not isinstance(pooling_params, PoolingParams):
            raise TypeError(
                f"pooling_params must be PoolingParams, got {type(pooling_params).__name__}"
            )
        engine = self.engine
        loras = per_prompt(lora_request, len(firsts))
        keep, side, add = truncation(tokenization_kwargs, truncate_prompt_tokens)
        if pooling_params is not None:  # its truncate_prompt_tokens cuts the pair too
            keep = pooling_params.truncation(keep)
        if scoring.cross_encodes(engine.model_config.num_labels):
            if add is False:
                raise ValueError(
                    "add_special_tokens=False: a cross-encoder reads each pair with its "
                    "tokenizer's pair template, special tokens included"
                )
            # a side named: the whole pair's ids, cut on it by the engine (as vLLM's)
            pair_keep = None if side else engine.max_model_len if keep == -1 else keep
            prompts = scoring.pair_prompts(
                engine.tokenizer, firsts, seconds, engine.separates_pairs, pair_keep
            )
            task = "score"
        else:  # the first texts, then every second, each embedded alone
            same = len({None if lora is None else lora.identity for lora in loras}) == 1
            prompts, task = scoring.embedded_once(firsts, seconds, same), "embed"
            loras = loras[: len(prompts) - len(seconds)] + loras
        requests = self._pool(
            prompts, pooling_params, task, Truncation(keep, side, add), use_tqdm, loras
        )
        if task == "embed":
            requests = scoring.spread(requests, len(seconds))
        return scoring.outputs(requests, task == "score", engine.tokenizer)

    def loglikelihood(
        self,
        contexts: Sequence[str | list[int]],
        continuations: Sequence[str | list[int]],
        use_tqdm: UseTqdm = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[LoglikelihoodOutput]:
        """The log-likelihood of each continuation after its context, in one batch (under a
        LoRA adapter, or one per pair, as `generate` takes them).

        Text contexts are encoded with the tokenizer's special tokens (e.g. BOS), continuations
        without, and the two token lists joined. Generates with `prompt_logprobs=1` and
        `max_tokens=0`: the joined prompt is prefilled once, nothing is sampled.
        """
        for name, texts in (("contexts", contexts), ("continuations", continuations)):
            if not isinstance(texts, Collection) or isinstance(texts, str | bytes):
                raise TypeError(  # a bare text would be read as one pair per character
                    f"{name} must be a list of texts or token-id lists, one per pair, "
                    f"got {type(texts).__name__}"
                )
        if len(contexts) != len(continuations):
            raise ValueError(f"got {len(contexts)} contexts for {len(continuations)} continuations")
        pairs = [
            (self._token_ids(c, special=True), self._token_ids(x, special=False))
            for c, x in zip(contexts, continuations, strict=True)
        ]
        for context, continuation in pairs:
            if not context or not continuation:
                raise ValueError("contexts and continuations must each give at least one token")
        params = [SamplingParams(max_tokens=0, prompt_logprobs=1)] * len(pairs)
        prompts = [{"prompt_token_ids": c + x} for c, x in pairs]
        loras = per_prompt(lora_request, len(prompts))
        groups = self._generate(prompts, params, use_tqdm, loras)  # floats: no Logprob made
        return [
            _loglikelihood(group[0].prompt_logprobs[len(c) :], x)
            for (_, group), (c, x) in zip(groups, pairs, strict=True)
        ]

    def beam_search(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: BeamSearchParams,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        use_tqdm: bool = False,
        concurrency_limit: int | None = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's beam search (beam_search.py), in vLLM's argument order: each prompt's best
        `params.beam_width` sequences, best first; `lora_request` as `generate` takes it;
        `concurrency_limit` prompts searched at a time."""
        return beam_search(self, prompts, params, use_tqdm, concurrency_limit, lora_request)

    def _token_ids(self, text_or_ids: str | list[int], special: bool) -> list[int]:
        if not isinstance(text_or_ids, str):
            if not isinstance(text_or_ids, Iterable) or isinstance(text_or_ids, bytes):
                raise TypeError(
                    "each context and continuation must be a text or a list of token ids, "
                    f"got {type(text_or_ids).__name__}"
                )
            return list(text_or_ids)
        if self.engine.tokenizer is None:
            raise ValueError(
                "no tokenizer here (skip_tokenizer_init=True, or the model has no "
                "tokenizer.json); pass token ids instead of text"
            )
        return self.engine.tokenizer.encode(text_or_ids, add_special_tokens=special)

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: UseTqdm = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate. The template's
        options as vLLM's LLM.chat takes them, in its order (`Tokenizer.apply_chat_template`); a
        content is a string or OpenAI's text parts, as the template takes it
        (`chat_template_content_format`, `tokenizer.content_format`: parts joined by newlines
        for a string); `chat_template` (Jinja source) replaces the model's template."""
        prompts = self._chat_prompts(
            messages,
            add_generation_prompt,
            continue_final_message,
            tools,
            chat_template_kwargs,
            chat_template,
            chat_template_content_format,
            truncation(tokenization_kwargs).add_special_tokens,
        )
        return self.generate(
            prompts, sampling_params, use_tqdm, lora_request,
            tokenization_kwargs=tokenization_kwargs, mm_processor_kwargs=mm_processor_kwargs,
        )  # fmt: skip

    def enqueue_chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: UseTqdm = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: list[int] | None = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> list[str]:
        """`chat`'s conversations queued as `enqueue` queues prompts (vLLM's, in its argument
        order: `priority` after `lora_request`): their request ids; `wait_for_completion` runs
        them."""
        prompts = self._chat_prompts(
            messages,
            add_generation_prompt,
            continue_final_message,
            tools,
            chat_template_kwargs,
            chat_template,
            chat_template_content_format,
            truncation(tokenization_kwargs).add_special_tokens,
        )
        return self.enqueue(
            prompts, sampling_params, lora_request, priority,
            tokenization_kwargs=tokenization_kwargs, mm_processor_kwargs=mm_processor_kwargs,
        )  # fmt: skip

    def _chat_prompts(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        add_generation_prompt: bool,
        continue_final_message: bool,
        tools: list[dict[str, Any]] | None,
        chat_template_kwargs: dict[str, Any] | None,
        chat_template: str | None,
        chat_template_content_format: str = "auto",
        add_special_tokens: bool | None = None,
    ) -> list[dict[str, Any]]:
        """Each conversation rendered by the chat template, as a prompt of ids and text; the
        text's ids without the tokenizer's special tokens (the template writes its own) unless
        `add_special_tokens` (tokenization_kwargs', vLLM's) is True."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise ValueError("this model has no tokenizer, so it has no chat template")
        try:
            source = tokenizer.get_chat_template(chat_template, tools)
            fmt = content_format(source, chat_template_content_format)
        except jinja2.TemplateError as error:
            raise ValueError(f"chat template failed to parse: {error}") from error
        conversations = [
            developer_as_system([template_message(m, fmt) for m in c], source)
            for c in _conversations(messages)
        ]
        if tools is not None and not (
            isinstance(tools, list) and all(isinstance(t, dict) for t in tools)
        ):
            raise TypeError(f"tools must be a list of tool dicts, got {tools!r:.60}")
        texts = [  # a template's own error is a ValueError (Tokenizer.apply_chat_template)
            tokenizer.apply_chat_template(
                c,
                tools,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tokenize=False,
                chat_template_kwargs=chat_template_kwargs,
            )
            for c in conversations
        ]
        return [
            {"prompt_token_ids": tokenizer.encode(text, bool(add_special_tokens)), "prompt": text}
            for text in texts
        ]

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` sample with when given no SamplingParams: SamplingParams'
        defaults with the model's recommended ones on top (`generation_config`, as in vLLM)."""
        return SamplingParams(**self.engine.sampling_defaults)

    def _params_per_prompt(self, sampling_params, count: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [self.get_default_sampling_params()] * count
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * count
        if not isinstance(sampling_params, Sequence) or isinstance(sampling_params, str | dict):
            raise TypeError(
                "sampling_params must be a SamplingParams or a list of them, "
                f"got {type(sampling_params).__name__}"
            )
        for index, params in enumerate(sampling_params):
            if not isinstance(params, SamplingParams):
                raise TypeError(
                    f"sampling_params[{index}] must be a SamplingParams, got {type(params).__name__}"
                )
        if len(sampling_params) != count:
            raise ValueError(f"got {len(sampling_params)} sampling_params for {count} prompts")
        return list(sampling_params)

    def _requests_for(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: Sequence[int] | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> list[tuple[str, list[Request]]]:
        cut = truncation(tokenization_kwargs)
        prompts = self._tokenized(prompt_list(prompts), cut)
        params = self._params_per_prompt(sampling_params, len(prompts))
        if cut != Truncation():
            params = [p.with_truncation(cut) for p in params]
        loras = per_prompt(lora_request, len(prompts))
        return self._make_requests(prompts, params, loras, _priorities(priority, len(prompts)))

    def _tokenized(self, prompts: list[Prompt], cut: Truncation) -> list[Prompt]:
        """The prompts, each text as its ids without special tokens where `tokenization_kwargs`
        said add_special_tokens=False (vLLM's)."""
        if cut.add_special_tokens is not False:
            return prompts
        return [without_special_tokens(p, self.engine.tokenizer) for p in prompts]

    def _make_requests(
        self,
        prompts: Sequence[Prompt],
        params: list[SamplingParams],
        loras: list[LoRARequest | None] | None = None,
        priorities: Sequence[int] | None = None,
    ) -> list[tuple[str, list[Request]]]:
        """Validate everything before queueing anything: one bad prompt rejects the whole call."""
        groups = []
        engine = self.engine
        loras = loras or [None] * len(prompts)
        # before any is read: the adapter cache may drop one read first before the second comes
        check_one_adapter_per_id(loras)
        priorities = priorities or [0] * len(prompts)
        for prompt, p, lora, priority in zip(prompts, params, loras, priorities, strict=True):
            p.validate()  # n=0 would otherwise make no request to validate
            text, ids = split_prompt(prompt)
            salt, embeds = prompt_cache_salt(prompt), prompt_embeds(prompt)
            base = str(next(self._ids))
            group = []
            for k in range(p.n):
                rid = base if p.n == 1 else f"{base}-{k}"
                group.append(
                    engine.make_request(
                        rid,
                        seeded(p, k),
                        text,
                        ids,
                        cache_salt=salt,
                        lora_request=lora,
                        priority=priority,
                        prompt_embeds=embeds,
                    )
                )
                if embeds is None:  # the first sample's ids: the prompt encoded once
                    ids = ids if ids is not None else group[0].prompt_token_ids
            groups.append((base, group))
        return groups

    def _enqueue_all(self, requests: list[Request]) -> None:
        """Queue the call's requests, all or none: where one is refused (its adapter could not
        be read again), those queued before it are aborted and the error raised."""
        for i, request in enumerate(requests):
            try:
                self.engine.enqueue(request)
            except BaseException:
                for queued in requests[:i]:
                    self.engine.abort(queued.request_id)
                raise

    def _check_can_step(self) -> None:
        if not self.engine.can_step:  # this thread would wait for itself
            raise RuntimeError(self.engine.hold)

    def _run(
        self,
        groups: list[tuple[str, list[Request]]],
        use_tqdm: UseTqdm,
        queued: bool = False,
        outputs: bool = True,
    ) -> list[RequestOutput]:
        """Step until the groups' requests (queued here unless `queued`) and all others have
        finished; with `outputs`, each group's RequestOutput, built as the group finishes (while
        the device runs the next step) rather than all at the end."""
        requests = [r for _, group in groups for r in group]
        finished_groups = _FinishedGroups(groups, token_text(self.engine.tokenizer))
        if not queued:
            with self._hook():  # another thread's generate may be stepping
                self._check_can_step()
                self._enqueue_all(requests)
        bar = progress_bar(use_tqdm, total=len(requests), desc="generate", unit="req")
        start, num_out = time.perf_counter(), 0
        with _full_collections_held():  # and while the outputs are built
            try:
                with bar:
                    while (updated := self._step()) is not None:
                        num_out += len(updated)
                        finished = sum(r.finished for r in updated)
                        if outputs:
                            finished_groups.add(updated)
                        if finished or updated:
                            bar.update(finished)
                            bar.set_postfix_str(
                                f"{num_out / (time.perf_counter() - start):.0f} tok/s",
                                refresh=False,
                            )
            except BaseException:
                # e.g. Ctrl-C: the call's requests must not run on inside the next call
                with self._hook():
                    for request in requests:
                        self.engine.abort(request.request_id)
                raise
            return finished_groups.outputs() if outputs else []

    def _step(self) -> list[Request] | None:
        """What the next step updated, waiting while the engine is held (paused, asleep, taking
        weights); None when all are done."""
        with self._asking:  # hooks from other threads first
            self._asking.wait_for(lambda: self._num_asking == 0)
        with self._lock:
            while self.engine.has_unfinished() and not self.engine.can_step:
                self._resumed.wait()
            if not self.engine.has_unfinished():
                return None
            updated = self.engine.step()
            if self.engine.paused:  # e.g. pause_generation("wait") drained: wake its caller
                self._resumed.notify_all()
            return updated


def _priorities(priority: Sequence[int] | None, count: int) -> Sequence[int]:
    """vLLM's `priority` argument of `generate`: one per prompt (None: 0 for each)."""
    if priority is None:
        return [0] * count
    if not isinstance(priority, Sequence) or isinstance(priority, str):
        raise TypeError(
            f"priority must be a list of ints, one per prompt, got {type(priority).__name__}"
        )
    if len(priority) != count:
        raise ValueError(f"got {len(priority)} priorities for {count} prompts")
    return priority


_held_lock = threading.Lock()
_held_runs = 0  # generate loops running (threads may run several at once)
_saved_threshold = 0


@contextmanager
def _full_collections_held() -> Iterator[None]:
    """No automatic full (oldest-generation) garbage collection while generate loops run and
    build their outputs; the young generations are still collected. A full collection walks
    every object alive, the outputs built so far included: with a rollout's 131k sample-logprob
    entries (a Logprob and a dict each) one took 40-200 ms on a 2-core host, and the device, one
    step ahead (about 13 ms), idled through it. generate makes no reference cycles (a test
    holds it to that), so nothing waits on a full collection to be freed meanwhile; the first
    one after the call comes in the caller's own allocations. The first loop in holds them,
    the last one out restores the threshold it found."""
    global _held_runs, _saved_threshold
    with _held_lock:
        if _held_runs == 0:
            first, second, _saved_threshold = gc.get_threshold()
            gc.set_threshold(first, second, 1 << 30)  # gen-1 collections before a full one
        _held_runs += 1
    try:
        yield
    finally:
        with _held_lock:
            _held_runs -= 1
            if _held_runs == 0:
                first, second, _ = gc.get_threshold()
                gc.set_threshold(first, second, _saved_threshold)


class _FinishedGroups:
    """The RequestOutput of each group (a prompt's n samples), built once all its requests
    have finished, and their sample logprobs' Logprob objects step by step: during the run,
    while the device computes the next step, not all after the last (a rollout whose samples
    all end together would otherwise build every one of them then)."""

    def __init__(self, groups: list[tuple[str, list[Request]]], text: TokenText):
        self.groups, self.text = groups, text
        self.group_of = {id(r): i for i, (_, group) in enumerate(groups) for r in group}
        # each group's requests not yet seen finished (counted, not scanned: n may be 16,384)
        self.unfinished = [len(group) for _, group in groups]
        self.seen_finished: set[int] = set()  # id(request)
        self.built: dict[int, RequestOutput] = {}
        self.logprobs: dict[int, SampleLogprobs] = {}  # id(request) -> so far

    def add(self, updated: list[Request]) -> None:
        """A step's updated requests: their new logprobs built, finished groups' outputs too."""
        for request in updated:
            i = self.group_of.get(id(request))
            if i is None:
                continue
            if request.logprobs is not None:
                self._logprobs_of(request)
            if not request.finished or id(request) in self.seen_finished:
                continue
            self.seen_finished.add(id(request))
            self.unfinished[i] -= 1
            if self.unfinished[i] == 0:
                self.built[i] = self._output(i)

    def outputs(self) -> list[RequestOutput]:
        """Every group's, in order (those that finished without a step built now)."""
        return [self.built.get(i) or self._output(i) for i in range(len(self.groups))]

    def _output(self, i: int) -> RequestOutput:
        return _request_output(*self.groups[i], self.text, self._logprobs_of)

    def _logprobs_of(self, request: Request) -> SampleLogprobs | None:
        """The request's sample logprobs as Logprob objects (or one FlatLogprobs), those not built
        yet built now."""
        if request.logprobs is None:
            return None
        built = self.logprobs.get(id(request))
        if built is None:
            built = self.logprobs[id(request)] = (
                FlatLogprobs() if request.params.flat_logprobs else []
            )
        if len(built) < len(request.logprobs):
            built += _sample_logprobs(request, self.text, start=len(built))
        return built


def _conversations(messages: Any) -> list[list[dict[str, Any]]]:
    """`chat`'s messages, one conversation (a list of message dicts) or a list of them, as a list
    of conversations."""

    def is_list(value: Any) -> bool:
        return isinstance(value, Sequence) and not isinstance(value, str | bytes)

    if is_list(messages) and messages and all(isinstance(m, dict) for m in messages):
        return [list(messages)]
    if is_list(messages) and all(
        is_list(c) and all(isinstance(m, dict) for m in c) for c in messages
    ):
        return [list(c) for c in messages]
    raise TypeError(
        "messages must be a conversation (a list of message dicts such as {'role': 'user', "
        f"'content': ...}}) or a list of conversations, got {type(messages).__name__}"
    )


def pooled_tensor(vector: list[float] | None) -> PoolingOutput:
    return PoolingOutput(None if vector is None else torch.tensor(vector, dtype=torch.float32))


def _pooled(request: Request, output: Callable) -> dict[str, Any]:
    """A pooling request's output fields, `output` holding what it pooled (None, and finished
    False, when it was aborted, e.g. by a pause's abort)."""
    return {
        "request_id": request.request_id,
        "outputs": output(request.pooled),
        "prompt_token_ids": request.prompt_token_ids,
        "finished": request.pooled is not None,
        "num_cached_tokens": request.num_cached_tokens or 0,
    }


def _loglikelihood(entries: list[dict[int, float]], continuation: list[int]) -> LoglikelihoodOutput:
    # each entry holds the top-1 id first, then the token itself when it ranked lower
    token_logprobs = [e[t] for e, t in zip(entries, continuation, strict=True)]
    is_greedy = all(next(iter(e)) == t for e, t in zip(entries, continuation, strict=True))
    return LoglikelihoodOutput(sum(token_logprobs), is_greedy, token_logprobs)


def _request_output(
    request_id: str,
    group: list[Request],
    text: TokenText,
    logprobs_of: Callable[[Request], SampleLogprobs | None],
) -> RequestOutput:
    """The group's RequestOutput, each request's sample logprobs from `logprobs_of`."""
    first = group[0]
    return RequestOutput(
        request_id=request_id,
        prompt=first.prompt,
        prompt_token_ids=first.given_prompt_ids,
        outputs=[
            CompletionOutput(
                index=k,
                text=r.output_text,
                token_ids=list(r.output_token_ids),
                cumulative_logprob=_cumulative_logprob(r),
                logprobs=logprobs_of(r),
                finish_reason=r.finish_reason,
                stop_reason=r.stop_reason,
                lora_request=r.lora_request,
            )
            for k, r in enumerate(group)
        ],
        num_cached_tokens=first.num_cached_tokens or 0,
        num_cache_creation_tokens=first.num_cache_creation_tokens or 0,
        prompt_logprobs=_prompt_logprobs(first, text),
        lora_request=first.lora_request,
    )


def _cumulative_logprob(request: Request) -> float | None:
    if request.params.logprobs is None:
        return None
    return cumulative_logprob(request.logprobs or [], request.output_token_ids)


def _sample_logprobs(request: Request, text: TokenText, start: int = 0) -> SampleLogprobs | None:
    """The request's sample logprobs from output position `start` on, as Logprob objects."""
    if request.logprobs is None:
        return None
    text = text if request.params.detokenize else no_text
    entries, end = request.logprobs[start:], len(request.logprobs)
    tokens, ranks = request.output_token_ids[start:end], request.sampled_ranks[start:end]
    params = request.params
    return sample_logprobs(
        entries, tokens, ranks, params.num_top_logprobs, text, params.flat_logprobs
    )


def _prompt_logprobs(request: Request, text: TokenText) -> PromptLogprobs | None:
    if request.prompt_logprobs is None:
        return None
    text = text if request.params.detokenize else no_text
    tokens, ranks = request.prompt_token_ids, request.prompt_ranks
    return prompt_logprobs(
        request.prompt_logprobs, tokens, ranks, request.params.prompt_logprobs, text,
        request.params.flat_logprobs,
    )  # fmt: skip
