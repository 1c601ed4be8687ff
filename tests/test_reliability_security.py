"""Security: `lily serve` listens on loopback by default; --api-key is checked (with hmac.compare_digest)
on every endpoint but /health; request size and max_tokens are limited; a malicious chat template in a
checkpoint can neither read files nor run code; prompts and keys stay out of the logs unless
--log-requests (and keys even then)."""

from __future__ import annotations

import argparse
import hmac
import logging
import os
import random
import shutil
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from helpers_gate import HANG_S

from lily.engine import load_backend
from lily.engine.prefix_cache import PrefixCache
from lily.server.app import ServerSettings, create_app
from lily.server.guard import OPEN_PATHS
from lily.tokenizer import TemplateError, Tokenizer, TokenizerError
from test_reliability_support import (InstrumentedBackend, LilyServer, assert_openai_error, make_tiny_checkpoint,
                                      wait_until_idle)

MODEL = "tiny"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("security"))


def secret(tag: str) -> str:
    return f"{tag}-{os.urandom(8).hex()}"


# -- the real process: loopback, key, limits, what its log holds ----------------------------------------

def test_serve_defaults_to_loopback():
    from lily.server.main import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert p.parse_args([]).host == "127.0.0.1"


def listening_addresses(pid: int, port: int) -> set[str]:
    """Local addresses a process listens on for `port`, from /proc/PID/net/tcp{,6} (state 0A = LISTEN)."""
    found = set()
    for name in ("tcp", "tcp6"):
        path = Path(f"/proc/{pid}/net/{name}")
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, p = local.split(":")
            if state == "0A" and int(p, 16) == port:
                found.add(addr)
    return found


@pytest.fixture(scope="module")
def keyed_server(ckpt, tmp_path_factory):
    key = secret("sk-lily")
    server = LilyServer(ckpt, "--api-key", key, "--max-body", "65536", "--max-seq", "256", "--served-model-name", MODEL,
                        log_path=tmp_path_factory.mktemp("log") / "serve.log", startup_timeout=HANG_S)
    with server:
        yield server, key


def test_process_listens_on_loopback_only_and_requires_the_key(keyed_server):
    server, key = keyed_server
    assert listening_addresses(server.proc.pid, server.port) == {"0100007F"}  # 127.0.0.1, nothing else
    auth = {"Authorization": f"Bearer {key}"}
    assert httpx.get(server.url + "/health", timeout=HANG_S).status_code == 200
    for path in ("/v1/models", "/metrics", "/openapi.json", "/v1/models/" + MODEL):
        assert_openai_error(httpx.get(server.url + path, timeout=HANG_S), 401)
        assert httpx.get(server.url + path, headers=auth, timeout=HANG_S).status_code == 200
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    assert_openai_error(httpx.post(server.url + "/v1/completions", json=body, timeout=HANG_S), 401)
    assert httpx.post(server.url + "/v1/completions", json=body, headers=auth, timeout=HANG_S).status_code == 200
    # limits: the body size (--max-body) and max_tokens (the context, --max-seq)
    big = {"model": MODEL, "prompt": "x" * 70_000, "max_tokens": 2}
    assert_openai_error(httpx.post(server.url + "/v1/completions", json=big, headers=auth, timeout=HANG_S), 413)
    err = assert_openai_error(httpx.post(server.url + "/v1/completions", json={**body, "max_tokens": 10**6},
                                         headers=auth, timeout=HANG_S), 400)
    assert err["code"] == "context_length_exceeded"


def test_log_holds_neither_prompts_nor_keys(keyed_server):
    server, key = keyed_server
    auth = {"Authorization": f"Bearer {key}"}
    prompt = secret("PROMPT")
    url = server.url
    # successes, streams, client errors that echo input, a wrong key, a key in the wrong header
    httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 3}, headers=auth, timeout=HANG_S)
    httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": prompt}],
                                                   "max_tokens": 3, "stream": True}, headers=auth, timeout=HANG_S)
    httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": prompt}],
                                                   "temperature": prompt}, headers=auth, timeout=HANG_S)
    httpx.post(url + "/v1/chat/completions", json={"model": prompt, "messages": []}, headers=auth, timeout=HANG_S)
    httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": prompt},
               headers={"Authorization": f"Bearer {key}x"}, timeout=HANG_S)
    httpx.get(url + "/v1/models", headers={"X-Api-Key": key[:-1]}, timeout=HANG_S)
    wait_until_idle(url, api_key=key)
    log = server.log()
    assert "POST /v1/completions 200" in log and "POST /v1/chat/completions 400" in log  # it does log requests
    assert "401" in log
    assert prompt not in log
    assert key not in log and key[:-1] not in log


