"""Runtime adapter loading, as vLLM's `/v1/load_lora_adapter` and `/v1/unload_lora_adapter` do it:
here they register with, and delete from, the adapter store, whose allowlists apply; every worker
then serves the adapter (or refuses it) from the store's catalog."""

from fastapi.responses import PlainTextResponse

from loramux import AlreadyExists, LoramuxError, NotFound

from .errors import ApiError
from .protocol import LoadLoraRequest, UnloadLoraRequest
from .upstream import Upstream

SCHEMES = ("s3://", "file://")


async def load(body: LoadLoraRequest, upstream: Upstream) -> PlainTextResponse:
    name, uri = body.lora_name, _source_uri(body.lora_path)
    if name == await upstream.base_name():
        raise ApiError(
            400, f"`{name}` is the base model's name; an adapter needs a name of its own", "lora_name"
        )
    if await _registered(upstream, name):
        raise ApiError(400, f"The lora adapter `{name}` has already been loaded.", "lora_name")
    try:
        await upstream.client.register_adapter(name, uri)
    except AlreadyExists:  # registered by someone else since the check
        raise ApiError(400, f"The lora adapter `{name}` has already been loaded.", "lora_name") from None
    except LoramuxError as e:
        raise ApiError.from_sdk(e, "lora_path") from None
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


async def unload(body: UnloadLoraRequest, upstream: Upstream) -> PlainTextResponse:
    name = body.lora_name
    try:
        await upstream.client.delete_adapter(name)
    except NotFound:
        raise ApiError(
            404, f"The lora adapter `{name}` cannot be found.", "lora_name", "model_not_found"
        ) from None
    except LoramuxError as e:
        raise ApiError.from_sdk(e, "lora_name") from None
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


async def _registered(upstream: Upstream, name: str) -> bool:
    try:
        await upstream.client.get_adapter(name)
    except NotFound:
        return False
    return True


def _source_uri(path: str) -> str:
    """s3:// and file:// URIs as they are; an absolute path is a file:// URI (vLLM takes paths)."""
    if path.startswith(SCHEMES):
        return path
    if path.startswith("/"):
        return f"file://{path}"
    raise ApiError(
        400, f"`lora_path` must be an s3:// or file:// URI or an absolute path, got {path!r}", "lora_path"
    )
