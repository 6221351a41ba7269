"""Text <-> token ids from a Hugging Face tokenizer.json, chat templates, and streaming detokenization."""

from __future__ import annotations

import contextlib
import contextvars
import copy
import functools
import json
import re
import threading
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, ClassVar, NoReturn

import jinja2
import numpy as np
import tokenizers
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tandem.model_files import read_json

# tokenizer_config.json's named special tokens: special, and variables of chat templates
NAMED_SPECIAL_TOKENS = (
    "bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token",
)  # fmt: skip
TRUNCATION = threading.Lock()  # the truncating copies are set and read under it
DETOKENIZE_CONTEXT = 5  # prompt tokens a detokenizer window starts with, so spacing decodes right


def encodable(text: str) -> str:
    """Text the tokenizer can take: UTF-8, so no lone surrogate such as "\\ud800" (JSON allows it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(
            f"holds {text[error.start : error.end]!r} at {error.start}, a lone surrogate, "
            "which is not Unicode text"
        ) from None
    return text


def _check_unicode(text: Any) -> None:
    if isinstance(text, str):
        try:
            encodable(text)
        except ValueError as error:
            raise ValueError(f"the text {error}") from None


class BatchEncoding(dict):
    """`input_ids` and `attention_mask` (and where asked `offset_mapping` or a chat's
    `assistant_masks`), read as keys or as attributes (`enc.input_ids`)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def as_tensors(encoding: BatchEncoding, kind: str | None, rows: bool) -> BatchEncoding:
    """The encoding's lists as [texts, tokens] torch tensors ("pt") or numpy arrays ("np"), one
    row for a single text (not `rows`); texts of different lengths are a ValueError (no padding
    here), as in transformers without padding."""
    if kind is None:
        return encoding
    lists = {name: value if rows else [value] for name, value in encoding.items()}
    if len({len(row) for row in lists["input_ids"]}) > 1:
        raise ValueError(
            f'return_tensors="{kind}" needs texts of one length in tokens; these differ '
            "(pad them, or leave return_tensors out for lists)"
        )
    if kind == "np":
        return BatchEncoding({name: np.array(value, np.int64) for name, value in lists.items()})
    import torch  # here: the tokenizer alone loads no torch

    return BatchEncoding({name: torch.tensor(value) for name, value in lists.items()})


