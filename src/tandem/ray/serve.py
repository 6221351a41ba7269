"""`tandem serve --data-parallel-size N`: N engine replicas behind one OpenAI endpoint (Ray Serve).

    client ─HTTP─> Serve proxy ─> Ingress ─handle, PrefixAffinityRouter─> EngineReplica x N
                                  (reads the body,                        (AsyncLLM + the app of
                                   computes the prefix key)                `tandem serve`, in process)

Each replica runs the same FastAPI app as `tandem serve`; the ingress forwards the request to
it whole and streams the reply back, so validation, errors and response shapes are one code.
The router sends requests with one prompt prefix key to one replica (`prefix_routing`), the next
ones on the ring when that replica has `max_num_seqs` requests ongoing. A request that reads a
stored response (/v1/responses' previous_response_id, GET and DELETE of one) goes to the
replica that stored it, which its id names (`responses.owner`). A call on the engine as a whole
(`ENGINE_ROUTES`: weight updates, sleep, ...) runs on every replica (`Ingress.broadcast`). A
replica that dies fails its in-flight requests with a 503 (or, mid-stream, an error event), and
Ray Serve's controller starts a new one in its place.
"""

# No `from __future__ import annotations`: Serve rebuilds the ingress's route functions in its own
# module, where FastAPI could not resolve string annotations such as "HttpRequest"; what the
# ingress calls is defined above it (a function defined below it was a NameError there).
import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import ray
from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import Response, StreamingResponse
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle
from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from tandem.async_llm import AsyncLLM
from tandem.ray.data import actor_resources
from tandem.ray.prefix_routing import prefix_key, ring_order
from tandem.server import responses
from tandem.server.app import build_app
from tandem.server.options import ServerOptions
from tandem.server.protocol import OpenAIError

logger = logging.getLogger(__name__)

REPLICA_HEADER = "x-tandem-replica"  # the replica that answered: its Ray actor's name
APP_NAME = "tandem"
# calls on the engine as a whole (server/admin.py's routes but /get_world_size, /abort_requests,
# the runtime LoRA routes): every replica runs them, as every vLLM data-parallel engine does
ENGINE_ROUTES = frozenset(
    {
        "/pause_generation", "/resume_generation", "/pause", "/resume", "/is_paused", "/sleep",
        "/is_sleeping", "/wake_up", "/reset_prefix_cache", "/init_weight_transfer_engine",
        "/start_weight_update", "/update_weights", "/finish_weight_update", "/start_profile",
        "/stop_profile", "/update_weights_from_path", "/abort_requests", "/v1/load_lora_adapter",
        "/v1/unload_lora_adapter",
    }
)  # fmt: skip


@dataclass(frozen=True)
class ForwardedRequest:
    method: str
    path: str
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes


class PrefixAffinityRouter(FIFOMixin, RequestRouter):
    """Ranks replicas by the ring order of the request's prefix key (any order without a key)."""

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        kwargs = pending_request.kwargs if pending_request else {}
        if kwargs.get("rank") is not None:  # a call every replica runs: the rank-th by id
            index, _ = kwargs["rank"]
            ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
            return [[ordered[index % len(ordered)]]]
        owner = [r for r in candidate_replicas if r.replica_id.unique_id == kwargs.get("owner")]
        if owner:  # it holds the stored response the request reads: it alone, when it has room
            return [owner]
        key = kwargs.get("prefix_key")
        if key is None or len(candidate_replicas) < 2:
            return [candidate_replicas]  # the least loaded of them
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        order = [by_id[i] for i in ring_order(key, list(by_id))]
        return [order[:1], order[1:]]  # its owner; if that one is full, the least loaded other


