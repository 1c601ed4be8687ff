"""The chat page (GET /) in a real headless Chromium driven by selenium: against `lily serve --demo` (a
message typed and sent, the streamed reply with its speed and cached tokens, a server error shown, the
conversation kept across a reload), and against in-process servers over a scripted backend (the
API key asked for, reasoning folded apart from the answer, a tool call shown, stop cancelling the
request on the server; the settings starting from the server's defaults and only what the user set
sent; a failed turn left out of the conversation, its text back in the box). Event-driven throughout: the page's own elements and the backend's events are
waited on, never a guessed time.

Needs Debian's chromium and chromium-driver (.ci/run installs them); without them the tests skip,
except under CI, where they fail."""

from __future__ import annotations

import contextlib
import json
import os
import random
import threading
from pathlib import Path

import httpx
import pytest
import torch

from helpers_serve import serving

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
WAIT_S = 120  # an upper bound for the slowest CI machine; every wait ends as soon as its condition holds


def _require_chromium():
    if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
        message = f"{CHROMIUM} and {CHROMEDRIVER} are needed (apt-get install chromium chromium-driver)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    _require_chromium()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run", "--disable-sync", "--disable-dev-shm-usage",
                 "--window-size=1100,900", f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}"):
        opts.add_argument(flag)
    driver = webdriver.Chrome(options=opts, service=Service(executable_path=CHROMEDRIVER))
    try:
        yield driver
    finally:
        driver.quit()


def wait_for(driver, condition, message=""):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, WAIT_S, poll_frequency=0.05).until(lambda d: condition(), message)


def by_css(driver, css):
    from selenium.webdriver.common.by import By

    return driver.find_elements(By.CSS_SELECTOR, css)


def turns(driver, role):
    return by_css(driver, f"#conversation .turn.{role}")


def set_field(driver, element_id, value):
    """Set an input's value as a user would leave it (works for number inputs too)."""
    driver.execute_script("arguments[0].value = arguments[1];", driver.find_element("id", element_id), str(value))


def type_and_send(driver, text):
    driver.find_element("id", "prompt").send_keys(text)
    press_enter(driver)


def press_enter(driver):
    from selenium.webdriver.common.keys import Keys

    driver.find_element("id", "prompt").send_keys(Keys.ENTER)


def open_settings(driver):
    if driver.find_element("id", "settings").get_attribute("open") is None:
        driver.find_element("css selector", "#settings summary").click()


def open_page(driver, url):
    driver.get(url + "/")
    driver.execute_script("localStorage.clear(); sessionStorage.clear();")
    driver.get(url + "/")


def stored_history(driver) -> list[dict]:
    return json.loads(driver.execute_script("return localStorage.getItem('lily-chat-history')") or "[]")


def assert_speed_shown(reply):
    """A finished reply's stats show its speed, unless every token reached the page in one read (a loaded machine
    may deliver the whole stream at once: no span to measure a speed over, and the page shows none) or there was
    one token."""
    line = reply.find_element("css selector", ".stats")
    span = float(line.get_attribute("data-token-span-ms") or "nan")
    assert "tok/s" in line.text or span == 0 or line.text.startswith("1 tokens"), (line.text, span)


# -- against lily serve --demo ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    _require_chromium()
    cache = tmp_path_factory.mktemp("cache")
    with serving(["--demo"], env={"LILY_CACHE_DIR": str(cache)}) as (url, _):
        yield url


