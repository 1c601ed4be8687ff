"""GET /health, GET /v1/models (and one model), GET /version, GET /metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import PlainTextResponse

from lily.server.context import ServerContext, server
from lily.server.errors import APIError
from lily.server.validation import check_model
from lily import __version__

router = APIRouter()


# HEAD for probes; registered after GET (decorators apply bottom-up), so a 405's Allow names GET
@router.head("/health", include_in_schema=False)
@router.get("/health", summary="liveness")
async def health(request: Request):
    if not server(request).worker._thread.is_alive():
        raise APIError(503, "the engine worker has stopped")
    return {"status": "ok"}


def model_card(ctx: ServerContext, name: str | None = None) -> dict:
    """OpenAI's fields, vLLM's max_model_len, what a request that leaves its sampling fields out samples with
    (the checkpoint's generation_config.json, unless `--generation-config none`), and lily's own: whether a chat
    request that says nothing of thinking thinks (the chat page starts from these, as any client would)."""
    return {"id": name or ctx.settings.model_name, "object": "model", "created": ctx.created, "owned_by": "lily",
            "max_model_len": ctx.settings.max_seq,
            "default_sampling_params": ctx.settings.sampling_defaults.params(),
            "lily": {"enable_thinking": ctx.thinks_by_default}}


@router.head("/v1/models", include_in_schema=False)
@router.get("/v1/models", summary="the served model")
async def list_models(request: Request):
    ctx = server(request)
    return {"object": "list", "data": [model_card(ctx, name)
                                       for name in (ctx.settings.model_name, *ctx.settings.served_aliases)]}


@router.head("/v1/models/{model:path}", include_in_schema=False)
@router.get("/v1/models/{model:path}", summary="one model")
async def get_model(model: str, request: Request):
    ctx = server(request)
    check_model(ctx, model)
    return model_card(ctx, model if model in ctx.settings.served_aliases else None)


@router.head("/version", include_in_schema=False)
@router.get("/version", summary="lily's version")
async def version():
    return {"version": __version__}


@router.head("/metrics", include_in_schema=False)
@router.get("/metrics", summary="Prometheus metrics", response_class=PlainTextResponse)
async def get_metrics(request: Request):
    ctx = server(request)
    cache, worker = ctx.prefix_cache, ctx.worker
    ctx.metrics.running = worker.running
    stats = cache.stats if cache is not None else None
    text = ctx.metrics.render(
        queue_depth=worker.queue_depth,
        cache_hits=stats.hits if stats else 0, cache_misses=stats.misses if stats else 0,
        cache_entries=len(cache) if cache is not None else 0,
        cache_bytes=cache.nbytes if cache is not None else 0)
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")
