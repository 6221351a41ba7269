"""`tandem serve`'s process: uvicorn over the app, and how it ends.

- SIGTERM or SIGINT: stop accepting connections, let open requests finish for
  `drain_timeout_s`, then end what is left (streams with an SSE error event, other calls with a
  503), shut the engine down, exit 0.
- The engine thread fails: its open requests get their errors (AsyncLLM does that), the server
  stops and the process exits 1, so a supervisor that restarts on exit brings the service back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import ssl
import threading
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI

from tandem.async_llm import AsyncLLM
from tandem.server.app import build_app
from tandem.server.options import ServerOptions
from tandem.server.protocol import logger
from tandem.server.serving import OpenAIServing

SHUTDOWN_MARGIN_S = 5  # past the drain: for the ended streams to send their error event
CERTIFICATE_CHECK_TICKS = 10  # --enable-ssl-refresh looks at the files every second


class Server(uvicorn.Server):
    def __init__(
        self,
        config: uvicorn.Config,
        llm: AsyncLLM,
        serving: OpenAIServing,
        options: ServerOptions,
    ):
        super().__init__(config)
        self.llm, self.serving, self.options = llm, serving, options
        self.engine_failed = False
        # --enable-ssl-refresh: the certificate files, read again into the TLS context when
        # they change (new connections get them; open ones keep theirs)
        self.certificates = CertificateFiles(options) if options.enable_ssl_refresh else None

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn's handlers, without raising the signal again once it has stopped: that would
        end the process before `serve` shuts the engine down and returns."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        signals = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in signals}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    async def on_tick(self, counter: int) -> bool:  # every 0.1 s
        if self.llm.failure is not None:
            self.engine_failed = True
            return True
        if self.certificates is not None and counter % CERTIFICATE_CHECK_TICKS == 0:
            self.certificates.refresh(self.config.ssl)
        return await super().on_tick(counter)

    async def shutdown(self, sockets=None) -> None:
        end = asyncio.get_running_loop().call_later(
            self.options.drain_timeout_s, self.serving.end_all, "the server is shutting down"
        )
        try:
            await super().shutdown(sockets)
        finally:
            end.cancel()


class CertificateFiles:
    """The TLS files of --ssl-certfile, --ssl-keyfile and --ssl-ca-certs, by their last change;
    `refresh` loads them into the context again once one changed."""

    def __init__(self, options: ServerOptions):
        self.options = options
        self.paths = [p for p in (options.ssl_certfile, options.ssl_keyfile, options.ssl_ca_certs)
                      if p is not None]  # fmt: skip
        self.seen = self.stamps()

    def stamps(self) -> list[tuple[int, int] | None]:
        found = []
        for path in self.paths:
            try:
                status = os.stat(path)
                found.append((status.st_mtime_ns, status.st_size))
            except OSError:  # being replaced: read next time
                found.append(None)
        return found

    def refresh(self, context: ssl.SSLContext) -> None:
        stamps = self.stamps()
        if stamps == self.seen or None in stamps:
            return
        try:
            context.load_cert_chain(self.options.ssl_certfile, self.options.ssl_keyfile)
            if self.options.ssl_ca_certs is not None:
                context.load_verify_locations(self.options.ssl_ca_certs)
        except (OSError, ssl.SSLError) as error:  # half written, or a key of another cert:
            logger.warning("TLS files changed but do not load yet: %s", error)  # next time
            return
        self.seen = stamps
        logger.info("TLS certificate reloaded from %s", self.options.ssl_certfile)


def uvicorn_config(app: FastAPI, host: str, port: int, options: ServerOptions) -> uvicorn.Config:
    """How uvicorn serves `app`: the address (or a Unix socket), TLS, logging, the drain, the
    parser's header limit (the root path is the app's: build_app)."""
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        uds=options.uds,
        # off by default: per-request lines would compete with the engine thread for the GIL
        access_log=options.access_log,
        timeout_graceful_shutdown=options.drain_timeout_s + SHUTDOWN_MARGIN_S,
        log_level=options.uvicorn_log_level,
        **({"log_config": options.log_config()} if options.log_config_file else {}),
        ssl_keyfile=options.ssl_keyfile,
        ssl_certfile=options.ssl_certfile,
        ssl_ca_certs=options.ssl_ca_certs,
        ssl_cert_reqs=options.ssl_cert_reqs,
        **({"ssl_ciphers": options.ssl_ciphers} if options.ssl_ciphers else {}),
        h11_max_incomplete_event_size=options.h11_max_incomplete_event_size,
    )
    access = logging.getLogger("uvicorn.access")  # configured by the Config just made
    for old in [f for f in access.filters if isinstance(f, QuietPaths)]:
        access.removeFilter(old)
    if options.quiet_paths():
        access.addFilter(QuietPaths(options.quiet_paths()))
    return config


class QuietPaths(logging.Filter):
    """Leaves out the access log's lines of requests to these paths (their query aside)."""

    def __init__(self, paths: frozenset[str]):
        super().__init__()
        self.paths = paths

    def filter(self, record: logging.LogRecord) -> bool:
        # uvicorn's access line: (client, method, path with its query, HTTP version, status)
        args = record.args if isinstance(record.args, tuple) else ()
        return len(args) < 3 or str(args[2]).split("?", 1)[0] not in self.paths


def serve(llm: AsyncLLM, model_name: str, host: str, port: int, options: ServerOptions) -> int:
    """Serve until a signal (then 0) or a fatal engine error (then 1); the engine is shut down."""
    try:
        app = build_app(llm, model_name, options=options)
        config = uvicorn_config(app, host, port, options)
        server = Server(config, llm, app.state.serving, options)
        server.run()
    finally:
        llm.shutdown()
    return 1 if server.engine_failed else 0
