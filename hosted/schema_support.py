"""What `strict: true` accepts: the JSON Schema keywords xgrammar 0.2.9 really enforces, as an allow-list.

A strict schema (response_format.json_schema.strict, or a tool's function.strict) may use only the keywords
below, in the combinations below; anything else, known to JSON Schema 2020-12 or not, is refused with a
`StrictSchemaError` whose `path` is the parameter path to the keyword (a 400 naming it). What is on the list
was measured against xgrammar's matcher: a conforming document accepted, a violating one rejected
(tests/hosted/test_strict_schema_vocabulary.py walks the whole 2020-12 vocabulary and every `format`).

Found not enforced (so refused): `contains`/`minContains`/`maxContains`, `uniqueItems`, `dependentRequired`,
`dependentSchemas`, `patternProperties` (a key matching both a property and a pattern gets one schema),
`not`, `if`/`then`/`else`, `allOf` with more than one schema, `oneOf` with overlapping branches, `$anchor` and
`$id`-relative refs, `$dynamicRef`; `multipleOf` on non-integers or beside a bound; `required` names not in `properties`;
`propertyNames` next to `properties`; any keyword beside `$ref`, `anyOf`/`oneOf`/`allOf` or `enum`/`const`
(xgrammar ignores the siblings); `pattern`, `format` and `minLength`/`maxLength` together (it keeps one);
string/number/array/object keywords without a `type` (it ignores them); lookaround in a `pattern`; the
formats idn-email, idn-hostname, iri, iri-reference, regex, and hostname (label length unchecked). The
formats date, date-time and ipv4 are enforced through exact patterns of our own (`grammar_schema`):
xgrammar's accept 2020-02-30 and 01.2.3.4.

Non-strict schemas are best effort, as OpenAI's `strict: false`: hosted/structured.check_schema refuses
what is invalid or clearly unenforceable, and the grammar enforces what it can.
"""
from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from typing import Any

# Annotations: they assert nothing about the instance, so they need no enforcement. `discriminator` is
# OpenAPI's (pydantic writes it beside a oneOf whose branches are told apart by a const property).
ANNOTATIONS = frozenset({"title", "description", "default", "examples", "deprecated", "readOnly", "writeOnly",
                         "$comment", "discriminator"})
# Root-only identifiers and containers: `$defs` (and draft-07's `definitions`, which xgrammar also resolves).
ROOT_ONLY = frozenset({"$schema", "$id"})
DEFS = ("$defs", "definitions")

STRING_KW = frozenset({"minLength", "maxLength", "pattern", "format"})
NUMBER_KW = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"})
ARRAY_KW = frozenset({"items", "prefixItems", "minItems", "maxItems", "unevaluatedItems", "uniqueItems"})
OBJECT_KW = frozenset({"properties", "required", "additionalProperties", "minProperties", "maxProperties",
                       "propertyNames", "unevaluatedProperties"})
COMBINATORS = ("anyOf", "oneOf", "allOf")
# Every keyword a strict schema may use (beside ANNOTATIONS); the rest of 2020-12 is refused.
ENFORCED = frozenset({"type", "enum", "const", "$ref", *DEFS, *ROOT_ONLY, *COMBINATORS,
                      *STRING_KW, *NUMBER_KW, *ARRAY_KW, *OBJECT_KW})

# Formats the grammar enforces exactly (date, date-time, ipv4 through FORMAT_PATTERNS below).
STRICT_FORMATS = frozenset({"date-time", "date", "time", "duration", "email", "ipv4", "ipv6", "uuid", "uri",
                            "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"})

_YEAR = r"(?:000[1-9]|00[1-9][0-9]|0[1-9][0-9]{2}|[1-9][0-9]{3})"  # 0001-9999, as Python's date
_LEAP_YEAR = r"(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
_DATE = (rf"(?:{_YEAR}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
         rf"|02-(?:0[1-9]|1[0-9]|2[0-8]))|{_LEAP_YEAR}-02-29)")
