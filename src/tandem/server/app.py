"""The FastAPI app: routes, API-key check, body-size cap, errors as OpenAI's JSON."""

from __future__ import annotations

import asyncio
import importlib
import inspect
import secrets
import time
import uuid
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from tandem import __version__
from tandem.async_llm import AsyncLLM, EngineDeadError
from tandem.lora.request import LoRARequest
from tandem.server import anthropic, responses, tokens
from tandem.server.adapters import adapter_router
from tandem.server.admin import admin_router, dev_router
from tandem.server.embeddings import (
    ClassificationRequest,
    EmbeddingRequest,
    PoolRequest,
    RerankRequest,
    ScoreRequest,
    classify,
    embeddings,
    pool,
    rerank,
    score,
)
from tandem.server.metrics import ServerMetrics
from tandem.server.options import ServerOptions
from tandem.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    OpenAIError,
    RequestOption,
    Text,
    TokenizeRequest,
    invalid,
    logger,
    validated,
)
from tandem.server.serving import OpenAIServing, ServerShuttingDown, chat_ids
from tandem.server.tokens import GenerateRequest
from tandem.tokenizer import Tokenizer, is_added_token, token_text

OPEN_PATHS = ("/health", "/ping", "/metrics")  # reachable without the API key
DOCS_ROUTES = ("docs_url", "redoc_url", "openapi_url")  # FastAPI's; None: not served


