"""Structured outputs: JSON schema, regex, choice, EBNF grammar, JSON object and structural tag,
by xgrammar.

The backend is xgrammar (vLLM's and SGLang's default): it compiles schemas, regexes and
grammars against the tokenizer's vocabulary once (cached per grammar), and a per-request
matcher then gives the next step's allowed tokens as a bitmask in tens of microseconds. No
grammar, regex or schema compiler is written here.

How the masks reach the device without a stall (engine.py, runner.py): a step with a
constrained row launches its forward pass as any other step, but its sampling is a separate
launch. Once the step before it is read back, the CPU advances each constrained row's matcher
by that step's token (`accept`), fills this step's bitmask rows into the slot's pinned buffer
(`fill_masks`), copies it to the device and records an event; the sampling launch waits on
that event. The CPU so has the whole forward pass to compute the masks; the timeline's
`mask_wait` lane shows whether the compute stream ever waited for them.

    bitmask [rows, ceil(vocab / 32)] int32: bit j of word w allows token 32 * w + j; rows
            without a constraint are all ones (the sampling graph applies every row's mask)
"""

from __future__ import annotations

import json
import re
import warnings
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tandem.config import cdiv

if TYPE_CHECKING:
    import xgrammar

    from tandem.request import Request
    from tandem.tokenizer import Tokenizer

BACKEND = "xgrammar"
KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
# the string formats xgrammar enforces (vLLM's list); another would compile and constrain nothing
STRING_FORMATS = frozenset({
    "email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid", "uri",
    "uri-reference", "uri-template", "json-pointer", "relative-json-pointer",
})  # fmt: skip
# JSON schema keywords whose value maps names to schemas (the names are no keywords)
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
# keywords whose values are data, not schemas
DATA_KEYWORDS = ("enum", "const", "default", "examples", "required")


@dataclass
class StructuredOutputsParams:
    """One constraint on a request's output, named as vLLM's `StructuredOutputsParams`:
    exactly one of `json` (a JSON schema, as a dict or a string), `regex`, `choice` (the output
    is one of these strings), `grammar` (EBNF, in xgrammar's GBNF dialect), `json_object`
    (any JSON object) or `structural_tag` (JSON text or a dict: xgrammar's structural tag,
    `{"type": "structural_tag", "format": {...}}`, e.g. a tag around a JSON schema; or the older
    form vLLM still takes, `{"structures": [{"begin", "schema", "end"}, ...], "triggers": [...]}`:
    free text in which each trigger starts one of the structures). A grammar without a `::=`
    rule is read as Lark (as vLLM's), else as EBNF."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict | None = None
    # JSON (schema or object): no whitespace between tokens beyond one space after ':' and ','
    disable_any_whitespace: bool = False
    # vLLM's: no property a schema does not name unless it allows others. xgrammar's strict
    # mode holds so whatever the value (as in vLLM with xgrammar): taken, checked as a bool
    disable_additional_properties: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        set_kinds = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise ValueError(
                f"structured_outputs takes exactly one of {', '.join(KINDS)}; got "
                f"{', '.join(set_kinds) or 'none'}"
            )
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    json.loads(self.json)
                except json.JSONDecodeError as e:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
                except RecursionError:
                    raise ValueError("structured_outputs.json is nested too deep") from None
            elif not isinstance(self.json, dict):
                raise ValueError(
                    f"structured_outputs.json must be a JSON schema (a dict or a string), got "
                    f"{type(self.json).__name__}"
                )
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None and (
            not isinstance(self.choice, list | tuple)
            or not self.choice
            or not all(isinstance(c, str) for c in self.choice)
        ):
            raise ValueError("structured_outputs.choice must be a non-empty list of strings")
        if self.json_object not in (None, True, False):
            raise ValueError("structured_outputs.json_object must be a boolean")
        for flag in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, flag), bool):  # "no" would turn it on
                raise ValueError(
                    f"structured_outputs.{flag} must be True or False, got "
                    f"{getattr(self, flag)!r:.40}"
                )
        if self.structural_tag is not None:
            check_structural_tag(self.structural_tag)

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @classmethod
    def from_dict(cls, value: dict[str, Any]) -> StructuredOutputsParams:
        """From a request's JSON field (the server's `structured_outputs`), unknown keys named."""
        if not isinstance(value, dict):
            raise ValueError("structured_outputs must be an object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(
                f"structured_outputs has unknown fields {unknown}; known: {sorted(known)}"
            )
        return cls(**value)


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """vLLM's engine-wide `structured_outputs_config`, at the values tandem honours: the backend
    is xgrammar ("auto" picks it), with no other to fall back to; `disable_any_whitespace` holds
    for every request's JSON (as its own flag does); additional properties are xgrammar's
    matter (vLLM's option shapes only its guidance backend); `reasoning_parser` is the engine's;
    a grammar starts after the thinking (`enable_in_reasoning` False)."""

    backend: str = "auto"
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    reasoning_parser: str = ""
    enable_in_reasoning: bool = False

    @classmethod
    def of(cls, value: Any) -> StructuredOutputsConfig:
        """From None, a dict or its JSON text; a ValueError naming an unknown key or a value
        tandem cannot honour."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                raise ValueError(f"structured_outputs_config is no JSON: {value!r:.80}") from None
        if value is None:
            value = {}
        if not isinstance(value, dict):
            raise ValueError(
                f"structured_outputs_config must be a dict, got {type(value).__name__}"
            )
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"structured_outputs_config has unknown keys {unknown}")
        config = cls(**value)
        for name in known - {"backend", "reasoning_parser"}:
            if not isinstance(getattr(config, name), bool):
                raise ValueError(f"structured_outputs_config.{name} must be True or False")
        if config.backend not in ("auto", BACKEND):
            raise ValueError(
                f"structured_outputs_config.backend must be 'auto' or '{BACKEND}' (tandem's "
                f"grammars are {BACKEND}'s), got {config.backend!r}"
            )
        if config.enable_in_reasoning:
            raise ValueError(
                "structured_outputs_config.enable_in_reasoning=True is not supported: a grammar "
                "starts once the thinking ends"
            )
        if not isinstance(config.reasoning_parser, str):
            raise ValueError("structured_outputs_config.reasoning_parser must be a string")
        return config


