"""The tokenizers and chat template of the synthetic checkpoints (`lily make-synthetic`, `lily serve --demo`),
so tests, the demo and full-size benchmarks run the real text path without downloads.

Both are byte-level BPE as Qwen's, learned by the `tokenizers` library's BPE trainer (deterministic) from
text built in here, then the special tokens as added tokens at fixed ids:
- tiny (the TINY config, vocab 512): 256 bytes + 243 merges (ids 0..498), the special tokens at 499..507,
  508..511 unused like the padding rows of the real vocabulary.
- full (the real 248,320 vocabulary): 248,044 BPE tokens (ids 0..248043), Qwen's special tokens at their
  real ids 248044..248069 (docs/model.md section 5), and reserved placeholders filling 248070..248319, so
  every id the model can sample is a token.
The chat template follows the Qwen3.6 ChatML behaviour (docs/model.md section 5) and is our own text;
both presets ship the same one.
"""

from __future__ import annotations

import json
import random
from functools import lru_cache
from pathlib import Path

TINY_BPE_SIZE = 499      # ids 0..498: bytes + merges
FULL_BPE_SIZE = 248044   # Qwen's: <|endoftext|> is the first id after the BPE vocabulary
FULL_VOCAB_SIZE = 248320

SPECIAL_TOKENS = {  # tiny
    "<|endoftext|>": 499,
    "<|im_end|>": 500,
    "<|im_start|>": 501,
    "<tool_call>": 502,
    "</tool_call>": 503,
    "<think>": 504,
    "</think>": 505,
    "<tool_response>": 506,
    "</tool_response>": 507,
}
# full: Qwen's added tokens in id order from 248044 (the ids docs/model.md gives: <|im_start|> 248045,
# <|im_end|> 248046, <tool_call> 248058, </tool_call> 248059, <think> 248068, </think> 248069)
_QWEN_ADDED = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
               "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
               "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>",
               "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
               "<tool_response>", "</tool_response>", "<think>", "</think>")
FULL_SPECIAL_TOKENS = {text: FULL_BPE_SIZE + i for i, text in enumerate(_QWEN_ADDED)}

# Tokens the model writes as part of its answer stay visible in decoded text (as in Qwen's tokenizer);
# the others are control tokens, dropped by skip_special_tokens.
_MARKUP = ("<tool_call>", "</tool_call>", "<think>", "</think>", "<tool_response>", "</tool_response>")

# The text the merges are learned from (ours): everyday English plus the chat/tool vocabulary the
# template produces, so prompts tokenize into natural-looking ids.
CORPUS = """
The quick brown fox jumps over the lazy dog. A small model can still learn the shape of a language.
You are a helpful assistant. The user asks a question and the assistant answers it clearly and briefly.
What is the weather like today in the city? It is sunny and warm, with a light wind from the west.
Please write a short story about a robot who learns to paint. Once upon a time there was a robot
named Lily who lived in a quiet town by the sea. Every morning she walked to the harbour and watched
the boats come in. One day she found a box of paints on the beach, and she began to paint the water,
the sky and the people she met. The people of the town were surprised, and then they were happy.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 2024 3.14 42. Time: 12:30. Date: Monday, the first of June.
Let me think about this step by step. First, we need to find the answer. Then we check it again.
The function returns a list of results. Call the tool with the right parameters and read the result.
def main(): print("hello, world") return 0 if x > 1 else -1 # comment
{"name": "get_weather", "arguments": {"location": "Paris", "unit": "celsius"}}
function parameter value name description type string object properties required location unit
In the beginning the work was hard, but the team kept going. They wrote tests, fixed bugs and shipped
the server. The engine reads the model from the disk, loads the weights and generates the next token.
Thank you! You're welcome. How can I help you today? I don't know, but I can try to find out.
"""


