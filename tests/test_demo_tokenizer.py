"""The synthetic checkpoints' tokenizers and chat template (lily/demo_tokenizer.py), checked through
transformers (AutoTokenizer.from_pretrained + apply_chat_template: the same path mlx-lm and HF users
take); the full-size one against the real vocabulary's size and special-token ids."""

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from lily.config import FULL, TINY
from lily.demo_tokenizer import FULL_SPECIAL_TOKENS, SPECIAL_TOKENS, build_tokenizer, write_tokenizer_files
from lily.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]


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


def tokenizer_json_of_a_fresh_process(preset: str, tmp_path: Path) -> str:
    """The tokenizer as another interpreter (its own hash seed, one trainer thread) learns it."""
    env = {**os.environ, "PYTHONHASHSEED": str(random.randrange(1, 2**31)), "RAYON_NUM_THREADS": "1",
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    code = ("import sys; from lily.demo_tokenizer import write_tokenizer_files; "
            f"write_tokenizer_files(sys.argv[1], {preset!r})")
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=env, check=True, cwd=ROOT)
    return (tmp_path / "tokenizer.json").read_text()


def test_deterministic(tmp_path):
    assert tokenizer_json_of_a_fresh_process("tiny", tmp_path) == build_tokenizer().to_str()


def test_learned_by_the_trainer():
    """The merges are the trainer's: the BPE model holds 499 ids and every merge joins two earlier tokens."""
    model = json.loads(build_tokenizer().to_str())["model"]
    vocab, merges = model["vocab"], model["merges"]
    assert len(vocab) == 499 and len(merges) == 499 - 256
    for m in merges:
        a, b = m if isinstance(m, list) else m.split(" ")
        assert max(vocab[a], vocab[b]) < vocab[a + b]


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


# -- the full-size tokenizer (`lily make-synthetic --preset full`) ------------------------------------

@pytest.fixture(scope="module")
def full_dir(tmp_path_factory):
    return write_tokenizer_files(tmp_path_factory.mktemp("full-tok"), "full")


def test_full_vocabulary_is_the_real_size_with_the_real_special_ids(full_dir):
    from transformers import AutoTokenizer

    tok = Tokenizer.from_dir(full_dir)
    assert tok.vocab_size == FULL.vocab_size == 248320
    hf = AutoTokenizer.from_pretrained(str(full_dir))
    assert len(hf) == 248320
    real = {"<|endoftext|>": 248044, "<|im_start|>": 248045, "<|im_end|>": 248046, "<tool_call>": 248058,
            "</tool_call>": 248059, "<think>": 248068, "</think>": 248069}  # docs/model.md section 5
    for text, i in real.items():
        assert tok.token_id(text) == i == hf.convert_tokens_to_ids(text) == FULL_SPECIAL_TOKENS[text]
    assert set(FULL.eos_token_ids) == {248046, 248044} and hf.eos_token_id == 248046
    # the BPE part is the first 248,044 ids, and ordinary text never reaches an added token
    model = json.loads((full_dir / "tokenizer.json").read_text())["model"]
    assert len(model["vocab"]) == 248044 == max(model["vocab"].values()) + 1
    rng = random.Random()
    text = " ".join(rng.choice(["robot", "harbour", "Paris", "42", "naïve", "日本語", "😀", "\n"]) for _ in range(40))
    ids = tok.encode(text)
    assert ids and max(ids) < 248044 and tok.decode(ids) == text == hf.decode(ids)
    # every id the model can sample decodes without error; the padding placeholders are hidden
    assert tok.decode([248319, 248100]) == ""


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}, {"add_generation_prompt": False}])
def test_full_template_renders_as_the_tiny_one(full_dir, tmp_path, kwargs):
    tiny = Tokenizer.from_dir(write_tokenizer_files(tmp_path / "tiny"))
    full = Tokenizer.from_dir(full_dir)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    msgs = [{"role": "system", "content": "You help."}, {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "reasoning_content": "one call",
             "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "content": "sunny"}]
    text = full.render_chat(msgs, tools=tools, **kwargs)
    assert text == tiny.render_chat(msgs, tools=tools, **kwargs)
    # the markup tokens become the real ids
    ids = full.encode(text)
    assert ids[0] == 248045 and ids.count(248046) == text.count("<|im_end|>")
    assert 248058 in ids and 248059 in ids
    if kwargs.get("add_generation_prompt", True):
        tail = full.encode("<think>\n\n</think>\n\n" if kwargs.get("enable_thinking") is False else "<think>\n")
        assert ids[-len(tail):] == tail and tail[0] == 248068 and (248069 in tail) == bool(kwargs)


def test_full_tokenizer_deterministic(full_dir, tmp_path):
    assert tokenizer_json_of_a_fresh_process("full", tmp_path) == (full_dir / "tokenizer.json").read_text()
