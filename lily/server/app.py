"""The OpenAI-compatible HTTP API over one engine worker: `create_app` puts the pieces together.

POST /v1/chat/completions, POST /v1/completions, POST /v1/responses (each streams as server-sent
events), GET /v1/models, POST /tokenize, POST /detokenize, GET /health, GET /version, GET /metrics, GET /openapi.json.
The routes live in lily/server/routes/ (one API family a file); what they share (validation, building
generations, streaming, usage, log-probabilities, errors) in modules of their own beside this one.
"""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware

from lily.engine.constraints import Grammars
from lily.engine.generation import Finished
from lily.engine.prefix_cache import PrefixCache
from lily.engine.worker import EngineWorker
from lily.server.context import ServerContext, ServerSettings
from lily.server.errors import install_error_handlers
from lily.server.guard import Draining, GuardMiddleware
from lily.server.metrics import Metrics
from lily.server.openapi import openapi_schema
from lily.server.request_ids import HEADER
from lily.server.routes import ROUTERS

__all__ = ["ServerSettings", "create_app"]


def create_app(backend, tokenizer, settings: ServerSettings, prefix_cache: PrefixCache | None = None) -> FastAPI:
    metrics = Metrics()

    def on_finished(done: Finished):
        metrics.record_generation(
            prompt_tokens=done.prompt_tokens, completion_tokens=done.completion_tokens,
            cached_tokens=done.cached_tokens, prefill_tokens=done.prompt_tokens - done.cached_tokens,
            prefill_s=done.prefill_s, decode_tokens=done.decode_steps, decode_s=done.decode_s,
            cancelled=done.finish_reason == "cancelled")

    worker = EngineWorker(backend, tokenizer, settings.max_queue, prefix_cache, on_finished=on_finished,
                          max_batch=settings.max_batch, step_tokens=settings.step_tokens,
                          run_ahead=settings.run_ahead, overlap_prefill=settings.overlap_prefill)

    @asynccontextmanager
    async def lifespan(app):
        yield
        worker.shutdown()

    app = FastAPI(title="lily", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible server for Qwen3.6-35B-A3B", docs_url=None, redoc_url=None)
    vocab = getattr(getattr(backend, "config", None), "vocab_size", None)  # the logits' width
    app.state.lily = ServerContext(settings, tokenizer, worker, metrics, prefix_cache, Grammars(tokenizer, vocab))
    app.state.worker = worker
    app.state.metrics = metrics
    app.state.settings = settings
    app.state.prefix_cache = prefix_cache
    app.state.draining = Draining()  # set as the shutdown's grace ends: a body still arriving is then refused
    install_error_handlers(app)
    for router in ROUTERS:  # the routes themselves, not a nested router: app.routes lists every path
        app.router.routes.extend(router.routes)
    app.openapi = lambda: openapi_schema(app, [settings.model_name, *settings.served_aliases, *settings.model_aliases])
    app.add_middleware(GuardMiddleware, settings=settings, metrics=metrics, draining=app.state.draining)
    if settings.cors_origins:  # added last, so outermost: a browser's preflight carries no API key
        # any request header: browser SDKs send their own (the openai JS SDK's x-stainless-*, openai-*)
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.cors_origins),
                           allow_methods=["GET", "POST", "HEAD"], allow_headers=["*"],
                           expose_headers=[HEADER], max_age=600)
    return app
