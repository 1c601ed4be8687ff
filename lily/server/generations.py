"""From a validated request body to the engine's GenerationRequests: sampling parameters, stop tokens,
where the prefix cache should snapshot, and a prompt's n choices."""

from __future__ import annotations

from dataclasses import replace

from lily.engine.generation import GenerationRequest
from lily.engine.sampling import SamplingParams
from lily.server.errors import APIError
from lily.server.generation_config import SamplingDefaults
from lily.tokenizer import Tokenizer


def sampling_params(tokenizer: Tokenizer, body, logprobs: bool, top_logprobs: int,
                    defaults: SamplingDefaults = SamplingDefaults()) -> SamplingParams:
    """The body's sampling fields; each it leaves out is the server's default (the checkpoint's
    generation_config.json unless `--generation-config none`; lily.server.generation_config)."""
    seed = None if body.seed is None else body.seed % (2 ** 64)
    top_k = defaults.top_k if body.top_k is None else body.top_k
    return SamplingParams(
        temperature=defaults.temperature if body.temperature is None else body.temperature,
        top_p=defaults.top_p if body.top_p is None else body.top_p,
        top_k=0 if top_k == -1 else top_k,
        min_p=defaults.min_p if body.min_p is None else body.min_p,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=defaults.repetition_penalty if body.repetition_penalty is None else body.repetition_penalty,
        seed=seed, logprobs=logprobs, top_logprobs=top_logprobs,
        logit_bias=logit_bias(tokenizer, body.logit_bias),
        allowed_token_ids=in_vocabulary(tokenizer, getattr(body, "allowed_token_ids", None), "allowed_token_ids"))


def in_vocabulary(tokenizer: Tokenizer, ids, param: str) -> tuple[int, ...] | None:
    """The token ids `param` names, each checked against the vocabulary (a 400 naming those outside it, as
    OpenAI and vLLM answer: an id no token has would otherwise be silently dropped, or index past the logits)."""
    if ids is None:
        return None
    ids = [int(i) for i in ids]
    bad = sorted({i for i in ids if not 0 <= i < tokenizer.vocab_size})
    if bad:
        shown = ", ".join(map(str, bad[:10])) + (f" and {len(bad) - 10} more" if len(bad) > 10 else "")
        raise APIError(400, f"{param}: token id(s) {shown} are outside the vocabulary (its size is "
                       f"{tokenizer.vocab_size}: ids 0 to {tokenizer.vocab_size - 1})", param=param)
    return tuple(ids)


def logit_bias(tokenizer: Tokenizer, bias: dict | None) -> tuple:
    bias = bias or {}  # keys are digit strings (the schema's pattern)
    ids = in_vocabulary(tokenizer, list(bias), "logit_bias")
    return tuple((i, float(v)) for i, v in zip(ids, bias.values()))


def stop_tokens(tokenizer: Tokenizer, body) -> frozenset[int]:
    """What ends the generation when drawn: the end-of-text tokens unless ignore_eos, and vLLM's stop_token_ids
    (which ignore_eos leaves in force, as in vLLM)."""
    eos = () if body.ignore_eos else tokenizer.eos_token_ids
    extra = in_vocabulary(tokenizer, getattr(body, "stop_token_ids", None), "stop_token_ids") or ()
    stops = frozenset(eos) | frozenset(extra)
    allowed = getattr(body, "allowed_token_ids", None)
    if body.min_tokens and allowed and set(allowed) <= stops:  # (min_tokens would leave no token to draw)
        raise APIError(400, "allowed_token_ids: every allowed token ends the generation, so min_tokens "
                       f"({body.min_tokens}) cannot be met; allow a token that does not, or leave min_tokens out",
                       param="allowed_token_ids")
    return stops


# a leading system turn at least this many tokens long is snapshotted too (shorter ones prefill in less than the
# snapshot costs to copy and to hold)
SHARED_PREFIX_MIN = 256


def turn_boundary(tokenizer: Tokenizer, ids: list[int]) -> tuple[int, ...]:
    """Where a chat prompt is worth a snapshot: where the last full chat turn ends (after its <|im_end|> and
    newline): a follow-up request repeats the conversation up to there, while the assistant turn itself is
    re-rendered differently (templates drop the reasoning); and where a leading system turn of SHARED_PREFIX_MIN
    tokens or more ends (its instructions and the tools the template writes into it), which an application's
    new conversations repeat with another first message."""
    if not tokenizer.has_token("<|im_end|>"):
        return ()
    im_end = tokenizer.token_id("<|im_end|>")
    last = next((i for i in range(len(ids) - 1, -1, -1) if ids[i] == im_end), None)  # (near the end: no full scan)
    if last is None:
        return ()
    newline = tokenizer.encode("\n")

    def after(i: int) -> int:
        end = i + 1
        return end + 1 if len(newline) == 1 and end < len(ids) and ids[end] == newline[0] else end

    points = {after(last)}
    if tokenizer.has_token("<|im_start|>") and ids[:1] == [tokenizer.token_id("<|im_start|>")] \
            and tokenizer.decode(ids[1:9]).startswith("system\n"):
        system_end = after(ids.index(im_end))
        if system_end >= SHARED_PREFIX_MIN:
            points.add(system_end)
    return tuple(sorted(points))


def choices(gen: GenerationRequest, n: int) -> list[GenerationRequest]:
    """n choices of one prompt, decoded together as slots allow. They share one cancel event (a client
    that leaves stops them all); with a seed, choice i samples with seed + i, so the choices differ
    and each is reproducible. The first snapshots its prompt but the last token (the cache serves
    strict prefixes only; prompts prefill in order), so the others prefill one token."""
    if n == 1:
        return [gen]
    seed = gen.sampling.seed
    last = len(gen.prompt_ids) - 1
    return [replace(gen, snapshot_at=gen.snapshot_at + ((last,) if i == 0 and last > 0 else ()),
                    sampling=replace(gen.sampling, seed=None if seed is None else (seed + i) % (2 ** 64)))
            for i in range(n)]
