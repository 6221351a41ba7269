"""Request bodies of the OpenAI-compatible API, and its error JSON."""

from __future__ import annotations

import logging
from typing import Annotated, Any, ClassVar, Literal, TypeVar

from fastapi.responses import JSONResponse
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

from tandem.sampling import MAX_N, MAX_TOP_K
from tandem.tokenizer import encodable, template_content, template_message, text_part

Text = Annotated[str, AfterValidator(encodable)]
MAX_TOKEN_ID = 2**32 - 1  # the tokenizer's u32

# A field the request models below do not declare is a 400, unless it is null, only labels the
# request (IGNORED_FIELDS), or is one tandem does not implement at a value that asks for nothing.
NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "best_of": (1,),
    "suffix": ("",),
    "tools": ([],),  # /v1/completions: chat declares tools and tool_choice
    "tool_choice": ("none", "auto"),
    "modalities": (["text"],),  # OpenAI's chat: text, its default
}
# OpenAI's labels of a request: `safety_identifier` replaces `user`, `prompt_cache_key` routes
IGNORED_FIELDS = (
    "user", "safety_identifier", "prompt_cache_key", "metadata", "store", "service_tier",
    "parallel_tool_calls",
)  # fmt: skip
# vLLM's guided decoding fields, removed in its 0.12 for the keys of structured_outputs
GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}

logger = logging.getLogger("uvicorn.error")  # the logger `tandem serve` prints


def declared(model: type[BaseModel]) -> set[str]:
    """The keys a request object of `model` may hold: its fields' names and aliases."""
    return set(model.model_fields) | {f.alias for f in model.model_fields.values() if f.alias}


