"""The checkpoint's tokenizer and chat template, and a streaming detokenizer.

Text <-> ids goes through `tokenizers` (tokenizer.json). The chat template ships with the checkpoint
(chat_template.jinja, tokenizer_config.json's "chat_template", or a processor's chat_template.json) and is
rendered, never re-typed, in
jinja2's immutable sandbox with the helpers Hugging Face templates expect (tojson, raise_exception,
strftime_now, loop controls).
"""

from __future__ import annotations

import datetime
import functools
import json
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

# Added tokens the model writes as part of its answer: kept in decoded text so the reasoning and
# tool-call parsers can see them. Every other special token (<|im_end|>, <|im_start|>, ...) is dropped.
VISIBLE_SPECIAL_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>",
                          "<tool_response>", "</tool_response>")
# where a checkpoint's chat template is looked for, in this order (Hugging Face's places: transformers 5's
# tokenizer takes chat_template.jinja over tokenizer_config.json's entry; chat_template.json is the processor's
# older file, {"chat_template": "..."}, which the tokenizer does not read: here the last resort)
TEMPLATE_FILE, TOKENIZER_CONFIG, PROCESSOR_TEMPLATE = "chat_template.jinja", "tokenizer_config.json", "chat_template.json"
NO_TEMPLATE = (f"the checkpoint has no chat template (neither {TEMPLATE_FILE}, a \"chat_template\" entry in "
               f"{TOKENIZER_CONFIG}, nor {PROCESSOR_TEMPLATE})")


class TokenizerError(ValueError):
    """A tokenizer directory lily cannot use, or a template that fails to render: one clear line."""


class TemplateError(ValueError):
    """The chat template rejected the request (raise_exception or a render error): a client error."""


def _raise_exception(message):
    raise TemplateError(str(message))


def _tojson(value, indent=None, separators=None, sort_keys=False, ensure_ascii=False):
    # a plain str, as transformers' filter: a Markup would HTML-escape a string it is joined to with `+`
    return json.dumps(value, indent=indent, separators=separators, sort_keys=sort_keys, ensure_ascii=ensure_ascii)


