"""POST /tokenize (text, or chat messages as the chat template renders them) and POST /detokenize."""

from __future__ import annotations

from fastapi import APIRouter, Request

from lily.server.context import server
from lily.server.errors import APIError
from lily.server.protocol import DetokenizeRequest, TokenizeChat, TokenizeRequest
from lily.server.validation import check_model, encode_text, render_chat

router = APIRouter()


@router.post("/tokenize", summary="token ids of a text, or of chat messages as the chat template renders them")
async def tokenize(body: TokenizeRequest, request: Request):
    ctx = server(request)
    check_model(ctx, body.model)
    if isinstance(body, TokenizeChat):
        ids = render_chat(ctx, body, "messages")[1]
    else:
        ids = encode_text(ctx, body.prompt, "prompt")
    return {"count": len(ids), "max_model_len": ctx.settings.max_seq, "tokens": ids}


@router.post("/detokenize", summary="the text of token ids")
async def detokenize(body: DetokenizeRequest, request: Request):
    ctx = server(request)
    check_model(ctx, body.model)
    vocab = ctx.tokenizer.vocab_size
    bad = [i for i in body.tokens if i >= vocab]
    if bad:
        raise APIError(400, f"tokens: token id {bad[0]} is outside the vocabulary (size {vocab})", param="tokens")
    return {"prompt": ctx.tokenizer.decode(body.tokens)}