class Tokenizer:
    """A `tokenizers` tokenizer plus the special tokens and chat template of a model folder,
    called as transformers' tokenizer is (`tok(text)`, `decode`, `apply_chat_template`, ...)."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        bos_token: str | None = None,
        eos_token: str | None = None,
        chat_template: str | None = None,
        template_tokens: dict[str, Any] | None = None,
        chat_templates: dict[str, str] | None = None,
    ) -> None:
        self.backend = backend
        self.name_or_path = ""  # transformers': the model or folder it came from (from_dir's)
        # transformers': tokenizer_config.json's settings as read (from_dir's), e.g. its
        # model_max_length, tokenizer_class and added tokens
        self.init_kwargs: dict[str, Any] = {}
        self._truncating: tokenizers.Tokenizer | None = None  # _truncation's, made when needed
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.chat_template = chat_template  # the default one
        # tokenizer_config.json's named templates ("default", "tool_use", ...), where it has them
        self.chat_templates = chat_templates or {}
        # the special tokens a chat template may name, those set, as transformers passes them
        # (bos_token and eos_token at least)
        self.template_tokens = {
            **(template_tokens or {}),
            **{n: t for n, t in (("bos_token", bos_token), ("eos_token", eos_token)) if t},
        }
        self.pad_token = self.template_tokens.get("pad_token")
        self.unk_token = self.template_tokens.get("unk_token")
        if chat_template:  # compiled now (and cached): a template that does not parse fails here
            compile_chat_template(chat_template)
        added = backend.get_added_tokens_decoder()
        # the ids decode(skip_special_tokens=True) drops: every added token marked special
        self.all_special_ids = sorted(i for i, token in added.items() if token.special)
        self.all_special_tokens = [added[i].content for i in self.all_special_ids]

    @classmethod
    def from_dir(cls, path: str | Path, name_or_path: str | None = None) -> Tokenizer:
        """Load tokenizer.json, tokenizer_config.json and chat_template.jinja the way transformers
        does; `name_or_path` (transformers'): the name it was asked for (a Hub id), else `path`."""
        folder = Path(path)
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(
                f"{tokenizer_file} not found; tandem needs a model folder with a tokenizer.json"
            )
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as error:  # tokenizers raises a bare Exception for a file it cannot read
            raise ValueError(f"{tokenizer_file} is not a readable tokenizer: {error}") from error
        config_file = folder / "tokenizer_config.json"
        config = read_json(config_file) if config_file.is_file() else {}
        special = {name: token_text(config.get(name)) for name in NAMED_SPECIAL_TOKENS}
        # Like transformers: named special tokens are special (added if the vocab lacks them), and
        # add_bos_token/add_eos_token are ignored: tokenizer.json's post-processor decides.
        backend.add_special_tokens([t for t in dict.fromkeys(special.values()) if t is not None])
        template_file = folder / "chat_template.jinja"
        configured = config.get("chat_template")  # one template, or a list of named ones
        named = named_templates(configured)
        if template_file.is_file():
            chat_template = template_file.read_text(encoding="utf-8")
        else:
            chat_template = named.get("default") if isinstance(configured, list) else configured
        template_tokens = {name: text for name, text in special.items() if text is not None}
        tokenizer = cls(
            backend, special["bos_token"], special["eos_token"], chat_template, template_tokens,
            named,
        )  # fmt: skip
        tokenizer.name_or_path = name_or_path or str(path)
        tokenizer.init_kwargs = config
        return tokenizer

    def __call__(
        self,
        text: str | list[str],
        add_special_tokens: bool = True,
        return_tensors: str | None = None,
        return_offsets_mapping: bool = False,
    ) -> BatchEncoding:
        """`input_ids` and `attention_mask` of a text, or lists of them for a list of texts;
        with transformers' `return_tensors` ("pt" or "np"), [texts, tokens] arrays of them;
        with `return_offsets_mapping`, each token's (start, end) characters in its text too
        (`offset_mapping`; (0, 0) for a special token the post-processor added)."""
        if return_tensors not in (None, "pt", "np"):
            raise ValueError(f'return_tensors must be "pt", "np" or None, got {return_tensors!r}')
        rows = not isinstance(text, str)
        if rows and (
            not isinstance(text, list | tuple) or not all(isinstance(t, str) for t in text)
        ):
            raise TypeError(
                f"text must be a string or a list of strings, got {type(text).__name__}"
            )
        encodings = [self._encoding(t, add_special_tokens) for t in (text if rows else [text])]
        fields = {
            "input_ids": [e.ids for e in encodings],
            "attention_mask": [[1] * len(e.ids) for e in encodings],
        }
        if return_offsets_mapping:
            fields["offset_mapping"] = [e.offsets for e in encodings]
        encoding = BatchEncoding(
            {name: value if rows else value[0] for name, value in fields.items()}
        )
        return as_tensors(encoding, return_tensors, rows=rows)

    def tokenize(self, text: str, add_special_tokens: bool = False) -> list[str]:
        """The vocabulary entries `text` is cut into (e.g. "Ġthe"), special tokens left out
        unless asked for, as transformers' `tokenize`."""
        try:
            return self.backend.encode(text, add_special_tokens=add_special_tokens).tokens
        except TypeError:  # the backend's "TextInputSequence must be str"
            _check_unicode(text)
            raise

    def __len__(self) -> int:
        """Number of token ids the tokenizer knows, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(
        self,
        text: str,
        add_special_tokens: bool = True,
        max_length: int | None = None,
        side: str = "right",
    ) -> list[int]:
        """Token ids of `text`; add_special_tokens runs tokenizer.json's post-processor (e.g. BOS).
        With `max_length`, at most that many, cut on `side` ("left" keeps the last) with the
        special tokens kept (transformers' truncation=True, as vLLM's tokenizer cuts a prompt
        whose request names no side). A lone surrogate in it is a ValueError saying where."""
        with self._truncation(max_length, side) as backend:
            return self._encoding(text, add_special_tokens, backend).ids

    def _encoding(
        self, text: str, add_special_tokens: bool, backend: tokenizers.Tokenizer | None = None
    ) -> tokenizers.Encoding:
        """The backend's whole encoding of `text` (ids, offsets, char_to_token)."""
        try:
            return (backend or self.backend).encode(text, add_special_tokens=add_special_tokens)
        except TypeError:  # the backend's "TextInputSequence must be str"
            _check_unicode(text)
            raise

    def encode_pair(self, text: str, pair: str, max_length: int | None = None) -> list[int]:
        """Token ids of two texts as one sequence, joined by tokenizer.json's post-processor's
        pair template (as transformers' `tokenizer(text, text_pair)`): a cross-encoder's input.
        With `max_length`, at most that many, the longer text cut first and the special tokens
        kept (transformers' `truncation=True`, as vLLM truncates a pair)."""
        with self._truncation(max_length, "right") as backend:
            return self._encode_pair(backend, text, pair)

    @contextlib.contextmanager
    def _truncation(self, max_length: int | None, side: str) -> Iterator[tokenizers.Tokenizer]:
        """The backend cutting to `max_length` on `side` (the longer of a pair first): a copy of
        its own, since truncation is the tokenizer's state. None, or a length past any text's
        (past 2**64 the tokenizer's usize overflows), cuts nothing: the backend itself."""
        if max_length is None or max_length >= 2**32:
            yield self.backend
            return
        with TRUNCATION:
            if self._truncating is None:
                self._truncating = copy.deepcopy(self.backend)
            self._truncating.enable_truncation(max_length, direction=side)
            try:
                yield self._truncating
            finally:
                self._truncating.no_truncation()

    @staticmethod
    def _encode_pair(backend: tokenizers.Tokenizer, text: str, pair: str) -> list[int]:
        try:
            return backend.encode(text, pair=pair, add_special_tokens=True).ids
        except TypeError:
            _check_unicode(text)
            _check_unicode(pair)
            raise

    def decode(self, ids: int | Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids` (or of one id; a numpy array or a torch tensor as well); ids past the
        tokenizer's vocab decode to nothing."""
        ids = ids.tolist() if hasattr(ids, "tolist") else ids
        ids = [ids] if isinstance(ids, int) else ids
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def batch_decode(
        self, sequences: Sequence[Sequence[int]], skip_special_tokens: bool = False
    ) -> list[str]:
        """`decode` of each list of ids (or row of a numpy array or torch tensor)."""
        sequences = sequences.tolist() if hasattr(sequences, "tolist") else sequences
        return [self.decode(ids, skip_special_tokens) for ids in sequences]

    def convert_ids_to_tokens(self, ids: int | list[int]) -> str | list[str | None] | None:
        """The vocabulary's entry of each id (e.g. "Ġthe"), not its decoded text."""
        if isinstance(ids, int):
            return self.backend.id_to_token(ids)
        return [self.backend.id_to_token(i) for i in ids]

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | list[int | None] | None:
        """The id of each vocabulary entry; unk_token's id (None without one) where none is."""
        if isinstance(tokens, str):
            return self._id_or_unk(tokens)
        return [self._id_or_unk(t) for t in tokens]

    def get_vocab(self) -> dict[str, int]:
        """Each vocabulary entry's id, added tokens included."""
        return self.backend.get_vocab(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        """Number of token ids of the base vocabulary, added tokens left out (`len` counts them)."""
        return self.backend.get_vocab_size(with_added_tokens=False)

    @property
    def bos_token_id(self) -> int | None:
        return self._id_of(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self._id_of(self.eos_token)

    @property
    def pad_token_id(self) -> int | None:
        return self._id_of(self.pad_token)

    @property
    def unk_token_id(self) -> int | None:
        return self._id_of(self.unk_token)

    def _id_or_unk(self, token: str) -> int | None:
        token_id = self.backend.token_to_id(token)
        return self.unk_token_id if token_id is None else token_id

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    def get_chat_template(
        self, chat_template: str | None = None, tools: list[dict] | None = None
    ) -> str | None:
        """The template source a chat renders with, as transformers' picks it: `chat_template`
        (a named template's name, or Jinja source), else the named "tool_use" template where
        `tools` are given, else the default; a ValueError where the model has named templates
        and no default."""
        if chat_template is not None:
            return self.chat_templates.get(chat_template, chat_template)
        if tools is not None and "tool_use" in self.chat_templates:
            return self.chat_templates["tool_use"]
        if self.chat_template is None and self.chat_templates:
            raise ValueError(
                "this model has several chat templates and no default: name one as "
                f"chat_template, of {sorted(self.chat_templates)}"
            )
        return self.chat_template

    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]] | list[list[dict[str, Any]]],
        tools: list[dict[str, Any]] | None = None,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool = False,
        tokenize: bool = True,
        return_dict: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        return_assistant_tokens_mask: bool = False,
        **kwargs: Any,
    ) -> str | list[str] | list[int] | list[list[int]] | BatchEncoding:
        """Render a chat (or a list of chats) and the tools it may call (OpenAI's {"type":
        "function", "function": {...}} objects) with the chat template, as transformers does:
        by default to a BatchEncoding of its ids (encoded with add_special_tokens=False), to the
        ids alone with return_dict=False, to the text with tokenize=False.
        `return_assistant_tokens_mask` adds `assistant_masks`: 1 for each token of what the
        template renders inside `{% generation %}` tags, 0 elsewhere (all 0 without the tags).

        `continue_final_message` ends the text right after the last message's content, so that
        the model continues that message (with add_generation_prompt=False); `chat_template_kwargs`
        and other keyword arguments are more variables for the template (e.g. Qwen3's
        enable_thinking); `chat_template` (Jinja source) renders instead of the model's template."""
        if not isinstance(conversation, list | tuple):
            raise TypeError(
                f"conversation must be a list of messages (or of chats), got "
                f"{type(conversation).__name__}"
            )
        if "messages" in kwargs:
            raise TypeError("apply_chat_template takes the messages as `conversation`")
        if chat_template is not None and not isinstance(chat_template, str):
            raise TypeError(
                f"chat_template must be Jinja source or None, got {chat_template!r:.60}"
            )
        source = self.get_chat_template(chat_template, tools)
        if source is None:
            raise ValueError(
                "this model has no chat template (no chat_template.jinja and no chat_template in "
                "tokenizer_config.json); send a plain text prompt instead of chat messages"
            )
        template = compile_chat_template(source)
        if add_generation_prompt and continue_final_message:
            raise ValueError(
                "add_generation_prompt and continue_final_message cannot both be true: set "
                "add_generation_prompt to false to continue the final message"
            )
        if return_assistant_tokens_mask and not (tokenize and return_dict):
            raise ValueError(
                "return_assistant_tokens_mask needs tokenize=True and return_dict=True"
            )
        if return_assistant_tokens_mask and continue_final_message:
            raise ValueError("return_assistant_tokens_mask cannot mark a continued final message")
        # like transformers, special tokens that are unset stay undefined in the template, and
        # documents (vLLM's request field, for retrieval) is None unless given
        variables = {
            "documents": None,
            **self.template_tokens,
            **template_kwargs(chat_template_kwargs),
            **kwargs,
        }
        batched = bool(conversation) and isinstance(conversation[0], list | tuple)
        texts, spans = [], []
        for messages in conversation if batched else [conversation]:
            if continue_final_message:
                messages = tagged(messages)
            try:
                text, marked = render_marking_generation(
                    template,
                    {
                        **variables,
                        "messages": messages,
                        "tools": tools,
                        "add_generation_prompt": add_generation_prompt,
                    },
                )
            except ValueError:  # raise_exception's, in the template's own words
                raise
            except Exception as error:  # as vLLM's safe_apply_chat_template: the template's own
                # logic failed on them (a variable it was not given, a key or index missing, the
                # sandbox's range limit, a macro recursing without end, ...)
                raise ValueError(
                    f"chat template failed on the messages: {type(error).__name__}: {error}"
                ) from error
            texts.append(cut_at_tag(text) if continue_final_message else text)
            spans.append(marked)
        if not tokenize:
            return texts if batched else texts[0]
        encoding = self(texts, add_special_tokens=False)
        if return_assistant_tokens_mask:
            encoding["assistant_masks"] = [
                assistant_mask(self._encoding(text, False), marked)
                for text, marked in zip(texts, spans, strict=True)
            ]
        if not batched:
            encoding = BatchEncoding({name: rows[0] for name, rows in encoding.items()})
        return encoding if return_dict else encoding.input_ids


# the variables apply_chat_template sets itself
TEMPLATE_ARGUMENTS = ("messages", "tools", "add_generation_prompt")


def template_kwargs(kwargs: Any) -> dict[str, Any]:
    """`chat_template_kwargs` checked: a dict of names other than the template's own arguments."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise ValueError("chat_template_kwargs must be an object of names to values")
    taken = [k for k in TEMPLATE_ARGUMENTS if k in kwargs]
    if taken:
        raise ValueError(
            f"chat_template_kwargs may not set {', '.join(taken)}: they are arguments of their own"
        )
    return kwargs


# appended to the final message's text for continue_final_message: the rendered text is cut
# where it shows (transformers' way: the content's own words may recur in the template's text)
CONTINUE_TAG = "Tandem-continue-final-message-tag "


def tagged(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A copy of `messages` whose final message's content (its last text part) ends in
    CONTINUE_TAG; a ValueError where it has no text to continue."""
    final = messages[-1] if messages and isinstance(messages[-1], dict) else None
    content = final.get("content") if final is not None else None
    if isinstance(content, str):
        return [*messages[:-1], {**final, "content": content + CONTINUE_TAG}]
    if isinstance(content, list | tuple):
        parts = list(content)
        for i in reversed(range(len(parts))):
            part = parts[i]
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                parts[i] = {**part, "text": part["text"] + CONTINUE_TAG}
                return [*messages[:-1], {**final, "content": parts}]
    raise ValueError("continue_final_message: the final message has no text to continue")


def cut_at_tag(text: str) -> str:
    """`text` cut right after the final message's content, where CONTINUE_TAG shows (its
    trailing space kept where the template kept the tag's); a ValueError where the template
    dropped it."""
    mark = CONTINUE_TAG.strip()
    at = text.rfind(mark)
    if at < 0:
        raise ValueError(
            "continue_final_message: the chat template's text does not contain the final "
            "message's content, so there is nothing to continue"
        )
    return text[:at] if text.startswith(CONTINUE_TAG, at) else text[:at].rstrip()


def prompt_context(
    tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool
) -> list[int]:
    """The last prompt ids an output's text is decoded after, so its spacing decodes right;
    those before a tail that decodes to U+FFFD (a character cut there, or a literal one) are
    as near as the context comes (none at all lost a Llama 2 tokenizer's leading space)."""
    context = list(prompt_token_ids[-DETOKENIZE_CONTEXT:])
    while context and tokenizer.decode(context, skip_special_tokens=skip_special_tokens).endswith(
        "\ufffd"
    ):
        context.pop()
    return context


def decode_after(
    tokenizer: Tokenizer, prompt_token_ids: list[int], ids: list[int], skip_special_tokens: bool
) -> str:
    """A whole output's text as it reads after the prompt: what IncrementalDetokenizer's deltas
    and flush add up to, in one decode of the output (beside its few context ids'); a tokenizer
    that strips a decode's first space, as Llama 2's, keeps the output's own."""
    context = prompt_context(tokenizer, prompt_token_ids, skip_special_tokens)
    lead = tokenizer.decode(context, skip_special_tokens=skip_special_tokens)
    return tokenizer.decode(context + ids, skip_special_tokens=skip_special_tokens)[len(lead) :]


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas that never split a character."""

    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.text = ""  # the deltas returned so far, concatenated
        context = prompt_context(tokenizer, prompt_token_ids, skip_special_tokens)
        # window = [tokens already emitted (left context) | tokens whose text is held back]
        self._window = context
        self._read_offset = len(context)

    def add(self, new_token_ids: list[int]) -> str:
        """Append output tokens; return the newly completed text ("" while a character is partial)."""
        self._window.extend(new_token_ids)
        delta = self._pending_text()
        if not delta or delta.endswith("\ufffd"):
            return ""
        return self._emit(delta)

    def flush(self) -> str:
        """Return the held-back text (a partial character, as U+FFFD) once the output has ended."""
        return self._emit(self._pending_text())

    def _pending_text(self) -> str:
        emitted_text = self._decode(self._window[: self._read_offset])
        return self._decode(self._window)[len(emitted_text) :]

    def _emit(self, delta: str) -> str:
        # E.g. window [a, b | c, d] with c, d just emitted -> [c, d |]
        del self._window[: self._read_offset]
        self._read_offset = len(self._window)
        self.text += delta
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)


class GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}`, which templates trained with an assistant-only
    loss put around the assistant's text: it renders as its text, and a render that marks
    generation (render_marking_generation) records where that text lies."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
        line = next(parser.stream).lineno  # the tag's name
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(line)

    @staticmethod
    def _mark(caller: Callable[[], str]) -> str:
        text = caller()
        marks = GENERATION_MARKS.get()
        if marks is not None:  # the text rendered so far ends where this block starts
            marks.spans.append((marks.length, marks.length + len(text)))
        return text


def marks_generation(source: str | None) -> bool:
    """Whether a template has `{% generation %}` tags (vLLM's test of whether it can mark the
    assistant's tokens)."""
    return source is not None and GENERATION_TAG.search(source) is not None


GENERATION_TAG = re.compile(r"\{%[-+]?\s*generation\s*[-+]?%\}")


class GenerationMarks:
    """A render's characters yielded so far, and the (start, end) of each generation block."""

    def __init__(self) -> None:
        self.length = 0
        self.spans: list[tuple[int, int]] = []


# the marks of the render running in this context (None: no render marks generation)
GENERATION_MARKS: contextvars.ContextVar[GenerationMarks | None] = contextvars.ContextVar(
    "generation_marks", default=None
)


def render_marking_generation(
    template: jinja2.Template, variables: dict[str, Any]
) -> tuple[str, list[tuple[int, int]]]:
    """The template's text and the (start, end) characters of each `{% generation %}` block in
    it, as transformers finds them: a block starts at the length of the text the template had
    yielded when the block rendered (inside a macro: the text before the macro's output)."""
    marks = GenerationMarks()
    token = GENERATION_MARKS.set(marks)
    try:
        parts = []
        for part in template.generate(**variables):
            parts.append(part)
            marks.length += len(part)
    finally:
        GENERATION_MARKS.reset(token)
    return "".join(parts), marks.spans


def assistant_mask(encoding: tokenizers.Encoding, spans: list[tuple[int, int]]) -> list[int]:
    """1 for each token from the one holding a span's first character to the one holding its
    last, as transformers marks them (a span whose first character no token holds ends the
    marking; one whose last character falls in the first token, or in none, runs to the end)."""
    mask = [0] * len(encoding.ids)
    for start, end in spans:
        first = encoding.char_to_token(start)
        if first is None:
            break
        last = encoding.char_to_token(end - 1)
        stop = last + 1 if last else len(mask)
        mask[first:stop] = [1] * (stop - first)
    return mask


CONTENT_FORMATS = ("auto", "string", "openai")  # vLLM's chat_template_content_format


@functools.lru_cache(maxsize=16)
def content_format(source: str | None, asked: str = "auto") -> str:
    """How a template takes a message's content: "openai" (a list of {"type": "text", "text":
    ...} parts) or "string". "auto", as vLLM's detection: "openai" where the template loops over
    a message's content (`for p in m.content`, or filtered or sliced: `m.content | select...`,
    `m['content'][1:]`), a message being a loop's item over `messages` or a variable set from
    it; else "string"."""
    if asked not in CONTENT_FORMATS:
        raise ValueError(
            f"chat_template_content_format must be one of {CONTENT_FORMATS}, got {asked!r}"
        )
    if asked != "auto" or source is None:
        return "string" if asked == "auto" else asked
    tree = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols", GenerationTag])
    tree = tree.parse(source)
    try:
        messages = loop_items(tree, assigned_from(tree, "messages"))
        return "openai" if loop_items(tree, messages, "content", first=True) else "string"
    except Undetectable:  # vLLM's detection fails there, and so falls back to "string"
        return "string"


class Undetectable(Exception):
    """A variable that content_format follows is set or looped into a target that is no plain
    name (`{% set ns.m = messages %}`, `{% for i, m in messages %}`)."""


def reads(node: nodes.Node, name: str, key: str | None = None) -> bool:
    """Whether `node` is variable `name` (or its item `key`: name.key, name['key']), seen
    through filters, tests and slices: `messages | reverse`, `m['content'][1:]`."""
    while isinstance(node, nodes.Filter | nodes.Test) or (
        isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice)
    ):
        node = node.node
        if node is None:  # a filter block's filter: it reads what the block renders
            return False
    if key is not None:
        if isinstance(node, nodes.Getitem):
            if not (isinstance(node.arg, nodes.Const) and node.arg.value == key):
                return False
        elif not (isinstance(node, nodes.Getattr) and node.attr == key):
            return False
        node = node.node
    return isinstance(node, nodes.Name) and node.ctx == "load" and node.name == name


def target_name(target: nodes.Node) -> str:
    if not isinstance(target, nodes.Name):
        raise Undetectable
    return target.name


def assigned_from(tree: nodes.Template, name: str) -> list[str]:
    """`name` and the variables set from it, from those, ...: messages -> loop_messages for
    `{% set loop_messages = messages[1:] %}`."""
    names, pending = [name], [name]
    while pending:
        source = pending.pop(0)
        for assign in tree.find_all(nodes.Assign):
            if reads(assign.node, source) and (target := target_name(assign.target)) not in names:
                names.append(target)
                pending.append(target)
    return names


def loop_items(
    tree: nodes.Template, names: list[str], key: str | None = None, first: bool = False
) -> list[str]:
    """The item variables of the loops over any of `names` (over their `key` item where given);
    `first`: only the first such loop's."""
    items = []
    for loop in tree.find_all(nodes.For):
        if any(reads(loop.iter, name, key) for name in names):
            items.append(target_name(loop.target))
            if first:
                break
    return items


# vLLM's content parts that hold text (OpenAI's text and refusal parts, the Responses API's
# input_text and output_text, vLLM's thinking part), and the key each holds it under
TEXT_PARTS = {
    "text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal",
    "thinking": "thinking",
}  # fmt: skip
# the kinds vLLM's parser skips where their text is null or missing; the others give a None text
SKIPPED_WITHOUT_TEXT = ("text", "refusal")
# the keys of the content part types vLLM knows (OpenAI's, of the openai 2.48 it ships with,
# among them): a text part's other keys (cache_control, a thinking part's signature) stay on it
KNOWN_PART_KEYS = frozenset({
    "type", "text", "refusal", "thinking", "closed", "name", "uuid", "image_url", "image_pil",
    "image_embeds", "audio_url", "audio_embeds", "video_url", "input_audio", "file", "data",
    "prompt_cache_breakpoint",
})  # fmt: skip


def text_part(part: Any) -> dict[str, Any] | None:
    """A content part as templates take it, as vLLM's parser gives it to them: a bare string or
    a part of TEXT_PARTS made a {"type": "text", "text": ...} part with the keys vLLM does not
    know, a tool_reference part as {"type": "tool_reference", "name": ...}; None for a text or
    refusal part without its text, which vLLM skips. A ValueError for any other part."""
    if isinstance(part, str):
        return {"type": "text", "text": part}
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "tool_reference":  # a deferred tool the template expands, by its name
        return {"type": "tool_reference", "name": part_string(part, "name")}
    if not isinstance(kind, str) or kind not in TEXT_PARTS:
        raise ValueError(
            "a message's content parts must be text for a text model: a string, or a part "
            f"{{'type': 'text', 'text': ...}} (input_text, output_text, refusal, thinking, "
            f"tool_reference too); got {part!r:.80}"
        )
    text = part_string(part, TEXT_PARTS[kind])
    if text is None and kind in SKIPPED_WITHOUT_TEXT:
        return None
    unknown = {key: value for key, value in part.items() if key not in KNOWN_PART_KEYS}
    return {"type": "text", "text": text, **unknown}


def part_string(part: dict[str, Any], key: str) -> str | None:
    value = part.get(key)
    if value is not None and not isinstance(value, str):
        raise ValueError(f"a {part['type']} part's {key} must be a string, got {value!r:.40}")
    return value


def template_content(content: Any, content_format: str, role: Any = None) -> Any:
    """A message's content (None, a string or a list of text_part's parts) as a template of
    `content_format` takes it, as vLLM's parser gives it: for a string, the parts' texts (a
    tool_reference's name) joined by newlines, those empty or None left out; as parts, a text
    made one part and the parts text_part skipped (None) left out. A tool's result of text
    parts is their texts joined whatever the format. None is no parts: "" (or [] as parts)."""
    content = [] if content is None else content
    if isinstance(content, str):
        as_parts = content_format == "openai" and role != "tool"
        return [{"type": "text", "text": content}] if as_parts else content
    parts = [part for part in content if part is not None]
    if content_format != "openai":
        texts = (p["name"] if p["type"] == "tool_reference" else p["text"] for p in parts)
        return "\n".join(text for text in texts if text)
    if role == "tool" and all(part["type"] == "text" for part in parts):
        return "\n".join(part["text"] for part in parts)
    return parts


def template_message(message: dict[str, Any], content_format: str) -> dict[str, Any]:
    """A chat message as vLLM's parser gives it to a template of `content_format`: its role, its
    content (template_content) and only the keys vLLM reads for that role: any role's name and
    task (strings), an assistant's tool_calls (template_tool_call; none for []) and reasoning
    (as reasoning_content too), a tool's tool_call_id, a developer's tools (None without). A
    role or content of another type is a TypeError."""
    role, content = message.get("role"), message.get("content")
    if role is not None and not isinstance(role, str):
        raise TypeError(f"a message's role must be a string such as 'user', got {role!r:.40}")
    if content is not None and not isinstance(content, list | str):
        raise TypeError(
            "a message's content must be a string or a list of text parts, got "
            f"{type(content).__name__}"
        )
    if isinstance(content, list):
        content = [text_part(part) for part in content]
    kept = {"role": role, "content": template_content(content, content_format, role)}
    if role == "assistant":
        kept |= assistant_fields(message)
    elif role == "tool" and "tool_call_id" in message:
        kept["tool_call_id"] = message["tool_call_id"]
    kept |= {key: message[key] for key in ("name", "task") if isinstance(message.get(key), str)}
    if role == "developer":
        kept["tools"] = message.get("tools")
    return kept


def developer_as_system(
    messages: list[dict[str, Any]], template: str | None
) -> list[dict[str, Any]]:
    """Template messages for a template that never names the developer role, as vLLM renders
    them: each developer message a system message (without its tools), and where a system
    message then stands anywhere but first, all of them merged into one first (their texts
    joined by a blank line; templates such as Qwen's need it first). Else as given."""
    # e.g. [system "A", user, developer "B"] -> [system "A\n\nB", user]
    if (
        not isinstance(template, str)  # none, or not Jinja source: apply_chat_template's error
        or '"developer"' in template
        or "'developer'" in template
        or all(m["role"] != "developer" for m in messages)
    ):
        return messages
    converted = [
        {key: value for key, value in m.items() if key != "tools"} | {"role": "system"}
        if m["role"] == "developer"
        else m
        for m in messages
    ]
    if [i for i, m in enumerate(converted) if m["role"] == "system"] == [0]:
        return converted
    texts = [system_text(m["content"]) for m in converted if m["role"] == "system"]
    merged = {"role": "system", "content": "\n\n".join(text for text in texts if text)}
    return [merged, *(m for m in converted if m["role"] != "system")]


def system_text(content: Any) -> str:
    """A system message's text for merging: a string, or its parts' texts one a line."""
    if not isinstance(content, list):
        return content or ""
    texts = (part if isinstance(part, str) else part.get("text") for part in content)
    return "\n".join(text for text in texts if isinstance(text, str))


def assistant_fields(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message's tool calls (left out where empty, so that templates take their
    path without calls, as vLLM's) and reasoning as templates take them."""
    fields: dict[str, Any] = {}
    tool_calls = message.get("tool_calls")
    if tool_calls is not None and not isinstance(tool_calls, list | tuple):
        raise TypeError(
            "an assistant's tool_calls must be a list of tool calls "
            f"({{'id': ..., 'type': 'function', 'function': ...}}), got {tool_calls!r:.60}"
        )
    if tool_calls:
        fields["tool_calls"] = [template_tool_call(call) for call in tool_calls]
    if message.get("reasoning") is not None:  # as vLLM's, under the name templates read too
        fields["reasoning"] = fields["reasoning_content"] = message["reasoning"]
    return fields


def template_tool_call(call: Any) -> dict[str, Any]:
    """An assistant's tool call as templates take it, as vLLM's parser gives it to them: its
    function's arguments parsed from their JSON text (templates write them with tojson; none,
    "" or null give {}). A call that is no function call, or arguments of no JSON, is a
    ValueError, as vLLM's."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(call, dict) or call.get("type", "function") != "function":
        raise ValueError(
            f"an assistant's tool_calls are function calls (objects), got {call!r:.60}"
        )
    if not isinstance(function, dict):
        raise ValueError(f"a tool call's function must be an object, got {function!r:.60}")
    arguments = function.get("arguments")
    if not arguments:
        arguments = {}
    elif isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as error:
            raise ValueError(
                f"a tool call's arguments must be JSON text, got {arguments!r:.60}: {error}"
            ) from error
        arguments = {} if arguments is None else arguments
    elif not isinstance(arguments, dict | list):
        raise TypeError(f"a tool call's arguments must be JSON text, got {arguments!r:.60}")
    return {**call, "function": {**function, "arguments": arguments}}


@functools.lru_cache(maxsize=16)  # LLM.chat(chat_template=...) renders it once per conversation
def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in a sandbox with the globals, filters and tags transformers
    provides."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=["jinja2.ext.loopcontrols", GenerationTag],
    )
    env.filters["tojson"] = to_json
    env.globals["raise_exception"] = raise_template_error
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def to_json(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson escapes HTML characters, which chat prompts must keep verbatim
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def raise_template_error(message: str) -> NoReturn:
    raise ValueError(f"chat template rejected the messages: {message}")


def token_text(value: str | dict[str, Any] | None) -> str | None:
    # tokenizer_config.json spells a token as a string or as a serialized AddedToken
    return value.get("content") if isinstance(value, dict) else value


def is_added_token(value: Any) -> bool:
    """Whether a tokenizer_config.json value is a serialized AddedToken ({"content": ...})."""
    return isinstance(value, dict) and value.get("__type") == "AddedToken"


def named_templates(value: Any) -> dict[str, str]:
    """tokenizer_config.json's list of named templates ([{"name", "template"}]) as a dict;
    {} for a single template."""
    if not isinstance(value, list):
        return {}
    return {
        t["name"]: t["template"]
        for t in value
        if isinstance(t, dict)
        and isinstance(t.get("name"), str)
        and isinstance(t.get("template"), str)
    }