def _filler_words(n: int, seed: int = 0) -> list[str]:
    """n pseudo-random lowercase words (Python's seeded generator: the same on every run and machine):
    enough distinct letter pairs for the full vocabulary's 247,788 merges."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    return ["".join(rng.choice(letters) for _ in range(rng.randint(5, 12))) for _ in range(n)]


def _training_text(preset: str) -> list[str]:
    lines = [line for line in CORPUS.splitlines() if line.strip()]
    if preset == "tiny":
        return lines
    # the English first and weighted, so its merges come early; the filler words make up the count
    words = _filler_words(90_000)
    return lines * 50 + [" ".join(words[i:i + 16]) for i in range(0, len(words), 16)]


@lru_cache(maxsize=2)
def _build_json(preset: str) -> str:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if preset not in ("tiny", "full"):
        raise ValueError(f"unknown preset {preset!r}; expected tiny or full")
    bpe_size, specials = (TINY_BPE_SIZE, SPECIAL_TOKENS) if preset == "tiny" else (FULL_BPE_SIZE, FULL_SPECIAL_TOKENS)
    tok = Tokenizer(models.BPE(fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=bpe_size, show_progress=False, min_frequency=0,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_training_text(preset), trainer)
    if tok.get_vocab_size() != bpe_size:
        raise RuntimeError(f"the built-in text gives {tok.get_vocab_size()} BPE tokens, not {bpe_size}")
    added = [AddedToken(text, special=text not in _MARKUP, normalized=False)
             for text, _ in sorted(specials.items(), key=lambda kv: kv[1])]
    if preset == "full":  # every remaining id of the model's vocabulary is a (hidden) token too
        first = bpe_size + len(added)
        added += [AddedToken(f"<|reserved_{i}|>", special=True, normalized=False)
                  for i in range(FULL_VOCAB_SIZE - first)]
    tok.add_tokens(added)
    for text, i in specials.items():
        if tok.token_to_id(text) != i:
            raise RuntimeError(f"{text} landed at id {tok.token_to_id(text)}, not {i}")
    return tok.to_str()


def build_tokenizer(preset: str = "tiny"):
    """The `tokenizers.Tokenizer` of a preset (module docstring). The full one takes about half a minute
    to learn; both are cached for the process."""
    from tokenizers import Tokenizer

    return Tokenizer.from_str(_build_json(preset))


# Jinja, written for Hugging Face's template environment (trim_blocks, lstrip_blocks, tojson,
# raise_exception). Behaviour: ChatML turns; the system prompt gains a "# Tools" section when tools are
# given; assistant tool calls are rendered in the XML-ish <function=...> form the model emits; tool
# results are grouped into one user turn of <tool_response> blocks; an assistant turn after the last
# real user message keeps its reasoning in <think>...</think>, earlier turns drop it.
CHAT_TEMPLATE = r"""{#- lily demo chat template: ChatML with Qwen3.6-style tools and thinking. All text is emitted
    through expressions, so the output does not depend on trim_blocks / lstrip_blocks. -#}
{%- macro text_of(content) -%}
    {%- if content is none -%}
    {%- elif content is string -%}{{- content -}}
    {%- elif content is iterable and content is not mapping -%}
        {%- for part in content -%}
            {%- if part is string -%}{{- part -}}
            {%- elif part is mapping and part.type == 'text' -%}{{- part.text -}}
            {%- else -%}{{- raise_exception('only text content parts are supported') -}}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}{{- raise_exception('message content must be a string or a list of text parts') -}}
    {%- endif -%}
{%- endmacro -%}
{%- if not messages -%}{{- raise_exception('no messages') -}}{%- endif -%}
{%- set has_system = messages[0].role == 'system' -%}
{%- if tools -%}
    {{- '<|im_start|>system\n' -}}
    {%- if has_system -%}{{- text_of(messages[0].content) + '\n\n' -}}{%- endif -%}
    {{- '# Tools\n\nYou can call the functions described below, inside <tools></tools>, to help answer.\n\n<tools>' -}}
    {%- for tool in tools -%}
        {{- '\n' + (tool | tojson) -}}
    {%- endfor -%}
    {{- '\n</tools>\n\nTo call a function, answer with exactly this form (one block per call, any number of '
        'parameters):\n\n<tool_call>\n<function=the_function_name>\n<parameter=parameter_name>\nthe value\n'
        '</parameter>\n</function>\n</tool_call>\n\nRules: use only the functions listed; give every required '
        'parameter; put nothing after the last </tool_call>; if no function fits, answer normally.<|im_end|>\n' -}}
{%- elif has_system -%}
    {{- '<|im_start|>system\n' + text_of(messages[0].content) + '<|im_end|>\n' -}}
{%- endif -%}
{#- the last real user query: assistant turns after it keep their reasoning -#}
{%- set ns = namespace(last_query=-1) -%}
{%- for m in messages -%}
    {%- if m.role == 'user' -%}
        {%- set t = text_of(m.content) -%}
        {%- if not (t.startswith('<tool_response>') and t.endswith('</tool_response>')) -%}
            {%- set ns.last_query = loop.index0 -%}
        {%- endif -%}
    {%- endif -%}
{%- endfor -%}
{%- for m in messages -%}
    {%- if m.role == 'system' -%}
        {%- if not loop.first -%}
            {{- '<|im_start|>system\n' + text_of(m.content) + '<|im_end|>\n' -}}
        {%- endif -%}
    {%- elif m.role == 'user' -%}
        {{- '<|im_start|>user\n' + text_of(m.content) + '<|im_end|>\n' -}}
    {%- elif m.role == 'assistant' -%}
        {%- set content = text_of(m.content) -%}
        {%- set reasoning = '' -%}
        {%- if m.reasoning_content is defined and m.reasoning_content is string -%}
            {%- set reasoning = m.reasoning_content -%}
        {%- elif '</think>' in content -%}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1] -%}
            {%- set content = content.split('</think>')[-1] -%}
        {%- endif -%}
        {%- set reasoning = reasoning.strip('\n') -%}
        {%- set content = content.lstrip('\n') -%}
        {{- '<|im_start|>assistant\n' -}}
        {%- if loop.index0 > ns.last_query and reasoning -%}
            {{- '<think>\n' + reasoning + '\n</think>\n\n' -}}
        {%- endif -%}
        {{- content -}}
        {%- if m.tool_calls is defined and m.tool_calls -%}
            {%- for call in m.tool_calls -%}
                {%- set f = call.function if call.function is defined else call -%}
                {%- if not loop.first -%}{{- '\n' -}}{%- elif content -%}{{- '\n\n' -}}{%- endif -%}
                {{- '<tool_call>\n<function=' + f.name + '>\n' -}}
                {%- if f.arguments is mapping -%}
                    {%- for name, value in f.arguments.items() -%}
                        {{- '<parameter=' + name + '>\n' -}}
                        {{- value if value is string else (value | tojson) -}}
                        {{- '\n</parameter>\n' -}}
                    {%- endfor -%}
                {%- elif f.arguments is string and f.arguments -%}
                    {{- raise_exception('tool call arguments must be an object (parse the JSON string first)') -}}
                {%- endif -%}
                {{- '</function>\n</tool_call>' -}}
            {%- endfor -%}
        {%- endif -%}
        {{- '<|im_end|>\n' -}}
    {%- elif m.role == 'tool' -%}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
        {{- '\n<tool_response>\n' + text_of(m.content) + '\n</tool_response>' -}}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
    {%- else -%}
        {{- raise_exception('unknown message role ' ~ m.role) -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
    {%- if enable_thinking is defined and enable_thinking is false -%}
        {{- '<think>\n\n</think>\n\n' -}}
    {%- else -%}
        {{- '<think>\n' -}}
    {%- endif -%}
{%- endif -%}
"""


def write_tokenizer_files(out_dir, preset: str = "tiny") -> Path:
    """tokenizer.json, tokenizer_config.json and chat_template.jinja into out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(_build_json(preset))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 262144,
        "clean_up_tokenization_spaces": False,
        "add_prefix_space": False,
        "errors": "replace",
        "split_special_tokens": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return out
