"""Function calling on the Responses API (``POST /v1/responses``), in chat's terms: the Responses API's flat function
tools (``{"type": "function", "name", "description", "parameters", "strict"}``) and ``tool_choice`` as chat's
(server/tools.py reads and holds the calls), its ``function_call`` / ``function_call_output`` input items as chat's
assistant ``tool_calls`` and ``role: "tool"`` messages, and chat's tool calls as ``function_call`` output items.
Built-in tools (web search, file search, code interpreter, MCP, ...) are refused: this server runs none."""

from __future__ import annotations

import uuid
from typing import Any

from waferline.server.protocol import APIError

_TOOL_KEYS = ("name", "description", "parameters", "strict")
_CHOICE_HINT = 'give "none", "auto", "required" or {"type": "function", "name": ...}'


def chat_tools(tools: Any) -> list[dict[str, Any]]:
    """``tools`` as chat's (``{"type": "function", "function": {...}}``; their fields are checked as chat checks
    them), or a 400 naming a tool type this server does not run."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise APIError("tools: give a list of function tools", param="tools")
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if not isinstance(kind, str):
            raise APIError(f'tools[{i}]: give {{"type": "function", "name": ...}}', param="tools")
        if kind != "function":
            raise APIError(f"tools[{i}]: tools of type {kind[:40]!r} are not supported (function tools only: this "
                           "server runs no built-in tools)", param="tools")
        out.append({"type": "function", "function": {k: tool[k] for k in _TOOL_KEYS if k in tool}})
    return out


def echoed_tools(tools: Any) -> list[dict[str, Any]]:
    """The request's function tools as the response echoes them (checked already: see ``chat_tools``)."""
    return [{"type": "function"} | {k: t.get(k) for k in _TOOL_KEYS} for t in tools or []]


def chat_tool_choice(choice: Any, tools: bool) -> Any:
    """``tool_choice`` as chat's (None: chat's default), or a 400. ``tools``: the request gives some ("none" and
    "auto" without tools mean what leaving it out does)."""
    if choice is None or choice in ("none", "auto") and not tools:
        return None
    if choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        if not isinstance(choice.get("name"), str):
            raise APIError(f"tool_choice: {_CHOICE_HINT}", param="tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}
    if isinstance(choice, dict) and isinstance(choice.get("type"), str):
        raise APIError(f"tool_choice of type {choice['type'][:40]!r} is not supported (function tools only): "
                       f"{_CHOICE_HINT}", param="tool_choice")
    raise APIError(f"tool_choice: {_CHOICE_HINT}, got {str(choice)[:40]!r}", param="tool_choice")


def call_message(item: dict[str, Any], i: int, out: list[dict[str, Any]]) -> None:
    """Add a ``function_call`` input item (an earlier response's call, sent back) to the chat messages ``out``: a call
    of chat's on the assistant message before it (one message holds a turn's text and calls), or on a new one."""
    for key in ("call_id", "name", "arguments"):
        if not isinstance(item.get(key), str):
            raise APIError(f"input[{i}]: a function_call item needs {key} (a string; arguments: JSON text)",
                           param="input")
    call = {"id": item["call_id"], "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]}}
    if out and out[-1]["role"] == "assistant":
        out[-1].setdefault("tool_calls", []).append(call)
    else:
        out.append({"role": "assistant", "content": None, "tool_calls": [call]})


def output_message(item: dict[str, Any], i: int, parts: Any, called: set[str]) -> dict[str, Any]:
    """A ``function_call_output`` input item (a call's result) as chat's tool message; ``parts`` reads a list
    ``output`` as message content; ``called``: the call ids of the ``function_call`` items before it (a stored
    conversation's included), one of which it answers (as OpenAI's API checks: an output of no call is a 400, not a
    tool message the model reads without it)."""
    if not isinstance(item.get("call_id"), str):
        raise APIError(f"input[{i}]: a function_call_output item needs call_id (a string)", param="input")
    output = item.get("output")
    if isinstance(output, list):
        output = parts(output, f"input[{i}].output")
    elif not isinstance(output, str):
        raise APIError(f"input[{i}].output: give a string or a list of input_text parts", param="input")
    if item["call_id"] not in called:
        raise APIError(f"input[{i}]: no function_call item before it has call_id {item['call_id'][:64]!r} (send the "
                       "response's function_call items back in input, before their outputs, or continue a stored "
                       "response that has them with previous_response_id)", param="input")
    return {"role": "tool", "tool_call_id": item["call_id"], "content": output}


def call_item(call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    """One of chat's tool calls as a ``function_call`` output item (``call_id``: chat's call id)."""
    fn = call["function"]
    return {"type": "function_call", "id": "fc_" + uuid.uuid4().hex, "call_id": call["id"], "name": fn["name"],
            "arguments": fn["arguments"], "status": status}
