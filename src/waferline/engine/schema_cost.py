"""What a JSON Schema would cost the grammar engine to build, counted before it is asked (engine/structured.py): the
schemas whose build would hold a server thread for seconds to minutes are refused."""

from __future__ import annotations

import collections
import urllib.parse
from typing import Any

from waferline.errors import RequestError

# The grammar engine's time to build a JSON Schema grows steeply with the patternProperties one object holds (llguidance
# 1.9.1, 2-core VM: 100 of them 0.03 s, 150 0.3 s, 200 0.95 s, 300 5.5 s, 400 over 10 s, 3,000 not done in 300 s), and
# allOf merges objects' (two of 100: 0.95 s), once for each branch of an anyOf it meets and each place a definition is
# used: a build cannot be stopped and holds a server thread. A schema with more than MAX_PATTERN_PROPERTIES of them,
# counted where each is used (a definition's at each "$ref" to it), is refused before the grammar engine sees it (160
# in one object: 0.3 s). Other features measured build fast: 1,000 properties 0.03 s, an enum of 20,000 values 0.04 s,
# 3,000 anyOf branches 6 ms, a pattern of 5,000 alternatives 0.04 s.
MAX_PATTERN_PROPERTIES = 160
_NOT_BUILT_HERE = frozenset(("$defs", "definitions", "enum", "const", "default", "examples"))
_NAMED_SCHEMAS = frozenset(("properties", "patternProperties", "dependentSchemas"))  # (their keys are names)


def refuse_costly_schema(schema: Any) -> None:
    """RequestError where ``schema`` has more than ``MAX_PATTERN_PROPERTIES`` patternProperties, counted where each is
    used (a local "$ref" counts its target's, once for each "$ref"; one back into itself, none): what the grammar
    engine would take seconds to minutes to build."""
    targets: dict[str, tuple[int, collections.Counter[str]]] = {}  # "#/..." -> (its own count, the refs it makes)
    totals: dict[str, int] = {}
    stack, on_path = [("#", False)], set()
    while stack:
        ref, done = stack.pop()
        if done:
            own, refs = targets[ref]
            totals[ref] = min(MAX_PATTERN_PROPERTIES + 1, own + sum(n * totals.get(r, 0) for r, n in refs.items()))
            on_path.discard(ref)
        elif ref not in totals and ref not in on_path:
            targets[ref] = _pattern_properties_of(_pointed(schema, ref))
            on_path.add(ref)
            stack.append((ref, True))
            stack += [(r, False) for r in targets[ref][1] if r not in totals and r not in on_path]
    if totals["#"] > MAX_PATTERN_PROPERTIES:
        raise RequestError(f"json_schema cannot be used: over {MAX_PATTERN_PROPERTIES} patternProperties (counted "
                           "where each is used), which the grammar engine would take seconds to minutes to build")


def _pattern_properties_of(node: Any) -> tuple[int, collections.Counter[str]]:
    """The patternProperties written in ``node`` and the local "$ref"s it makes (not what they point to); definitions
    count where they are used, and values (enum, const) not at all."""
    count, refs, nodes = 0, collections.Counter[str](), [(node, False)]
    while nodes:
        node, names = nodes.pop()  # (names: a mapping of property names to schemas, whatever the names are)
        if isinstance(node, list):
            nodes += ((v, False) for v in node)
            continue
        if not isinstance(node, dict):
            continue
        if names:
            nodes += ((v, False) for v in node.values())
            continue
        if isinstance(node.get("patternProperties"), dict):
            count += len(node["patternProperties"])
        if isinstance(node.get("$ref"), str) and node["$ref"].startswith("#"):
            refs[node["$ref"]] += 1
        nodes += ((v, k in _NAMED_SCHEMAS) for k, v in node.items() if k not in _NOT_BUILT_HERE)
    return count, refs


def _pointed(schema: Any, ref: str) -> Any:
    """What the local "$ref" ``ref`` ("#/$defs/a") points to in ``schema`` (None where nothing, or an anchor)."""
    if ref != "#" and not ref.startswith("#/"):
        return None
    node = schema
    for part in ref[1:].split("/")[1:]:
        part = urllib.parse.unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node
