"""The tiny demo tokenizer and chat template, for the TINY config (vocab 512) and the `tiny` synthetic
checkpoint, so tests and `lily serve --demo` exercise the real text path without downloads.

Byte-level BPE (as Qwen's): ids 0..255 are the 256 bytes (in the GPT-2 byte-to-unicode alphabet),
256..498 merges learned deterministically from the built-in English text below, then the special
tokens at fixed ids (499..507); 508..511 stay unused, like the padding rows of the real vocabulary.
The chat template follows the Qwen3.6 ChatML behaviour (shared/MODEL.md section 5) and is our own text.
"""

from __future__ import annotations

import json
from collections import Counter
from functools import lru_cache
from pathlib import Path

N_MERGED = 499  # ids 0..498: bytes + merges
SPECIAL_TOKENS = {
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
# Control tokens; the markup ones (think / tool_call / tool_response) are not "special" so decoding
# with skip_special_tokens keeps them, as in Qwen's tokenizer.
_CONTROL = ("<|endoftext|>", "<|im_end|>", "<|im_start|>")

# Merges are learned from this text (ours): everyday English plus the chat/tool vocabulary the
# template produces, so prompts tokenize into a few hundred natural-looking ids.
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


@lru_cache(maxsize=1)
def byte_alphabet() -> tuple[str, ...]:
    """The GPT-2 byte-level alphabet: printable bytes map to themselves, the rest to code points 256+."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return tuple(out[b] for b in range(256))


def _pretokenize(text: str) -> list[str]:
    from tokenizers import pre_tokenizers

    pre = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return [piece for piece, _ in pre.pre_tokenize_str(text)]


@lru_cache(maxsize=1)
def learn_merges() -> tuple[tuple[str, str], ...]:
    """Plain BPE on CORPUS: repeatedly merge the most frequent adjacent pair (ties: smallest pair),
    never across pre-token boundaries. Deterministic."""
    words = Counter(_pretokenize(CORPUS))
    seqs = {w: list(w) for w in words}
    merges: list[tuple[str, str]] = []
    while 256 + len(merges) < N_MERGED:
        pairs: Counter = Counter()
        for w, n in words.items():
            s = seqs[w]
            for a, b in zip(s, s[1:]):
                pairs[(a, b)] += n
        if not pairs:
            break
        best = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))[0]
        merges.append(best)
        joined = best[0] + best[1]
        for w in seqs:
            s, out, i = seqs[w], [], 0
            while i < len(s):
                if i + 1 < len(s) and s[i] == best[0] and s[i + 1] == best[1]:
                    out.append(joined)
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            seqs[w] = out
    if 256 + len(merges) != N_MERGED:
        raise RuntimeError("the built-in corpus is too small to learn the demo merges")
    return tuple(merges)


def build_tokenizer():
    """The demo `tokenizers.Tokenizer` (byte-level BPE + the special tokens at their fixed ids)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {ch: i for i, ch in enumerate(byte_alphabet())}
    merges = list(learn_merges())
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    for text, i in sorted(SPECIAL_TOKENS.items(), key=lambda kv: kv[1]):
        assert tok.get_vocab_size(with_added_tokens=True) == i
        tok.add_tokens([AddedToken(text, special=text in _CONTROL, normalized=False)])
    return tok


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


def write_tokenizer_files(out_dir) -> Path:
    """tokenizer.json, tokenizer_config.json and chat_template.jinja into out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save(str(out / "tokenizer.json"))
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
