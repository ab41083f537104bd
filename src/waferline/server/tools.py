"""Function calling in chat completions: ``tools`` and ``tool_choice``, as OpenAI's API and vLLM's server take them.

``tool_choice`` (default ``"auto"`` where tools are given, as OpenAI's):

- ``{"type": "function", "function": {"name": N}}``: the answer is a call of N; its arguments are held to N's
  ``parameters`` schema (and to an object) by a structured output (engine/structured.py), whatever the model;
- ``"required"``: one or more calls (one with ``parallel_tool_calls: false``), held to a JSON array of
  ``{"name": ..., "parameters": ...}`` objects, one of the tools each;
- ``"auto"``: the model decides, in its own tool-call format, which a parser reads from the text. Only with
  ``waferline serve --tool-call-parser hermes`` (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, as
  Hermes, Qwen 2.5/3 and others write them); text before the first call is the message's content;
- ``"none"``: no call; the tools still reach the chat template.

The model sees the tools only through its chat template (``apply_chat_template(tools=...)``); a template that does not
render them leaves named and required calls to the structured output alone. Answers carry ``message.tool_calls``
(``finish_reason`` ``"tool_calls"``, or ``"stop"`` for a named call, as OpenAI's); streamed, content goes out as it
comes, and the calls in one chunk when the choice ends (a text cut by ``max_tokens`` stays content).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from waferline.server.protocol import APIError

PARSERS = ("hermes",)
OPEN, CLOSE = "<tool_call>", "</tool_call>"
_HERMES = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|$)", re.DOTALL)


@dataclass
class ToolPlan:
    """What a chat request's tools ask of its answer: ``mode`` "named", "required" or "auto"."""

    mode: str
    tools: dict[str, dict[str, Any]]  # name -> its parameters schema
    name: str | None = None  # (named)
    parallel: bool = True

    def structured(self) -> dict[str, Any]:
        """The SamplingParams fields that hold the answer to this plan's calls (none for "auto")."""
        if self.mode == "named":
            return {"json_schema": _object(self.name or "", self.tools[self.name or ""])}
        if self.mode == "required":
            # each tool's whole schema sits under the array schema's "$defs", named after the tool, and its local
            # references ("#", "#/$defs/Loc", "#/properties/a") are re-rooted there: they keep pointing into it
            refs = {n: "#/$defs/" + n.replace("~", "~0").replace("/", "~1") for n in self.tools}  # (JSON pointers)
            defs = {n: _rooted(_object(n, schema), refs[n]) for n, schema in self.tools.items()}
            items = [{"type": "object", "properties": {"name": {"const": n}, "parameters": {"$ref": ref}},
                      "required": ["name", "parameters"], "additionalProperties": False} for n, ref in refs.items()]
            return {"json_schema": {"type": "array", "items": {"anyOf": items}, "minItems": 1, "$defs": defs}
                    | ({} if self.parallel else {"maxItems": 1})}
        return {}

    def calls(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """A finished answer's (content, tool calls): no calls where the text holds none this plan can read (then the
        whole text is the content)."""
        found: list[tuple[str, Any]] = []
        content: str | None = None
        try:
            if self.mode == "named":
                found = [(self.name or "", _loads(text))]
            elif self.mode == "required":
                found = [(c["name"], c["parameters"]) for c in _loads(text)]
            else:
                first = text.find(OPEN)
                if first < 0:
                    return text, []
                for m in _HERMES.finditer(text, first):
                    call = _loads(m.group(1))
                    args = call.get("arguments", call.get("parameters", {}))
                    found.append((call["name"], _loads(args) if isinstance(args, str) else args))
                content = text[:first] or None  # (as it was streamed)
            if not found or any(not isinstance(name, str) or name not in self.tools or not isinstance(args, dict)
                                for name, args in found):
                return text, []
            if not self.parallel:
                found = found[:1]
            return content, [call_object(name, _dumps(args)) for name, args in found]
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError):  # (cut by max_tokens, not a call
            # at all, or nested deeper than Python decodes or writes back)
            return text, []

    def finish_reason(self, calls: list[dict[str, Any]], reason: str | None) -> str | None:
        return "tool_calls" if calls and self.mode != "named" else reason


