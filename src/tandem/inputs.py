"""vLLM's prompt dicts (`vllm.inputs`): the keys a prompt given as a dict may hold.

A prompt is text, or one of these dicts; `split_prompt` (request.py) reads them. A key that none
of them names is a ValueError, not dropped: an image in `multi_modal_data` left out would answer
a question about a picture that the model never saw.
"""

from __future__ import annotations

from typing import Any, NamedTuple, NotRequired, TypedDict


class TextPrompt(TypedDict):
    prompt: str
    cache_salt: NotRequired[str]  # shares cached blocks only with prompts of the same salt


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    prompt: NotRequired[str]  # the text the ids came from, for the output's `prompt`
    cache_salt: NotRequired[str]


class EmbedsPrompt(TypedDict):
    prompt_embeds: Any  # a [tokens, hidden] tensor (prompt_embeds.py)
    cache_salt: NotRequired[str]


PromptType = str | TextPrompt | TokensPrompt | EmbedsPrompt

KEYS = frozenset().union(
    *(
        form.__required_keys__ | form.__optional_keys__
        for form in (TextPrompt, TokensPrompt, EmbedsPrompt)
    )
)


def check_keys(prompt: dict[str, Any]) -> None:
    """A ValueError naming the keys of a prompt dict that tandem does not read (vLLM's
    multi_modal_data, token_type_ids, ...), unless they are None or empty (asking for nothing)."""
    unknown = sorted(k for k, v in prompt.items() if k not in KEYS and not asks_nothing(v))
    if unknown:
        raise ValueError(
            f"a prompt dict holds {', '.join(sorted(KEYS))}; got {', '.join(map(repr, unknown))}, "
            "which tandem does not read (it takes no multi-modal data or token type ids)"
        )


def asks_nothing(value: Any) -> bool:
    return value is None or (isinstance(value, dict | list) and not value)


def check_mm_processor_kwargs(mm_processor_kwargs: dict[str, Any] | None) -> None:
    """vLLM's per-call options of a multi-modal processor: None or {} alone (tandem serves text
    models, which have none)."""
    if not asks_nothing(mm_processor_kwargs):
        raise ValueError(
            f"mm_processor_kwargs={mm_processor_kwargs!r}: tandem serves text models alone, "
            "which have no multi-modal processor to pass options to"
        )


class Truncation(NamedTuple):
    """How a call tokenizes and cuts its prompts: to `keep` tokens (None: all), on `side`
    ("left" keeps the last, "right" the first; None: the model's, as vLLM's tokenizer); a text
    prompt with the tokenizer's special tokens unless `add_special_tokens` is False (None: the
    call's default)."""

    keep: int | None = None
    side: str | None = None
    add_special_tokens: bool | None = None


TOKENIZATION_KWARGS = (
    "truncate_prompt_tokens", "truncation_side", "add_special_tokens", "truncation", "max_length",
)  # fmt: skip


def truncation(tokenization_kwargs: dict[str, Any] | None, given: int | None = None) -> Truncation:
    """vLLM's `tokenization_kwargs` as read here: its `truncate_prompt_tokens` (where vLLM moves
    the methods' own argument), or `given`, its `truncation_side` and `add_special_tokens`, and
    transformers' `truncation=True` (to `max_length`, else all that fit: -1), as vLLM reads
    them; another key is a ValueError."""
    if tokenization_kwargs is None:
        return Truncation(given)
    if not isinstance(tokenization_kwargs, dict):
        raise TypeError(
            f"tokenization_kwargs must be a dict, got {type(tokenization_kwargs).__name__}"
        )
    other = sorted(set(tokenization_kwargs) - set(TOKENIZATION_KWARGS))
    if other:
        raise ValueError(
            f"tokenization_kwargs takes {', '.join(TOKENIZATION_KWARGS)} here, got {other}"
        )
    keep = tokenization_kwargs.get("truncate_prompt_tokens")
    cut, most = tokenization_kwargs.get("truncation"), tokenization_kwargs.get("max_length")
    if cut not in (None, True, False, "longest_first", "do_not_truncate"):
        raise ValueError(
            f"truncation must be True, False, 'longest_first' or 'do_not_truncate', got {cut!r:.40}"
        )
    if most is not None and cut not in (True, "longest_first"):
        raise ValueError("max_length cuts prompts with truncation=True; give truncation too")
    if cut in (True, "longest_first"):
        if keep is not None:
            raise ValueError("give truncate_prompt_tokens or truncation, not both")
        keep = -1 if most is None else most
    add = tokenization_kwargs.get("add_special_tokens")
    if add is not None and not isinstance(add, bool):
        raise ValueError(f"add_special_tokens must be True or False, got {add!r:.40}")
    if given is not None and keep is not None and keep != given:
        raise ValueError(
            f"truncate_prompt_tokens is {given} and tokenization_kwargs' is {keep}: give one"
        )
    side = tokenization_kwargs.get("truncation_side")
    if side not in (None, "left", "right"):
        raise ValueError(f"truncation_side must be 'left', 'right' or None, got {side!r:.40}")
    return Truncation(given if keep is None else keep, side, add)