class EngineReplica:
    """One engine and the OpenAI app over it; `forward` runs a request through the app."""

    def __init__(
        self,
        model: str,
        served_model_name: str | list[str],
        options: ServerOptions | None,
        **engine_args,
    ):
        self.llm = AsyncLLM.from_model(model, **engine_args)
        self.app = build_app(self.llm, served_model_name, options=options)
        replica_id = serve.get_replica_context().replica_id
        self.name = replica_id.to_full_id_str()
        # the ids of the responses it stores name it, for the ingress to route their readers
        self.app.state.responses.tag = replica_id.unique_id

    async def forward(
        self,
        request: ForwardedRequest,
        prefix_key: str | None = None,
        owner: str | None = None,
        rank: tuple[int, int] | None = None,
    ) -> AsyncIterator[Any]:
        """Yields (status, headers), then the body's chunks, as the app sends them.

        `prefix_key`, `owner` and `rank` are read by the router (PrefixAffinityRouter), not here.
        """
        sent: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        caller_left = asyncio.Event()
        body_read = False

        async def receive() -> dict[str, Any]:
            nonlocal body_read
            if not body_read:
                body_read = True
                return {"type": "http.request", "body": request.body, "more_body": False}
            await caller_left.wait()
            return {"type": "http.disconnect"}

        app = asyncio.ensure_future(self.app(asgi_scope(request), receive, sent.put))
        try:
            while True:
                message = await next_message(sent, app)
                if message["type"] == "http.response.start":
                    headers = [(k.decode(), v.decode()) for k, v in message.get("headers", [])]
                    yield message["status"], [*headers, (REPLICA_HEADER, self.name)]
                elif message["type"] == "http.response.body":
                    if message.get("body"):
                        yield message["body"]
                    if not message.get("more_body"):
                        return
        finally:
            caller_left.set()  # the app aborts the request if it was still running
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await app

    def check_health(self) -> None:
        if not self.llm.is_running:
            raise RuntimeError("the engine thread stopped")


async def next_message(sent: asyncio.Queue[dict[str, Any]], app: asyncio.Future) -> dict[str, Any]:
    """The app's next ASGI message; raises if the app ended without finishing its response."""
    getter = asyncio.ensure_future(sent.get())
    await asyncio.wait({getter, app}, return_when=asyncio.FIRST_COMPLETED)
    if getter.done():
        return getter.result()
    getter.cancel()
    app.result()  # raises the app's error, if it had one
    raise RuntimeError("the app ended without a complete response")


def asgi_scope(request: ForwardedRequest) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": request.method,
        "scheme": "http",
        "path": request.path,
        "raw_path": request.path.encode(),
        "query_string": request.query_string,
        "root_path": "",
        "headers": request.headers,
        "client": None,
        "server": None,
    }


def replica_died() -> OpenAIError:
    message = "the engine replica serving this request died; it is being restarted, retry"
    return OpenAIError(message, 503, "server_error", code="replica_died")


async def rest_of(reply, headers: list[tuple[str, str]]) -> AsyncIterator[bytes]:
    """The body's chunks; a stream whose replica dies ends with an error event."""
    streaming = any(k == "content-type" and "event-stream" in v for k, v in headers)
    try:
        async for chunk in reply:
            yield chunk
    except (RayActorError, ActorUnavailableError):
        if not streaming:
            raise  # the client sees a response cut short
        yield f"data: {json.dumps(replica_died().body())}\n\ndata: [DONE]\n\n".encode()


async def whole(reply) -> tuple[int, list[tuple[str, str]], bytes]:
    """A replica's reply read to its end: status, headers and body."""
    status, headers = await reply.__anext__()
    return status, headers, b"".join([chunk async for chunk in reply])


ingress_app = FastAPI(title="tandem")