def check_structural_tag(tag: str | dict) -> None:
    """ValueError unless `tag` is a structural tag's JSON object, in either form; xgrammar
    checks the rest as it compiles."""
    spec = tag
    if isinstance(tag, str):
        try:
            spec = json.loads(tag)
        except (json.JSONDecodeError, RecursionError):
            raise ValueError("structured_outputs.structural_tag is not valid JSON") from None
    if not isinstance(spec, dict):
        raise ValueError("structured_outputs.structural_tag must be a JSON object")
    if "structures" not in spec:
        if not isinstance(spec.get("format"), dict):
            raise ValueError(
                "structured_outputs.structural_tag needs its format (an object), or the older "
                "structures and triggers"
            )
        return
    structures, triggers = spec["structures"], spec.get("triggers")
    if not isinstance(triggers, list) or not all(isinstance(t, str) and t for t in triggers):
        raise ValueError("structured_outputs.structural_tag.triggers must be non-empty strings")
    if not isinstance(structures, list) or not structures:
        raise ValueError("structured_outputs.structural_tag.structures must be a non-empty list")
    for i, structure in enumerate(structures):
        if not (
            isinstance(structure, dict)
            and isinstance(structure.get("begin"), str)
            and isinstance(structure.get("end"), str)
            and isinstance(structure.get("schema"), dict | bool)
        ):
            raise ValueError(
                f"structured_outputs.structural_tag.structures[{i}] needs begin and end "
                "(strings) and schema (a JSON schema)"
            )


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly `choices`, e.g. ["yes", "no"] ->
    'root ::= "yes" | "no"'. JSON string escapes are GBNF's literal escapes."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def is_lark(grammar: str) -> bool:
    """Whether a grammar reads as Lark (`start: "a" | "b"`): no line defines a rule with
    EBNF's "::=" once comments are left out (vLLM's test)."""
    lines = (re.sub(r"(#|//).*$", "", line).strip() for line in grammar.splitlines())
    return not any("::=" in line for line in lines)