class _GenerationTag(jinja2.ext.Extension):
    """{% generation %}...{% endgeneration %} (transformers' marking of the assistant's text for training
    masks): rendered as its body, as transformers renders it for a prompt."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _strftime_now(fmt):
    return datetime.datetime.now().strftime(fmt)


def _compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _GenerationTag])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TokenizerError(f"{path}: cannot be read ({getattr(e, 'strerror', None) or e})") from None


LONG_TEXT = 1 << 16  # characters: above, encode lets other threads run while it works


def _config_template(value, source: Path) -> str | None:
    """tokenizer_config.json's "chat_template": a string, or Hugging Face's list of named templates
    ([{"name": "default", "template": ...}, ...]) of which transformers renders "default" (without tools)."""
    if value is None or isinstance(value, str):
        return value
    named = None
    if isinstance(value, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                       and isinstance(t.get("template"), str) for t in value):
        named = {t["name"]: t["template"] for t in value}
    elif isinstance(value, dict) and all(isinstance(t, str) for t in value.values()):
        named = value
    if named is None:
        raise TokenizerError(f"{source}: \"chat_template\" is neither a string nor a list of named templates "
                             "([{\"name\": \"default\", \"template\": \"...\"}, ...])")
    if "default" not in named:
        raise TokenizerError(f"{source}: \"chat_template\" names templates {sorted(named)} but none \"default\", "
                             "the one a chat request renders")
    return named["default"]


def _processor_template(path: Path) -> str | None:
    """chat_template.json (a processor's file, {"chat_template": "..."})."""
    try:
        value = json.loads(_read_text(path))
    except json.JSONDecodeError as e:
        raise TokenizerError(f"{path}: invalid JSON ({e})") from None
    if not isinstance(value, dict) or not isinstance(value.get("chat_template"), str):
        raise TokenizerError(f"{path}: expected a JSON object with a \"chat_template\" string")
    return value["chat_template"]


class Tokenizer:
    def __init__(self, tokenizer: HFTokenizer, chat_template: str | None, eos_token_ids: list[int]):
        self.directory: Path | None = None  # where from_dir read it (named when the template is missing)
        self._tok = tokenizer
        self.chat_template_source = chat_template
        self._template = _compile_template(chat_template) if chat_template else None
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        added = tokenizer.get_added_tokens_decoder()
        # ids never shown to the user (control tokens such as <|im_end|>)
        self.hidden_ids = frozenset(i for i, t in added.items()
                                    if t.special and t.content not in VISIBLE_SPECIAL_TOKENS)
        self.eos_token_ids = list(eos_token_ids)
        self._added_ids = frozenset(added)
        self._byte_level = (json.loads(tokenizer.to_str()).get("decoder") or {}).get("type") == "ByteLevel"

    @classmethod
    def from_dir(cls, path: str | Path, eos_token_ids: list[int] | None = None) -> "Tokenizer":
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise TokenizerError(f"{path}: tokenizer.json is missing")
        try:
            tok = HFTokenizer.from_file(str(tok_file))
        except Exception as e:  # the tokenizers library raises a bare Exception
            from lily.checkpoint.safetensors_dir import LFS_POINTER, is_lfs_pointer

            if is_lfs_pointer(tok_file):
                raise TokenizerError(f"{tok_file}: {LFS_POINTER}") from None
            raise TokenizerError(f"{tok_file}: cannot be read ({e})") from None
        template = None
        cfg: dict = {}
        cfg_file = path / TOKENIZER_CONFIG
        if cfg_file.is_file():
            try:
                cfg = json.loads(_read_text(cfg_file))
            except json.JSONDecodeError as e:
                raise TokenizerError(f"{cfg_file}: invalid JSON ({e})") from None
            if not isinstance(cfg, dict):
                raise TokenizerError(f"{cfg_file}: expected a JSON object")
        jinja_file = path / TEMPLATE_FILE
        if jinja_file.is_file():
            template = _read_text(jinja_file)
        else:
            template = _config_template(cfg.get("chat_template"), cfg_file)
            if template is None and (path / PROCESSOR_TEMPLATE).is_file():
                template = _processor_template(path / PROCESSOR_TEMPLATE)
        if eos_token_ids is None:
            eos_token_ids = []
            for name in ("<|im_end|>", "<|endoftext|>", cfg.get("eos_token")):
                if isinstance(name, str) and tok.token_to_id(name) is not None:
                    eos_token_ids.append(tok.token_to_id(name))
        try:
            obj = cls(tok, template, sorted(set(eos_token_ids), key=eos_token_ids.index))
        except jinja2.TemplateError as e:
            raise TokenizerError(f"{path}: the chat template does not compile ({e})") from None
        obj.directory = path
        return obj

    # -- ids <-> text --------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Text to ids; special-token strings in the text (from the template) become their ids. A long text goes
        through encode_batch, the same ids, which lets go of the GIL while it works (encode holds it: a 4 MB
        prompt tokenized in a server's worker thread still froze its event loop for seconds)."""
        if len(text) > LONG_TEXT:
            return self._tok.encode_batch([text], add_special_tokens=False)[0].ids
        return self._tok.encode(text, add_special_tokens=False).ids

    def fewest_tokens(self, text: str) -> int:
        """A lower bound on len(encode(text)) that costs no tokenization: a byte-level tokenizer's tokens each
        cover at most the longest token's bytes of the (normalized) text; 0 for another kind (an unknown token
        may cover any length)."""
        longest = self._longest_token_bytes
        if not longest:
            return 0
        normalizer = self._tok.normalizer  # (NFC may shorten the text: count what the tokens cover)
        if normalizer is not None:
            text = normalizer.normalize_str(text)
        return -(-len(text.encode("utf-8", "surrogatepass")) // longest)

    @functools.cached_property
    def _longest_token_bytes(self) -> int:
        """The most bytes of text one token stands for (0: not a byte-level tokenizer)."""
        if not self._byte_level:
            return 0
        added = {t.content for t in self._tok.get_added_tokens_decoder().values()}
        return max(len(piece.encode("utf-8")) if piece in added else len(piece)  # (a byte-level piece: 1 char a byte)
                   for piece in self._tok.get_vocab(with_added_tokens=True))

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode([i for i in ids if i not in self.hidden_ids], skip_special_tokens=False)

    def tokenizer_json(self) -> str:
        """tokenizer.json's text (what a grammar engine builds its token trie from)."""
        return self._tok.to_str()

    def token_id(self, token: str) -> int:
        """The id of a (special) token by its string; KeyError if the vocabulary has no such token."""
        i = self._tok.token_to_id(token)
        if i is None:
            raise KeyError(f"the tokenizer has no token {token!r}")
        return i

    def has_token(self, token: str) -> bool:
        return self._tok.token_to_id(token) is not None

    def token_text(self, token_id: int) -> str:
        """The text of one token, as the logprobs API shows it."""
        return self._tok.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> list[int]:
        """The raw bytes of one token (a byte-level token may hold part of a UTF-8 character)."""
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return []
        if self._byte_level and token_id not in self._added_ids:
            inverse = _unicode_to_byte()
            if all(ch in inverse for ch in piece):
                return [inverse[ch] for ch in piece]
        return list(piece.encode("utf-8"))

    # -- chat ----------------------------------------------------------------------------------
    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def missing_template_warning(self) -> str | None:
        """What `lily check` and `lily serve` warn at start when chat requests cannot work, naming the files
        looked for (a download filtered to *.json and *.safetensors leaves chat_template.jinja behind); None
        when there is a template."""
        if self.has_chat_template:
            return None
        where = self.directory if self.directory is not None else Path(".")
        return (f"{where}: no chat template (neither {where / TEMPLATE_FILE}, a \"chat_template\" entry in "
                f"{where / TOKENIZER_CONFIG}, nor {where / PROCESSOR_TEMPLATE}): chat and responses requests will be "
                "refused (400); /v1/completions works; add the checkpoint's chat_template.jinja")

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None,
                    add_generation_prompt: bool = True, **kwargs) -> str:
        if self._template is None:
            # the file names, not the server's paths: the client learns what the operator must add
            raise TemplateError(f"{NO_TEMPLATE}, so chat requests cannot be served; use /v1/completions, or ask "
                                f"the server's operator to add {TEMPLATE_FILE} to the checkpoint")
        try:
            return self._template.render(messages=messages, tools=tools or None,
                                         add_generation_prompt=add_generation_prompt, **kwargs)
        except TemplateError:
            raise
        except jinja2.TemplateError as e:
            raise TemplateError(f"the chat template failed to render the request: {e}") from None
        except (TypeError, ValueError, LookupError, AttributeError, ArithmeticError, RecursionError) as e:
            raise TemplateError(f"the chat template failed to render the request: {e}") from None

    def template_thinks_by_default(self, enable_thinking: bool | None = None) -> bool:
        """Whether the template's generation prompt opens a <think> block when enable_thinking is unset, or
        set to `enable_thinking` (a server's default: a template that cannot think ignores it)."""
        if self._template is None:
            return False
        kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
        try:
            prompt = self.render_chat([{"role": "user", "content": "x"}], **kwargs)
        except TemplateError:
            return False
        return opens_thinking(prompt)

    def detokenizer(self) -> "IncrementalDetokenizer":
        return IncrementalDetokenizer(self)


def load_model_tokenizer(model_dir: str | Path, config) -> Tokenizer:
    """The tokenizer `lily serve` runs a checkpoint with, checked against the model (`config`, a
    ModelConfig) before any weight is read: tokenizer.json parses, its ids fit the model's vocabulary,
    an end-of-sequence token exists, and the chat template (when there is one) renders a conversation.
    TokenizerError, one line naming the file, otherwise. `lily check` runs the same checks."""
    path = Path(model_dir)
    if not (path / "tokenizer.json").is_file():
        raise TokenizerError(f"{path}: tokenizer.json is missing (lily serve needs the checkpoint's tokenizer "
                             "files; lily generate --prompt-ids runs without them)")
    tok = Tokenizer.from_dir(path)
    if tok.vocab_size > config.vocab_size:  # its ids would index past the embedding
        raise TokenizerError(f"{path / 'tokenizer.json'}: the tokenizer has {tok.vocab_size} tokens but the model's "
                             f"vocabulary (config.json vocab_size) is {config.vocab_size}; it is not this model's "
                             "tokenizer")
    # the config's eos ids first, then those the tokenizer names (<|im_end|>, <|endoftext|>)
    tok.eos_token_ids = list(dict.fromkeys(
        [i for i in config.eos_token_ids if i < tok.vocab_size] + tok.eos_token_ids))
    if not tok.eos_token_ids:
        raise TokenizerError(f"{path}: the tokenizer has no end-of-sequence token")
    if tok.has_chat_template:
        try:
            tok.render_chat([{"role": "system", "content": "You are helpful."},
                             {"role": "user", "content": "Hello"}])
        except TemplateError as e:
            raise TokenizerError(f"{path}: the chat template fails on a two-message chat ({e})") from None
    return tok


@functools.lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    """Inverse of the byte-level BPE alphabet: printable bytes stand for themselves, the other bytes
    for code points from 256 up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in printable:
            out[chr(b)] = b
        else:
            out[chr(256 + extra)] = b
            extra += 1
    return out


def opens_thinking(prompt: str) -> bool:
    """True when the prompt leaves a <think> block open, so the model's first words are reasoning."""
    start, end = prompt.rfind("<think>"), prompt.rfind("</think>")
    return start >= 0 and start > end


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas without ever splitting a UTF-8 character.

    Byte-level BPE tokens can end in the middle of a multi-byte character; decoding such a prefix
    yields U+FFFD. We decode a short window of recent tokens and hold the tail back until it decodes
    cleanly (or more than a few tokens have passed, so a genuinely invalid byte sequence still flows).
    """

    MAX_HOLD = 8  # tokens; a character is at most 4 bytes, so 8 tokens is always enough

    def __init__(self, tokenizer: Tokenizer):
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # window start: tokens before it are fully emitted
        self._read = 0    # tokens up to here have been emitted as text

    def add(self, token_id: int) -> str:
        self._ids.append(token_id)
        prefix_text = self._tok.decode(self._ids[self._prefix:self._read])
        full_text = self._tok.decode(self._ids[self._prefix:])
        held = len(self._ids) - self._read
        if full_text.endswith("\ufffd") and held < self.MAX_HOLD:
            return ""
        if not full_text.startswith(prefix_text):
            # A merge changed earlier text (normalisers); emit nothing lost: fall back to the tail.
            delta = full_text[len(prefix_text):] if len(full_text) > len(prefix_text) else ""
        else:
            delta = full_text[len(prefix_text):]
        self._prefix, self._read = self._read, len(self._ids)
        return delta

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end)."""
        if self._read == len(self._ids):
            return ""
        prefix_text = self._tok.decode(self._ids[self._prefix:self._read])
        full_text = self._tok.decode(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        return full_text[len(prefix_text):]