def build_app(
    llm: AsyncLLM,
    model_name: str | Sequence[str],
    api_key: str | None = None,
    options: ServerOptions | None = None,
) -> FastAPI:
    """The OpenAI-compatible API over `llm`, serving it as `model_name`: requests may name any
    of several names (vLLM's served_model_name list), answers carry the first."""
    options = options or ServerOptions(api_key=api_key)
    options.validate()
    names = [model_name] if isinstance(model_name, str) else list(model_name)
    if not names or not all(isinstance(name, str) and name for name in names):
        raise ValueError(f"served model names must be non-empty strings, got {model_name!r}")
    clashing = [lora.lora_name for lora in options.lora_modules if lora.lora_name in names]
    if clashing:
        raise ValueError(f"LoRA module names {clashing} are served model names already")
    check_lora_modules(llm, options.lora_modules)
    docs = {} if not options.disable_fastapi_docs else dict.fromkeys(DOCS_ROUTES)
    app = FastAPI(title="tandem", **docs)
    # vLLM's --root-path: paths with the proxy's prefix and without it both reach the routes
    app.root_path = options.root_path or ""
    metrics = ServerMetrics(llm, names[0])
    serving = OpenAIServing(llm, names, metrics, options, options.lora_modules)
    app.state.llm, app.state.serving = llm, serving
    if options.api_keys():
        app.add_middleware(ApiKeyMiddleware, api_keys=options.api_keys())
    app.add_middleware(RequestLimitMiddleware, options=options)
    if options.enable_request_id_headers:
        app.add_middleware(RequestIdMiddleware)
    app.add_middleware(  # the outermost: a preflight is answered before the API key is asked
        CORSMiddleware,
        allow_origins=options.allowed_origins,
        allow_methods=options.allowed_methods,
        allow_headers=options.allowed_headers,
        allow_credentials=options.allow_credentials,
    )
    for path in options.middleware:  # vLLM's --middleware, outermost as there
        add_middleware(app, path)
    add_error_handlers(app, options.log_error_stack)
    app.include_router(admin_router(llm))  # RL: pause, sleep, weights (behind the API key)
    if options.server_dev_mode:
        logger.warning("VLLM_SERVER_DEV_MODE: /collective_rpc runs any engine method by name")
        app.include_router(dev_router(llm))
    if options.allow_runtime_lora_updating:
        app.include_router(adapter_router(serving))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: HttpRequest) -> Response:
        return await serving.completions(body, http)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, http: HttpRequest) -> Response:
        return await serving.chat(body, http)

    @app.post("/v1/embeddings")
    async def create_embeddings(body: EmbeddingRequest) -> dict[str, Any]:
        return await embeddings(serving, body)

    @app.post("/classify")
    async def create_classification(body: ClassificationRequest) -> dict[str, Any]:
        return await classify(serving, body)

    @app.post("/pooling")
    async def create_pooling(body: PoolRequest) -> dict[str, Any]:
        return await pool(serving, body)

    @app.post("/score")
    @app.post("/v1/score")
    async def create_score(body: ScoreRequest) -> dict[str, Any]:
        return await score(serving, body)

    @app.post("/rerank")
    @app.post("/v1/rerank")
    @app.post("/v2/rerank")
    async def create_rerank(body: RerankRequest) -> dict[str, Any]:
        return await rerank(serving, body)

    stored = app.state.responses = responses.ResponseStore()

    @app.post("/v1/responses")
    async def create_response(body: responses.ResponsesRequest, http: HttpRequest) -> Response:
        return await responses.create(serving, stored, body, http)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> dict[str, Any]:
        return stored.get(response_id)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str) -> dict[str, Any]:
        return await stored.cancel(response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> dict[str, Any]:
        stored.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    @app.post("/v1/messages")  # Anthropic's Messages API (anthropic.py)
    async def create_message(body: anthropic.MessagesRequest, http: HttpRequest) -> Response:
        return await anthropic.create(serving, body, http)

    @app.post("/v1/messages/count_tokens")
    async def count_message_tokens(body: anthropic.CountTokensRequest) -> dict[str, int]:
        return await anthropic.count_tokens(serving, body)

    @app.post("/abort_requests")  # vLLM's, for RL trainers: end these calls where they are
    async def abort_requests(body: AbortRequest) -> dict[str, list[str]]:
        return {"aborted": serving.abort(set(body.request_ids))}

    @app.post("/inference/v1/generate")
    async def generate_tokens(body: GenerateRequest, http: HttpRequest) -> Response:
        return await tokens.generate(serving, body, http)

    # SageMaker's (vLLM's too): the endpoint that the body's fields name; a classifier's
    # inputs are classified, any other model's embedded
    classifier = llm.engine.model_config.num_labels > 0
    invocations = {
        "messages": (ChatCompletionRequest, serving.chat),
        "prompt": (CompletionRequest, serving.completions),
        "text_1": (ScoreRequest, lambda body, _: score(serving, body)),
        "query": (RerankRequest, lambda body, _: rerank(serving, body)),
        "token_ids": (GenerateRequest, lambda body, http: tokens.generate(serving, body, http)),
        "input": (ClassificationRequest, lambda body, _: classify(serving, body))
        if classifier
        else (EmbeddingRequest, lambda body, _: embeddings(serving, body)),
    }

    @app.post("/invocations")
    async def invoke(http: HttpRequest) -> Any:
        try:
            body = await http.json()
        except (ValueError, RecursionError):  # not JSON, or nested past the parser
            raise OpenAIError("the request body is not valid JSON") from None
        field = next((f for f in invocations if isinstance(body, dict) and f in body), None)
        if field is None:
            raise OpenAIError(
                "an invocation names its endpoint by its fields: messages (chat), prompt "
                "(completions), input (embeddings or classify), text_1 (score), query (rerank) "
                "or token_ids (generate)"
            )
        model, route = invocations[field]
        return await route(validated(model, body), http)

    @app.post("/v1/completions/render")
    async def render_completion(body: CompletionRequest) -> list[dict[str, Any]]:
        return await tokens.render_completion(serving, body)

    @app.post("/v1/chat/completions/render")
    async def render_chat(body: ChatCompletionRequest) -> dict[str, Any]:
        return await tokens.render_chat(serving, body)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        created = int(time.time())
        cards = [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "tandem",
                "root": llm.model,
                "parent": None,  # a base model; vLLM names the base of a LoRA adapter here
                "max_model_len": llm.max_model_len,
                "permission": [model_permission(created)],
            }
            for name in names
        ]
        cards += [  # as vLLM lists a LoRA adapter: its folder as root, the model as parent
            {**cards[0], "id": lora.lora_name, "root": lora.lora_path, "parent": names[0]}
            for lora in serving.adapters.values()
        ]
        return {"object": "list", "data": cards}

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/load")  # vLLM's, for load balancers: the generation calls being answered
    async def load() -> dict[str, int]:
        return {"server_load": len(serving.open)}

    @app.get("/health")
    @app.get("/ping")  # SageMaker's name (vLLM's too)
    async def health() -> Response:
        stall = options.health_stall_timeout_s
        stalled = stall > 0 and llm.seconds_without_progress() > stall
        return Response(status_code=200 if llm.is_running and not stalled else 503)

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
            _, tokens = await asyncio.to_thread(chat_ids, tokenizer, body, serving.options)
        else:
            add_special_tokens = body.add_special_tokens is not False
            tokens = await asyncio.to_thread(tokenizer.encode, body.prompt, add_special_tokens)
        strs = tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None
        return {
            "tokens": tokens,
            "count": len(tokens),
            "max_model_len": llm.max_model_len,
            "token_strs": strs,
        }

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, str]:
        serving.check_model(body.model)
        # as vLLM's: special tokens (a chat template's markers, BOS) stay in the text
        return {"prompt": serving.tokenizer().decode(body.tokens, skip_special_tokens=False)}

    if options.enable_tokenizer_info_endpoint:

        @app.get("/tokenizer_info")
        async def get_tokenizer_info() -> dict[str, Any]:
            return tokenizer_info(serving.tokenizer(), options.chat_template)

    return app


