"""POST /tokenize (text, or chat messages as the chat template renders them), POST /detokenize, and
GET /tokenizer_info (as vLLM serves it: what a client needs to count tokens through these two endpoints
instead of downloading the tokenizer). The model field is optional here: there is one tokenizer."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import JSONResponse

from lily.server.chat_prompt import prompt_ending
from lily.server.context import server
from lily.server.errors import APIError
from lily.server.protocol import DetokenizeRequest, TokenizeChat, TokenizeRequest
from lily.server.validation import check_model, encode_text, render_chat

router = APIRouter()


@router.post("/tokenize", summary="token ids of a text, or of chat messages as the chat template renders them")
async def tokenize(body: TokenizeRequest, request: Request):
    ctx = server(request)
    if body.model is not None:
        check_model(ctx, body.model)
    # off the event loop, as is the answer's JSON (FastAPI's encoder walks a list of a million ids in Python): a
    # 4 MB text takes seconds, while /health and the streams wait
    if isinstance(body, TokenizeChat):
        ids = (await run_in_threadpool(render_chat, ctx, body, "messages", *prompt_ending(body)))[1]
    else:
        ids = await run_in_threadpool(encode_text, ctx, body.prompt, "prompt")
    return await run_in_threadpool(JSONResponse, {"count": len(ids), "max_model_len": ctx.settings.max_seq,
                                                  "tokens": ids})


@router.post("/detokenize", summary="the text of token ids, special tokens included")
async def detokenize(body: DetokenizeRequest, request: Request):
    ctx = server(request)
    if body.model is not None:
        check_model(ctx, body.model)
    vocab = ctx.tokenizer.vocab_size
    bad = [i for i in body.tokens if i >= vocab]
    if bad:
        raise APIError(400, f"tokens: token id {bad[0]} is outside the vocabulary (size {vocab})", param="tokens")
    return {"prompt": decode_with_special_tokens(ctx.tokenizer, body.tokens)}


def decode_with_special_tokens(tokenizer, ids: list[int]) -> str:
    """The text of `ids` with every special token in it (<|im_start|>, <|im_end|>, ...), as vLLM's /detokenize
    answers (its tokenizer.decode keeps them), so /tokenize then /detokenize gives back a rendered chat prompt.
    Tokenizer.decode hides the control tokens (an answer's text must not show them): each of them is put back
    as its own text between the runs decoded around it."""
    hidden = tokenizer.hidden_ids
    pieces, run = [], []
    for i in ids:
        if i in hidden:
            pieces += [tokenizer.decode(run), tokenizer.token_text(i)]
            run = []
        else:
            run.append(i)
    return "".join(pieces) + tokenizer.decode(run)


@router.get("/tokenizer_info", summary="the tokenizer's settings and chat template (as vLLM's endpoint)")
async def tokenizer_info(request: Request):
    ctx = server(request)
    tok = ctx.tokenizer
    eos = [tok.token_text(i) for i in tok.eos_token_ids]
    return {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": ctx.settings.max_seq,
            "vocab_size": tok.vocab_size, "eos_token": eos[0] if eos else None, "eos_token_ids": tok.eos_token_ids,
            "bos_token": None, "pad_token": eos[-1] if eos else None, "add_bos_token": False, "add_eos_token": False,
            "chat_template": tok.chat_template_source}
