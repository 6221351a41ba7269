"""vLLM's prompt dicts (`vllm.inputs`): the keys a prompt given as a dict may hold.

A prompt is text, or one of these dicts; `split_prompt` (request.py) reads them. A key that none
of them names is a ValueError, not dropped: an image in `multi_modal_data` left out would answer
a question about a picture that the model never saw.
"""

from __future__ import annotations

from typing import Any, NotRequired, TypedDict


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
