"""Reasoning parsers (`--reasoning-parser`, vLLM's names): a chat answer's thinking, between
`<think>` and `</think>`, goes to the message's `reasoning` and the rest to its `content`, whole
or as stream deltas. Both parsers start in the thinking part (a thinking model's template may
open `<think>` in the prompt), drop a `<think>` that opens it, and end it at `</think>`;
"qwen3" also ends it at a `<tool_call>` (which stays in the content, for the tool-call parser)
and starts in the content when the request's template runs with `enable_thinking: false`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

THINK_START, THINK_END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    ends: tuple[str, ...]  # what ends the thinking part; the first is dropped, others kept
    follows_enable_thinking: bool  # enable_thinking: false in the template starts in content

    def splitter(
        self, chat_template_kwargs: dict[str, Any] | None, must_open: bool = False
    ) -> ReasoningSplitter:
        """A choice's splitter; `must_open`: the answer thinks only if it opens with <think>
        (a constrained answer, whose grammar decides)."""
        thinking = not (
            self.follows_enable_thinking
            and (chat_template_kwargs or {}).get("enable_thinking", True) is False
        )
        return ReasoningSplitter(self.ends, thinking, must_open)


PARSERS = {
    "deepseek_r1": ReasoningParser("deepseek_r1", (THINK_END,), follows_enable_thinking=False),
    "qwen3": ReasoningParser("qwen3", (THINK_END, "<tool_call>"), follows_enable_thinking=True),
}


class ReasoningSplitter:
    """One choice's text -> (reasoning, content) pieces as it grows. Text that may be the start
    of a tag is held back until the next piece says whether it is one."""

    def __init__(self, ends: tuple[str, ...], thinking: bool, must_open: bool = False):
        self.ends = ends
        self.state = "opening" if thinking else "content"  # then "thinking", then "content"
        self.must_open = must_open
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
            elif self.must_open:
                self.state, held, self.held = "content", self.held, ""
                return "", held
            else:
                self.state = "thinking"  # the template opened it in the prompt
        found = [(self.held.find(end), end) for end in self.ends if end in self.held]
        if found:
            at, end = min(found)
            reasoning, rest = self.held[:at], self.held[at:]
            if end == self.ends[0]:
                rest = rest[len(end) :]
            self.state, self.held = "content", ""
            return reasoning, rest
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
