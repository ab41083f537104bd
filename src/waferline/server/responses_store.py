"""Stored responses of the Responses API (``POST /v1/responses`` with ``store``, ``previous_response_id``; ``GET`` and
``DELETE /v1/responses/{id}``, ``GET /v1/responses/{id}/input_items``), kept in this process's memory.

``ResponseStore`` holds at most ``capacity`` responses (``serve --responses-store N``, default 1024; 0: none, and
``store: true`` and ``previous_response_id`` are refused) and at most ``max_bytes`` of them (256 MiB; each entry
counted at its whole conversation's JSON size, items it shares with others included, so the count is never below what
the entries hold): a least-recently-used map, so adding one past either bound evicts those unused longest (a lookup
counts as a use); one entry larger than the whole budget is not kept. Each entry is the finished ``response`` object
as answered and the input items the model saw for it: the items of the chain of responses before it (their inputs and
outputs, in order; not their ``instructions``, which apply to their own request only, as OpenAI's API does) and then
the request's own ``input``. A request with ``previous_response_id`` runs on that entry's items and output items,
then its own input, so an entry needs no other to be continued: evicting or deleting a response leaves those that
continued it whole. Items keep what was sent (each given an ``id`` where it had none), so a conversation continued
here renders the same prompt as the same items sent in ``input``.

The store is one per server (every API key's requests see every response, as a single-tenant server's do) and safe to
use from any thread (one lock). An unknown id (never stored, stored with ``store: false``, evicted, deleted) is
OpenAI's error: a 400 ``previous_response_not_found`` naming ``previous_response_id`` where a request continues it, a
404 where it is read or deleted."""

from __future__ import annotations

import json
import threading
import uuid
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from waferline.server.protocol import APIError

DEFAULT_CAPACITY = 1024
DEFAULT_MAX_BYTES = 256 * 2**20
MAX_LIST = 100  # most input items one page lists (OpenAI's bound; 20 by default)
_PREFIX = {"function_call": "fc_", "function_call_output": "fco_"}  # (an item's id prefix by type; else msg_)


@dataclass(frozen=True)
class Stored:
    """One stored response: its ``response`` object and the input ``items`` the model saw (the chain's, then its own),
    each with an ``id``."""

    response: dict[str, Any]
    items: list[dict[str, Any]]

    def conversation(self) -> list[dict[str, Any]]:
        """The items a request continuing this response starts from: its input items, then its output items."""
        return self.items + list(self.response["output"])


class ResponseStore:
    """A bounded, thread-safe map of response id -> ``Stored`` (least recently used evicted first)."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY, max_bytes: int = DEFAULT_MAX_BYTES):
        if capacity < 0:
            raise ValueError(f"the responses store holds 0 or more responses, got {capacity}")
        self.capacity, self.max_bytes = capacity, max_bytes
        self._entries: OrderedDict[str, Stored] = OrderedDict()
        self._sizes: dict[str, int] = {}
        self.bytes = 0  # the entries' sizes (their conversations' JSON), summed
        self._lock = threading.Lock()

    @property
    def on(self) -> bool:
        return self.capacity > 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def put(self, entry: Stored) -> None:
        if not self.on:
            return
        rid = entry.response["id"]
        size = len(json.dumps(entry.conversation(), default=str))  # (outside the lock: a long chain takes a while)
        with self._lock:
            self._drop(rid)
            if size > self.max_bytes:
                return
            self._entries[rid], self._sizes[rid] = entry, size
            self.bytes += size
            while len(self._entries) > self.capacity or self.bytes > self.max_bytes:
                self._drop(next(iter(self._entries)))

    def _drop(self, rid: str) -> bool:
        """Remove ``rid``'s entry (under the lock): whether there was one."""
        if self._entries.pop(rid, None) is None:
            return False
        self.bytes -= self._sizes.pop(rid)
        return True

    def get(self, rid: str) -> Stored | None:
        with self._lock:
            entry = self._entries.get(rid)
            if entry is not None:
                self._entries.move_to_end(rid)
            return entry

    def delete(self, rid: str) -> bool:
        with self._lock:
            return self._drop(rid)

    def previous(self, rid: Any) -> Stored:
        """The response a request continues (``previous_response_id``), or OpenAI's 400 for one not stored."""
        if not isinstance(rid, str) or not rid:
            raise APIError(f"previous_response_id: give a response id (a string), got {str(rid)[:40]!r}",
                           param="previous_response_id")
        entry = self.get(rid)
        if entry is None:
            raise APIError(f"Previous response with id '{rid[:100]}' not found.", param="previous_response_id",
                           code="previous_response_not_found")
        return entry

    def stored(self, rid: str) -> Stored:
        """A stored response by id, or a 404."""
        entry = self.get(rid) if self.on else None
        if entry is None:
            raise APIError(f"Response with id '{rid[:100]}' not found." + ("" if self.on else
                           " (this server stores no responses: serve --responses-store N)"), 404,
                           param="response_id", code="response_not_found")
        return entry