_TIME = r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]+)?(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
# One decoded character of a JSON string, as a pattern xgrammar matches on the string's raw text: a character
# that needs no escape (never a control character, nor a UTF-8-encoded surrogate, which xgrammar's own string
# rule lets through and which then decodes as three U+FFFD), or a short escape. Length bounds are enforced
# as repetitions of it: xgrammar's minLength/maxLength rule also lets raw control characters through.
JSON_CHAR = "(?:[ !#-\\[\\]-\ud7ff\ue000-\U0010ffff]|\\\\[\"\\\\/bfnrt])"
FORMAT_PATTERNS = {
    "date": rf"^{_DATE}$",
    "date-time": rf"^{_DATE}T{_TIME}$",
    "ipv4": rf"^{_OCTET}(?:\.{_OCTET}){{3}}$",
}
# JSON Schema 2020-12's keywords (core, applicator, unevaluated, validation, meta-data, format-annotation,
# content), for messages: a keyword outside ENFORCED and ANNOTATIONS is refused either way.
VOCABULARY_2020_12 = frozenset({
    "$schema", "$id", "$ref", "$anchor", "$dynamicRef", "$dynamicAnchor", "$vocabulary", "$comment", "$defs",
    "prefixItems", "items", "contains", "additionalProperties", "properties", "patternProperties",
    "dependentSchemas", "propertyNames", "if", "then", "else", "allOf", "anyOf", "oneOf", "not",
    "unevaluatedItems", "unevaluatedProperties", "type", "enum", "const", "multipleOf", "maximum",
    "exclusiveMaximum", "minimum", "exclusiveMinimum", "maxLength", "minLength", "pattern", "maxItems",
    "minItems", "uniqueItems", "maxContains", "minContains", "maxProperties", "minProperties", "required",
    "dependentRequired", "title", "description", "default", "deprecated", "readOnly", "writeOnly", "examples",
    "format", "contentEncoding", "contentMediaType", "contentSchema"})
_LOOKAROUND = re.compile(r"\(\?<?[=!]")
# Pattern pieces that can match a UTF-8-encoded surrogate (invalid UTF-8, decoded as U+FFFD x3) or a raw
# backslash (which then starts an escape and changes what the string decodes to).
_WIDE_ESCAPES = {"W": "\\W", "D": "\\D", "S": "\\S", "\\": "a literal backslash"}
_JSON_TYPES = {"object": Mapping, "array": list, "string": str, "boolean": bool, "null": type(None)}


class StrictSchemaError(ValueError):
    """A strict schema using what constrained decoding would not enforce; `path` names the keyword."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path


def check_strict(schema: Any, where: str) -> None:
    """Raise StrictSchemaError for the first keyword (or combination) of `schema` not on the allow-list."""
    _check(schema, where, schema, root=True)


def _check(schema: Any, where: str, doc: Any, root: bool = False) -> None:
    """`doc`: the whole schema (for resolving $refs); `root`: whether `schema` is it."""
    if schema is True:
        return
    if schema is False:
        raise StrictSchemaError(where, "the schema `false` is only enforced as items, additionalProperties or "
                                       "unevaluated*; elsewhere leave the field out of the schema")
    if not isinstance(schema, Mapping):
        raise StrictSchemaError(where, f"must be a JSON schema object, got {type(schema).__name__}")
    for key in schema:
        if key in ANNOTATIONS:
            continue
        if key not in ENFORCED:
            raise StrictSchemaError(f"{where}.{key}", _why_not(key))
        if key in ROOT_ONLY and not root:
            raise StrictSchemaError(f"{where}.{key}", f"'{key}' is only supported at the schema's root "
                                                      f"(it would change how references resolve)")
    asserting = [k for k in schema if k not in ANNOTATIONS and k not in ROOT_ONLY and k not in DEFS]
    for key in ("$ref", *COMBINATORS, "enum", "const"):
        if key in schema:
            _alone(schema, key, asserting, where)
    if "$ref" in schema:
        ref = schema["$ref"]
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            raise StrictSchemaError(f"{where}.$ref", "only local references ('#' or '#/...') are supported")
    for key in COMBINATORS:
        if key in schema:
            _combinator(schema[key], key, f"{where}.{key}", doc)
    if "enum" in schema or "const" in schema:
        _enum_matches_type(schema, where)
    _typed(schema, where)
    _strings(schema, where)
    _numbers(schema, where)
    _arrays(schema, where, doc)
    _objects(schema, where, doc)
    for key in DEFS:
        defs = schema.get(key)
        if defs is not None:
            if not isinstance(defs, Mapping):
                raise StrictSchemaError(f"{where}.{key}", "must be an object of schemas")
            for name, sub in defs.items():
                _check(sub, f"{where}.{key}.{name}", doc)


def _why_not(key: str) -> str:
    if key in VOCABULARY_2020_12:
        return (f"'{key}' is not enforced by constrained decoding, so strict mode refuses it (drop it, or set "
                f"strict to false for a best-effort schema)")
    return f"'{key}' is not a JSON Schema 2020-12 keyword; strict mode refuses what it cannot enforce"


def _alone(schema: Mapping[str, Any], key: str, asserting: list[str], where: str) -> None:
    """xgrammar ignores every assertion beside $ref, a combinator or enum/const: they must stand alone
    (annotations aside; `type` may accompany enum/const when every value has that type)."""
    allowed = {key, "type"} if key in ("enum", "const") else {key}
    others = [k for k in asserting if k not in allowed]
    if others:
        raise StrictSchemaError(f"{where}.{others[0]}", f"'{others[0]}' beside '{key}' is not enforced "
                                                        f"(move it into the {key} target or branches)")


def _combinator(branches: Any, key: str, where: str, doc: Any) -> None:
    if not isinstance(branches, list) or not branches:
        raise StrictSchemaError(where, "must be a non-empty array of schemas")
    if key == "allOf" and len(branches) > 1:
        raise StrictSchemaError(where, "'allOf' with more than one schema is not enforced (merge them)")
    if key == "oneOf" and len(branches) > 1:
        from hosted.structured import _disjoint

        if not _disjoint(branches, doc):
            raise StrictSchemaError(where, "'oneOf' branches that may overlap are not enforced (exactly one "
                                           "must match); give each a different type or a const discriminator")
    for i, sub in enumerate(branches):
        _check(sub, f"{where}[{i}]", doc)


def _types(schema: Mapping[str, Any]) -> set[str]:
    t = schema.get("type")
    return {x for x in t if isinstance(x, str)} if isinstance(t, list) else {t} if isinstance(t, str) else set()


def _has_type(value: Any, t: str) -> bool:
    if t == "integer":
        return (isinstance(value, int) and not isinstance(value, bool)) or \
            (isinstance(value, float) and value.is_integer())
    if t == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, _JSON_TYPES[t]) and (t == "boolean" or not isinstance(value, bool))


def _enum_matches_type(schema: Mapping[str, Any], where: str) -> None:
    types = _types(schema)
    if not types:
        return
    values = schema["enum"] if "enum" in schema else [schema["const"]]
    key = "enum" if "enum" in schema else "const"
    for value in values if isinstance(values, list) else []:
        if not any(_has_type(value, t) for t in types if t in _JSON_TYPES or t in ("integer", "number")):
            raise StrictSchemaError(f"{where}.{key}", f"the value {value!r} is not of type {schema['type']!r} "
                                                      f"(the grammar would produce it anyway)")


def _typed(schema: Mapping[str, Any], where: str) -> None:
    """Type-specific keywords are enforced only when the schema says its type."""
    if "type" in schema:
        return
    for kw in sorted(STRING_KW | NUMBER_KW | ARRAY_KW | OBJECT_KW):
        if kw in schema:
            raise StrictSchemaError(f"{where}.{kw}", f"'{kw}' is enforced only in a schema with a 'type'")


def _strings(schema: Mapping[str, Any], where: str) -> None:
    if "pattern" in schema:
        p = schema["pattern"]
        if isinstance(p, str) and _LOOKAROUND.search(p):
            raise StrictSchemaError(f"{where}.pattern", "lookahead and lookbehind in a pattern are not enforced")
    if isinstance(schema.get("pattern"), str):
        wide = _wide_piece(schema["pattern"])
        if wide:
            raise StrictSchemaError(f"{where}.pattern", f"{wide} in a pattern is not enforced exactly (the grammar "
                                                        f"lets it produce invalid UTF-8 or change the decoded "
                                                        f"text); list the characters allowed instead")
    fmt = schema.get("format")
    if fmt is not None and (not isinstance(fmt, str) or fmt not in STRICT_FORMATS):
        raise StrictSchemaError(f"{where}.format", f"format {fmt!r} is not enforced by constrained decoding "
                                                   f"(enforced: {', '.join(sorted(STRICT_FORMATS))})")
    kinds = [k for k in ("pattern", "format") if k in schema]
    if "minLength" in schema or "maxLength" in schema:
        kinds.append("minLength" if "minLength" in schema else "maxLength")
    if len(kinds) > 1:
        raise StrictSchemaError(f"{where}.{kinds[1]}", f"'{kinds[0]}' and '{kinds[1]}' together are not enforced "
                                                       f"(only one of pattern, format, min/maxLength is)")


def _wide_piece(pattern: str) -> str | None:
    """The first piece of `pattern` that matches any character ('.', a negated class, \\W \\D \\S) or a
    backslash; None when there is none."""
    i, in_class = 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern):
            if pattern[i + 1] in _WIDE_ESCAPES:
                return _WIDE_ESCAPES[pattern[i + 1]]
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
            if pattern[i + 1:i + 2] == "^":
                return "a negated character class"
            if pattern[i + 1:i + 2] == "]":  # a literal ] first in the class
                i += 1
        elif c == ".":
            return "'.'"
        i += 1
    return None


def _numbers(schema: Mapping[str, Any], where: str) -> None:
    if "multipleOf" not in schema:
        return
    m = schema["multipleOf"]
    types = _types(schema)
    if "integer" not in types or types - {"integer", "null"} or \
            not (isinstance(m, int) and not isinstance(m, bool) and m > 0):
        raise StrictSchemaError(f"{where}.multipleOf", "'multipleOf' is enforced only with type 'integer' (or "
                                                       "integer and null) and a positive integer multipleOf")
    bounds = [k for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum") if k in schema]
    if bounds:  # xgrammar drops multipleOf beside a range ("not yet supported")
        raise StrictSchemaError(f"{where}.multipleOf", f"'multipleOf' beside '{bounds[0]}' is not enforced")


def _arrays(schema: Mapping[str, Any], where: str, doc: Any) -> None:
    if schema.get("uniqueItems") not in (None, False):
        raise StrictSchemaError(f"{where}.uniqueItems", "'uniqueItems' is not enforced by constrained decoding")
    for key in ("items", "unevaluatedItems"):
        if key in schema and schema[key] is not False:
            _check(schema[key], f"{where}.{key}", doc)
    if "prefixItems" in schema:
        items = schema["prefixItems"]
        if not isinstance(items, list) or not items:
            raise StrictSchemaError(f"{where}.prefixItems", "must be a non-empty array of schemas")
        for i, sub in enumerate(items):
            _check(sub, f"{where}.prefixItems[{i}]", doc)


def _objects(schema: Mapping[str, Any], where: str, doc: Any) -> None:
    props = schema.get("properties")
    if props is not None:
        if not isinstance(props, Mapping):
            raise StrictSchemaError(f"{where}.properties", "must be an object of schemas")
        for name, sub in props.items():
            _check(sub, f"{where}.properties.{name}", doc)
    required = schema.get("required")
    if isinstance(required, list):
        for i, name in enumerate(required):
            if not isinstance(name, str) or name not in (props or {}):
                raise StrictSchemaError(f"{where}.required[{i}]", f"required property {name!r} is not in "
                                                                 f"'properties' (only listed properties are "
                                                                 f"enforced as required)")
    if "propertyNames" in schema:
        if props:
            raise StrictSchemaError(f"{where}.propertyNames", "'propertyNames' beside 'properties' is not "
                                                              "enforced (listed names would bypass it)")
        _check(schema["propertyNames"], f"{where}.propertyNames", doc)
    for key in ("additionalProperties", "unevaluatedProperties"):
        if key in schema and schema[key] is not False:
            _check(schema[key], f"{where}.{key}", doc)


# ---------------------------------------------------------------------------------------------- grammar side
def grammar_schema(schema: Any) -> Any:
    """The schema handed to xgrammar: `format`s it enforces loosely (date, date-time, ipv4) and string length
    bounds replaced by exact patterns (where no other pattern or format sits beside them). The client's schema
    is left untouched."""
    out = copy.deepcopy(schema)
    return out if _rewrite(out) else schema


_SUB_ONE = ("items", "additionalProperties", "unevaluatedItems", "unevaluatedProperties", "propertyNames",
            "contains", "not", "if", "then", "else", "contentSchema")
_SUB_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_SUB_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")


def _is_string(node: dict) -> bool:
    t = node.get("type")
    return t == "string" or (isinstance(t, list) and "string" in t)


def _rewrite(node: Any) -> bool:
    """Rewrite `node` (a schema) and its subschemas in place; whether anything changed."""
    if not isinstance(node, dict):
        return False
    changed = False
    fmt = node.get("format")
    if isinstance(fmt, str) and fmt in FORMAT_PATTERNS and not {"pattern", "minLength", "maxLength"} & node.keys():
        del node["format"]
        node["pattern"] = FORMAT_PATTERNS[fmt]
        changed = True
    elif _is_string(node) and {"minLength", "maxLength"} & node.keys() and not {"pattern", "format"} & node.keys():
        lo, hi = node.pop("minLength", 0), node.pop("maxLength", "")
        node["pattern"] = f"^{JSON_CHAR}{{{lo},{hi}}}$"
        changed = True
    subs = [node[k] for k in _SUB_ONE if k in node]
    subs += [v for k in _SUB_MAPS if isinstance(node.get(k), dict) for v in node[k].values()]
    subs += [v for k in _SUB_LISTS if isinstance(node.get(k), list) for v in node[k]]
    for sub in subs:
        changed = _rewrite(sub) or changed
    return changed
