"""How a forced tool call writes each parameter's value, and so how the output parser reads it back: as its
text or as a JSON value (`value_form`), from the tool's parameters schema with its $refs followed (`tool_schema`).
lily.server.structured builds the call grammar's value rules from these and lily.server.chat_parsing reads the
values with them, so the grammar and the parser cannot disagree."""

from __future__ import annotations

from lily.engine.constraints import map_schemas


# a schema made of these keywords alone says nothing about its value: (not strict) the value is any text
ANNOTATIONS = {"description", "title", "default", "examples", "deprecated", "readOnly", "writeOnly", "$comment"}
# what a string parameter may say and the call grammar still holds its text to (annotations included); for a
# strict tool anything else about the text (pattern, format, ...) is refused rather than silently ignored
STRING_KEYWORDS = ANNOTATIONS | {"type", "enum", "const", "minLength", "maxLength"}


# where a tool's parameters schema keeps the definitions its $refs point to (pydantic: $defs; older: definitions)
DEFINITIONS = ("$defs", "definitions")


def _pointer(root: dict, ref) -> dict | None:
    """The schema a local $ref ("#/$defs/Addr") points to in `root`, or None (a remote or broken one)."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        return None
    node = root
    for part in ref[1:].split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node if isinstance(node, dict) else None


def resolve_ref(schema, root: dict):
    """`schema` with its own top-level $ref followed into `root` (a chain of them too), the keywords beside it
    kept: pydantic writes a nested model or an Enum as {"$ref": "#/$defs/Addr"}, whose form (text or JSON) and
    whose keywords are the definition's. Left as it is where the ref does not resolve, or a keyword beside it
    other than an annotation says otherwise than the definition (both would then hold: kept as a JSON schema)."""
    for _ in range(8):  # a ref to a ref ..., not a cycle of them
        if not isinstance(schema, dict) or "$ref" not in schema:
            break
        target = _pointer(root, schema["$ref"])
        rest = {k: v for k, v in schema.items() if k != "$ref"}
        if target is None or any(k in target and target[k] != v for k, v in rest.items() if k not in ANNOTATIONS):
            break
        schema = {**{k: v for k, v in target.items() if k not in DEFINITIONS}, **rest}
    return schema


def tool_schema(params) -> tuple[dict, dict, dict]:
    """A tool's parameters schema as the call grammar and the output parser both read it: (the object schema, a
    root $ref followed to it; its properties by name, each one's own $ref followed; the root's definitions, which
    a value's JSON schema carries along so that the $refs inside it, recursive ones too, resolve)."""
    if not isinstance(params, dict):
        return {}, {}, {}
    defs = {k: params[k] for k in DEFINITIONS if isinstance(params.get(k), dict)}
    obj = resolve_ref(params, params)
    props = obj.get("properties") if isinstance(obj.get("properties"), dict) else {}
    return obj, {name: resolve_ref(s, params) for name, s in props.items()}, defs


def _no_string(schema, root: dict, depth: int = 0) -> bool:
    """Whether no string is valid against the schema, as far as its type / enum / const / anyOf / oneOf tell
    (False where they do not tell): pydantic's Optional[int] is {"anyOf": [{"type": "integer"}, {"type": "null"}]}."""
    schema = resolve_ref(schema, root)
    if not isinstance(schema, dict) or depth > 8:
        return False
    typ = schema.get("type")
    if isinstance(typ, str) or (isinstance(typ, list) and all(isinstance(t, str) for t in typ)):
        return "string" not in ([typ] if isinstance(typ, str) else typ)
    if "const" in schema:
        return not isinstance(schema["const"], str)
    if isinstance(schema.get("enum"), list):
        return not any(isinstance(v, str) for v in schema["enum"])
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list) and schema[key]:
            return all(_no_string(s, root, depth + 1) for s in schema[key])
    return False


def admits_null(schema, root: dict, depth: int = 0) -> bool:
    """Whether the schema's type / anyOf / oneOf let the value be null (pydantic's Optional[str] is {"anyOf":
    [{"type": "string"}, {"type": "null"}]}): a freely written "null" then means None, not the text."""
    schema = resolve_ref(schema, root)
    if not isinstance(schema, dict) or depth > 8:
        return False
    typ = schema.get("type")
    if typ == "null" or (isinstance(typ, list) and "null" in typ):
        return True
    return any(isinstance(schema.get(key), list) and any(admits_null(s, root, depth + 1) for s in schema[key])
               for key in ("anyOf", "oneOf"))


