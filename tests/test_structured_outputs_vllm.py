"""vLLM's structured outputs: structured_outputs {json, regex, choice, grammar, json_object} and the older guided_json /
guided_regex / guided_choice / guided_grammar, on chat and text completions. Oracles: Python's re (the same patterns
fully matched), the lark package parsing the answer with the same grammar, an equivalent regex for a GBNF grammar,
jsonschema for JSON, membership for a choice; against a stand-in model of fresh random logits every step, so a
rule the engine did not hold is broken at once. Each test draws its patterns, grammars and choices afresh."""

import json
import random
import re

import jsonschema
import lark
import openai
import pytest
from fastapi.testclient import TestClient

from conftest import seed_of
from helpers_standin import RandomLogitsBackend
from lily.demo_tokenizer import write_tokenizer_files
from lily.server.app import ServerSettings, create_app
from lily.server.output_rules import regex_literal
from lily.tokenizer import Tokenizer

MODEL = "tiny"
SEED = seed_of("test_structured_outputs_vllm.py") % 2 ** 31
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    tokenizer = Tokenizer.from_dir(write_tokenizer_files(tmp_path_factory.mktemp("tok")))
    app = create_app(RandomLogitsBackend(tokenizer.vocab_size, SEED), tokenizer,
                     ServerSettings(model_name=MODEL, max_seq=2048))
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def body_for(path: str, seed: int, **fields) -> dict:
    body = {"model": MODEL, "max_tokens": 200, "temperature": 1.0, "seed": seed}
    if path == CHAT:
        body.update(messages=[{"role": "user", "content": "answer"}], reasoning_effort="none")
    else:
        body["prompt"] = "answer:"
    body.update(fields)
    return body


def answers(client, path: str, seed: int, **fields) -> list[str]:
    """Every choice's answer; each must have ended by the rule's end (finish_reason stop)."""
    r = client.post(path, json=body_for(path, seed, **fields))
    assert r.status_code == 200, r.text
    out = []
    for choice in r.json()["choices"]:
        assert choice["finish_reason"] == "stop", choice
        out.append(choice["message"]["content"] if path == CHAT else choice["text"])
    return out


def random_regex(rng: random.Random) -> str:
    """A pattern of bounded length in the syntax Python's re and llguidance's (Rust's regex crate) share: classes,
    bounded repeats, groups with alternatives, escapes, a '/' (Lark's regex delimiter) and a non-ASCII letter.
    (Not \\w or \\d: both are Unicode classes in each, but not the same ones: Rust's \\w takes combining marks.)"""
    def piece() -> str:
        return rng.choice([
            f"[a-{rng.choice('cfk')}]{{{rng.randint(1, 2)},{rng.randint(3, 5)}}}",
            "[0-9]{1,3}", "(?:yes|no|maybe)", r"\.", "/", "-", "é", "[A-Z][a-z]?", "[a-z0-9_]{2}", " ?",
            f"(?:{rng.choice(['ab', 'a/b', 'x'])}|{rng.choice(['cd', 'c.d', 'zz'])})",
        ])
    return "".join(piece() for _ in range(rng.randint(2, 5)))


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_a_regex_is_matched_by_the_whole_answer(client, path):
    rng = random.Random(SEED + len(path))
    for i in range(3):
        pattern = random_regex(rng)
        field = rng.choice(["structured_outputs", "guided_regex"])
        rule = {"structured_outputs": {"regex": pattern}} if field == "structured_outputs" else {"guided_regex": pattern}
        for text in answers(client, path, rng.randrange(2 ** 31), n=2, **rule):
            assert re.fullmatch(pattern, text), (pattern, text)


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_a_choice_is_answered_with_one_of_its_strings_exactly(client, path):
    """Strings that share prefixes (the engine must not stop at the shorter one unless it chose it), quotes,
    spaces, a slash and non-ASCII text."""
    rng = random.Random(SEED + 7 + len(path))
    pool = ["yes", "yes please", "no", "n/a", 'say "hi"', "ünïcode", "a|b", "(x)", "yes, no", "1.5", ""]
    seen = set()
    for i in range(4):
        choices = rng.sample(pool, rng.randint(2, 5))
        rule = rng.choice([{"structured_outputs": {"choice": choices}}, {"guided_choice": choices}])
        for text in answers(client, path, rng.randrange(2 ** 31), n=3, **rule):
            assert text in choices, (choices, text)
            seen.add(text)
    assert len(seen) >= 2  # (twelve draws over random logits: a rule that always picked one would show here)


