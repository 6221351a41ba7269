"""vLLM's runtime LoRA routes (`--allow-runtime-lora-updating`, vLLM's
VLLM_ALLOW_RUNTIME_LORA_UPDATING): POST /v1/load_lora_adapter serves a PEFT folder as a model
of its name, read and checked before it is listed; with `load_inplace` it replaces the adapter
of a name already served. POST /v1/unload_lora_adapter stops serving it. Either way requests
already running under the old adapter finish under it: a load takes a new id, so the old one
keeps its device slot and its prefix-cache KV. Behind the API key like every route.
"""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from pydantic import Field

from tandem.lora.request import LoRARequest
from tandem.server.protocol import OpenAIError, RequestOption, Text
from tandem.server.serving import OpenAIServing


class LoadLoRAAdapterRequest(RequestOption):
    lora_name: Annotated[Text, Field(min_length=1)]
    lora_path: Annotated[Text, Field(min_length=1)]
    load_inplace: bool = False  # replace the adapter of a name already served


class UnloadLoRAAdapterRequest(RequestOption):
    lora_name: Text
    lora_int_id: int | None = None


def adapter_router(serving: OpenAIServing) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/load_lora_adapter")
    async def load(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        cache = serving.llm.engine.adapter_cache
        if cache is None:
            raise OpenAIError("this server runs no LoRA adapters: start it with --enable-lora")
        name = body.lora_name
        if name in serving.model_names or (name in serving.adapters and not body.load_inplace):
            raise OpenAIError(
                f"The lora adapter '{name}' has already been loaded.", param="lora_name"
            )
        lora_id = serving.next_lora_id  # taken before the read: loads run side by side
        serving.next_lora_id += 1
        try:
            lora = LoRARequest(name, lora_id, body.lora_path)
            await asyncio.to_thread(cache.get, lora)  # read off the event loop and the engine
        except ValueError as error:
            raise OpenAIError(str(error), param="lora_path") from error
        if name in serving.adapters and not body.load_inplace:  # loaded while this one read
            raise OpenAIError(
                f"The lora adapter '{name}' has already been loaded.", param="lora_name"
            )
        serving.adapters[name] = lora  # new requests of the name run under it
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @router.post("/v1/unload_lora_adapter")
    async def unload(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        lora = serving.adapters.get(body.lora_name)
        if lora is None or body.lora_int_id not in (None, lora.lora_int_id):
            message = f"The lora adapter '{body.lora_name}' cannot be found."
            raise OpenAIError(message, 404, param="lora_name", code="not_found")
        del serving.adapters[body.lora_name]
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    return router
