"""The real server code over the real tiny checkpoint and the reference backend, with the model's output
scripted (a random model will not call a tool or think by itself): the backend runs every token for real, then
its logits are overridden to force the scripted text. The oracle for a rendered prompt is transformers' chat
template over the checkpoint's own files.

    with scripted_server(tmp_dir) as (ckpt, tokenizer, backend, client):   # client: the openai client
        backend.script = tokenizer.encode("...")                          # backend.prompts: every prefill
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import threading
from pathlib import Path

import openai
import torch
import uvicorn
from helpers_gate import HANG_S, poll_until

from lily.engine import load_backend
from lily.server.app import ServerSettings, create_app
from lily.synthetic import make_synthetic
from lily.tokenizer import Tokenizer


class ScriptedBackend:
    """The real backend, with the next tokens forced; records every prompt it prefills."""

    def __init__(self, inner, eos: int):
        self.inner, self.eos = inner, eos
        self.config, self.device = inner.config, inner.device
        self.script: list[int] = []
        self.prompts: list[list[int]] = []

    def _force(self, logits):
        out = torch.full_like(logits, -1e4)
        out[self.script.pop(0) if self.script else self.eos] = 0.0
        return out

    def new_state(self):
        return self.inner.new_state()

    def prefill(self, ids, state):
        self.prompts.append(list(ids))
        return self._force(self.inner.prefill(ids, state))

    def decode(self, token, state):
        return self._force(self.inner.decode(token, state))

    def clone_state(self, state):
        return self.inner.clone_state(state)

    def state_nbytes(self, state):
        return self.inner.state_nbytes(state)


@contextlib.contextmanager
def scripted_server(tmp_dir: Path):
    ckpt = make_synthetic("tiny", Path(tmp_dir) / "ckpt", seed=3)
    tokenizer = Tokenizer.from_dir(ckpt)
    backend = ScriptedBackend(load_backend(ckpt, "cpu", "reference"), tokenizer.token_id("<|im_end|>"))
    app = create_app(backend, tokenizer, ServerSettings(model_name="tiny", max_seq=1024))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    poll_until(lambda: server.started or not thread.is_alive(), "uvicorn to start")
    assert server.started, "uvicorn did not start"
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=HANG_S)
    try:
        yield ckpt, tokenizer, backend, client
    finally:
        server.should_exit = True
        thread.join(HANG_S)


def prefilled(backend, request, script: list[int] = ()) -> tuple[list[int], object]:
    """The tokens `request()` prefilled (all its prefills, in order; the server has no prefix cache), and what it
    returned; the model writes `script`."""
    backend.script, before = list(script), len(backend.prompts)
    out = request()
    return [t for p in backend.prompts[before:] for t in p], out


def hf_tokenizer(ckpt, tmp_path: Path):
    """transformers' tokenizer over the checkpoint's own tokenizer and chat template files: the oracle."""
    from transformers import AutoTokenizer
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(Path(ckpt) / name, tmp_path / name)
    return AutoTokenizer.from_pretrained(str(tmp_path))
