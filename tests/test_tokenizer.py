"""lily.tokenizer against transformers' tokenizer and chat-template rendering (the oracle)."""

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lily.demo_tokenizer import write_tokenizer_files
from lily.tokenizer import Tokenizer, TemplateError, TokenizerError, opens_thinking


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return write_tokenizer_files(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def tok(tok_dir):
    return Tokenizer.from_dir(tok_dir)


@pytest.fixture(scope="module")
def hf(tok_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(tok_dir))


def test_special_ids_by_string(tok):
    assert tok.token_id("<|im_end|>") == 500 and tok.token_id("<tool_call>") == 502
    assert tok.eos_token_ids[0] == 500 and 499 in tok.eos_token_ids
    with pytest.raises(KeyError):
        tok.token_id("<nope>")


@settings(max_examples=40, deadline=None)
@given(st.text(min_size=1, max_size=40))
def test_encode_decode_match_transformers(tok, hf, text):
    ids = tok.encode(text)
    assert ids == hf.encode(text, add_special_tokens=False)
    # control tokens (<|im_end|>, ...) are hidden from output text, as transformers' skip_special_tokens does
    assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    if not any(t in text for t in ("<|im_end|>", "<|im_start|>", "<|endoftext|>")):
        assert tok.decode(ids) == text


def test_chat_template_matches_transformers(tok, hf):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "weather",
                                               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "need tool",
         "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny"},
    ]
    for kwargs in ({}, {"enable_thinking": False}, {"enable_thinking": True}):
        ours = tok.render_chat(messages, tools=tools, **kwargs)
        theirs = hf.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True, **kwargs)
        assert ours == theirs
    assert opens_thinking(tok.render_chat(messages[:2]))
    assert not opens_thinking(tok.render_chat(messages[:2], enable_thinking=False))
    assert tok.template_thinks_by_default()


def test_template_errors_are_client_errors(tok):
    with pytest.raises(TemplateError, match="unknown message role"):
        tok.render_chat([{"role": "robot", "content": "x"}])


def test_missing_tokenizer_is_one_clear_line(tmp_path):
    with pytest.raises(TokenizerError, match="tokenizer.json is missing"):
        Tokenizer.from_dir(tmp_path)


def test_template_from_tokenizer_config(tmp_path, tok_dir):
    (tmp_path / "tokenizer.json").write_text((tok_dir / "tokenizer.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages[0].content | tojson }}!"}))
    assert Tokenizer.from_dir(tmp_path).render_chat([{"role": "user", "content": "é"}]) == '"é"!'


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=30))
def test_detokenizer_never_splits_a_character(tok, text):
    ids = tok.encode(text)
    detok = tok.detokenizer()
    deltas = [detok.add(i) for i in ids]
    deltas.append(detok.flush())
    assert "".join(deltas) == tok.decode(ids)
    assert all("\ufffd" not in d for d in deltas)  # valid text never shows a replacement char


def test_token_bytes_are_raw_bytes(tok):
    ids = tok.encode("é✓")
    assert sum((tok.token_bytes(i) for i in ids), []) == list("é✓".encode())
    assert tok.token_bytes(tok.token_id("<think>")) == list(b"<think>")


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, 507), min_size=1, max_size=30))
def test_detokenizer_on_arbitrary_ids_adds_up_to_the_full_decode(tok, ids):
    # what a random model emits: stray continuation bytes, control tokens, markup tokens
    detok = tok.detokenizer()
    assert "".join(detok.add(i) for i in ids) + detok.flush() == tok.decode(ids)


# -- where the chat template is found (transformers 5's precedence) ---------------------------------------------

def template_dir(tmp_path, tok_dir, jinja=None, config=None, processor=None):
    """A tokenizer directory with the chat template in any of its three places."""
    d = tmp_path / "tok"
    d.mkdir(parents=True)
    (d / "tokenizer.json").write_text((tok_dir / "tokenizer.json").read_text())
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    if config is not None:
        cfg["chat_template"] = config
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    if jinja is not None:
        (d / "chat_template.jinja").write_text(jinja)
    if processor is not None:
        (d / "chat_template.json").write_text(json.dumps({"chat_template": processor}))
    return d


