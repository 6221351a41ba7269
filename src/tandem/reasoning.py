"""Reasoning parsers (`reasoning_parser`, vLLM's names and `--reasoning-parser`): an answer's
thinking runs from its start, or from a `<think>` that opens it, to `</think>`.

Two things follow it. The server puts a chat answer's thinking in the message's `reasoning` and
the rest in `content`, whole or as stream deltas (`ReasoningSplitter`). The engine starts a
request's structured-output grammar only once its thinking ends: while a constrained request
thinks, its row's mask allows every token and its matcher is not advanced; the `</think>` token
read back ends the thinking (structured.py). The state is the host's, current when the next
step's masks are filled, so the gate adds no wait. A prompt whose last tag is `</think>` (a
template run with `enable_thinking: false`, an assistant prefill that closed it) answers
without thinking; one whose last tag is `<think>`, or that has none, thinks first.

Both parsers use `<think>` and `</think>`, which must be tokens of the model's vocabulary;
"qwen3" also ends the thinking at a `<tool_call>` in the text (kept in the content, for the
tool-call parser) when no `</think>` follows (which wins, as vLLM's: thinking that mentions the
tag goes on). A stream holds the text from the tag on until the call's `</tool_call>` (or the
answer's end) says which, and, on the server, takes `enable_thinking: false` in the template's kwargs
as no thinking.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

THINK_START, THINK_END = "<think>", "</think>"
TOOL_CALL_END = "</tool_call>"  # qwen3's: a call closed with no </think> yet ends the thinking


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    ends: tuple[str, ...]  # what ends the thinking part in the text; the first is dropped
    follows_enable_thinking: bool  # enable_thinking: false in the template: no thinking

    def splitter(
        self, thinking: bool, chat_template_kwargs: dict[str, Any] | None = None
    ) -> ReasoningSplitter:
        """A choice's splitter; `thinking`: the prompt leaves the thinking open."""
        off = (
            self.follows_enable_thinking
            and (chat_template_kwargs or {}).get("enable_thinking", True) is False
        )
        return ReasoningSplitter(self.ends, thinking and not off)


PARSERS = {
    "deepseek_r1": ReasoningParser("deepseek_r1", (THINK_END,), follows_enable_thinking=False),
    "qwen3": ReasoningParser("qwen3", (THINK_END, "<tool_call>"), follows_enable_thinking=True),
}


def check_parser(name: str | None) -> None:
    if name is not None and name not in PARSERS:
        raise ValueError(
            f"reasoning_parser {name!r} is not known; choose one of {', '.join(PARSERS)}"
        )


@dataclass(frozen=True)
class ThinkTokens:
    """The token ids of <think> and </think> in a model's vocabulary."""

    start: int
    end: int
    # the tokenizer's special tokens (a chat's turn markers, such as <|im_start|>)
    special: frozenset[int] = frozenset()

    @classmethod
    def of(cls, name: str, tokenizer: Any) -> ThinkTokens:
        if tokenizer is None:
            raise ValueError(f"reasoning_parser {name!r} needs the model's tokenizer.json")
        ids = [tokenizer.backend.token_to_id(tag) for tag in (THINK_START, THINK_END)]
        if None in ids:
            raise ValueError(
                f"reasoning_parser {name!r} needs {THINK_START} and {THINK_END} as tokens of "
                "the model's vocabulary; this tokenizer has no such token"
            )
        return cls(*ids, frozenset(tokenizer.all_special_ids) - set(ids))

    def ended(self, prompt_token_ids: Sequence[int]) -> bool:
        """Whether the prompt closed the thinking: its last tag is </think> (vLLM's check) in
        the turn it ends with. A special token after that tag (<|im_start|>) starts a later
        turn: the </think> closed an earlier answer's thinking (a tool call's, in a chat's
        history), and the new answer thinks again."""
        for token in reversed(prompt_token_ids):
            if token == self.start or token in self.special:
                return False
            if token == self.end:
                return True
        return False


class ReasoningSplitter:
    """One choice's text -> (reasoning, content) pieces as it grows. Text that may be the start
    of a tag is held back until the next piece says whether it is one."""

    def __init__(self, ends: tuple[str, ...], thinking: bool):
        self.ends = ends
        self.state = "opening" if thinking else "content"  # then "thinking", then "content"
        self.held = ""

    def feed(self, text: str, final: bool) -> tuple[str, str]:
        """The reasoning and the content that `text` (the next delta) settles."""
        if self.state == "content":
            return "", text
        self.held += text
        if self.state == "opening":  # a <think> that opens the answer is dropped
            stripped = self.held.lstrip()
            if stripped.startswith(THINK_START):
                self.held, self.state = stripped[len(THINK_START) :], "thinking"
            elif not final and THINK_START.startswith(stripped):
                return "", ""  # may still become "<think>"
            else:
                self.state = "thinking"  # the template opened it in the prompt
        at = self.held.find(self.ends[0])
        if at >= 0:  # </think> ends the thinking wherever the other tags stand
            reasoning, rest = self.held[:at], self.held[at + len(self.ends[0]) :]
            self.state, self.held = "content", ""
            return reasoning, rest
        others = [self.held.find(end) for end in self.ends[1:] if end in self.held]
        if others:  # the content from there on, unless a </think> comes after it
            at = min(others)
            reasoning, rest = self.held[:at], self.held[at:]
            # held until the answer ends or the call closes: a call without </think> after it
            # is the answer's, and then streams as it comes
            if final or TOOL_CALL_END in rest:
                self.state, self.held = "content", ""
                return reasoning, rest
            self.held = rest
            return reasoning, ""
        keep = 0 if final else held_tag_prefix(self.held, self.ends)
        reasoning, self.held = (
            self.held[: len(self.held) - keep],
            self.held[len(self.held) - keep :],
        )
        return reasoning, ""


def held_tag_prefix(text: str, tags: tuple[str, ...]) -> int:
    """The length of the longest end of `text` that begins one of `tags`."""
    for size in range(min(len(text), max(map(len, tags)) - 1), 0, -1):
        tail = text[-size:]
        if any(tag.startswith(tail) for tag in tags):
            return size
    return 0


def split(splitter: ReasoningSplitter, text: str) -> tuple[str | None, str]:
    """A whole answer's reasoning (None: none) and content."""
    reasoning, content = splitter.feed(text, final=True)
    return reasoning or None, content
