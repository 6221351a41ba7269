"""The server's limits and lifecycle settings (the `tandem serve` flags), in one place."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2

from tandem.lora.request import LoRARequest
from tandem.server.tool_calls import PARSERS
from tandem.tokenizer import compile_chat_template, content_format

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")  # uvicorn's
MIDDLEWARE_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")  # "module.name", dotted
FINGERPRINT_MODES = ("full", "hash", "custom", "none")  # vLLM's --fingerprint-mode


@dataclass(frozen=True)
class ServerOptions:
    # require "Authorization: Bearer <key>" with this key, or one of these (not on /health,
    # /ping, /metrics)
    api_key: str | tuple[str, ...] | None = None
    max_request_bytes: int = 8 * 2**20  # a larger body is a 413
    max_sequences_per_request: int = 256  # prompts x n; more is a 400
    max_stop_strings: int = 16
    max_stop_string_length: int = 256  # characters
    health_stall_timeout_s: float = 60.0  # /health is 503 once work waits this long on no step
    drain_timeout_s: float = 30.0  # SIGTERM: open requests get this long before they are ended
    access_log: bool = False
    # tool_choice "auto": the parser of the model's tool-call format (tool_calls.PARSERS)
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False  # vLLM's flag; a parser alone enables it here too
    # LoRA adapters that requests name as their model (vLLM's --lora-modules)
    lora_modules: tuple[LoRARequest, ...] = ()
    # vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter (its
    # VLLM_ALLOW_RUNTIME_LORA_UPDATING): off, they are 404s
    allow_runtime_lora_updating: bool = False
    # vLLM's VLLM_SERVER_DEV_MODE: its development routes /collective_rpc, /server_info,
    # /reset_mm_cache and /reset_encoder_cache (admin.dev_router)
    server_dev_mode: bool = False
    # vLLM's --enable-tokenizer-info-endpoint: GET /tokenizer_info answers the tokenizer's
    # settings (tokenizer_config.json's) and chat template; off, it is a 404
    enable_tokenizer_info_endpoint: bool = False
    # the chat template of every chat request, Jinja source (--chat-template reads it from a
    # file or takes it inline); None: the model's
    chat_template: str | None = None
    # vLLM's --trust-request-chat-template: a request's own chat_template is a 400 without it
    trust_request_chat_template: bool = False
    response_role: str = "assistant"  # a chat answer's role after a generation prompt (vLLM's)
    # vLLM's --default-chat-template-kwargs: template variables a request's own override
    default_chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's --chat-template-content-format: how templates take a message's content
    # (tokenizer.content_format: "auto", "string" or "openai")
    chat_template_content_format: str = "auto"
    # CORS (vLLM's flags and defaults: any origin, method and header; no credentials)
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    root_path: str | None = None  # the path prefix of a proxy in front (FastAPI's root_path)
    disable_fastapi_docs: bool = False  # no /docs, /redoc, /openapi.json
    # TLS (uvicorn's): the certificate chain and its key, PEM files; CA certificates and
    # whether clients must present a certificate (ssl.CERT_NONE 0, OPTIONAL 1, REQUIRED 2)
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = 0
    ssl_ciphers: str | None = None  # TLS 1.2 and below's cipher suites, OpenSSL's list (vLLM's)
    # vLLM's --enable-ssl-refresh: the certificate files are read again once they change
    enable_ssl_refresh: bool = False
    # vLLM's --uds: serve on this Unix socket instead of the host and port
    uds: str | None = None
    # vLLM's header limits: a request's headers past this many bytes (uvicorn's h11 parser's
    # limit too) or past this many headers is a 431
    h11_max_incomplete_event_size: int = 4 * 2**20
    h11_max_header_count: int = 256
    # vLLM's --disable-access-log-for-endpoints: comma-separated paths whose requests the
    # access log (--access-log) leaves out, e.g. "/health,/metrics"
    disable_access_log_for_endpoints: str | None = None
    # vLLM's --log-error-stack (on by default under VLLM_SERVER_DEV_MODE): every error answer
    # logs its exception with its stack trace
    log_error_stack: bool = False
    # vLLM's --enable-per-request-metrics: an answer of one choice carries its timings
    # ("metrics": queue, first token, generation, mean inter-token ms, tokens per second; a
    # stream's on its usage chunk)
    enable_per_request_metrics: bool = False
    # vLLM's --fingerprint-mode: the answers' system_fingerprint, "full" (tandem's version, the
    # parallel sizes and a hash of the engine's settings), "hash" (no sizes), "custom"
    # (fingerprint_value) or "none" (null)
    fingerprint_mode: str = "full"
    fingerprint_value: str | None = None
    # vLLM's --exclude-tools-when-tool-choice-none: a chat with tool_choice "none" is rendered
    # without its tools (its template sees none)
    exclude_tools_when_tool_choice_none: bool = False
    uvicorn_log_level: str | None = None  # None: uvicorn's ("info")
    # vLLM's --enable-log-requests: a line per request (its prompt cut to max_log_len
    # characters and ids, None: whole) and its sampling parameters
    enable_log_requests: bool = False
    max_log_len: int | None = None
    # vLLM's --enable-log-outputs (with --enable-log-requests): a line per finished choice, its
    # text and ids cut to max_log_len, and its finish reason
    enable_log_outputs: bool = False
    # vLLM's --enable-log-deltas (on by default; --no-enable-log-deltas): with
    # --enable-log-outputs, a stream's outputs get a line each too, as they are sent
    enable_log_deltas: bool = True
    # vLLM's --enable-force-include-usage: every stream ends with its usage, asked or not
    enable_force_include_usage: bool = False
    # vLLM's --return-tokens-as-token-ids: every request's logprobs name tokens by id
    return_tokens_as_token_ids: bool = False
    # vLLM's --enable-request-id-headers: every response carries X-Request-Id (the client's
    # own, else a new one)
    enable_request_id_headers: bool = False
    # vLLM's --middleware: import paths ("package.module.name") of ASGI middleware classes or
    # async functions (FastAPI's @app.middleware("http")), each outside the server's own
    middleware: tuple[str, ...] = ()
    # vLLM's --log-config-file: uvicorn's logging as a JSON file (logging.config.dictConfig's)
    log_config_file: str | None = None

    def validate(self) -> None:
        for name in ("max_request_bytes", "max_sequences_per_request", "max_stop_strings"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_stop_string_length < 1:
            raise ValueError(
                f"max_stop_string_length must be at least 1, got {self.max_stop_string_length}"
            )
        self.validate_tool_options()
        names = [lora.lora_name for lora in self.lora_modules]
        if len(set(names)) < len(names):
            raise ValueError(f"lora_modules must have distinct names, got {names}")
        for name in ("health_stall_timeout_s", "drain_timeout_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        self.validate_chat_options()
        self.validate_http_options()
        self.validate_logging_options()
        self.validate_api_keys()

    def api_keys(self) -> tuple[str, ...]:
        return (self.api_key,) if isinstance(self.api_key, str) else tuple(self.api_key or ())

    def validate_api_keys(self) -> None:
        keys = self.api_keys()
        if self.api_key is not None and (
            not keys or not all(isinstance(k, str) and k for k in keys)
        ):
            raise ValueError(
                f"api_key must be a non-empty string or a list of them, got {self.api_key!r}"
            )

    def validate_logging_options(self) -> None:
        length = self.max_log_len
        if length is not None and (
            isinstance(length, bool) or not isinstance(length, int) or length < 0
        ):
            raise ValueError(f"max_log_len must be an int >= 0 or None, got {length!r}")

    def validate_http_options(self) -> None:
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            value = getattr(self, name)
            if isinstance(value, str) or not all(isinstance(v, str) for v in value):
                raise ValueError(f"{name} must be a list of strings, got {value!r}")
        for name in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{name} (--{name.replace('_', '-')}) {path!r} is not a file")
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("TLS needs both --ssl-certfile and --ssl-keyfile")
        if self.fingerprint_mode not in FINGERPRINT_MODES:
            raise ValueError(
                f"fingerprint_mode must be one of {', '.join(FINGERPRINT_MODES)}, got "
                f"{self.fingerprint_mode!r}"
            )
        if (self.fingerprint_mode == "custom") != (self.fingerprint_value is not None):
            raise ValueError("--fingerprint-value goes with --fingerprint-mode custom, and only")
        for name in ("h11_max_incomplete_event_size", "h11_max_header_count"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.enable_ssl_refresh and self.ssl_certfile is None:
            raise ValueError("--enable-ssl-refresh reloads --ssl-certfile: give it")
        if self.uds is not None and (self.ssl_keyfile is not None):
            raise ValueError("--uds serves plain HTTP on a Unix socket: no --ssl-keyfile with it")
        if self.ssl_cert_reqs not in (0, 1, 2):
            raise ValueError(
                f"ssl_cert_reqs must be 0 (none), 1 (optional) or 2 (required), got "
                f"{self.ssl_cert_reqs!r}"
            )
        if self.uvicorn_log_level not in (None, *LOG_LEVELS):
            raise ValueError(
                f"uvicorn_log_level must be one of {', '.join(LOG_LEVELS)}, got "
                f"{self.uvicorn_log_level!r}"
            )
        if self.enable_log_outputs and not self.enable_log_requests:
            raise ValueError("--enable-log-outputs needs --enable-log-requests (as vLLM's)")
        self.log_config()  # a ValueError where it is no JSON object
        bad = [path for path in self.middleware if not MIDDLEWARE_PATH.fullmatch(str(path))]
        if bad or not isinstance(self.middleware, tuple):
            raise ValueError(
                f"middleware (--middleware) takes import paths such as package.module.name, "
                f"got {bad or self.middleware!r}"
            )

    def log_config(self) -> dict[str, Any] | None:
        """--log-config-file's logging config (None: uvicorn's own)."""
        if self.log_config_file is None:
            return None
        try:
            config = json.loads(Path(self.log_config_file).read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:
            raise ValueError(
                f"log_config_file (--log-config-file) {self.log_config_file!r} is no readable "
                f"JSON: {error}"
            ) from error
        if not isinstance(config, dict):
            raise ValueError(
                f"log_config_file (--log-config-file) {self.log_config_file!r} holds no JSON "
                "object (logging.config.dictConfig's)"
            )
        return config

    def quiet_paths(self) -> frozenset[str]:
        """The paths --disable-access-log-for-endpoints leaves out of the access log."""
        given = self.disable_access_log_for_endpoints or ""
        return frozenset(path.strip() for path in given.split(",") if path.strip())

    def one_server_only(self) -> list[str]:
        """The flags Ray Serve's proxy does not take (--data-parallel-size): those set."""
        names = ("root_path", "ssl_keyfile", "ssl_certfile", "ssl_ca_certs", "uvicorn_log_level",
                 "log_config_file", "ssl_ciphers", "uds", "disable_access_log_for_endpoints",
                 "enable_ssl_refresh")  # fmt: skip
        return [f"--{name.replace('_', '-')}" for name in names if getattr(self, name)]

    def validate_chat_options(self) -> None:
        if self.chat_template is not None:
            try:
                compile_chat_template(self.chat_template)
            except jinja2.TemplateError as error:
                raise ValueError(
                    f"chat_template (--chat-template) does not compile: {error}"
                ) from error
        content_format(None, self.chat_template_content_format)  # a ValueError naming the rest
        if not isinstance(self.response_role, str) or not self.response_role:
            raise ValueError(
                f"response_role must be a non-empty string, got {self.response_role!r}"
            )
        kwargs = self.default_chat_template_kwargs
        if kwargs is not None and not isinstance(kwargs, dict):
            raise ValueError(f"default_chat_template_kwargs must be a JSON object, got {kwargs!r}")

    def chat_template_kwargs(self, given: dict[str, Any] | None) -> dict[str, Any] | None:
        """A request's template variables over the server's defaults."""
        if not self.default_chat_template_kwargs:
            return given
        return {**self.default_chat_template_kwargs, **(given or {})}

    def validate_tool_options(self) -> None:
        if self.tool_call_parser is not None and self.tool_call_parser not in PARSERS:
            raise ValueError(
                f"tool_call_parser {self.tool_call_parser!r} is not known; choose one of "
                f"{', '.join(PARSERS)}"
            )
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError(
                "enable_auto_tool_choice (--enable-auto-tool-choice) needs a tool_call_parser "
                f"(--tool-call-parser: {', '.join(PARSERS)})"
            )