def marked(word):
    return "{{ '" + word + ":' }}{% for m in messages %}{{ m.content }}{% endfor %}"


def test_named_templates_in_tokenizer_config_render_the_default_as_transformers_does(tmp_path, tok_dir):
    from transformers import AutoTokenizer

    real = (tok_dir / "chat_template.jinja").read_text()
    names = random.sample(["tool_use", "rag", "summary", "json"], 2)
    listed = [{"name": n, "template": marked(n)} for n in names] + [{"name": "default", "template": real}]
    random.shuffle(listed)
    d = template_dir(tmp_path, tok_dir, config=listed)
    ours = Tokenizer.from_dir(d)
    hf = AutoTokenizer.from_pretrained(str(d))
    messages = [{"role": "user", "content": "".join(random.choices("abcxyz é", k=12))}]
    assert ours.has_chat_template and ours.missing_template_warning() is None
    assert ours.render_chat(messages) == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_named_templates_without_a_default_are_one_clear_line(tmp_path, tok_dir):
    d = template_dir(tmp_path, tok_dir, config=[{"name": "rag", "template": marked("rag")}])
    with pytest.raises(TokenizerError, match=r'tokenizer_config.json: "chat_template" names templates \['):
        Tokenizer.from_dir(d)


def test_template_places_in_transformers_order(tmp_path, tok_dir):
    """chat_template.jinja over tokenizer_config.json's entry (transformers' tokenizer), and the processor's
    chat_template.json ({"chat_template": ...}) when neither has one."""
    msg = [{"role": "user", "content": str(random.randrange(10**6))}]
    cases = [(dict(jinja=marked("j"), config=marked("c"), processor=marked("p")), "j:"),
             (dict(config=marked("c"), processor=marked("p")), "c:"),
             (dict(config=[{"name": "default", "template": marked("c")}], processor=marked("p")), "c:"),
             (dict(processor=marked("p")), "p:")]
    for i, (places, first) in enumerate(cases):
        d = template_dir(tmp_path / str(i), tok_dir, **places)
        assert Tokenizer.from_dir(d).render_chat(msg) == first + msg[0]["content"], places


def test_no_template_warning_names_every_place_looked(tmp_path, tok_dir):
    d = template_dir(tmp_path, tok_dir)
    warning = Tokenizer.from_dir(d).missing_template_warning()
    assert all(str(d / name) in warning for name in ("chat_template.jinja", "tokenizer_config.json",
                                                     "chat_template.json")), warning


def test_a_broken_processor_template_file_is_one_clear_line(tmp_path, tok_dir):
    d = template_dir(tmp_path, tok_dir)
    (d / "chat_template.json").write_text(json.dumps({"template": marked("p")}))
    with pytest.raises(TokenizerError, match=r'chat_template.json: expected a JSON object with a "chat_template"'):
        Tokenizer.from_dir(d)


def test_template_helpers_render_as_transformers_does(tmp_path, tok_dir):
    """tojson joined to a string with `+` (a plain string, as transformers' filter: a Markup escaped '<' to
    '&lt;') and transformers' {% generation %} block (rendered as its body) give transformers' text."""
    from transformers import AutoTokenizer

    template = ("{{ '<tools>' + (tools | tojson) + '</tools>' }}{% for m in messages %}<|im_start|>{{ m.role }}\n"
                "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}{% else %}"
                "{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>"
                "assistant\n{% endif %}")
    d = template_dir(tmp_path, tok_dir, jinja=template)
    words = ["".join(random.choices("ab<>&\"' é", k=random.randint(1, 9))) for _ in range(3)]
    tools = [{"type": "function", "function": {"name": "f", "description": words[0], "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": words[1]}, {"role": "assistant", "content": words[2]},
                {"role": "user", "content": "<b>"}]
    ours = Tokenizer.from_dir(d).render_chat(messages, tools=tools)
    theirs = AutoTokenizer.from_pretrained(str(d)).apply_chat_template(messages, tools=tools, tokenize=False,
                                                                         add_generation_prompt=True)
    assert ours == theirs and "<tools>" in ours and "&lt;" not in ours