def value_form(schema, strict: bool, root: dict | None = None) -> str | None:
    """How the call grammar (tool_choice required / named) writes a parameter of this schema (its $ref followed:
    `tool_schema`), and so how the parser reads it back: "text" (the value is its text: a string type; not
    strict, also a schema of annotations only or an enum / const of strings), "json" (a JSON value: anything
    else for a strict tool; for a tool without strict, a schema no string is valid against: a non-string type,
    an anyOf such as Optional[int]'s), or None: a tool without strict whose schema the text reading would read
    as text but a grammar would have to write as JSON (no type, a type list with "string"), which the grammar
    writes as free text and the parser reads the loose way (`_read_loose`). `root`: the tool's parameters
    schema, where $refs inside the schema point. lily.server.structured builds the grammar's value rules from
    this, so the two cannot disagree."""
    if not isinstance(schema, dict):
        return "text"
    typ = schema.get("type")
    if typ == "string":
        return "text"
    if strict:
        return "json"
    if typ is None and set(schema) <= ANNOTATIONS:
        return "text"
    if typ is None and set(schema) <= STRING_KEYWORDS and (
            isinstance(schema.get("const"), str) or (isinstance(schema.get("enum"), list) and schema["enum"]
                                                      and all(isinstance(v, str) for v in schema["enum"]))):
        return "text"
    if typ is None and _no_string(schema, root or {}):
        return "json"
    if typ is None or not isinstance(typ, (str, list)) or (isinstance(typ, list) and "string" in typ):
        return None
    return "json"


# the keywords of an allOf branch that `closed_objects` merges into its object (annotations aside)
MERGED = {"type", "properties", "required", "title", "description", "$comment"}


def _merge_all_of(schema: dict) -> dict:
    """An object schema with the allOf branches that only name properties (and required ones) merged into it:
    strict mode closes every object, and a branch closed on its own refuses the others' properties (JSON
    Schema's additionalProperties sees only its object's own properties: allOf [{a}, {b}] closed was
    unsatisfiable). A property in several is each one's schema at once (allOf)."""
    branches = schema.get("allOf")
    if not isinstance(branches, list) or schema.get("type", "object") != "object":
        return schema
    plain = [b for b in branches if isinstance(b, dict) and set(b) <= MERGED and b.get("type", "object") == "object"
             and isinstance(b.get("properties", {}), dict) and isinstance(b.get("required", []), list)]
    if not plain or not isinstance(schema.get("properties", {}), dict) \
            or not isinstance(schema.get("required", []), list):
        return schema
    out = {k: v for k, v in schema.items() if k != "allOf"}
    props = dict(out.get("properties", {}))
    required = list(out.get("required", []))
    for b in plain:
        for name, sub in b.get("properties", {}).items():
            props[name] = {"allOf": [props[name], sub]} if name in props else sub
        required += [r for r in b.get("required", []) if r not in required]
    out.update(type="object", properties=props)
    if required:
        out["required"] = required
    rest = [b for b in branches if not any(b is p for p in plain)]
    if rest:
        out["allOf"] = rest
    return out


def _close(schema: dict) -> dict:
    is_object = schema.get("type") == "object" or (isinstance(schema.get("type"), list) and "object" in schema["type"]) \
        or "properties" in schema
    if is_object and "additionalProperties" not in schema and "patternProperties" not in schema:
        return {**schema, "additionalProperties": False}
    return schema


def closed_objects(schema):
    """A strict json_schema (or a strict tool's parameters) as OpenAI's strict mode reads it: every object allows
    only the properties it lists (additionalProperties false where the schema says nothing; OpenAI refuses a
    strict schema without it, and JSON Schema's default, any other key, let the output carry keys nobody asked
    for). An allOf's branches that only name properties are merged into their object first (`_merge_all_of`);
    any other branch is closed on its own, as JSON Schema reads it."""
    return map_schemas(schema, _close, before=_merge_all_of)