def tokenizer_info(tokenizer: Tokenizer, chat_template: str | None) -> dict[str, Any]:
    """vLLM's /tokenizer_info: the tokenizer's settings as its tokenizer_config.json gives them
    (file paths left out, a token written as an AddedToken object as its text), its added
    tokens as {id: text}, the class the file names (tokenizer_class) and the chat template
    requests are rendered with."""
    info = {
        name: token_text(value) if is_added_token(value) else value
        for name, value in tokenizer.init_kwargs.items()
        if name not in ("vocab_file", "merges_file")
    }
    added = tokenizer.backend.get_added_tokens_decoder()
    info["added_tokens_decoder"] = {str(i): token.content for i, token in sorted(added.items())}
    info["name_or_path"] = tokenizer.name_or_path
    info["tokenizer_class"] = info.get("tokenizer_class") or "PreTrainedTokenizerFast"
    template = chat_template or tokenizer.chat_template
    if template:
        info["chat_template"] = template
    return info


def model_permission(created: int) -> dict[str, Any]:
    """vLLM's one permission entry of a model card: sampling and logprobs, nothing else."""
    return {
        "id": f"modelperm-{secrets.token_hex(16)}",
        "object": "model_permission",
        "created": created,
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }


def add_middleware(app: FastAPI, path: str) -> None:
    """vLLM's --middleware: the class or async function at the import path `path`, as
    app.add_middleware or @app.middleware("http") takes it; ValueError naming the flag else."""
    module_name, _, name = path.rpartition(".")
    try:
        found = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"--middleware {path}: cannot import it ({error})") from error
    if inspect.isclass(found):
        app.add_middleware(found)
    elif inspect.iscoroutinefunction(found):
        app.middleware("http")(found)
    else:
        raise ValueError(
            f"--middleware {path}: a middleware class or an async function (request, call_next) "
            f"is needed, got {type(found).__name__}"
        )


def add_error_handlers(app: FastAPI, log_stack: bool = False) -> None:
    """Each error as the API's error JSON; with `log_stack` (--log-error-stack) each is logged
    with its stack trace too."""

    def answer(http: HttpRequest, cause: Exception, error: OpenAIError) -> JSONResponse:
        if log_stack:
            logger.error(
                "%s %s answered %d: %s", http.method, http.url.path, error.status_code,
                error.message, exc_info=cause,
            )  # fmt: skip
        return answered(http.url.path, error)

    @app.exception_handler(OpenAIError)
    async def openai_error(http: HttpRequest, error: OpenAIError) -> JSONResponse:
        return answer(http, error, error)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(http: HttpRequest, error: RequestValidationError) -> JSONResponse:
        return answer(http, error, invalid(error.errors()))

    @app.exception_handler(HTTPException)
    async def http_error(http: HttpRequest, error: HTTPException) -> JSONResponse:
        return answer(http, error, OpenAIError(str(error.detail), error.status_code))

    @app.exception_handler(EngineDeadError)
    async def engine_dead(http: HttpRequest, error: EngineDeadError) -> JSONResponse:
        return closing(answer(http, error, OpenAIError(str(error), 500, "server_error")))

    @app.exception_handler(ServerShuttingDown)
    async def shutting_down(http: HttpRequest, error: ServerShuttingDown) -> JSONResponse:
        return closing(answer(http, error, OpenAIError(str(error), 503, "server_error")))

    @app.exception_handler(Exception)  # after the response, starlette re-raises it to be logged
    async def unexpected(http: HttpRequest, error: Exception) -> JSONResponse:
        failure = OpenAIError(f"internal error: {error!r}", 500, "server_error")
        return closing(answered(http.url.path, failure))