def arithmetic_grammar(rng: random.Random) -> tuple[str, list[str]]:
    """A Lark grammar both the lark package and llguidance read, drawn afresh, and the operators it allows."""
    ops = rng.sample(["+", "-", "*", "/"], rng.randint(1, 3))
    digits = rng.randint(1, 3)
    grammar = "\n".join([
        "start: term (OP term)? (OP term)?",
        'term: NUMBER | "(" NUMBER OP NUMBER ")"',
        "OP: " + " | ".join(json.dumps(o) for o in ops),
        f"NUMBER: /[1-9][0-9]{{0,{digits - 1}}}/",
    ])
    return grammar, ops


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_a_lark_grammar_s_answers_parse_with_lark(client, path):
    rng = random.Random(SEED + 11 + len(path))
    for i in range(3):
        grammar, ops = arithmetic_grammar(rng)
        parser = lark.Lark(grammar, start="start", parser="earley")
        rule = rng.choice([{"structured_outputs": {"grammar": grammar}}, {"guided_grammar": grammar}])
        for text in answers(client, path, rng.randrange(2 ** 31), n=2, **rule):
            parser.parse(text)  # (raises on an answer outside the grammar)
            assert all(op in ops for op in re.findall(r"[-+*/]", text)), (ops, text)


def test_a_gbnf_grammar_as_vllm_s_docs_write_one(client):
    """GBNF (root ::= ..., vLLM's other engines' syntax) is converted to Lark; the answers match the regex the
    grammar is equivalent to."""
    rng = random.Random(SEED + 13)
    cols = rng.sample(["name", "age", "city", "id"], 3)
    gbnf = "\n".join([
        'root ::= "SELECT " column ("," column)? " FROM " table',
        "column ::= " + " | ".join(f'"{c}"' for c in cols),
        "table ::= [a-z] [a-z]? [a-z]?",
    ])
    alt = "|".join(cols)
    same = re.compile(rf"SELECT (?:{alt})(?:,(?:{alt}))? FROM [a-z]{{1,3}}")
    for path in (CHAT, COMPLETIONS):
        for text in answers(client, path, rng.randrange(2 ** 31), n=2, structured_outputs={"grammar": gbnf}):
            assert same.fullmatch(text), text


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "pet": {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}},
                                                   "required": ["kind"]}},
          "required": ["name", "age", "pet"]}


def closed(schema):
    """PERSON with every object closed: what disable_additional_properties asks for."""
    out = json.loads(json.dumps(schema))
    out["additionalProperties"] = False
    out["properties"]["pet"]["additionalProperties"] = False
    return out


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_json_rules_validate(client, path):
    """structured_outputs.json as an object or as its JSON text, disable_additional_properties closing every
    object, guided_json, and json_object."""
    rng = random.Random(SEED + 17 + len(path))
    for text in answers(client, path, rng.randrange(2 ** 31), n=2,
                        structured_outputs={"json": PERSON, "disable_additional_properties": True}):
        jsonschema.validate(json.loads(text), closed(PERSON))
    for text in answers(client, path, rng.randrange(2 ** 31),
                        structured_outputs={"json": json.dumps(closed(PERSON))}):
        jsonschema.validate(json.loads(text), closed(PERSON))
    for text in answers(client, path, rng.randrange(2 ** 31), guided_json=closed(PERSON)):
        jsonschema.validate(json.loads(text), closed(PERSON))
    r = client.post(path, json=body_for(path, rng.randrange(2 ** 31), max_tokens=40,
                                        structured_outputs={"json_object": True}))
    text = r.json()["choices"][0]["message"]["content"] if path == CHAT else r.json()["choices"][0]["text"]
    assert text.lstrip().startswith("{"), text  # (the random model need not close a free object in 40 tokens)


def test_a_streamed_answer_follows_the_rule(client):
    rng = random.Random(SEED + 19)
    pattern = random_regex(rng)
    r = client.post(CHAT, json=body_for(CHAT, rng.randrange(2 ** 31), stream=True,
                                        structured_outputs={"regex": pattern}))
    assert r.status_code == 200
    text, finish = "", None
    for line in r.text.splitlines():
        if line.startswith("data: {"):
            choice = json.loads(line[6:])["choices"][0]
            text += choice["delta"].get("content") or ""
            finish = choice["finish_reason"] or finish
    assert finish == "stop" and re.fullmatch(pattern, text), (pattern, text)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "strict": True,
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 8}}}}}


