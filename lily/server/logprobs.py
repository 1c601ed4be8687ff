"""Log-probabilities in the API's two shapes: chat's list of entries, and the legacy completions
object (parallel lists: tokens, token_logprobs, top_logprobs, text_offset)."""

from __future__ import annotations

from lily.engine.generation import GenerationRequest, Started
from lily.tokenizer import Tokenizer

LOGPROB_FLOOR = -9999.0  # JSON has no -Infinity


def lp(x: float) -> float:
    return max(float(x), LOGPROB_FLOOR)


def token_label(tokenizer: Tokenizer, token: int, as_ids: bool = False) -> str:
    """A token as the logprobs show it: its text, or, for a piece of a UTF-8 character, "bytes:" and
    its bytes as \\xNN (as OpenAI writes them), so two such pieces never share one key; as_ids (vLLM's
    return_tokens_as_token_ids): "token_id:" and its id."""
    if as_ids:
        return f"token_id:{token}"
    raw = bytes(tokenizer.token_bytes(token))
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
    return tokenizer.token_text(token)


def chat_logprobs(tokenizer: Tokenizer, tokens, as_ids: bool = False) -> list[dict]:
    out = []
    for t in tokens:
        if t.logprob is None:
            continue
        out.append({"token": token_label(tokenizer, t.token, as_ids), "logprob": lp(t.logprob),
                    "bytes": tokenizer.token_bytes(t.token),
                    "top_logprobs": [{"token": token_label(tokenizer, i, as_ids), "logprob": lp(v),
                                      "bytes": tokenizer.token_bytes(i)}
                                     for i, v in (t.top or [])]})
    return out


class TextOffsets:
    """Each token's text_offset: where its text starts in the choice's text, counted as the output text is made
    (lily.tokenizer.IncrementalDetokenizer), so the pieces of one UTF-8 character, which add no text until the
    last, all sit at that character's start; `start`: the text before the first token (the echoed prompt)."""

    def __init__(self, tokenizer: Tokenizer, start: int = 0):
        self.pos = start
        self._detok = tokenizer.detokenizer()

    def at(self, token: int) -> int:
        at = self.pos
        self.pos += len(self._detok.add(token))
        return at


def completion_logprobs(tokenizer: Tokenizer, tokens, offsets: TextOffsets, as_ids: bool = False) -> dict:
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for t in tokens:
        out["tokens"].append(token_label(tokenizer, t.token, as_ids))
        out["token_logprobs"].append(lp(t.logprob))
        top: dict[str, float] = {}
        for i, v in t.top or []:  # best first; tokens with the same label keep the best
            top.setdefault(token_label(tokenizer, i, as_ids), lp(v))
        # the chosen token always, as OpenAI's legacy API and vLLM (up to logprobs + 1 entries)
        top.setdefault(out["tokens"][-1], out["token_logprobs"][-1])
        out["top_logprobs"].append(top)
        out["text_offset"].append(offsets.at(t.token))
    return out


def echo_logprobs(tokenizer: Tokenizer, started: Started | None, gen: GenerationRequest,
                  as_ids: bool = False) -> dict | None:
    """The echoed prompt's entries: its first token has no log-probability (nothing comes before it)."""
    if started is None or started.prompt_logprobs is None:
        return None
    first = gen.prompt_ids[0]
    offsets = TextOffsets(tokenizer)
    offsets.at(first)
    rest = completion_logprobs(tokenizer, started.prompt_logprobs, offsets, as_ids)
    return {"tokens": [token_label(tokenizer, first, as_ids)] + rest["tokens"], "token_logprobs": [None] + rest["token_logprobs"],
            "top_logprobs": [None] + rest["top_logprobs"], "text_offset": [0] + rest["text_offset"]}


def joined(*parts: dict | None) -> dict:
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for part in parts:
        for key, values in (part or {}).items():
            out[key] += values
    return out