def with_ids(items: list[dict[str, Any]], earlier: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A request's input items to store: each as sent, with a new ``id`` (on a copy) where it has none, or one an item
    before it in the request has; an id an item of ``earlier`` (the chain's) has is a 400, as OpenAI's API refuses
    it: the previous response's items sent again."""
    chain = {item["id"] for item in earlier}
    seen: set[str] = set()
    out = []
    for i, item in enumerate(items):
        rid = item.get("id")
        if isinstance(rid, str) and rid in chain:
            raise APIError(f"input[{i}]: duplicate item id {rid[:64]!r}: the previous response's items are part of "
                           "the conversation already (send only the new items with previous_response_id)",
                           param="input")
        if not isinstance(rid, str) or not rid or rid in seen:
            item = dict(item, id=_PREFIX.get(item.get("type", "message"), "msg_") + uuid.uuid4().hex)
        seen.add(item["id"])
        out.append(item)
    return out


def listed(item: dict[str, Any]) -> dict[str, Any]:
    """A stored input item as ``input_items`` lists it (OpenAI's item shapes: text content as parts)."""
    kind = item.get("type", "message")
    if kind == "function_call":
        return {"id": item["id"], "type": kind, "call_id": item["call_id"], "name": item["name"],
                "arguments": item["arguments"], "status": "completed"}
    if kind == "function_call_output":
        output = item["output"]
        if isinstance(output, list):
            output = [{"type": "input_text", "text": p["text"]} for p in output]
        return {"id": item["id"], "type": kind, "call_id": item["call_id"], "output": output, "status": "completed"}
    assistant = item["role"] == "assistant"
    content = item["content"]
    texts = [content] if isinstance(content, str) else [p["text"] for p in content]
    parts = [{"type": "output_text", "text": t, "annotations": []} if assistant else {"type": "input_text", "text": t}
             for t in texts]
    return {"id": item["id"], "type": "message", "role": item["role"], "content": parts, "status": "completed"}


def check_query(query: Any, include: str, stream: bool = False) -> None:
    """A 400 naming what a read of a stored response asks for that this server does not give: ``include`` values
    other than ``include`` (the one it gives, as the response holds it already), and (``stream``: the read of the
    response itself) ``stream=true``: a stored response is finished, and is read whole."""
    for v in query.getlist("include[]") + query.getlist("include"):  # (the openai client sends include[]=...)
        if v != include:
            raise APIError(f"include: {v[:60]!r} is not supported (only {include!r})", param="include")
    if stream and query.get("stream", "false").lower() not in ("false", "0"):
        raise APIError("stream is not supported here: a stored response is finished (read it whole)", param="stream")


def input_items(entry: Stored, query: Mapping[str, str]) -> dict[str, Any]:
    """``GET /v1/responses/{id}/input_items``: a page of the input items the model saw (``order`` "desc", the
    default, or "asc"; ``limit`` 1-100, default 20; ``after`` an item id, as the openai client pages), in OpenAI's list
    shape; other values of those, and ``before``, are a 400 naming them."""
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise APIError(f"order: \"asc\" or \"desc\", got {order[:20]!r}", param="order")
    text = query.get("limit", "20")
    # (4 significant digits at most read: past 100 either way, and int() refuses more than 4300 digits)
    limit = int(text.lstrip("0")[:4] or "0") if text.isascii() and text.isdigit() else 0
    if not 1 <= limit <= MAX_LIST:
        raise APIError(f"limit: an integer from 1 to {MAX_LIST}, got {text[:20]!r}", param="limit")
    if "before" in query:
        raise APIError("before is not supported: page with after", param="before")
    items = entry.items if order == "asc" else entry.items[::-1]
    after = query.get("after")
    if after is not None:
        at = next((k for k, item in enumerate(items) if item["id"] == after), None)
        if at is None:
            raise APIError(f"after: no input item of this response has id {after[:64]!r}", param="after")
        items = items[at + 1:]
    page = [listed(item) for item in items[:limit]]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > len(page)}