def test_beside_tools_the_answer_is_a_call_or_the_rule_s(client):
    """tools with tool_choice auto and a regex or choice: each answer is tool calls or content the rule holds
    (as with a JSON response_format); a grammar cannot stand beside calls (a 400 naming it) but is held alone
    under tool_choice none."""
    rng = random.Random(SEED + 23)
    pattern = random_regex(rng)
    kinds = set()
    for seed in range(6):
        # (one call: the random model would go on making calls up to max_tokens)
        r = client.post(CHAT, json=body_for(CHAT, seed * 7919 + SEED % 1000, n=2, tools=[WEATHER],
                                            parallel_tool_calls=False, guided_regex=pattern))
        assert r.status_code == 200, r.text
        for choice in r.json()["choices"]:
            msg = choice["message"]
            if msg.get("tool_calls"):
                kinds.add("call")
                assert choice["finish_reason"] == "tool_calls" and not (msg["content"] or "").strip()
                assert set(json.loads(msg["tool_calls"][0]["function"]["arguments"])) == {"city"}
            else:
                kinds.add("answer")
                assert choice["finish_reason"] == "stop" and re.fullmatch(pattern, msg["content"]), msg
    assert kinds  # (which of the two the random model takes is its own draw)
    grammar, _ = arithmetic_grammar(rng)
    r = client.post(CHAT, json=body_for(CHAT, 1, tools=[WEATHER], structured_outputs={"grammar": grammar}))
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs.grammar", r.text
    assert "tool_choice none" in r.json()["error"]["message"]
    text = answers(client, CHAT, 2, tools=[WEATHER], tool_choice="none", structured_outputs={"grammar": grammar})[0]
    lark.Lark(grammar, start="start").parse(text)


def test_through_the_openai_client_s_extra_body(client):
    sdk = openai.OpenAI(base_url="http://testserver/v1", api_key="none", max_retries=0, http_client=client)
    rng = random.Random(SEED + 29)
    choices = rng.sample(["red", "green", "blue", "light blue"], 3)
    out = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a colour"}],
                                      temperature=1.0, seed=rng.randrange(1000), max_tokens=50,
                                      extra_body={"structured_outputs": {"choice": choices},
                                                  "reasoning_effort": "none"})
    assert out.choices[0].message.content in choices
    pattern = random_regex(rng)
    out = sdk.completions.create(model=MODEL, prompt="x", temperature=1.0, seed=rng.randrange(1000), max_tokens=200,
                                 extra_body={"guided_regex": pattern, "guided_decoding_backend": "xgrammar"})
    assert re.fullmatch(pattern, out.choices[0].text), (pattern, out.choices[0].text)


