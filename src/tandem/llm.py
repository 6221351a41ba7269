"""Offline batch generation, shaped like vLLM's `LLM` so switching is one import."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import jinja2
from tqdm import tqdm

from tandem.config import EngineConfig
from tandem.engine import Engine
from tandem.request import Request
from tandem.sampling import MAX_SEED, SamplingParams
from tandem.weights import NamedTensors

Prompt = str | dict[str, Any]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[dict[int, float]] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class LLM:
    """`LLM(model=folder_or_preset, **engine_args)`; see EngineConfig for the arguments."""

    def __init__(self, model: str, **engine_args: Any):
        self.engine = Engine(EngineConfig(model=model, **engine_args))
        self._next_id = 0
        # the engine is stepped under this lock, so the RL hooks below, called from another
        # thread while `generate` runs, land between two steps; `_resumed` wakes a paused loop
        self._lock = threading.RLock()
        self._resumed = threading.Condition(self._lock)

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes (nothing to do on one device)."""
        self.engine.shutdown()

    def get_tokenizer(self):
        return self.engine.tokenizer

    # ---- RL hooks (safe from another thread: applied between two steps) ------------------

    def update_weights(self, named_tensors: NamedTensors) -> None:
        """Copy (Hugging Face name, tensor) pairs into the weights in place (see Engine)."""
        with self._lock:
            self.engine.update_weights(named_tensors)

    def update_weights_from_path(self, path: str | Path) -> None:
        with self._lock:
            self.engine.update_weights_from_path(path)

    def pause_generation(self, mode: str = "keep") -> None:
        """Stop stepping: "keep" holds the requests (a running `generate` waits), "abort" ends them."""
        with self._lock:
            self.engine.pause_generation(mode)

    def resume_generation(self, recompute_kv: bool = False) -> None:
        with self._lock:
            self.engine.resume_generation(recompute_kv)
            self._resumed.notify_all()

    def sleep(self, level: int = 1) -> int:
        """Free the KV cache and the weights' device memory (see Engine.sleep); bytes freed."""
        with self._lock:
            return self.engine.sleep(level)

    def wake_up(self) -> None:
        with self._lock:
            self.engine.wake_up()
            self._resumed.notify_all()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or {"prompt_token_ids": [...]}); outputs in input order."""
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        params = self._params_per_prompt(sampling_params, len(prompts))
        groups = self._make_requests(prompts, params)
        self._run([r for _, group in groups for r in group], use_tqdm)
        return [_request_output(rid, group) for rid, group in groups]

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise ValueError("this model has no tokenizer, so it has no chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        try:
            texts = [tokenizer.apply_chat_template(c) for c in conversations]
        except jinja2.TemplateError as error:  # e.g. a message without "role" or "content"
            raise ValueError(f"chat template failed on the messages: {error}") from error
        prompts = [
            {"prompt_token_ids": tokenizer.encode(text, add_special_tokens=False), "prompt": text}
            for text in texts
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _params_per_prompt(self, sampling_params, count: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * count
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * count
        if len(sampling_params) != count:
            raise ValueError(f"got {len(sampling_params)} sampling_params for {count} prompts")
        return list(sampling_params)

    def _make_requests(
        self, prompts: Sequence[Prompt], params: list[SamplingParams]
    ) -> list[tuple[str, list[Request]]]:
        """Validate everything before queueing anything: one bad prompt rejects the whole call."""
        groups = []
        engine = self.engine
        for prompt, p in zip(prompts, params, strict=True):
            p.validate()  # n=0 would otherwise make no request to validate
            text, ids = _split_prompt(prompt)
            base = str(self._next_id)
            self._next_id += 1
            group = []
            for k in range(p.n):
                sibling = (
                    p
                    if p.seed is None or k == 0
                    else replace(p, seed=(p.seed + k) % (MAX_SEED + 1))
                )
                rid = base if p.n == 1 else f"{base}-{k}"
                group.append(engine.make_request(rid, sibling, prompt=text, prompt_token_ids=ids))
                ids = ids if ids is not None else group[0].prompt_token_ids
            groups.append((base, group))
        return groups

    def _run(self, requests: list[Request], use_tqdm: bool) -> None:
        with self._lock:
            if not self.engine.can_step:  # this thread would wait for itself
                raise RuntimeError(
                    "the engine is paused or asleep; call resume_generation() / wake_up() first"
                )
            for request in requests:
                self.engine.enqueue(request)
        bar = tqdm(total=len(requests), desc="generate", unit="req", disable=not use_tqdm)
        start, num_out = time.perf_counter(), 0
        try:
            with bar:
                while (updated := self._step()) is not None:
                    num_out += len(updated)
                    finished = sum(r.finished for r in updated)
                    if finished or updated:
                        bar.update(finished)
                        bar.set_postfix_str(
                            f"{num_out / (time.perf_counter() - start):.0f} tok/s", refresh=False
                        )
        except BaseException:
            # e.g. Ctrl-C: the call's requests must not run on inside the next call
            with self._lock:
                for request in requests:
                    self.engine.abort(request.request_id)
            raise

    def _step(self) -> list[Request] | None:
        """What the next step updated, waiting while paused or asleep; None when all are done."""
        with self._lock:
            while self.engine.has_unfinished() and not self.engine.can_step:
                self._resumed.wait()
            if not self.engine.has_unfinished():
                return None
            return self.engine.step()


def _split_prompt(prompt: Prompt) -> tuple[str | None, list[int] | None]:
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        return prompt.get("prompt"), prompt["prompt_token_ids"]
    raise ValueError(f"a prompt is a string or {{'prompt_token_ids': [...]}}, got {prompt!r:.80}")


def _request_output(request_id: str, group: list[Request]) -> RequestOutput:
    first = group[0]
    return RequestOutput(
        request_id=request_id,
        prompt=first.prompt,
        prompt_token_ids=first.prompt_token_ids,
        outputs=[
            CompletionOutput(
                k, r.output_text, list(r.output_token_ids), r.finish_reason, r.logprobs
            )
            for k, r in enumerate(group)
        ],
        num_cached_tokens=first.num_cached_tokens or 0,
    )
