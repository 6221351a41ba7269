"""Request bodies of the OpenAI-compatible API, and its error JSON."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from tandem.sampling import MAX_LOGPROBS, MAX_TOP_K

MAX_N = 128  # OpenAI's limit; one request must not queue millions of engine requests
MAX_TOKEN_ID = 2**32 - 1  # the tokenizer's u32

# A field the request models below do not declare is a 400, unless it is null, only labels the
# request (IGNORED_FIELDS), or is one tandem does not implement at a value that asks for nothing.
NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "best_of": (1,),
    "echo": (False,),
    "frequency_penalty": (0,),
    "presence_penalty": (0,),
    "repetition_penalty": (1,),
    "logit_bias": ({},),
    "suffix": ("",),
    "tools": ([],),
    "tool_choice": ("none", "auto"),
    "response_format": ({"type": "text"},),
    "skip_special_tokens": (True,),
    "include_stop_str_in_output": (False,),
}
IGNORED_FIELDS = ("user", "metadata", "store", "service_tier", "parallel_tool_calls")


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
        error = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        return {"error": error}


class StreamOptions(BaseModel):
    include_usage: bool = False


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
    stop: str | list[str] | None = None
    n: int | None = Field(None, le=MAX_N)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    # beyond OpenAI, as in vLLM
    top_k: int | None = Field(None, le=MAX_TOP_K)
    min_p: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    return_token_ids: bool | None = None  # add each choice's generated token ids

    def unsupported_field(self) -> str | None:
        """The first field given that this server does not implement, unless it asks for nothing."""
        for name, value in (self.model_extra or {}).items():
            if value is None or name in IGNORED_FIELDS or value in NEUTRAL_VALUES.get(name, ()):
                continue
            return name
        return None


class CompletionRequest(SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = None  # the prompt before the completion, with logprobs if asked


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]

    def as_template_input(self) -> dict[str, str]:
        content = self.content
        text = content if isinstance(content, str) else "".join(part.text for part in content)
        return {"role": self.role, "content": text}


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


class TokenizeRequest(BaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]]