@pytest.mark.parametrize("path,fields,param,says", [
    (CHAT, {"structured_outputs": {"regex": "a(?=b)"}}, "structured_outputs.regex", "look-around"),
    (COMPLETIONS, {"guided_regex": r"(a)\1"}, "guided_regex", "back"),
    (CHAT, {"structured_outputs": {"grammar": "start: (("}}, "structured_outputs.grammar", "cannot be enforced"),
    (COMPLETIONS, {"guided_grammar": "root ::= ((\n"}, "guided_grammar", "cannot be enforced"),
    (CHAT, {"structured_outputs": {"json": "{not json"}}, "structured_outputs.json", "JSON Schema"),
    (COMPLETIONS, {"guided_json": "[1, 2]"}, "guided_json", "JSON object"),
    (CHAT, {"structured_outputs": {"json": {"type": "object", "if": {}}}}, "structured_outputs.json", '"if"'),
    (CHAT, {"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "regex and choice"),
    (COMPLETIONS, {"structured_outputs": {}}, "structured_outputs", "exactly one"),
    (CHAT, {"structured_outputs": {"choice": []}}, "structured_outputs.choice", "at least 1"),
    (CHAT, {"structured_outputs": {"regexp": "a"}}, "structured_outputs.regexp", "unknown field"),
    (CHAT, {"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern",
     "not supported"),
    (CHAT, {"structured_outputs": {"choice": ["a"], "disable_any_whitespace": True}},
     "structured_outputs.disable_any_whitespace", "only false"),
    (CHAT, {"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag", "tools"),
    (COMPLETIONS, {"guided_whitespace_pattern": " *"}, "guided_whitespace_pattern", "not supported"),
    (CHAT, {"response_format": {"type": "json_object"}, "guided_choice": ["a"]}, "guided_choice", "response_format"),
    (COMPLETIONS, {"guided_regex": "a", "structured_outputs": {"regex": "b"}}, "guided_regex", "structured_outputs"),
])
def test_a_rule_the_engine_cannot_hold_is_a_400_naming_it(client, path, fields, param, says):
    r = client.post(path, json=body_for(path, 1, **fields))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"].startswith(param) and says in err["message"], err
    assert client.post(path, json=body_for(path, 1, max_tokens=2)).status_code == 200


def test_continuing_a_message_under_a_rule_is_a_400(client):
    body = body_for(CHAT, 3, guided_choice=["a", "b"], continue_final_message=True,
                    messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "I say"}])
    r = client.post(CHAT, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message", r.text


def test_regex_literal_escapes_lark_s_delimiter_only():
    """Every unescaped / escaped (no bare / left to end Lark's terminal early), escape pairs copied whole, and the
    pattern's meaning unchanged: Python's re matches the same strings with either."""
    rng = random.Random(SEED + 31)
    for _ in range(200):
        pattern = "".join(rng.choice(["a", "/", "\\/", "\\\\", "\\d", "[/]", "."]) for _ in range(rng.randint(1, 8)))
        lit = regex_literal(pattern)
        assert lit[0] == lit[-1] == "/"
        body, i = lit[1:-1], 0
        while i < len(body):
            assert body[i] != "/", (pattern, lit)  # (a / only as the second char of an escape pair)
            i += 2 if body[i] == "\\" else 1
        for _ in range(30):
            s = "".join(rng.choice("a/\\5.") for _ in range(rng.randint(0, 8)))
            assert bool(re.fullmatch(pattern, s)) == bool(re.fullmatch(body, s)), (pattern, body, s)


def test_a_deeply_nested_grammar_compiles_or_is_refused_and_never_kills_the_process(tmp_path):
    """llguidance recurses once a level of a grammar's nesting: a chain of 3,000 Lark rules overflowed a thread's
    stack and the server died (QA: a segmentation fault). Compiled on a stack of its own, such a chain compiles
    (or is a GrammarError); run in a child process, so that a crash fails this test rather than the run."""
    import subprocess
    import sys

    n = random.randint(3000, 3400)
    script = f"""
import sys
from lily.demo_tokenizer import write_tokenizer_files
from lily.engine.constraints import GrammarError, Grammars
from lily.tokenizer import Tokenizer
grammars = Grammars(Tokenizer.from_dir(write_tokenizer_files(sys.argv[1])))
source = "start: r0\\n" + "".join(f'r{{i}}: r{{i + 1}} | "x"\\n' for i in range({n})) + 'r{n}: "y"\\n'
try:
    grammars.lark(source)
    print("compiled")
except GrammarError as e:
    print("refused", e)
"""
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.split()[0] in ("compiled", "refused"), (done.returncode, done.stderr)


def test_many_choices_a_start_rule_as_vllm_writes_it_and_the_size_limits(client):
    """A choice of thousands of strings (as Lark alternatives 2,000 passed the parser's row limit); a Lark grammar
    whose start rule is ?start: (vLLM's example's; it was taken for GBNF and refused); GBNF past 16 KiB and Lark
    past 64 KiB are a 400 naming the field (GBNF is converted by Python code whose time grows with the square of
    its rules, stalling every stream); vLLM's rules on /v1/responses are a 400 rather than ignored."""
    rng = random.Random(SEED + 37)
    choices = [f"item{i:05d}" for i in rng.sample(range(10 ** 5), rng.randint(2500, 4000))]
    for text in answers(client, COMPLETIONS, rng.randrange(2 ** 31), n=3, guided_choice=choices):
        assert text in choices, text
    grammar, _ = arithmetic_grammar(rng)
    grammar = grammar.replace("start:", "?start:", 1)
    parser = lark.Lark(grammar, start="start")
    for text in answers(client, CHAT, rng.randrange(2 ** 31), n=2, structured_outputs={"grammar": grammar}):
        parser.parse(text)
    gbnf = 'root ::= r0\n' + "".join(f'r{i} ::= r{i + 1} | "x"\n' for i in range(900)) + 'r900 ::= "y"\n'
    lark_big = "start: r0\n" + "".join(f'r{i}: r{i + 1} | "x"\n' for i in range(3800)) + 'r3800: "y"\n'
    for path, fields, param in ((CHAT, {"guided_grammar": gbnf}, "guided_grammar"),
                                (COMPLETIONS, {"structured_outputs": {"grammar": lark_big}}, "structured_outputs.grammar")):
        r = client.post(path, json=body_for(path, 1, **fields))
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and "at most" in err["message"], err
    for field, value in (("structured_outputs", {"regex": "a+"}), ("guided_choice", ["a", "b"])):
        r = client.post("/v1/responses", json={"model": MODEL, "input": "hi", field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
        assert "text.format" in r.json()["error"]["message"]
