"""Schemathesis against the server's own OpenAPI schema (GET /openapi.json): requests generated from the
schema, valid and invalid, sent to the real app (tiny synthetic checkpoint, reference backend). Every
response must conform to the schema (status codes, content types, bodies), never be a 5xx, and every
error must be in OpenAI's shape. Bounded: a fixed number of examples per operation."""

from __future__ import annotations

import json

import jsonschema
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import negative_data_rejection, positive_data_acceptance
from schemathesis.specs.openapi.checks import ParameterLocation

from lily.engine import load_backend
from lily.engine.prefix_cache import PrefixCache
from lily.server.app import ServerSettings, create_app
from lily.tokenizer import Tokenizer
from test_reliability_support import load_test, make_tiny_checkpoint

MAX_SEQ = 64  # short answers keep every generated request quick


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("schemathesis"))
    backend = load_backend(ckpt, "cpu", "reference")
    tokenizer = Tokenizer.from_dir(ckpt)
    cache = PrefixCache(4, 1 << 28, backend.clone_state, backend.state_nbytes)
    app = create_app(backend, tokenizer, ServerSettings(model_name="tiny", max_seq=MAX_SEQ, max_body=1 << 20,
                                                        max_queue=4), cache)
    yield app
    app.state.worker.shutdown()


@pytest.fixture
def api_schema(app):
    loaded = schemathesis.openapi.from_asgi("/openapi.json", app)
    if hasattr(loaded.config, "max_stream_events"):  # newer schemathesis reads only 20 events of a stream
        loaded.config.max_stream_events = 1 << 20
    return loaded


schema = schemathesis.pytest.from_fixture("api_schema")


def body_valid_after_all(case) -> bool:
    """Whether a negative case whose negation is in its body holds a body its operation's schema accepts after
    all: schemathesis negates one branch of an anyOf / oneOf, and the result may fall into another (a message's
    role mutated out of one message type's enum into another's, with the other type's fields present). The
    server rightly accepts such a body, so it is no accepted negative."""
    data = getattr(case.meta.phase, "data", None)
    if getattr(data, "parameter_location", None) != ParameterLocation.BODY:
        return False
    doc = case.operation.schema.raw_schema
    op = doc["paths"][case.operation.path][case.operation.method.lower()]
    body_schema = op["requestBody"]["content"][case.media_type or "application/json"]["schema"]
    validator = jsonschema.Draft202012Validator({**body_schema, "components": doc.get("components", {})})
    return validator.is_valid(case.body)


def content_type(response) -> str:
    value = response.headers.get("content-type") or ""
    return value[0] if isinstance(value, list) else value


@schema.parametrize()
@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck), derandomize=False)
def test_server_conforms_to_its_own_schema(case):
    response = case.call(timeout=300)  # n choices run one after another: slow on a small CPU
    assert response.status_code < 500, response.text[:500]
    # A schema cannot say "prompt + max_tokens fits the context", "token ids below the vocabulary size",
    # "prompts x n is at most 16", "arguments hold a JSON object", "tool_choice names one of the tools", "a tool's
    # name holds no '>' or line break, no whitespace at its ends" or "response_format's schema is one the grammar
    # engine can enforce" (structured_outputs' regex or grammar one it can compile, its json a schema's JSON text,
    # one rule a request, allowed_token_ids that leave a token it allows), "continue_final_message has text to
    # continue", nor the rules between fields (top_logprobs and stream_options need logprobs and stream, min_tokens
    # at most max_tokens, best_of equal to n, continue_final_message without add_generation_prompt nor a grammar
    # from the answer's start, a legacy function_call beside tool_calls), nor "the
    # Responses input holds a message" (reasoning items alone are no conversation) or "reasoning and
    # reasoning_content, both given, agree", so
    # schema-valid requests may still be refused, for those only.
    case.validate_response(response, excluded_checks=[positive_data_acceptance, negative_data_rejection])
    if response.status_code < 400 and case.meta.generation.mode.is_negative and not body_valid_after_all(case):
        case.validate_response(response, checks=[negative_data_rejection])
    if response.status_code == 400 and str(case.meta.generation.mode).lower().endswith("positive"):
        err = response.json()["error"]
        assert err["code"] == "context_length_exceeded" or any(
            reason in err["message"] for reason in ("outside the vocabulary", "must be a JSON object in a string",
                                                 "generations; at most", "which is not in tools",
                                                 "'required' needs tools",
                                                 "cannot be enforced by constrained decoding",
                                                 "only allowed when", "is more than max",
                                                 "generates no extra candidates", "no text to continue",
                                                 "no place to continue it from",
                                                 "cannot be true with continue_final_message",
                                                 "cannot be combined with a response_format",
                                                 "calls go in tool_calls or in function_call, not both",
                                                 "holds no message", "differs from reasoning_content",
                                                 "can be held to one rule only", "give exactly one of",
                                                 "not a JSON Schema", "a JSON Schema is a JSON object",
                                                 "cannot stand beside tool calls", "a tool's name may not hold",
                                                 "none of the allowed tokens can be drawn",
                                                 # (seed's int64 bounds reach the generator as floats: 2**63 - 1
                                                 # rounds to 2**63, so it draws seeds just past them)
                                                 "less than or equal to 9223372036854775807",
                                                 "greater than or equal to -9223372036854775808")), err
    if response.status_code >= 400:
        body = response.json()
        assert set(body) == {"error"} and {"message", "type", "param", "code"} == set(body["error"]), body
        assert body["error"]["message"] and "\n" not in body["error"]["message"]
    elif content_type(response).startswith("text/event-stream"):
        lines = [ln for ln in response.text.split("\n") if ln.startswith("data: ")]
        if getattr(response, "stream_cut_short", False):  # the client's read timeout: check what came
            assert all("error" not in json.loads(ln[6:]) for ln in lines if ln != "data: [DONE]")
            return
        if case.path == "/v1/responses":  # (OpenAI's Responses stream ends with its last event, no [DONE])
            assert lines and json.loads(lines[-1][6:])["type"] in (
                "response.completed", "response.incomplete", "response.failed"), response.text[-300:]
            return
        assert lines and lines[-1] == "data: [DONE]", response.text[-300:]
        if case.path == "/v1/chat/completions":
            assert load_test.check_stream(lines) == "", response.text[-500:]
        else:
            assert all("error" not in json.loads(ln[6:]) for ln in lines[:-1])
