"""lm-evaluation-harness on the offline engine: `TandemLM`, registered as lm-eval's model
"tandem" (the `eval` extra: pip install 'tandem[eval]'), the counterpart of its "vllm" model.

    import lm_eval
    import tandem.evaluation  # registers "tandem"

    lm_eval.simple_evaluate(model="tandem", model_args="pretrained=FOLDER,max_model_len=4096",
                            tasks=["hellaswag"])

or lm-eval's command with the model registered: `python -m tandem.evaluation run --model tandem
--model_args pretrained=FOLDER --tasks hellaswag` (what `lm_eval run` takes).

Loglikelihoods (multiple-choice tasks) and rolling loglikelihoods (perplexity) are
`LLM.loglikelihood`: every context and continuation prefilled once, with `prompt_logprobs=1` and
nothing sampled. `generate_until` is `LLM.generate` with the task's stop strings, greedy unless
the task samples. Every call of lm-eval's is one batch: the engine schedules it whole.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, maybe_truncate, normalize_gen_kwargs
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from tandem.llm import LLM
from tandem.sampling import SamplingParams

DEFAULT_MAX_GEN_TOKS = 256
SAMPLING_FIELDS = {f.name for f in fields(SamplingParams)}


@register_model("tandem")
class TandemLM(TemplateLM):
    """lm-eval's model over a tandem `LLM`: `pretrained` is the model (a folder, Hub id or
    preset), or an LLM already built; the other arguments are the LLM's engine arguments, and
    lm-eval's `max_gen_toks` and `max_length` (default: the engine's max_model_len)."""

    def __init__(
        self,
        pretrained: str | LLM,
        max_gen_toks: int = DEFAULT_MAX_GEN_TOKS,
        max_length: int | None = None,
        add_bos_token: bool | None = None,  # lm-eval's: None, as the tokenizer encodes
        truncation_side: str = "left",  # lm-eval's vllm model's: where a long context is cut
        batch_size: int | str = "auto",  # lm-eval's; the engine batches every call whole
        max_batch_size: int | None = None,  # lm-eval's, likewise
        device: str | None = None,  # lm-eval's (its "cuda" by default); the engine picks its own
        **engine_args: Any,
    ):
        super().__init__()
        del batch_size, max_batch_size, device
        if truncation_side not in ("left", "right", "middle"):
            raise ValueError(
                f"truncation_side must be left, right or middle, got {truncation_side!r}"
            )
        self.add_bos_token, self.truncation_side = add_bos_token, truncation_side
        self.llm = pretrained if isinstance(pretrained, LLM) else LLM(pretrained, **engine_args)
        self.tokenizer = self.llm.get_tokenizer()
        if self.tokenizer is None:
            raise ValueError("lm-eval's tasks are text: the model needs its tokenizer.json")
        limit = self.llm.engine.max_model_len
        if max_length is not None and not 2 < max_length <= limit:
            raise ValueError(f"max_length must be in [3, max_model_len={limit}], got {max_length}")
        self._max_length = max_length or limit
        self.max_gen_toks = max_gen_toks
        self._name = (
            str(pretrained) if isinstance(pretrained, str) else pretrained.engine.config.model
        )

    @property
    def eot_token_id(self) -> int:
        return self.llm.engine.eos_token_ids[0]

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return self.eot_token_id if bos is None else bos

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return self._name

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, **kwargs
    ) -> list[int]:
        """As lm-eval's vllm and hf models: the tokenizer's special tokens unless
        `add_special_tokens` or `add_bos_token` says otherwise, none on a text that already
        begins with the BOS text (a chat template's)."""
        special = add_special_tokens if add_special_tokens is not None else self.add_bos_token
        bos = self.tokenizer.decode(self.prefix_token_id)
        if bos and string.startswith(bos):
            special = False
        return self.tokenizer.encode(string, add_special_tokens=special is not False)

    def apply_chat_template(
        self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        return self.tokenizer.apply_chat_template(
            chat_history, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def _loglikelihood_tokens(
        self, requests: list[tuple[Any, list[int], list[int]]], disable_tqdm: bool = False, **kwargs
    ) -> list[tuple[float, bool]]:
        """Each (cache key, context ids, continuation ids): the continuation's logprob and
        whether it is the greedy one. A pair past max_length keeps its last tokens (the context's
        first go, then the continuation's), at least one of them context."""
        contexts, continuations = [], []
        for _, context, continuation in requests:
            tokens = (context + continuation)[-(self.max_length - 1) :]
            scored = min(len(continuation), len(tokens) - 1)
            contexts.append(tokens[:-scored])
            continuations.append(tokens[-scored:])
        outputs = self.llm.loglikelihood(contexts, continuations, use_tqdm=not disable_tqdm)
        answers = [(out.logprob, out.is_greedy) for out in outputs]
        for (key, _, _), answer in zip(requests, answers, strict=True):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return answers

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text's whole log-likelihood, over windows of max_length tokens (lm-eval's)."""
        windows, owners = [], []
        for i, (text,) in enumerate(request.args for request in requests):
            for context, continuation in map(
                make_disjoint_window,
                get_rolling_token_windows(
                    token_list=self.tok_encode(text),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length - 2,  # a window and its context token fit
                    context_len=1,
                ),
            ):
                windows.append((None, context, continuation))
                owners.append(i)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(
            owners, self._loglikelihood_tokens(windows, disable_tqdm), strict=True
        ):
            totals[owner] += logprob
        for request, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each (context, generation kwargs): the completion up to the first of `until` or the
        EOS text (the stop string left out), at most `max_gen_toks` tokens; the kwargs read as
        lm-eval's vllm model reads them (its aliases of max_gen_toks, greedy unless `do_sample`,
        special tokens kept in the text), a long context cut from `truncation_side`."""
        eos = self.tokenizer.decode(self.eot_token_id)
        prompts, params = [], []
        for context, gen_kwargs in (request.args for request in requests):
            kwargs = dict(normalize_gen_kwargs(gen_kwargs, default_max_gen_toks=self.max_gen_toks))
            until = handle_stop_sequences(kwargs.pop("until"), eos=eos or None)
            max_tokens = int(kwargs.pop("max_gen_toks"))
            # greedy unless the task samples (do_sample false sets temperature 0 above)
            kwargs.setdefault("temperature", 1.0 if kwargs.pop("do_sample") else 0.0)
            kwargs.setdefault("skip_special_tokens", False)
            unknown = sorted(set(kwargs) - SAMPLING_FIELDS)
            if unknown:
                raise ValueError(f"generation kwargs {unknown} are not SamplingParams fields")
            ids, max_tokens = maybe_truncate(
                self.tok_encode(context),
                max_gen_toks=max_tokens,
                max_model_len=self.max_length,
                side=self.truncation_side,
                shrink_gen_toks=max_tokens >= self.max_length,  # a context keeps a token
                verbose=False,
            )
            prompts.append({"prompt_token_ids": ids})
            params.append(
                SamplingParams(max_tokens=max_tokens, stop=[s for s in until if s], **kwargs)
            )
        outputs = self.llm.generate(prompts, params, use_tqdm=not disable_tqdm)
        texts = [out.outputs[0].text for out in outputs]
        for request, text in zip(requests, texts, strict=True):
            self.cache_hook.add_partial("generate_until", request.args, text)
        return texts


if __name__ == "__main__":  # lm-eval's command line, with "tandem" among its models
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()