def test_chat_with_the_demo_server(browser, demo, tmp_path):
    d = browser
    open_page(d, demo)
    wait_for(d, lambda: d.find_element("id", "model").text == "lily-demo-tiny", "the model's name")
    assert d.find_element("id", "thinking").is_selected()  # the demo's template thinks unless told otherwise
    set_field(d, "max-tokens", 24)
    words = " ".join(random.choice(["robot", "harbour", "paint", "town", "sea"]) for _ in range(5))
    type_and_send(d, f"Tell me about the {words}.")
    wait_for(d, lambda: "prompt tokens cached" in (by_css(d, ".turn.assistant .stats") or [None])[0].text,
             "the reply's usage")
    reply = turns(d, "assistant")[0]
    assert turns(d, "user")[0].text == f"Tell me about the {words}."
    stats = reply.find_element("css selector", ".stats").text
    assert_speed_shown(reply)
    assert "24 tokens" in stats or "finish: stop" in stats, stats
    assert "prompt tokens cached" in stats
    # the demo thinks by default: the reasoning is shown apart from the answer, folded
    reasoning = reply.find_element("css selector", ".reasoning")
    assert reasoning.is_displayed() and reasoning.get_attribute("open") is None
    assert d.execute_script("return arguments[0].querySelector('.reasoning-text').textContent",
                            reply).strip() != ""
    # a second turn reuses the cached prefix of the first
    open_settings(d)
    d.find_element("id", "thinking").click()  # thinking off
    type_and_send(d, "And then?")
    wait_for(d, lambda: len(turns(d, "assistant")) == 2 and "prompt tokens cached" in
             turns(d, "assistant")[1].find_element("css selector", ".stats").text, "the second reply")
    assert_speed_shown(turns(d, "assistant")[1])
    second = turns(d, "assistant")[1]
    cached = int(second.find_element("css selector", ".stats").text.split(" prompt tokens cached")[0].split()[-3])
    assert cached > 0
    assert not second.find_element("css selector", ".reasoning").is_displayed()  # thinking was off
    if os.environ.get("LILY_CHAT_SCREENSHOT"):  # docs/chat-page.png is made this way
        d.find_element("css selector", "#settings summary").click()
        d.save_screenshot(os.environ["LILY_CHAT_SCREENSHOT"])
        open_settings(d)
    # a server error is shown, word for word as the server gave it; the failed turn is not kept (the next
    # request would carry two user messages in a row): its text is back in the box
    set_field(d, "max-tokens", 10 ** 9)
    type_and_send(d, "Too long")
    wait_for(d, lambda: len(turns(d, "assistant")) == 3 and
             turns(d, "assistant")[2].find_element("css selector", ".error").is_displayed(), "the error")
    assert d.find_element("id", "prompt").get_attribute("value") == "Too long"
    history = stored_history(d)
    assert [m["role"] for m in history] == ["user", "assistant", "user", "assistant"]
    asked = history + [{"role": "user", "content": "Too long"}]
    said = httpx.post(demo + "/v1/chat/completions", json={"model": "lily-demo-tiny", "max_tokens": 10 ** 9,
                                                          "messages": asked,
                                                          "chat_template_kwargs": {"enable_thinking": False}})
    assert said.status_code == 400
    assert turns(d, "assistant")[2].find_element("css selector", ".error").text == said.json()["error"]["message"]
    # the conversation is kept across a reload, until New chat
    d.refresh()
    wait_for(d, lambda: len(turns(d, "user")) == 2 and len(turns(d, "assistant")) == 2, "the kept conversation")
    assert turns(d, "user")[0].text == f"Tell me about the {words}."
    d.find_element("id", "new-chat").click()
    assert turns(d, "user") == [] and turns(d, "assistant") == []