class UnsupportedSchema(Exception):
    """A JSON schema keyword xgrammar compiles but does not enforce; its text says where."""


def check_json_features(schema: Any, path: str = "#") -> None:
    """Raise UnsupportedSchema where a JSON schema asks for what xgrammar lets through unchecked
    (as vLLM's has_xgrammar_unsupported_json_features refuses it): uniqueItems, contains,
    patternProperties, propertyNames, multipleOf on a number, a string format it does not know;
    and, stricter than vLLM, what xgrammar 0.2.9 lets through too: a length beside a pattern or
    format (it drops the bounds, saying so), allOf of several schemas, not, if with then or else,
    dependentRequired, dependentSchemas and dependencies."""
    if not isinstance(schema, dict):
        return
    keys = ("uniqueItems", "contains", "minContains", "maxContains", "patternProperties",
            "propertyNames", "not", "dependentRequired", "dependentSchemas", "dependencies")  # fmt: skip
    for key in keys:
        if key in schema and not (key == "uniqueItems" and schema[key] is False):
            raise UnsupportedSchema(f"{key} (at {path})")
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        raise UnsupportedSchema(f"allOf of {len(schema['allOf'])} schemas (at {path})")
    if "if" in schema and ("then" in schema or "else" in schema):
        raise UnsupportedSchema(f"if with then or else (at {path})")
    kinds = schema.get("type")
    numbers = kinds == "number" or (isinstance(kinds, list) and "number" in kinds)
    if numbers and "multipleOf" in schema:  # an integer's is enforced
        raise UnsupportedSchema(f"multipleOf on a number (at {path})")
    strings = kinds == "string" or (isinstance(kinds, list) and "string" in kinds)
    fmt = schema.get("format") if strings else None  # int64 on an integer: a note, no check
    if fmt is not None and fmt not in STRING_FORMATS:
        raise UnsupportedSchema(f"the string format {fmt!r} (at {path})")
    if (fmt is not None or "pattern" in schema) and (
        "minLength" in schema or "maxLength" in schema
    ):
        raise UnsupportedSchema(f"a length beside a {'format' if fmt else 'pattern'} (at {path})")
    try:
        for key, value in schema.items():
            if key in DATA_KEYWORDS:
                continue
            if key in SCHEMA_MAPS and isinstance(value, dict):
                children = [(f"{path}/{key}/{name}", sub) for name, sub in value.items()]
            elif isinstance(value, list):
                children = [(f"{path}/{key}/{i}", sub) for i, sub in enumerate(value)]
            else:
                children = [(f"{path}/{key}", value)]
            for child_path, child in children:
                check_json_features(child, child_path)
    except RecursionError:
        raise ValueError("the JSON schema is nested too deep") from None


def available() -> bool:
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        return False
    return True


# vLLM's VLLM_XGRAMMAR_CACHE_MB: past it the least recently used compiled grammars are dropped
# (without a limit every distinct grammar a server was sent stayed in memory)
CACHE_BYTES = 512 * 2**20
# vLLM's VLLM_REGEX_COMPILATION_TIMEOUT_S: a served request's regex still compiling after it is
# a ValueError (nested quantifiers can explode the automaton); its compile ends unwatched
REGEX_COMPILE_SECONDS = 5.0


