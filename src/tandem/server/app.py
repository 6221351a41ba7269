"""The FastAPI app: routes, API-key check, errors as OpenAI's JSON, and `serve`."""

from __future__ import annotations

import secrets
import time
from typing import Any

import uvicorn
from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from tandem.async_llm import AsyncLLM, EngineDeadError
from tandem.server.admin import admin_router
from tandem.server.metrics import ServerMetrics
from tandem.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    OpenAIError,
    TokenizeRequest,
)
from tandem.server.serving import OpenAIServing, chat_prompt

OPEN_PATHS = ("/health", "/metrics")  # reachable without the API key


def build_app(llm: AsyncLLM, model_name: str, api_key: str | None = None) -> FastAPI:
    """The OpenAI-compatible API over `llm`, serving it as `model_name`."""
    app = FastAPI(title="tandem")
    metrics = ServerMetrics(llm)
    serving = OpenAIServing(llm, model_name, metrics)
    app.state.llm = llm
    if api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    add_error_handlers(app)
    app.include_router(admin_router(llm))  # RL: pause, sleep, weights (behind the API key)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: HttpRequest) -> Response:
        return await serving.completions(body, http)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, http: HttpRequest) -> Response:
        return await serving.chat(body, http)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        model = {
            "id": model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "tandem",
            "max_model_len": llm.max_model_len,
        }
        return {"object": "list", "data": [model]}

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if llm.is_running else 503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        serving.check_model(body.model)
        tokenizer = serving.tokenizer()
        if (body.prompt is None) == (body.messages is None):
            raise OpenAIError("give exactly one of prompt and messages", param="prompt")
        if body.messages is not None:
            text = chat_prompt(tokenizer, body.messages, body.add_generation_prompt)
            tokens = tokenizer.encode(text, add_special_tokens=False)
        else:
            tokens = tokenizer.encode(body.prompt, body.add_special_tokens)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": llm.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, str]:
        serving.check_model(body.model)
        return {"prompt": serving.tokenizer().decode(body.tokens)}

    return app


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def openai_error(_: HttpRequest, error: OpenAIError) -> JSONResponse:
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: HttpRequest, error: RequestValidationError) -> JSONResponse:
        problems = error.errors()
        if any(p["type"] == "json_invalid" for p in problems):
            return OpenAIError("the request body is not valid JSON").response()
        if not location(problems[0]):  # no body, or one that is not a JSON object
            message = "the request body must be a JSON object (Content-Type: application/json)"
            return OpenAIError(message).response()
        message = "; ".join(f"{location(p)}: {p['msg']}" for p in problems)
        return OpenAIError(message, param=location(problems[0])).response()

    @app.exception_handler(HTTPException)
    async def http_error(_: HttpRequest, error: HTTPException) -> JSONResponse:
        return OpenAIError(str(error.detail), error.status_code).response()

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_: HttpRequest, error: EngineDeadError) -> JSONResponse:
        return OpenAIError(str(error), 500, "server_error").response()

    @app.exception_handler(Exception)  # after the response, starlette re-raises it to be logged
    async def unexpected(_: HttpRequest, error: Exception) -> JSONResponse:
        return OpenAIError(f"internal error: {error!r}", 500, "server_error").response()


def location(problem: dict[str, Any]) -> str:
    """A validation error's place in the body, e.g. ("body", "messages", 0, "role") -> messages.0.role."""
    return ".".join(str(part) for part in problem["loc"] if part != "body")


class ApiKeyMiddleware:
    """401 unless `Authorization: Bearer <api_key>`, for every path but OPEN_PATHS."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                error = OpenAIError(
                    "missing or wrong API key; send it as 'Authorization: Bearer <key>'",
                    401,
                    code="invalid_api_key",
                )
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def serve(llm: AsyncLLM, model_name: str, host: str, port: int, api_key: str | None = None) -> None:
    """Serve until interrupted, then stop the engine thread."""
    try:
        app = build_app(llm, model_name, api_key)
        # no access log: its per-request lines would compete with the engine thread for the GIL
        uvicorn.run(app, host=host, port=port, access_log=False, timeout_graceful_shutdown=5)
    finally:
        llm.shutdown()