def test_page_and_assets_are_served_from_the_package(demo):
    page = httpx.get(demo + "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    for ref in ("/chat/chat.js", "/chat/chat.css"):
        assert ref in page.text
        r = httpx.get(demo + ref)
        assert r.status_code == 200
        assert r.content == (ROOT / "lily" / "server" / "chat_page" / ref.split("/")[-1]).read_bytes()
    # nothing the page loads comes from elsewhere (works offline)
    assert "http://" not in page.text and "https://" not in page.text
    assert httpx.get(demo + "/chat/../main.py").status_code == 404


# -- against a scripted backend: API key, reasoning, tool calls, stop -------------------------------------

SCRIPT = ("The user wants the weather; call the tool.\n</think>\n\n"  # the prompt opened <think>
          "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>")
LONG = "one two three four five six seven eight nine ten " * 20
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


class ScriptedBackend:
    """Answers every prompt with the tokens of `script`, then <|im_end|>. With `hold_at` set, the decode
    step that would write token number hold_at (0: the prefill, before any token) waits for `release` (so the
    test can press stop while the request is surely running); `ended` is set when a request's state is handed
    back; `prompts` keeps each prompt's ids."""

    device = torch.device("cpu")

    def __init__(self, tokenizer, vocab):
        self.tokenizer, self.vocab = tokenizer, vocab
        self.script: list[int] = []
        self.hold_at: int | None = None
        self.held = threading.Event()
        self.release = threading.Event()
        self.ended = threading.Event()
        self.decoded = 0
        self.prompts: list[list[int]] = []

    def answer(self, text: str, hold_at: int | None = None):
        self.script = self.tokenizer.encode(text) + [self.tokenizer.token_id("<|im_end|>")]
        self.hold_at, self.decoded = hold_at, 0
        for e in (self.held, self.release, self.ended):
            e.clear()

    def _logits(self, n: int) -> torch.Tensor:
        out = torch.full((self.vocab,), -100.0)
        out[self.script[min(n, len(self.script) - 1)]] = 100.0
        return out

    def new_state(self):
        return {"n": 0}

    def prefill(self, ids, state):
        self.prompts.append(list(ids))
        state["n"] = 0
        if self.hold_at == 0:
            self.held.set()
            assert self.release.wait(WAIT_S)
        return self._logits(0)

    def decode(self, token, state):
        state["n"] += 1
        self.decoded += 1
        if state["n"] == self.hold_at:
            self.held.set()
            assert self.release.wait(WAIT_S)
        return self._logits(state["n"])

    def release_state(self, state):
        self.ended.set()


class ChatBodies:
    """An ASGI wrapper that keeps the body of each chat request as the server received it: what the page sent."""

    def __init__(self, app):
        self.app, self.bodies = app, []

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] != "/v1/chat/completions":
            return await self.app(scope, receive, send)
        parts = []

        async def receive_and_keep():
            message = await receive()
            if message["type"] == "http.request":
                parts.append(message.get("body", b""))
                if not message.get("more_body"):
                    self.bodies.append(json.loads(b"".join(parts)))
            return message

        await self.app(scope, receive_and_keep, send)


@contextlib.contextmanager
def scripted_server(tmp_path_factory, settings):
    """An in-process server over a ScriptedBackend: (url, backend, the chat bodies it received, tokenizer)."""
    _require_chromium()
    import uvicorn

    from lily.demo_tokenizer import write_tokenizer_files
    from lily.server.app import create_app
    from lily.server.listen import bind_sockets
    from lily.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(write_tokenizer_files(tmp_path_factory.mktemp("tok")))
    backend = ScriptedBackend(tokenizer, 512)
    app = ChatBodies(create_app(backend, tokenizer, settings))
    sockets = bind_sockets("127.0.0.1", 0)
    started = threading.Event()

    class Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets)
            started.set()

    server = Server(uvicorn.Config(app, log_level="warning", log_config=None))
    thread = threading.Thread(target=server.run, kwargs={"sockets": sockets}, daemon=True)
    thread.start()
    assert started.wait(WAIT_S)
    try:
        yield f"http://127.0.0.1:{sockets[0].getsockname()[1]}", backend, app.bodies, tokenizer
    finally:
        backend.release.set()
        server.should_exit = True
        thread.join(30)


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    from lily.server.app import ServerSettings

    key = f"sk-{random.randrange(1 << 40):x}"
    with scripted_server(tmp_path_factory, ServerSettings(model_name="scripted", max_seq=4096, api_key=key)) as (
            url, backend, _, _):
        yield url, backend, key