class GrammarBackend:
    """xgrammar's compiler for one tokenizer and model vocabulary: constraints -> compiled
    grammars (cached by xgrammar), and a fresh matcher per request."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        stop_token_ids: list[int],
        disable_any_whitespace: bool = False,  # for every request (structured_outputs_config)
    ):
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        self.xgr = xgr
        hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
        info = xgr.TokenizerInfo.from_huggingface(
            hf, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids)
        )
        self.compiler = xgr.GrammarCompiler(info, max_threads=2, cache_limit_bytes=CACHE_BYTES)
        self.vocab_size = vocab_size
        self.disable_any_whitespace = disable_any_whitespace
        self.words = cdiv(vocab_size, 32)  # int32 words of one bitmask row
        self.batch = xgr.BatchGrammarMatcher()
        # [words] int32 each, by the control bytes a JSON constraint lets through (whitespace
        # between tokens): the tokens free of every other control byte, none of which JSON
        # allows raw
        self.json_filters = {
            allowed: control_free_tokens(info.decoded_vocab, vocab_size, allowed)
            for allowed in (b"", NO_TAB, WHITESPACE)
        }

    def compile(self, params: StructuredOutputsParams) -> xgrammar.CompiledGrammar:
        """The compiled grammar; a ValueError carrying xgrammar's message when it rejects it."""
        kind = params.kind
        try:
            if kind in ("json", "json_object"):  # an object: OpenAI's json_object, not any value
                schema = params.json if kind == "json" else {"type": "object"}
                check_json_features(json.loads(schema) if isinstance(schema, str) else schema)
                return self.compiler.compile_json_schema(
                    schema if isinstance(schema, str) else json.dumps(schema),
                    any_whitespace=self.any_whitespace(params),
                )
            if kind == "regex":
                return self.compiler.compile_regex(params.regex)
            if kind == "choice":
                return self.compiler.compile_grammar(choice_grammar(list(params.choice)))
            if kind == "structural_tag":
                return self.structural_tag(params.structural_tag)
            if is_lark(params.grammar):
                return self.compiler.compile_lark(params.grammar)
            return self.compiler.compile_grammar(params.grammar)
        except UnsupportedSchema as e:
            raise ValueError(
                f"the JSON schema asks for {e}, which {BACKEND} does not enforce (its outputs "
                "could break the schema); leave it out"
            ) from None
        except Exception as e:  # xgrammar raises RuntimeError/ValueError subclasses
            message = _backend_message(e)
            raise ValueError(f"{BACKEND} rejected the {kind} constraint: {message}") from None

    def structural_tag(self, tag: str | dict) -> xgrammar.CompiledGrammar:
        spec = json.loads(tag) if isinstance(tag, str) else tag
        if "structures" not in spec:
            return self.compiler.compile_structural_tag(json.dumps(spec))
        items = [
            self.xgr.StructuralTagItem(
                begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"]
            )
            for s in spec["structures"]
        ]
        with warnings.catch_warnings():  # xgrammar keeps the older form, deprecated
            warnings.simplefilter("ignore", DeprecationWarning)
            return self.compiler.compile_structural_tag(items, spec["triggers"])

    def matcher(self, compiled: xgrammar.CompiledGrammar) -> xgrammar.GrammarMatcher:
        return self.xgr.GrammarMatcher(compiled)

    def token_filter(self, params: StructuredOutputsParams) -> np.ndarray | None:
        """The mask row a JSON constraint's masks are ANDed with: xgrammar 0.2.9 compiles a
        string with maxLength to characters [^"\\\r\n], which lets raw control bytes (e.g.
        0x12, tab) into a string, and no JSON parser takes them. A structural tag's JSON too
        (its free text then holds no such bytes but tab, newline and carriage return). None for
        the other kinds."""
        if params.kind == "structural_tag":
            return self.json_filters[WHITESPACE]
        if params.kind not in ("json", "json_object"):
            return None
        if not self.any_whitespace(params):
            return self.json_filters[b""]
        # xgrammar 0.2.9 lets a raw tab into a string with a length (and a raw control byte
        # there is no JSON): a schema that has one gets no tab between tokens either
        schema = params.json if params.kind == "json" else None
        if isinstance(schema, str):
            schema = json.loads(schema)
        return self.json_filters[NO_TAB if has_length(schema) else WHITESPACE]

    def any_whitespace(self, params: StructuredOutputsParams) -> bool:
        """Whether a JSON constraint lets whitespace in between tokens: unless the request or the
        engine turns it off."""
        return not (params.disable_any_whitespace or self.disable_any_whitespace)

    def fill_masks(
        self, bitmask: torch.Tensor, requests: list[Request], rows: list[int], num_rows: int
    ) -> None:
        """Rows [0, num_rows) of the host `bitmask`: the next-token mask of each masked row in
        `rows` (a live matcher, or a thinking budget: reasoning.py), all ones elsewhere."""
        host = bitmask.numpy()
        host[:num_rows] = -1
        live = [r for r in rows if not requests[r].finished]
        # a request still thinking samples freely (its row stays all ones) until its budget is
        # spent, when </think> alone is allowed; the grammar's masks start after the thinking
        grammar = [
            r
            for r in live
            if requests[r].reasoning_end_id is None and requests[r].matcher is not None
        ]
        if grammar:
            matchers = [requests[r].matcher for r in grammar]
            self.batch.batch_fill_next_token_bitmask(matchers, bitmask, grammar)
        for r in grammar:
            if requests[r].token_filter is not None:
                host[r] &= requests[r].token_filter
        for r in live:
            end = requests[r].reasoning_end_id
            if end is not None and requests[r].thinking_left == 0:
                host[r] = 0
                host[r, end // 32] = np.uint32(1 << (end % 32)).view(np.int32)


WHITESPACE = b"\t\n\r"  # the control bytes JSON allows between tokens
NO_TAB = b"\n\r"


def has_length(schema: Any) -> bool:
    """Whether a JSON schema bounds a string's length anywhere (or has a property so named)."""
    if isinstance(schema, dict):
        return (
            "minLength" in schema or "maxLength" in schema or any(map(has_length, schema.values()))
        )
    return isinstance(schema, list) and any(map(has_length, schema))


def control_free_tokens(decoded_vocab: list[bytes], vocab_size: int, allowed: bytes):
    """[ceil(vocab / 32)] int32 bitmask row: the tokens whose bytes hold no control byte
    (0x00-0x1f) that JSON forbids outside strings as well as raw inside them, but those
    `allowed` (whitespace between tokens). Ids past the tokenizer's vocabulary stay allowed
    (xgrammar's own mask bans them)."""
    forbidden = bytes(b for b in range(0x20) if b not in allowed)
    bits = np.ones(cdiv(vocab_size, 32) * 32, dtype=np.uint64)
    for token_id, piece in enumerate(decoded_vocab[:vocab_size]):
        if len(piece.translate(None, forbidden)) != len(piece):
            bits[token_id] = 0
    words = (bits.reshape(-1, 32) << np.arange(32, dtype=np.uint64)).sum(axis=1)
    return words.astype(np.uint32).view(np.int32)


def _backend_message(error: Exception) -> str:
    """xgrammar's message without its C++ log prefix, e.g. "[13:13:29] /project/cpp/
    regex_converter.cc:94: Regex parsing error ..." -> "Regex parsing error ..."."""
    lines = str(error).strip().splitlines()
    if not lines:
        return type(error).__name__
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", lines[0])


def accept(request: Request, token: int) -> str | None:
    """Advance the request's matcher by its new output token: None to go on, "stop" when the
    grammar has ended, "abort" when the token breaks it (no allowed token was left to sample,
    e.g. allowed_token_ids outside the grammar). While the request thinks, its tokens are not
    the grammar's: the end of thinking starts it."""
    if request.reasoning_end_id is not None:
        if token == request.reasoning_end_id:
            request.reasoning_end_id = None
        elif request.thinking_left:
            request.thinking_left -= 1
        return None
    matcher = request.matcher
    if matcher is None:  # a thinking budget alone, its thinking over
        return None
    if not matcher.accept_token(token):
        return "abort"
    return "stop" if matcher.is_terminated() else None


def apply_masks(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """-inf into [rows, vocab] logits where the row's [rows, words] bitmask has a 0 bit; xgrammar's
    Triton kernel on CUDA (no host sync: capturable), its torch version on CPU."""
    import xgrammar as xgr

    backend = "triton" if logits.is_cuda else "torch_native"
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1], backend=backend)


class MaskBuffers:
    """A slot's bitmask rows: pinned host and device twin, copied only in steps that need them."""

    def __init__(self, max_seqs: int, vocab_size: int, device: torch.device):
        words = cdiv(vocab_size, 32)
        pin = device.type == "cuda"
        self.host = torch.full((max_seqs, words), -1, dtype=torch.int32, pin_memory=pin)
        self.device = (
            torch.full((max_seqs, words), -1, dtype=torch.int32, device=device)
            if pin
            else self.host
        )  # [max_seqs, ceil(vocab / 32)]

    def copy_in(self, num_rows: int) -> None:
        if self.device is not self.host:
            self.device[:num_rows].copy_(self.host[:num_rows], non_blocking=True)
