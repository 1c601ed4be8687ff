"""The checkpoint's generation_config.json (Hugging Face's format) as the sampling defaults of requests.

As vLLM's `--generation-config auto` (its default) does: the file's temperature, top_p, top_k, min_p and
repetition_penalty are what a request samples with when it leaves that field out (chat, completions,
responses); a field the request sets wins. Its max_new_tokens is the default max_tokens of chat and
responses requests (capped by what the context leaves), as vLLM's `get_max_tokens` makes it; completions
keep OpenAI's 16 (vLLM's request model fills in 16 before the default could apply). HF has no presence or
frequency penalty keys, so those keep lily's 0. `lily serve --generation-config none` ignores the file (lily's
built-in defaults: temperature 1, top_p 1, top_k and min_p off, no repetition penalty), as vLLM's
`--generation-config vllm` does; a checkpoint without the file gets the same.

`do_sample: false` is ignored, as vLLM ignores it: the OpenAI API has no such switch (a client asks for greedy
with temperature 0), and the same checkpoint then gives the same defaults under both servers. The log says
so when a file sets it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from lily.cli import UserError
from lily.server.protocol import sampling_field

FILE = "generation_config.json"
MODES = ("auto", "none")
# the file's key -> the request field it is the default of (vLLM's list: repetition_penalty, temperature,
# top_k, top_p, min_p, max_new_tokens)
KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
        "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


class GenerationConfigError(UserError):
    """generation_config.json cannot be used: one line naming the file and the key."""


@dataclass(frozen=True)
class SamplingDefaults:
    """What a request samples with where it sets nothing (lily's built-in values unless the file says)."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                  # 0: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = None   # chat and responses; None: what the context leaves
    source: str = field(default="lily's built-in defaults", compare=False)  # where they came from, for the log

    def params(self) -> dict:
        """The values alone (the /v1/models entry shows them); max_tokens only when the file sets it."""
        out = {k: v for k, v in asdict(self).items() if k != "source"}
        if out["max_tokens"] is None:
            del out["max_tokens"]
        return out

    def describe(self) -> str:
        shown = ", ".join(f"{k} {'off' if k in ('top_k', 'min_p') and not v else v}" for k, v in self.params().items())
        return f"{shown} ({self.source})"


def read_generation_config(model_dir, mode: str = "auto") -> tuple[SamplingDefaults, list[str]]:
    """(the defaults `mode` gives for this checkpoint, notes worth a log line).

    A file lily cannot use is an error at start-up naming the file and the key, not a warning and the key
    ignored: the model's authors put these values there for its answers' quality, and a server that quietly
    samples otherwise would answer worse with nothing but a log line scrolled past to say why. The fix is
    one edit away (or --generation-config none), and it is made before minutes of loading weights. The
    bounds are a request's own (lily.server.protocol), so a default is always a value a client could send."""
    if mode not in MODES:
        raise ValueError(f"generation config mode {mode!r}; expected one of {MODES}")
    path = Path(model_dir) / FILE
    if mode == "none":
        return SamplingDefaults(source="lily's built-in defaults, --generation-config none"), []
    if not path.is_file():
        return SamplingDefaults(source=f"lily's built-in defaults: the checkpoint has no {FILE}"), []
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise GenerationConfigError(f"{path}: not valid JSON ({e}); fix it, or start with "
                                    "--generation-config none to ignore it") from None
    if not isinstance(data, dict):
        raise GenerationConfigError(f"{path}: holds a JSON {type(data).__name__}, not an object; fix it, or "
                                    "start with --generation-config none to ignore it")
    values = {}
    for key, name in KEYS.items():
        value = data.get(key)
        if value is None:  # absent, or null: not set (transformers' own "unset")
            continue
        try:
            values[name] = sampling_field(name, value)
        except ValueError as e:
            raise GenerationConfigError(f"{path}: {key} {json.dumps(value)} cannot be a request's default ({e}); "
                                        "fix it, or start with --generation-config none to ignore the file") from None
    if values.get("top_k") == -1:
        values["top_k"] = 0
    notes = []
    if data.get("do_sample") is False and values:
        notes.append(f"{path} sets do_sample false, ignored as vLLM ignores it: its sampling values are still the "
                     "defaults (a request asks for greedy with temperature 0)")
    return SamplingDefaults(**values, source=str(path)), notes