class RequestOption(BaseModel):
    """A nested object that sets how a request is served (stream_options, response_format, tools,
    tool_choice), or a body without sampling (/tokenize, /detokenize): a field it does not declare
    is a 400 naming it, as at a generation body's top level, so that a misspelt name (a
    json_schema's "schmea") never loses what it asked for. Null fields ask for nothing and pass."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def drop_null_undeclared(cls, data: Any) -> Any:
        if isinstance(data, dict):
            keys = declared(cls)
            return {k: v for k, v in data.items() if k in keys or v is not None}
        return data


class MessagePart(BaseModel):
    """A chat message or a part of one. Clients send back the fields of earlier responses with
    their messages (OpenAI's "refusal", "annotations"), which change nothing here: a field not
    declared is ignored, with a warning when it is not null, as vLLM does."""

    @model_validator(mode="before")
    @classmethod
    def warn_undeclared(cls, data: Any) -> Any:
        if isinstance(data, dict):
            keys = declared(cls)
            if names := sorted(str(k) for k, v in data.items() if k not in keys and v is not None):
                logger.warning("ignored the fields %s of a %s", ", ".join(names), cls.__name__)
        return data


class OpenAIError(Exception):
    """An error the client caused or should see, sent as OpenAI's error JSON."""

    def __init__(
        self,
        message: str,
        status_code: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.type = type
        self.param = param
        self.code = code

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code)

    def body(self) -> dict[str, Any]:
        # a message may quote what the client sent: a lone surrogate in it as its escape
        message = self.message.encode("utf-8", "backslashreplace").decode("utf-8")
        error = {"message": message, "type": self.type, "param": self.param, "code": self.code}
        return {"error": error}


Body = TypeVar("Body", bound=BaseModel)


def validated(model: type[Body], data: Any) -> Body:
    """`data` as a `model` request, a 400 naming its first problem as FastAPI's bodies get."""
    try:
        return model.model_validate(data)
    except ValidationError as error:
        raise invalid(error.errors(include_url=False)) from None


def invalid(problems: list[dict[str, Any]]) -> OpenAIError:
    """A request body's validation problems as one 400, naming the first one's place."""
    if any(p["type"] == "json_invalid" for p in problems):
        return OpenAIError("the request body is not valid JSON")
    if not location(problems[0]):  # no body, or one that is not a JSON object
        return OpenAIError(
            "the request body must be a JSON object (Content-Type: application/json)"
        )
    # text that is not Unicode fails every member of a union: say only that
    problems = [p for p in problems if "lone surrogate" in p["msg"]] or problems
    message = "; ".join(f"{location(p)}: {p['msg']}" for p in problems)
    return OpenAIError(message, param=location(problems[0]))


def location(problem: dict[str, Any]) -> str:
    """A validation error's place in the body, e.g. ("body", "messages", 0, "role") -> messages.0.role.

    Union members pydantic tried ("list[int]", "function-after[encodable(), str]") are left out.
    """
    parts = problem["loc"]
    return ".".join(str(p) for p in parts if p != "body" and not (isinstance(p, str) and "[" in p))


class StreamOptions(RequestOption):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: every chunk carries its choice's usage so far


class JsonSchemaFormat(RequestOption):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # None: any JSON object
    strict: bool | None = None  # the schema is always followed strictly


class ResponseFormat(RequestOption):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    # structural_tag (vLLM's): xgrammar's `format`, or the older `structures` and `triggers`
    format: dict[str, Any] | None = None
    structures: list[dict[str, Any]] | None = None
    triggers: list[str] | None = None


class SamplingRequest(BaseModel):
    """Fields both generation endpoints share; None means the OpenAI default.

    Undeclared fields are kept in `model_extra` for `unsupported_field` to check.
    """

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token ids as strings, as JSON keys must be
    stop: Text | list[Text] | None = None
    n: int | None = Field(None, le=MAX_N)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    # beyond OpenAI, as in vLLM
    top_k: int | None = Field(None, le=MAX_TOP_K)
    min_p: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    repetition_penalty: float | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[Text] | None = None
    return_token_ids: bool | None = None  # add each choice's generated token ids
    return_tokens_as_token_ids: bool | None = None  # logprobs name tokens "token_id:<id>"
    request_id: Text | None = None  # the response's id, after "cmpl-" (X-Request-Id wins)
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None  # vLLM's (SamplingParams checks it)
    include_stop_str_in_output: bool | None = None
    truncate_prompt_tokens: int | None = None  # keep k of the prompt's tokens (-1: all that fit)
    # vLLM's: "left" keeps the prompt's last k tokens, "right" its first k; None: "left"
    truncation_side: Literal["left", "right"] | None = None
    # each prompt token's logprob and the top k at its position (not with stream)
    prompt_logprobs: int | None = Field(None, ge=-1)  # vLLM's -1: the whole vocabulary
    # shares cached blocks only with requests of the same salt
    cache_salt: Annotated[str, Field(min_length=1), AfterValidator(encodable)] | None = None
    response_format: ResponseFormat | None = None
    # StructuredOutputsParams' fields (tandem/structured.py): one constraint and its options
    structured_outputs: dict[str, Any] | None = None
    # vLLM's free-form arguments for custom sampling code: SamplingParams.extra_args
    vllm_xargs: dict[str, str | int | float | list[str | int | float]] | None = None
    # vLLM's: finish ("repetition") once the output ends in a repeated n-gram
    repetition_detection: dict[str, int] | None = None
    # vLLM's, with --reasoning-parser: after this many thinking tokens, </think> is forced
    thinking_token_budget: int | None = None
    # vLLM's, with logprobs: each position's logprobs of exactly these ids (and the sampled one)
    logprob_token_ids: list[int] | None = None
    # vLLM's: the n best beams of a beam search (server/beam_search.py), scored with this
    use_beam_search: bool = False
    length_penalty: float = 1.0
    # vLLM's: lower is served first under --scheduling-policy priority; under fcfs, 0 alone
    priority: int = 0

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or ())

    def unsupported_field(self) -> str | None:
        """The first field given that this server does not implement, unless it asks for nothing."""
        for name, value in (self.model_extra or {}).items():
            if value is None or name in IGNORED_FIELDS or value in NEUTRAL_VALUES.get(name, ()):
                continue
            return name
        return None


