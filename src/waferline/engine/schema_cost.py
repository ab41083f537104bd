"""What a JSON Schema would cost the grammar engine to build, counted before it is asked (engine/structured.py): the
schemas whose build would hold a server thread for seconds to minutes are refused."""

from __future__ import annotations

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
