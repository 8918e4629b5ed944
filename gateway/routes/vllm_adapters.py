"""vLLM's runtime adapter endpoints, `/v1/load_lora_adapter` and `/v1/unload_lora_adapter`, with vLLM's
status codes and plain-text success bodies; they register into (and delete from) the same durable registry.
They need the admin key."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse

from gateway.auth import AdminDep
from gateway.errors import APIError
from gateway.request_model import RequestModel
from gateway.state import StateDep
from registry.adapters import ALL_TENANTS

router = APIRouter(prefix="/v1", tags=["vllm"], dependencies=[AdminDep])


class LoadLoRAAdapter(RequestModel):
    lora_name: str = ""
    lora_path: str = ""


class UnloadLoRAAdapter(RequestModel):
    lora_name: str = ""
    lora_int_id: int | None = None


@router.post("/load_lora_adapter")
async def load_lora_adapter(body: LoadLoRAAdapter, state: StateDep):
    if not body.lora_name or not body.lora_path:
        raise APIError(400, "Both 'lora_name' and 'lora_path' must be provided.", param="lora_name")
    if await state.registry.get(body.lora_name, None, ALL_TENANTS) is not None:
        raise APIError(400, f"The lora adapter '{body.lora_name}' has already been loaded.", param="lora_name")
    try:
        await state.adapters.register(body.lora_name, body.lora_path)
    except APIError as e:
        if e.status_code == 422:  # vLLM answers a bad adapter with 400
            raise APIError(400, e.message, param=e.param, code=e.code) from None
        raise
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoRAAdapter, state: StateDep):
    if not body.lora_name:
        raise APIError(400, "'lora_name' needs to be provided to unload a LoRA adapter.", param="lora_name")
    if not await state.adapters.delete(body.lora_name, None):
        raise APIError(404, f"The lora adapter '{body.lora_name}' cannot be found.", param="lora_name")
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
