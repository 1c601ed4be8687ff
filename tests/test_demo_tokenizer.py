"""The demo tokenizer and chat template (lily/demo_tokenizer.py), checked through transformers
(AutoTokenizer.from_pretrained + apply_chat_template: the same path mlx-lm and HF users take)."""

import json
import random

import pytest

from lily.config import TINY
from lily.demo_tokenizer import SPECIAL_TOKENS, build_tokenizer, write_tokenizer_files


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return write_tokenizer_files(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def hf(tok_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tok_dir))


def render(hf, messages, **kw):
    kw.setdefault("add_generation_prompt", True)
    return hf.apply_chat_template(messages, tokenize=False, **kw)


def test_vocabulary_layout(hf):
    tok = build_tokenizer()
    assert tok.get_vocab_size(with_added_tokens=True) == 508 <= TINY.vocab_size
    for text, i in SPECIAL_TOKENS.items():
        assert tok.token_to_id(text) == i and hf.convert_tokens_to_ids(text) == i
    assert TINY.eos_token_ids == (SPECIAL_TOKENS["<|im_end|>"], SPECIAL_TOKENS["<|endoftext|>"])
    assert hf.eos_token_id == 500
    # merges really compress English: fewer tokens than bytes
    text = "The robot walked to the harbour and watched the boats come in."
    assert len(tok.encode(text).ids) < len(text.encode()) * 0.6


def test_byte_level_round_trip(hf):
    tok = build_tokenizer()
    rng = random.Random()
    alphabet = "abcdefghij XYZ  \n\t.,!?'\"{}[]<>|=_-0123456789éüßñ中文日本語한국어😀🚀\u200b"
    for _ in range(30):
        s = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 60)))
        ids = tok.encode(s).ids
        assert all(0 <= i < 499 for i in ids)
        assert tok.decode(ids) == s
        assert hf.encode(s, add_special_tokens=False) == ids


def test_special_tokens_in_text_become_single_ids():
    tok = build_tokenizer()
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>\n<think>\n</think><tool_call>").ids
    assert ids[0] == 501 and 500 in ids and 504 in ids and 505 in ids and ids[-1] == 502


def test_deterministic():
    assert build_tokenizer().to_str() == build_tokenizer().to_str()


def test_simple_turns_and_generation_prompt(hf):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    assert render(hf, msgs) == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
                                "<|im_start|>assistant\n<think>\n")
    assert render(hf, msgs, enable_thinking=False).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert render(hf, msgs, add_generation_prompt=False).endswith("Hi there<|im_end|>\n")


def test_content_parts(hf):
    msgs = [{"role": "user", "content": [{"type": "text", "text": "one "}, {"type": "text", "text": "two"}]}]
    assert render(hf, msgs, add_generation_prompt=False) == "<|im_start|>user\none two<|im_end|>\n"


def test_reasoning_kept_only_after_the_last_user_query(hf):
    msgs = [{"role": "user", "content": "q1"},
            {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
            {"role": "user", "content": "q2"},
            {"role": "assistant", "content": "<think>\nr2\n</think>\n\na2"}]
    out = render(hf, msgs, add_generation_prompt=False)
    assert "r1" not in out and "<|im_start|>assistant\na1<|im_end|>" in out
    assert "<|im_start|>assistant\n<think>\nr2\n</think>\n\na2<|im_end|>\n" in out


def test_tools_and_tool_calls(hf):
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Current weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    msgs = [{"role": "system", "content": "You help."},
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {"role": "assistant", "content": "", "reasoning_content": "two calls",
             "tool_calls": [{"type": "function", "function": {"name": "get_weather",
                                                              "arguments": {"city": "Paris", "days": 2}}},
                            {"type": "function", "function": {"name": "get_weather",
                                                              "arguments": {"city": "Rome"}}}]},
            {"role": "tool", "content": "sunny"},
            {"role": "tool", "content": "rain"}]
    out = render(hf, msgs, tools=tools)
    system = out.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nYou help.\n\n# Tools\n")
    listed = system.split("<tools>\n")[1].split("\n</tools>")[0]
    assert json.loads(listed) == tools[0]
    assert "<tool_call>\n<function=" in system and "<parameter=" in system
    assert ("<|im_start|>assistant\n<think>\ntwo calls\n</think>\n\n"
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
            "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>\n"
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n</function>\n"
            "</tool_call><|im_end|>\n") in out
    assert out.endswith("<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n"
                        "</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n")


def test_tools_without_system_message(hf):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    out = render(hf, [{"role": "user", "content": "x"}], tools=tools)
    assert out.startswith("<|im_start|>system\n# Tools\n")
    assert out.count("<|im_start|>system") == 1


def test_rendered_prompt_tokenizes_to_known_ids(hf):
    ids = hf.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert ids[0] == 501 and ids[-2:] == [504, build_tokenizer().token_to_id("Ċ")]