def test_api_key_reasoning_tool_calls_and_stop(browser, scripted):
    url, backend, key = scripted
    d = browser
    open_page(d, url)
    # the page asks for the key; a wrong one is refused with the server's words
    wait_for(d, lambda: d.find_element("id", "key-form").is_displayed(), "the key form")
    d.find_element("id", "api-key").send_keys("wrong-key\n")
    wait_for(d, lambda: d.find_element("id", "key-error").is_displayed(), "the refusal")
    assert "API key" in d.find_element("id", "key-error").text
    box = d.find_element("id", "api-key")
    box.clear()
    box.send_keys(key + "\n")
    wait_for(d, lambda: d.find_element("id", "model").text == "scripted", "the model's name")
    assert not d.find_element("id", "key-form").is_displayed()

    # reasoning folded apart from the answer, the tool call shown
    backend.answer(SCRIPT)
    open_settings(d)
    set_field(d, "tools", json.dumps(TOOLS))
    type_and_send(d, "What is the weather in Paris?")
    wait_for(d, lambda: "finish: tool_calls" in d.find_element("css selector", ".turn.assistant .stats").text,
             "the tool call's finish")
    reply = turns(d, "assistant")[0]
    reasoning = reply.find_element("css selector", ".reasoning")
    assert reasoning.is_displayed() and reasoning.get_attribute("open") is None
    assert d.execute_script("return arguments[0].querySelector('.reasoning-text').textContent", reply).strip() \
        == "The user wants the weather; call the tool."
    call = reply.find_element("css selector", ".tool-call")
    assert call.find_element("css selector", ".name").text == "get_weather"
    assert json.loads(call.text.split("get_weather", 1)[1]) == {"city": "Paris"}
    assert reply.find_element("css selector", ".content").text == ""

    # stop: the request is held mid-answer, stop is pressed, the server cancels it
    set_field(d, "tools", "")
    d.find_element("id", "thinking").click()  # thinking off: the words are the answer
    backend.answer(LONG, hold_at=6)
    type_and_send(d, "Count for me.")
    assert backend.held.wait(WAIT_S)
    wait_for(d, lambda: len(turns(d, "assistant")) == 2 and
             turns(d, "assistant")[1].find_element("css selector", ".content").text.startswith("one two"),
             "the streamed start of the answer")
    d.find_element("id", "stop").click()
    wait_for(d, lambda: "stopped" in turns(d, "assistant")[1].find_element("css selector", ".stats").text, "stopped")
    assert d.find_element("id", "send").is_displayed() and not d.find_element("id", "stop").is_displayed()
    backend.release.set()
    assert backend.ended.wait(WAIT_S)  # the request's end on the server: cancelled, not run out
    assert backend.decoded < len(backend.script) - 1
    metrics = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {key}"}).text
    assert "lily_requests_cancelled_total 1" in metrics


# -- against a scripted server that does not think by default, with sampling defaults of its own ------------

@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """`lily serve --no-enable-thinking` over a checkpoint whose generation_config.json sets a temperature and
    max_new_tokens: (url, backend, chat bodies received, tokenizer, the defaults)."""
    from lily.server.app import ServerSettings
    from lily.server.generation_config import SamplingDefaults

    defaults = SamplingDefaults(temperature=round(random.uniform(0.1, 1.9), 2), top_p=0.95, top_k=20,
                                max_tokens=random.randrange(100, 1000), source="a test's")
    settings = ServerSettings(model_name="plain", max_seq=4096, enable_thinking=False, sampling_defaults=defaults)
    with scripted_server(tmp_path_factory, settings) as served:
        yield (*served, defaults)


def stats_of_last(driver) -> str:
    replies = turns(driver, "assistant")
    return replies[-1].find_element("css selector", ".stats").text if replies else ""


def test_the_page_starts_from_the_servers_defaults_and_sends_only_what_is_set(browser, plain):
    from lily.tokenizer import opens_thinking

    url, backend, bodies, tokenizer, defaults = plain
    d = browser
    open_page(d, url)
    wait_for(d, lambda: d.find_element("id", "model").text == "plain", "the model's name")
    open_settings(d)
    # the checkbox is the server's --no-enable-thinking; the empty fields name the checkpoint's defaults
    assert not d.find_element("id", "thinking").is_selected()
    assert httpx.get(url + "/v1/models").json()["data"][0]["lily"] == {"enable_thinking": False}
    for field, default in (("temperature", defaults.temperature), ("max-tokens", defaults.max_tokens)):
        box = d.find_element("id", field)
        assert box.get_attribute("value") == "" and box.get_attribute("placeholder") == str(default), field

    answer = " ".join(random.sample(["sea", "town", "paint", "robot", "lamp", "river", "cloud"], 4))
    backend.answer(answer)
    type_and_send(d, "Say something.")
    wait_for(d, lambda: "finish: stop" in stats_of_last(d), "the reply")
    sent = bodies[-1]
    assert not {"temperature", "max_tokens", "chat_template_kwargs", "top_p"} & set(sent), sent
    assert not opens_thinking(tokenizer.decode(backend.prompts[-1]))  # the server's default: no thinking
    reply = turns(d, "assistant")[-1]
    assert reply.find_element("css selector", ".content").text == answer
    assert not reply.find_element("css selector", ".reasoning").is_displayed()

    # what the user changes is sent, and only that
    backend.answer("Thinking it over.\n</think>\n\n" + answer)
    d.find_element("id", "thinking").click()
    t = round(random.uniform(0, 2), 1)
    set_field(d, "temperature", t)
    type_and_send(d, "Think first.")
    wait_for(d, lambda: len(turns(d, "assistant")) == 2 and "finish: stop" in stats_of_last(d), "the second reply")
    sent = bodies[-1]
    assert sent["chat_template_kwargs"] == {"enable_thinking": True} and sent["temperature"] == t, sent
    assert "max_tokens" not in sent  # empty: not sent as 0
    assert opens_thinking(tokenizer.decode(backend.prompts[-1]))
    assert turns(d, "assistant")[-1].find_element("css selector", ".reasoning").is_displayed()


