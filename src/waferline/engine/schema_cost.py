"""What a JSON Schema would cost the grammar engine to build, counted before it is asked (engine/structured.py): the
schemas whose build would hold a server thread for seconds to minutes are refused, and those whose numbers would crash
it."""

from __future__ import annotations

import json
import re
import urllib.parse
from typing import Any

from waferline.errors import RequestError

# The grammar engine's time to build a JSON Schema grows steeply with the patternProperties one object holds (llguidance
# 1.9.1, 2-core VM: 100 of them 0.03 s, 150 0.3 s, 200 0.95 s, 300 5.5 s, 400 over 10 s, 3,000 not done in 300 s), and
# allOf merges objects' (two different objects of 100: 0.95 s): a build cannot be stopped and holds a server thread. A
# schema with more than MAX_PATTERN_PROPERTIES of them in all is refused before the grammar engine sees it (160 in one
# object: 0.3 s). Each schema counts once, however many "$ref"s use it: the engine builds a definition once (one of 100
# referenced 20 times: 33 ms; ten anyOf branches each merging a definition of 120 into an object of their own: 0.7 s).
# Other features measured build fast: 1,000 properties 0.03 s, an enum of 20,000 values 0.04 s, 3,000 anyOf branches
# 6 ms, a pattern of 5,000 alternatives 0.04 s.
MAX_PATTERN_PROPERTIES = 160
_NOT_BUILT_HERE = frozenset(("$defs", "definitions", "enum", "const", "default", "examples"))
_NAMED_SCHEMAS = frozenset(("properties", "patternProperties", "dependentSchemas"))  # (their keys are names)


def refuse_costly_schema(schema: Any) -> None:
    """RequestError where ``schema`` has more than ``MAX_PATTERN_PROPERTIES`` patternProperties in all: those written
    in it and in the definitions its local "$ref"s reach, each schema once (definitions no "$ref" reaches, and values
    such as enum and const, not at all). What the grammar engine would take seconds to minutes to build."""
    count, seen, nodes = 0, set(), [(schema, False)]
    while nodes:
        node, names = nodes.pop()  # (names: a mapping of property names to schemas, whatever the names are)
        if isinstance(node, list):
            nodes += ((v, False) for v in node)
            continue
        if not isinstance(node, dict) or id(node) in seen:
            continue
        seen.add(id(node))
        if names:
            nodes += ((v, False) for v in node.values())
            continue
        if isinstance(node.get("patternProperties"), dict):
            count += len(node["patternProperties"])
            if count > MAX_PATTERN_PROPERTIES:
                raise RequestError(f"json_schema cannot be used: over {MAX_PATTERN_PROPERTIES} patternProperties, "
                                   "which the grammar engine would take seconds to minutes to build")
        if isinstance(node.get("$ref"), str):
            nodes.append((_pointed(schema, node["$ref"]), False))
        nodes += ((v, k in _NAMED_SCHEMAS) for k, v in node.items() if k not in _NOT_BUILT_HERE)


def _pointed(schema: Any, ref: str) -> Any:
    """What the local "$ref" ``ref`` ("#/$defs/a") points to in ``schema`` (None where nothing, another document or
    an anchor)."""
    if ref != "#" and not ref.startswith("#/"):
        return None
    node = schema
    for part in ref[1:].split("/")[1:]:
        part = urllib.parse.unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and part.isascii() and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


# The grammar engine (llguidance 1.9.1) reads a JSON Schema's numbers as f64 and an integer's range as i64: a const or
# an enum value that holds an integer at or below -2^63 ({"const": -9223372036854775807}, {"enum": [[-1e19]]} in an
# integer schema), or an integer range whose two ends both lie there ({"type": "integer", "minimum": -1e19, "maximum":
# -1e19}), ends the whole process (SIGSEGV as it builds the grammar) instead of failing. Such a number in a const, an
# enum or a bound is refused before the engine sees it (a bound there is one no integer range can use anyway: "Failed
# to generate regex"). Also in the JSON Schemas a Lark grammar embeds (%json {...}).
LOWEST_NUMBER = -(2 ** 63)
_BOUNDS = frozenset(("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"))
_LARK_JSON = re.compile(r"%json\b\s*")


def refuse_crashing_numbers(schema: Any, kind: str = "json_schema") -> None:
    """RequestError where a const, an enum value (or a number inside one) or a numeric bound of ``schema`` is at or
    below ``LOWEST_NUMBER`` as an f64 (what the grammar engine would crash on); instances that only annotate
    ("default", "examples") are not read."""
    nodes = [(schema, False)]
    while nodes:
        node, names = nodes.pop()
        if isinstance(node, list):
            nodes += ((v, False) for v in node)
            continue
        if not isinstance(node, dict):
            continue
        if names:
            nodes += ((v, False) for v in node.values())
            continue
        for key, value in node.items():
            if key in _BOUNDS or key in ("const", "enum"):
                low = _lowest(value if key not in _BOUNDS else [value])
                if low is not None:
                    raise RequestError(f"{kind} cannot be used: the number {low} (in \"{key}\") is at or below "
                                       f"-2^63 ({LOWEST_NUMBER}), which the grammar engine cannot hold")
            elif key not in ("default", "examples"):
                nodes.append((value, key in _NAMED_SCHEMAS))


def _lowest(value: Any) -> int | float | None:
    """The first number in ``value`` (a JSON instance) at or below ``LOWEST_NUMBER`` once rounded to an f64; else
    None."""
    items = [value]
    while items:
        v = items.pop()
        if isinstance(v, (list, dict)):
            items += v.values() if isinstance(v, dict) else v
        elif type(v) is int and v <= LOWEST_NUMBER + 512 or type(v) is float and v <= LOWEST_NUMBER:
            return v  # (an integer within 512 of -2^63 rounds to it)
    return None


def refuse_crashing_lark(text: str) -> None:
    """``refuse_crashing_numbers`` of each JSON Schema a Lark grammar embeds (``%json {...}``; one that is not JSON is
    left to the grammar engine's own error)."""
    decoder = json.JSONDecoder()
    for m in _LARK_JSON.finditer(text):
        try:
            schema, _ = decoder.raw_decode(text, m.end())
        except ValueError:
            continue
        refuse_crashing_numbers(schema, "grammar")
