"""What every route needs from the running server: settings, tokenizer, the engine worker, metrics and
the prefix cache, held once on the app (`app.state.lily`) and reached from a request with `server()`."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field

from fastapi import Request

from lily.engine.constraints import Grammars
from lily.engine.prefix_cache import PrefixCache
from lily.engine.worker import DEFAULT_MAX_BATCH, DEFAULT_STEP_TOKENS, EngineWorker
from lily.server.connections import BODY_TIMEOUT_S
from lily.server.generation_config import SamplingDefaults
from lily.server.metrics import Metrics
from lily.tokenizer import Tokenizer


@dataclass
class ServerSettings:
    model_name: str
    max_seq: int
    api_key: str | None = None
    max_body: int = 4 * 1024 * 1024
    body_timeout: float = BODY_TIMEOUT_S    # a request body's longest pause (guard.py), seconds
    max_queue: int = 256
    enable_thinking: bool | None = None  # None: the chat template's own default
    log_requests: bool = False
    model_aliases: tuple[str, ...] = ()     # other ids a request may name (the checkpoint's path), not listed
    served_aliases: tuple[str, ...] = ()    # more served names (--served-model-name A B): listed and accepted
    cors_origins: tuple[str, ...] = ()  # browser origins allowed to call the API ("*": any); none by default
    max_batch: int = DEFAULT_MAX_BATCH      # sequences decoded together (the backend's slots may allow fewer)
    step_tokens: int = DEFAULT_STEP_TOKENS  # a step's token budget: its decodes plus one prefill piece
    run_ahead: bool = True                  # a lone greedy stream's next step queued before its text is made
    overlap_prefill: bool = True            # a prompt piece runs beside the decodes (a stream of its own)
    # what a request samples with where it sets nothing (the checkpoint's generation_config.json by default)
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)


@dataclass
class ServerContext:
    settings: ServerSettings
    tokenizer: Tokenizer
    worker: EngineWorker
    metrics: Metrics
    prefix_cache: PrefixCache | None = None
    grammars: Grammars | None = None  # structured outputs: grammars compiled for this tokenizer, cached
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def model_names(self) -> set[str]:
        return {self.settings.model_name, *self.settings.served_aliases, *self.settings.model_aliases}

    @functools.cached_property
    def thinks_by_default(self) -> bool:
        """Whether a chat request that says nothing of thinking (no chat_template_kwargs.enable_thinking, no
        reasoning_effort) thinks: --enable-thinking / --no-enable-thinking, else the chat template's default."""
        return self.tokenizer.template_thinks_by_default(self.settings.enable_thinking)


def server(request: Request) -> ServerContext:
    return request.app.state.lily