class CompletionRequest(SamplingRequest):
    prompt: Text | list[int] | list[Text] | list[list[int]] | None = None
    # vLLM's, in place of prompt (enable_prompt_embeds): base64 of torch.save(tensor) bytes of
    # [tokens, hidden] embeddings, or a list of them (prompt_embeds.py)
    prompt_embeds: Text | list[Text] | None = None
    logprobs: int | None = None
    echo: bool | None = None  # the prompt before the completion, with logprobs if asked
    add_special_tokens: bool = True  # a text prompt gets the tokenizer's BOS
    # vLLM's, read by /v1/completions/render alone: each token's characters in its text prompt
    return_token_offsets: bool | None = False


class TextPart(MessagePart):
    # OpenAI's text part, and the Responses API's input_text and output_text, as vLLM reads them
    text_key: ClassVar[str] = "text"  # the field that holds the part's text
    type: Literal["text", "input_text", "output_text"]
    text: Text | None = None  # None: see ChatMessage.check_part_texts


class RefusalPart(MessagePart):
    """An assistant's refusal sent back with its message: text, as vLLM renders it."""

    text_key: ClassVar[str] = "refusal"
    type: Literal["refusal"]
    refusal: Text | None = None


class ThinkingPart(MessagePart):
    """vLLM's part of a model's thinking: text, as vLLM renders it."""

    text_key: ClassVar[str] = "thinking"
    type: Literal["thinking"]
    thinking: Text | None = None
    closed: bool | None = None  # whether the thinking ended; changes nothing in the text


class ToolReferencePart(MessagePart):
    """vLLM's reference to a deferred tool, by name, for the chat template to expand."""

    text_key: ClassVar[str] = "name"
    type: Literal["tool_reference"]
    name: Text | None = None


# a part is one of those, or a bare string (vLLM's)
ContentPart = (
    Annotated[
        TextPart | RefusalPart | ThinkingPart | ToolReferencePart, Field(discriminator="type")
    ]
    | Text
)
# the roles of OpenAI's message types, whose parts vLLM's request validation checks
OPENAI_ROLES = ("system", "developer", "user", "assistant", "tool")


class FunctionCall(MessagePart):
    name: Text
    arguments: Text  # JSON text, as the model wrote it


class ToolCall(MessagePart):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(MessagePart):
    # OpenAI's roles (system, developer, user, assistant, tool) or any other the chat template
    # knows (vLLM's custom roles, e.g. Llama 3's "ipython")
    role: Text
    content: Text | list[ContentPart] | None = None  # None: no parts, "" to a template
    tool_calls: list[ToolCall] | None = None  # an assistant's
    tool_call_id: Text | None = None  # a tool message answers this call
    name: Text | None = None
    # an assistant's thinking before its content or calls (vLLM's two names of it)
    reasoning: Text | None = None
    reasoning_content: Text | None = None
    tools: list[dict[str, Any]] | None = None  # a developer's, as vLLM gives them to templates
    task: Text | None = None  # a model's task marker (DeepSeek V4's), as vLLM passes it

    @model_validator(mode="before")
    @classmethod
    def drop_others_tool_calls(cls, data: Any) -> Any:
        """vLLM's parser keeps an assistant's tool calls alone: others' are dropped unread."""
        if isinstance(data, dict) and data.get("role") != "assistant" and "tool_calls" in data:
            if data["tool_calls"] is not None:
                logger.warning("ignored the tool_calls of a %s message", data.get("role"))
            return {k: v for k, v in data.items() if k != "tool_calls"}
        return data

    @model_validator(mode="after")
    def check_part_texts(self) -> ChatMessage:
        """A part without its text is a 400 on a message of OpenAI's roles, as vLLM's request
        validation has it; on another role's, vLLM's parser skips a text or refusal part and
        gives the others a None text (tokenizer.text_part)."""
        if self.role not in OPENAI_ROLES or not isinstance(self.content, list):
            return self
        for part in self.content:
            if not isinstance(part, str) and getattr(part, part.text_key) is None:
                raise ValueError(
                    f"a {part.type} part of a {self.role} message needs its {part.text_key} as "
                    "a string; leave the part out rather than send it without"
                )
        return self

    def openai_content(self) -> str | list[dict[str, Any] | None] | None:
        """The content, each part as tokenizer.text_part gives it (None where vLLM skips it)."""
        if not isinstance(self.content, list):
            return self.content
        return [text_part(p if isinstance(p, str) else p.model_dump()) for p in self.content]

    def text(self) -> str:
        """The content as text; text parts are joined by newlines, as vLLM renders them."""
        return template_content(self.openai_content(), "string")

    def as_template_input(self, content_format: str = "string") -> dict[str, Any]:
        """The message as vLLM's server gives it to a chat template of `content_format`
        (tokenizer.template_message), reasoning_content read as reasoning where that is null."""
        message = self.model_dump(include=self.model_fields_set - {"reasoning_content"})
        if self.reasoning is None and self.reasoning_content is not None:
            message["reasoning"] = self.reasoning_content
        return template_message(message, content_format)