def answered(path: str, error: OpenAIError) -> JSONResponse:
    """`error` in the shape of the API that `path` is of: Anthropic's on the Messages API's
    routes, else OpenAI's."""
    return anthropic.error_response(error) if anthropic.serves(path) else error.response()


def closing(response: JSONResponse) -> JSONResponse:
    """Tell the client this connection ends with the response: after a 5xx it is not reused."""
    response.headers["Connection"] = "close"
    return response


class AbortRequest(RequestOption):
    request_ids: list[Text]  # the ids of the answers, as they give them ("generate-tokens-42")


class ApiKeyMiddleware:
    """401 unless `Authorization: Bearer <key>` (the scheme in any case) with one of the keys,
    or on the Messages API's routes `x-api-key: <key>` (Anthropic's clients'), but on
    OPEN_PATHS."""

    def __init__(self, app: ASGIApp, api_keys: tuple[str, ...]):
        self.app = app
        self.expected = [key.encode() for key in api_keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            headers, anthropic_api = dict(scope["headers"]), anthropic.serves(scope["path"])
            scheme, _, key = headers.get(b"authorization", b"").partition(b" ")
            given = [key.strip()] if scheme.lower() == b"bearer" else []
            if anthropic_api and b"x-api-key" in headers:
                given.append(headers[b"x-api-key"])
            # every key compared, each in constant time: the answer's time names none of them
            matches = [
                secrets.compare_digest(k, expected) for k in given for expected in self.expected
            ]
            if not any(matches):
                how = "'x-api-key: <key>' or " if anthropic_api else ""
                error = OpenAIError(
                    f"missing or wrong API key; send it as {how}'Authorization: Bearer <key>'",
                    401,
                    code="invalid_api_key",
                )
                await answered(scope["path"], error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class RequestIdMiddleware:
    """vLLM's --enable-request-id-headers: every response carries X-Request-Id, the client's
    own or a new one."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = dict(scope["headers"]).get(b"x-request-id") or uuid.uuid4().hex.encode()

        async def with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", request_id)]}
            await send(message)

        await self.app(scope, receive, with_id)


class RequestLimitMiddleware:
    """413 for a request body past `max_request_bytes`, by its Content-Length or as it arrives;
    431 for headers past `h11_max_header_count` or `h11_max_incomplete_event_size` bytes."""

    def __init__(self, app: ASGIApp, options: ServerOptions):
        self.app = app
        self.max_bytes = options.max_request_bytes
        self.max_headers = options.h11_max_header_count
        self.max_header_bytes = options.h11_max_incomplete_event_size

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = scope["headers"]
        if len(headers) > self.max_headers:
            message = (
                f"the request has more than {self.max_headers} headers (--h11-max-header-count)"
            )
            too_many = OpenAIError(message, 431, code="request_header_fields_too_large")
            await closing(answered(scope["path"], too_many))(scope, receive, send)
            return
        if sum(len(name) + len(value) for name, value in headers) > self.max_header_bytes:
            message = (
                f"the request's headers are larger than {self.max_header_bytes} bytes "
                "(--h11-max-incomplete-event-size)"
            )
            too_large = OpenAIError(message, 431, code="request_header_fields_too_large")
            await closing(answered(scope["path"], too_large))(scope, receive, send)
            return
        length = dict(headers).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            await closing(answered(scope["path"], self.too_large()))(scope, receive, send)
            return
        received = 0

        async def counted() -> dict:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:  # re-raised by FastAPI's body reading, as a 413
                raise HTTPException(413, self.too_large().message)
            return message

        await self.app(scope, counted, send)

    def too_large(self) -> OpenAIError:
        message = f"the request body is larger than {self.max_bytes} bytes (--max-request-bytes)"
        return OpenAIError(message, 413, code="request_too_large")


def check_lora_modules(llm: AsyncLLM, lora_modules: Sequence[LoRARequest]) -> None:
    """Read every --lora-modules adapter before serving, as vLLM loads its static adapters:
    ValueError for one the engine cannot run (it was listed, then every request a 400)."""
    if lora_modules and llm.engine.adapter_cache is None:
        raise ValueError("--lora-modules needs --enable-lora")
    for lora in lora_modules:
        llm.engine.adapter_cache.get(lora)