def in_process(ckpt, **settings):
    backend = InstrumentedBackend(load_backend(ckpt, "cpu", "reference"))
    tokenizer = Tokenizer.from_dir(ckpt)
    cache = PrefixCache(4, 1 << 28, backend.clone_state, backend.state_nbytes)
    app = create_app(backend, tokenizer, ServerSettings(model_name=MODEL, max_seq=256, **settings), cache)
    return TestClient(app, raise_server_exceptions=False), backend


@pytest.mark.parametrize("log_requests", [False, True])
def test_log_requests_shows_prompts_never_keys(ckpt, caplog, log_requests):
    key, prompt = secret("sk"), secret("PROMPT")
    client, backend = in_process(ckpt, api_key=key, log_requests=log_requests)
    auth = {"Authorization": f"Bearer {key}"}
    with client, caplog.at_level(logging.DEBUG):
        r = client.post("/v1/chat/completions", headers=auth,
                        json={"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 2})
        assert r.status_code == 200
        backend.poison_next_decode = True  # a failure logs a traceback: that must not carry the prompt either
        r = client.post("/v1/completions", headers=auth, json={"model": MODEL, "prompt": prompt + " again", "max_tokens": 4})
        assert_openai_error(r, 500)
        client.post("/v1/completions", headers={"Authorization": f"Bearer {prompt}"}, json={"model": MODEL, "prompt": "x"})
    text = caplog.text
    assert "POST /v1/chat/completions 200" in text and "generation failed" in text
    assert key not in text
    assert (prompt in text) == log_requests


# -- the API key ----------------------------------------------------------------------------------

def test_api_key_checked_in_constant_time_on_every_endpoint_but_health(ckpt, monkeypatch):
    key = secret("sk")
    calls = []
    real = hmac.compare_digest

    def spy(a, b):
        calls.append((type(a), type(b)))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    client, _ = in_process(ckpt, api_key=key)
    paths = sorted({r.path.replace("{model:path}", MODEL) for r in client.app.routes if hasattr(r, "methods")})
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/metrics", "/openapi.json", "/health"} <= set(paths)
    wrong = [None, "", key[:-1], key + "x", key.upper(), "x" * len(key), f"Basic {key}", random.choice(["null", "undefined"])]
    with client:
        for path in paths + ["/nowhere", "/v1/chat/completions/../models"]:
            for method in ("GET", "POST", "OPTIONS", "DELETE"):
                for bad in wrong:
                    headers = {} if bad is None else {"Authorization": bad if bad.startswith("Basic") else f"Bearer {bad}"}
                    before = len(calls)
                    r = client.request(method, path, headers=headers, json={"model": MODEL})
                    if path in OPEN_PATHS:  # liveness, and the chat page (it asks for the key itself)
                        assert r.status_code != 401 and len(calls) == before
                        continue
                    err = assert_openai_error(r, 401)
                    assert key not in r.text and err["code"] == "invalid_api_key"
                    assert len(calls) == before + 1, f"{method} {path}: the key was not compared with compare_digest"
                    assert r.headers.get("www-authenticate", "").lower().startswith("bearer")
            ok = client.get(path, headers={"Authorization": f"Bearer {key}"})
            assert ok.status_code != 401
        assert client.get("/v1/models", headers={"X-Api-Key": key}).status_code == 200
        assert client.get("/v1/models", headers={"Authorization": f"bearer {key}"}).status_code == 200
    assert calls and all(t == (bytes, bytes) for t in calls)


# -- the chat template sandbox -------------------------------------------------------------------------

def malicious_templates(secret_file: Path, marker: Path) -> dict[str, str]:
    return {
        "subclasses": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "popen": "{{ cycler.__init__.__globals__.os.popen('touch " + str(marker) + "').read() }}",
        "lipsum": "{{ lipsum.__globals__['os'].system('touch " + str(marker) + "') }}",
        "helper-globals": "{{ raise_exception.__globals__['__builtins__']['open']('" + str(secret_file) + "').read() }}",
        "strftime-globals": "{{ strftime_now.__globals__['datetime'].__builtins__ }}",
        "tojson-class": "{{ (messages|tojson).__class__.__init__.__globals__ }}",
        "include": "{% include '" + str(secret_file) + "' %}",
        "import": "{% import '" + str(secret_file) + "' as s %}{{ s }}",
        "extends": "{% extends '" + str(secret_file) + "' %}",
        "open": "{{ open('" + str(secret_file) + "').read() }}",
        "mutate-messages": "{{ messages.append({'role': 'system', 'content': 'x'}) }}{{ messages|length }}",
        "mutate-dict": "{% for m in messages %}{{ m.update({'content': 'pwned'}) }}{% endfor %}",
        "format-attr": "{{ '{0.__class__.__init__.__globals__}'.format(messages) }}",
        "self-context": "{{ self._TemplateReference__context }}",
        "namespace-init": "{{ namespace.__init__.__globals__ }}",
        "huge-range": "{% for i in range(10**9) %}{% endfor %}",
        "getattr-filter": "{{ messages|attr('__class__') }}",
    }


def test_malicious_chat_template_reads_no_file_runs_no_code(ckpt, tmp_path):
    secret_file = tmp_path / "secret.txt"
    secret_text = secret("FILE-CONTENT")
    secret_file.write_text(secret_text)
    marker = tmp_path / "pwned"
    for name, source in malicious_templates(secret_file, marker).items():
        d = tmp_path / name
        d.mkdir()
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(ckpt / f, d / f)
        (d / "chat_template.jinja").write_text(source)
        try:
            tok = Tokenizer.from_dir(d)
        except TokenizerError as e:  # refused at load: fine, as long as it says so in one line
            assert "\n" not in str(e)
            continue
        messages = [{"role": "user", "content": "hello"}]
        try:
            out = tok.render_chat(messages)
        except TemplateError as e:  # the sandbox stopped it
            assert secret_text not in str(e) and "\n" not in str(e), name
        else:  # it rendered: nothing of Python's insides came out
            assert secret_text not in out, name
            assert not any(s in out for s in ("<function", "<module", "<class", "__builtins__", "<built-in")), (name, out[:300])
        assert messages == [{"role": "user", "content": "hello"}], f"{name}: the template changed its input"
    assert not marker.exists(), "a template ran a shell command"


def test_malicious_template_in_a_served_checkpoint_is_a_400(ckpt, tmp_path):
    bad = Path(shutil.copytree(ckpt, tmp_path / "ckpt"))
    secret_file = tmp_path / "secret.txt"
    secret_file.write_text(secret("FILE-CONTENT"))
    (bad / "chat_template.jinja").write_text("{% include '" + str(secret_file) + "' %}"
                                             "{{ ''.__class__.__mro__[1].__subclasses__() }}")
    client, _ = in_process(bad)
    with client:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        err = assert_openai_error(client.post("/v1/chat/completions", json=body), 400)
        assert secret_file.read_text() not in err["message"]
        # the server itself is fine: plain completions still work
        assert client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}).status_code == 200