class FunctionDefinition(RequestOption):
    name: Text = Field(min_length=1)
    description: Text | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class Tool(RequestOption):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(RequestOption):
    name: str


class NamedToolChoice(RequestOption):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=-1)  # vLLM's -1: the whole vocabulary
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # False: one call at most, the first
    # the chat template's options, as vLLM takes them (Tokenizer.apply_chat_template)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[Text, Any] | None = None
    chat_template: Text | None = None  # vLLM's: Jinja source (--trust-request-chat-template)
    add_special_tokens: bool = False  # the template writes its own BOS
    echo: bool = False  # vLLM's: the final message's text leads the answer's if of its role
    # vLLM's: the template's reasoning_effort, and enable_thinking unless the kwargs set it
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = (
        None
    )
    include_reasoning: bool = True  # False: message.reasoning is left out (--reasoning-parser)
    # vLLM's: texts for retrieval-augmented generation, the template's `documents`
    documents: list[dict[str, Text]] | None = None
    return_prompt_text: bool | None = None  # vLLM's: the rendered prompt in the response
    # vLLM's, read by /v1/chat/completions/render alone: each token's characters in the
    # rendered prompt, and which tokens the template marks as the assistant's
    return_token_offsets: bool | None = False
    return_assistant_tokens_mask: bool = False

    def template_kwargs(self) -> dict[str, Any] | None:
        """The chat template's variables: chat_template_kwargs, with reasoning_effort over a
        variable of that name and documents over theirs (as vLLM); enable_thinking follows
        reasoning_effort unless chat_template_kwargs sets it."""
        kwargs = self.chat_template_kwargs
        if self.reasoning_effort is not None:
            thinking = {"enable_thinking": self.reasoning_effort != "none"}
            kwargs = {**thinking, **(kwargs or {}), "reasoning_effort": self.reasoning_effort}
        if self.documents is not None:
            kwargs = {**(kwargs or {}), "documents": self.documents}
        return kwargs

    def answer_role(self, response_role: str = "assistant") -> str:
        """`response_role` (--response-role), or without a generation prompt the final
        message's (as vLLM)."""
        return response_role if self.add_generation_prompt else self.messages[-1].role

    def echoed(self, response_role: str = "assistant") -> str:
        """The text echo puts before the answer: the final message's, when of the answer's role."""
        final = self.messages[-1]
        return final.text() if self.echo and final.role == self.answer_role(response_role) else ""


class TokenizeRequest(RequestOption):
    model: str | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None  # given to the chat template with the messages
    add_special_tokens: bool | None = None  # None: a prompt's True, messages' False
    return_token_strs: bool = False  # add each id's entry in the vocabulary
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[Text, Any] | None = None
    chat_template: Text | None = None  # as the chat request's

    def template_kwargs(self) -> dict[str, Any] | None:
        return self.chat_template_kwargs


class DetokenizeRequest(RequestOption):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]]
