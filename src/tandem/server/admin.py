"""Admin routes for an RL trainer: pause/resume, sleep/wake-up, weights from a checkpoint or
broadcast by the trainer, forgetting the prefix cache; and the profiler's start and stop.

vLLM's routes take its query parameters and answer its shapes (/pause, /resume, /is_paused,
/sleep, /wake_up, /is_sleeping); /pause_generation and /resume_generation, tandem's older
spelling, take a JSON body and answer {"paused": ...}.

vLLM's /collective_rpc, /server_info, /reset_mm_cache and /reset_encoder_cache are served only
with VLLM_SERVER_DEV_MODE=1, as vLLM serves them (the first runs any of the engine's methods).
They sit behind the same API key as the OpenAI routes (app.py's middleware guards every path
but /health and /metrics). Engine errors the caller caused come back as 400s naming the field,
as does a field a body does not declare (a misspelt "levle" never falls back to the default).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import os
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query
from fastapi.responses import Response
from pydantic import Field
from torch.utils import collect_env

from tandem import envs
from tandem.async_llm import AsyncLLM
from tandem.server.protocol import OpenAIError, RequestOption, Text


class PauseRequest(RequestOption):
    mode: Literal["keep", "abort", "wait"] = "keep"


class ResumeRequest(RequestOption):
    recompute_kv: bool = False


class SleepRequest(RequestOption):
    level: Literal[0, 1, 2] = 1


class UpdateWeightsRequest(RequestOption):
    path: Text


class InitWeightTransferRequest(RequestOption):
    init_info: dict[str, Any]


class WeightTransferUpdateRequest(RequestOption):
    update_info: dict[str, Any]


class CollectiveRpcRequest(RequestOption):
    method: Text  # the engine's method, or its worker extension's (worker_extension_cls)
    timeout: float | None = None
    args: list[Any] = Field(default_factory=list)
    kwargs: dict[str, Any] = Field(default_factory=dict)


def admin_router(llm: AsyncLLM) -> APIRouter:
    router = APIRouter()

    @router.post("/pause_generation")
    async def pause_generation(body: PauseRequest) -> dict[str, bool]:
        await llm.pause_generation(body.mode, clear_cache=False)  # "keep" keeps the KV
        return {"paused": True}

    @router.post("/resume_generation")
    async def resume_generation(body: ResumeRequest | None = None) -> dict[str, bool]:
        await llm.resume_generation((body or ResumeRequest()).recompute_kv)
        return {"paused": False}

    @router.post("/pause")
    async def pause(
        mode: Literal["abort", "wait", "keep"] = "abort",
        wait_for_inflight_requests: bool = False,
        clear_cache: bool = True,
    ) -> dict[str, str]:
        # "wait": answered once the admitted requests finished; clear_cache: kept requests too
        # recompute their KV on resuming (vLLM's engine resets its running requests)
        await llm.pause_generation(
            mode, wait_for_inflight_requests=wait_for_inflight_requests, clear_cache=clear_cache
        )
        return {"status": "paused"}

    @router.post("/resume")
    async def resume() -> dict[str, str]:
        await llm.resume_generation()
        return {"status": "resumed"}

    @router.get("/is_paused")
    async def is_paused() -> dict[str, bool]:
        return {"is_paused": await llm.is_paused()}

    @router.post("/sleep")
    async def sleep(
        body: SleepRequest | None = None,
        level: int | None = Query(None, ge=0, le=2),
        mode: Literal["abort", "wait", "keep"] = "abort",
    ) -> dict[str, float]:
        # vLLM's route reads ?level=; the body's, when both are given, must agree
        if body is not None and level is not None and body.level != level:
            message = f"the query's level={level} and the body's level={body.level} differ"
            raise OpenAIError(message, param="level")
        if level is None:
            level = (body or SleepRequest()).level
        freed = await _engine_call(llm.sleep(level, mode))
        return {"freed_gib": freed / 2**30}

    @router.get("/is_sleeping")
    async def is_sleeping() -> dict[str, bool]:
        return {"is_sleeping": await llm.is_sleeping()}

    @router.post("/wake_up")
    async def wake_up(tags: Annotated[list[str] | None, Query()] = None) -> dict[str, bool]:
        # vLLM's ?tags=weights&tags=kv_cache: the parts to wake (none given: all)
        await _engine_call(llm.wake_up(tags), param="tags")
        return {"sleeping": await llm.is_sleeping()}

    @router.post("/reset_prefix_cache")
    async def reset_prefix_cache(
        reset_running_requests: bool = False, reset_external: bool = False
    ) -> dict[str, bool]:
        # vLLM's query parameters (reset_external: its KV connector's cache; tandem has none)
        success = await llm.reset_prefix_cache(reset_running_requests, reset_external)
        return {"success": success}  # vLLM's answer

    # vLLM's weight transfer (weight_transfer/): the trainer sends, these announce it
    @router.post("/init_weight_transfer_engine")
    async def init_weight_transfer_engine(body: InitWeightTransferRequest) -> dict[str, str]:
        await _engine_call(llm.init_weight_transfer_engine(body.model_dump()), param="init_info")
        return {"message": "Weight transfer initialized"}

    @router.post("/start_weight_update")
    async def start_weight_update() -> dict[str, str]:
        await _engine_call(llm.start_weight_update())
        return {"message": "Weight update started"}

    @router.post("/update_weights")
    async def update_weights(body: WeightTransferUpdateRequest) -> dict[str, str]:
        await _engine_call(llm.update_weights(body.model_dump()), param="update_info")
        return {"message": "Weights updated"}

    @router.post("/finish_weight_update")
    async def finish_weight_update() -> dict[str, str]:
        await _engine_call(llm.finish_weight_update())
        return {"message": "Weight update finished"}

    # vLLM's, with the engine's profiler_config (without it: a 400 naming it)
    @router.post("/start_profile")
    async def start_profile() -> dict[str, str]:
        await _engine_call(llm.start_profile(), param="profiler_config")
        return {"status": "profiling"}

    @router.post("/stop_profile")
    async def stop_profile() -> dict[str, list[str | None]]:
        return {"traces": await _engine_call(llm.stop_profile(), param="profiler_config")}

    @router.get("/get_world_size")
    async def get_world_size(include_dp: bool = True) -> dict[str, int]:
        del include_dp  # one engine: no data parallelism inside it (as LLM.get_world_size)
        return {"world_size": llm.engine.config.tensor_parallel_size}

    @router.post("/update_weights_from_path")
    async def update_weights_from_path(body: UpdateWeightsRequest) -> dict[str, bool]:
        await _engine_call(llm.update_weights_from_path(body.path), param="path")
        return {"updated": True}

    return router


def dev_router(llm: AsyncLLM) -> APIRouter:
    """vLLM's development routes, served under VLLM_SERVER_DEV_MODE=1 alone: /collective_rpc
    runs a method by name on every rank (LLM.collective_rpc), a worker extension's (RL code's)
    or the engine's own; each rank's result as JSON gives it if a dict, list or null, else as
    its text (vLLM's answer). /server_info answers the engine's settings (the Hub token hidden),
    the VLLM_ variables set and the TANDEM_ switches, and the machine's software;
    /reset_mm_cache and /reset_encoder_cache answer 200 (a text model has neither cache)."""
    router = APIRouter()

    @router.get("/server_info")
    async def server_info(config_format: Literal["text", "json"] = "text") -> dict[str, Any]:
        config = llm.engine.config
        if isinstance(config.hf_token, str):  # the Hub's token is a secret: its place shown
            config = dataclasses.replace(config, hf_token="<hidden>")
        return {
            # vLLM's key names; the settings are tandem's EngineConfig
            "vllm_config": (
                str(config)
                if config_format == "text"
                else json.loads(json.dumps(dataclasses.asdict(config), default=str))
            ),
            "vllm_env": {
                name: value
                for name, value in os.environ.items()
                if name.startswith("VLLM_") and "KEY" not in name
            },
            "tandem_env": {name: str(value) for name, value in envs.current().items()},
            "system_env": await asyncio.to_thread(system_env),
        }

    @router.post("/reset_mm_cache")
    async def reset_mm_cache() -> Response:
        await llm.reset_mm_cache()
        return Response(status_code=200)

    @router.post("/reset_encoder_cache")
    async def reset_encoder_cache() -> Response:
        await llm.reset_encoder_cache()
        return Response(status_code=200)

    @router.post("/collective_rpc")
    async def collective_rpc(body: CollectiveRpcRequest) -> dict[str, list]:
        call = llm.collective_rpc(body.method, body.timeout, tuple(body.args), body.kwargs)
        results = await _engine_call(call, param="method")
        return {
            "results": [r if r is None or isinstance(r, dict | list) else str(r) for r in results]
        }

    return router


@functools.cache
def system_env() -> dict[str, Any]:
    """The machine's software as torch's collect_env reports it (versions of torch, CUDA,
    Python, the driver and GPUs, pip packages), read once: it runs pip and nvidia-smi."""
    return collect_env.get_env_info()._asdict()


async def _engine_call(call, param: str | None = None):
    try:
        return await call
    except (ValueError, TypeError, OSError, RuntimeError) as error:  # OSError: a bad path
        raise OpenAIError(str(error), 400, param=param) from error