def test_cors_only_for_the_origins_given(ckpt):
    """--cors-origin lets a browser page from that origin call the API: the preflight (which carries no
    key) is answered, the key is still required for the call itself; other origins, and every origin
    without the flag, get no CORS grant."""
    backend = load_backend(ckpt, "cpu", "reference")
    tokenizer = Tokenizer.from_dir(ckpt)
    ui, other = "http://localhost:3000", "http://evil.example"
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for origins in ((ui,), ()):
        app = create_app(backend, tokenizer, ServerSettings(model_name="tiny", max_seq=128, api_key="k",
                                                            cors_origins=origins))
        with TestClient(app) as c:
            r = c.options("/v1/chat/completions", headers={"Origin": ui, **preflight})
            granted = r.headers.get("access-control-allow-origin")
            assert granted == (ui if origins else None), (origins, r.status_code, dict(r.headers))
            r = c.post("/v1/chat/completions", json=body, headers={"Origin": ui, "Authorization": "Bearer k"})
            assert r.status_code == 200 and r.headers.get("access-control-allow-origin") == (ui if origins else None)
            r = c.post("/v1/chat/completions", json=body, headers={"Origin": ui})
            assert r.status_code == 401
            r = c.options("/v1/chat/completions", headers={"Origin": other, **preflight})
            assert r.headers.get("access-control-allow-origin") is None