def _object(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    """A tool's parameters schema held to objects (a call's arguments are one: a schema without "type", or with
    "null" among its types, also allows arrays, numbers, null); a 400 where it describes no object."""
    kind = schema.get("type")
    if kind == "object":
        return schema
    if kind is None or isinstance(kind, list) and "object" in kind:
        return schema | {"type": "object"}
    raise APIError(f"tools: the parameters of {name} describe {json.dumps(kind)[:40]}, not an object (a call's "
                   'arguments are one: {"type": "object", ...})', param="tools")


# keywords whose values are instances (data, kept as they are), and those whose values map names to schemas
_DATA = frozenset(("const", "enum", "default", "examples"))
_NAMED = frozenset(("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"))


def _rooted(node: Any, root: str, names: bool = False) -> Any:
    """``node`` (a tool's parameters schema) with its local "$ref" values ("#", "#/...") re-rooted at ``root``. An
    anchor's ("#name") is left as it is, and so is a part with an "$id" of its own (a resource, the tool's whole
    schema too): its local references are to itself wherever it sits. Instances (a "const", an "enum"'s values) are
    data, not schemas: a "$ref" in them stays as written. ``names``: ``node`` maps names to schemas."""
    if isinstance(node, dict):
        if names:
            return {k: _rooted(v, root) for k, v in node.items()}
        if isinstance(node.get("$id"), str) and not node["$id"].startswith("#"):
            return node
        return {k: root + v[1:] if k == "$ref" and isinstance(v, str) and (v == "#" or v.startswith("#/"))
                else v if k in _DATA else _rooted(v, root, k in _NAMED) for k, v in node.items()}
    if isinstance(node, list):
        return [_rooted(v, root) for v in node]
    return node


class _Number(str):
    """A JSON number with a fraction or exponent, as the model wrote it (1e999 is not Infinity; no digit is lost)."""


def _loads(text: str) -> Any:
    """JSON whose numbers with a fraction or exponent stay as written: a call's arguments go back out as they came."""
    return json.loads(text, parse_float=_Number)


def _dumps(v: Any) -> str:
    """``v`` (from ``_loads``) as JSON text, ", " and ": " between items, numbers as written."""
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_dumps(k)}: {_dumps(x)}" for k, x in v.items()) + "}"
    if isinstance(v, list):
        return "[" + ", ".join(_dumps(x) for x in v) + "]"
    if isinstance(v, _Number):
        return str.__str__(v)
    out = json.dumps(v, ensure_ascii=False)
    try:
        out.encode("utf-8")
    except UnicodeEncodeError:  # (a lone surrogate escape, "\ud800": as \uXXXX, which the answer's UTF-8 can hold)
        return json.dumps(v)
    return out


def call_object(name: str, arguments: str) -> dict[str, Any]:
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": name, "arguments": arguments}}


def plan_of(req: Any, parser: str | None) -> ToolPlan | None:
    """The tool plan of a chat request (None: no calls will be read), or a 400 naming the field that is wrong."""
    tools = getattr(req, "tools", None) or []
    choice = req.tool_choice
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise APIError("tools: each function needs a name of its own", param="tools")
    schemas = {t.function.name: t.function.parameters or {"type": "object"} for t in tools}
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if choice.get("type") == "function" and isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise APIError('tool_choice: give "none", "auto", "required" or {"type": "function", "function": '
                           '{"name": ...}}', param="tool_choice")
        if name not in schemas:
            raise APIError(f"tool_choice names {name[:64]!r}, which is not among the tools", param="tool_choice")
        return ToolPlan("named", schemas, name)
    if choice not in (None, "none", "auto", "required"):
        raise APIError(f'tool_choice must be "none", "auto", "required" or a named function, got {str(choice)[:40]!r}',
                       param="tool_choice")
    if choice in ("auto", "required") and not tools:
        raise APIError(f'tool_choice "{choice}" needs tools', param="tool_choice")
    if not tools or choice == "none":
        return None
    parallel = req.parallel_tool_calls is not False
    if choice == "required":
        return ToolPlan("required", schemas, parallel=parallel)
    if parser is None:
        raise APIError('tool_choice "auto" (the default where tools are given) needs the model\'s tool-call format: '
                       "start the server with --tool-call-parser hermes, or send tool_choice \"required\" or a named "
                       "function", param="tool_choice")
    return ToolPlan("auto", schemas, parallel=parallel)


@dataclass
class ToolStream:
    """One streamed choice under a tool plan: ``feed`` gives the text that may go out as content now (under "auto",
    all before a call's opening tag, holding back a tail that may begin one; under named and required, nothing),
    ``finish`` the content still held and the calls."""

    plan: ToolPlan
    text: str = ""
    sent: int = 0
    held: bool = False
    calls: list[dict[str, Any]] = field(default_factory=list)

    def feed(self, piece: str) -> str:
        self.text += piece
        if self.plan.mode != "auto" or self.held:
            return ""
        at = self.text.find(OPEN, self.sent)
        if at >= 0:
            self.held = True
            end = at
        else:
            keep = next((k for k in range(min(len(OPEN) - 1, len(self.text)), 0, -1)
                         if OPEN.startswith(self.text[-k:])), 0)
            end = len(self.text) - keep
        out, self.sent = self.text[self.sent:end], max(self.sent, end)
        return out

    def finish(self) -> str:
        """The content still to send at the choice's end (the calls are then in ``calls``)."""
        content, self.calls = self.plan.calls(self.text)
        if not self.calls:
            return self.text[self.sent:]
        if self.plan.mode == "auto":  # (content before the first call went out already)
            return ""
        return content or ""