@serve.ingress(ingress_app)  # here, not in build_serve_app: each process must bind its own routes
class Ingress:
    """Forwards every request to an engine replica, routed by its prompt's prefix key."""

    def __init__(self, engine: DeploymentHandle, block_size: int, num_replicas: int):
        self.engine = engine
        self.block_size = block_size
        self.num_replicas = num_replicas

    @ingress_app.api_route("/{path:path}", methods=["GET", "POST", "DELETE", "OPTIONS"])
    async def forward(self, path: str, http: HttpRequest) -> Response:
        body = await http.body()
        request = ForwardedRequest(
            http.method, http.url.path, http.url.query.encode(), http.headers.raw, body
        )
        if request.path in ENGINE_ROUTES:
            return await self.broadcast(request)
        key = prefix_key(request.path, body, self.block_size)
        owner = responses.owner(http.method, request.path, body)
        reply = self.engine.options(stream=True).forward.remote(
            request, prefix_key=key, owner=owner
        )
        try:
            status, headers = await reply.__anext__()
        except (RayActorError, ActorUnavailableError) as error:
            logger.warning("a replica died with a request in flight: %s", error)
            return replica_died().response()
        except RayTaskError as error:  # the replica raised outside the app's own error handling
            return OpenAIError(f"internal error: {error}", 500, "server_error").response()
        return StreamingResponse(rest_of(reply, headers), status_code=status, headers=dict(headers))

    async def broadcast(self, request: ForwardedRequest) -> Response:
        """Every replica runs the call, at once (a weight transfer joins them all in one group).
        The answer is the first replica's (an /abort_requests' names what any aborted), or the
        first error; a 503 where fewer replicas answered than serve (one is being restarted)."""
        size = self.num_replicas
        replies = [
            self.engine.options(stream=True).forward.remote(request, rank=(rank, size))
            for rank in range(size)
        ]
        try:
            answers = await asyncio.gather(*(whole(reply) for reply in replies))
        except (RayActorError, ActorUnavailableError) as error:
            logger.warning("a replica died with an engine call in flight: %s", error)
            return replica_died().response()
        except RayTaskError as error:  # as `forward`: raised outside the app's error handling
            return OpenAIError(f"internal error: {error}", 500, "server_error").response()
        names = sorted({dict(headers)[REPLICA_HEADER] for _, headers, _ in answers})
        if len(names) < size:
            message = (
                f"{len(names)} of the {size} engine replicas ran {request.path} (one is being "
                "restarted, with the model's own weights); retry"
            )
            return OpenAIError(message, 503, "server_error", code="replica_missing").response()
        failed = [answer for answer in answers if answer[0] != 200]
        status, headers, body = failed[0] if failed else answers[0]
        if not failed and request.path == "/abort_requests":
            aborted = [i for _, _, b in answers for i in json.loads(b)["aborted"]]
            body = json.dumps({"aborted": sorted(set(aborted))}).encode()
        kept = {k: v for k, v in headers if k not in ("content-length", REPLICA_HEADER)}
        kept[REPLICA_HEADER] = ",".join(names)
        return Response(body, status_code=status, headers=kept)


def build_serve_app(
    model: str,
    engine_args: dict[str, Any],
    data_parallel_size: int,
    served_model_name: str | list[str] | None = None,
    options: ServerOptions | None = None,
    health_check_period_s: float = 10.0,
    num_ingress_replicas: int | None = None,
) -> serve.Application:
    """The Ray Serve application: ingress replicas (default: one per engine) and
    `data_parallel_size` engine replicas, each serving the app of `tandem serve` with
    `options`."""
    if not isinstance(data_parallel_size, int) or data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {data_parallel_size!r}")
    if options is not None:
        options.validate()  # here, not first in each replica
    resources = actor_resources(engine_args)
    engine = serve.deployment(
        EngineReplica,
        num_replicas=data_parallel_size,
        max_ongoing_requests=engine_args.get("max_num_seqs") or 256,
        ray_actor_options={"num_cpus": resources["num_cpus"], "num_gpus": resources["num_gpus"]},
        request_router_config=RequestRouterConfig(request_router_class=PrefixAffinityRouter),
        health_check_period_s=health_check_period_s,
    ).bind(model, served_model_name or model, options, **engine_args)
    ingress = serve.deployment(
        Ingress,
        num_replicas=num_ingress_replicas or data_parallel_size,
        max_ongoing_requests=10_000,  # it only forwards; the engines' limits apply behind it
        ray_actor_options={"num_cpus": 0},
    )
    return ingress.bind(engine, engine_args.get("block_size") or 16, data_parallel_size)


def serve_data_parallel(
    model: str,
    engine_args: dict[str, Any],
    data_parallel_size: int,
    host: str,
    port: int,
    served_model_name: str | list[str] | None = None,
    options: ServerOptions | None = None,
) -> None:
    """Serve on host:port until interrupted (joins RAY_ADDRESS's cluster, or starts one here)."""
    if not ray.is_initialized():
        ray.init()
    app = build_serve_app(model, engine_args, data_parallel_size, served_model_name, options)
    serve.start(http_options={"host": host, "port": port})
    serve.run(app, name=APP_NAME, route_prefix="/", blocking=True)