def test_a_failed_turn_is_not_kept_and_comes_back_to_edit(browser, plain):
    url, backend, bodies, _, _ = plain
    d = browser
    open_page(d, url)
    wait_for(d, lambda: d.find_element("id", "model").text == "plain", "the model's name")
    open_settings(d)
    prompt = d.find_element("id", "prompt")

    def failed(n: int, text: str):
        """The n-th reply shows an error, the turn is marked, its text is back in the box, history unchanged."""
        wait_for(d, lambda: len(turns(d, "assistant")) == n and
                 turns(d, "assistant")[-1].find_element("css selector", ".error").is_displayed(), "the error")
        assert prompt.get_attribute("value") == text
        assert "failed" in turns(d, "user")[-1].get_attribute("class")
        return turns(d, "assistant")[-1].find_element("css selector", ".error").text

    # a typing mistake in the tools: nothing reaches the server
    first = f"Hello {random.randrange(10 ** 6)}"
    set_field(d, "tools", "[{oops")
    type_and_send(d, first)
    assert "JSON" in failed(1, first)
    assert stored_history(d) == [] and all(b["messages"][-1]["content"] != first for b in bodies)

    # fixed, the same text is sent again from the box: one user message, not two
    set_field(d, "tools", "")
    backend.answer("Hi there.")
    press_enter(d)  # the text is in the box already
    wait_for(d, lambda: "finish: stop" in stats_of_last(d), "the reply")
    assert bodies[-1]["messages"] == [{"role": "user", "content": first}]
    assert [m["role"] for m in stored_history(d)] == ["user", "assistant"]

    # a 400 from the server: the same
    second = f"Again {random.randrange(10 ** 6)}"
    set_field(d, "max-tokens", 10 ** 6)  # past the context
    type_and_send(d, second)
    assert "maximum context length" in failed(3, second)
    assert [m["role"] for m in stored_history(d)] == ["user", "assistant"]
    set_field(d, "max-tokens", "")
    press_enter(d)  # the text is in the box already
    wait_for(d, lambda: len(turns(d, "assistant")) == 4 and "finish: stop" in stats_of_last(d), "the reply")
    assert [m["role"] for m in bodies[-1]["messages"]] == ["user", "assistant", "user"]
    assert bodies[-1]["messages"][-1]["content"] == second

    # stopped before the first token: nothing to keep either
    third = f"Stop me {random.randrange(10 ** 6)}"
    backend.answer("Too late.", hold_at=0)
    type_and_send(d, third)
    assert backend.held.wait(WAIT_S)
    d.find_element("id", "stop").click()
    wait_for(d, lambda: "stopped" in stats_of_last(d), "stopped")
    backend.release.set()
    assert prompt.get_attribute("value") == third
    assert [m["role"] for m in stored_history(d)] == ["user", "assistant", "user", "assistant"]
    # after a reload only the kept turns are shown
    d.refresh()
    wait_for(d, lambda: len(turns(d, "user")) == 2 and len(turns(d, "assistant")) == 2, "the kept conversation")


def test_new_chat_while_a_reply_streams_starts_empty(browser, plain):
    url, backend, _, _, _ = plain
    d = browser
    open_page(d, url)
    wait_for(d, lambda: d.find_element("id", "model").text == "plain", "the model's name")
    backend.answer(LONG, hold_at=random.randrange(3, 8))
    type_and_send(d, "Count for me.")
    assert backend.held.wait(WAIT_S)
    wait_for(d, lambda: turns(d, "assistant") and
             turns(d, "assistant")[0].find_element("css selector", ".content").text.startswith("one"), "the answer")
    d.find_element("id", "new-chat").click()
    wait_for(d, lambda: d.find_element("id", "send").is_displayed(), "the request's end")
    backend.release.set()
    # the cut reply belongs to the conversation that was left, not to the new one
    assert stored_history(d) == [] and turns(d, "assistant") == [] and turns(d, "user") == []
