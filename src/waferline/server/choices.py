"""The choices of one completion or chat completion response: one engine sequence each (``n`` per prompt, several
prompts in a completion), their events gathered into the OpenAI answer (``Choices.body``) or turned into SSE chunks
as they arrive (``Choices.chunks``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from waferline.engine.sampling import TokenLogprobs
from waferline.engine.sequence import Event
from waferline.server.logprobs import TokenTexts, chat_entry, completion_logprobs, echoed, text_offsets
from waferline.server.tools import ToolPlan, ToolStream


@dataclass
class Choice:
    """One choice: its prompt, what it echoes (completions ``echo``: the prompt's text; None: nothing) and, as its
    events arrive, its text, tokens and log-probabilities."""

    index: int
    ids: list[int]
    first_of_prompt: bool  # (a prompt's tokens count once in usage, whatever n)
    echo: str | None = None
    text: list[str] = field(default_factory=list)
    toks: list[int] = field(default_factory=list)
    lps: list[TokenLogprobs] = field(default_factory=list)
    prompt_lps: list[TokenLogprobs] | None = None
    last: Event | None = None
    emitted: int = 0  # characters of generated text sent so far
    starts: list[int] = field(default_factory=list)  # (each generated token's: its text_offset past the echo)
    echoed: bool = False  # (streamed: the prompt was sent)
    tool_stream: ToolStream | None = None  # (streamed chat with tools: the content held back, the calls)


class Choices:
    """The choices of one request. ``score_only``: completions ``echo`` with ``max_tokens`` 0 (the prompt scored
    alone: each choice's one generated token is left out of the answer); ``texts``: token texts for log-probabilities
    (None: none were asked for); ``tools``: a chat request's tool plan (server/tools.py), whose calls are read from
    each choice's text."""

    def __init__(self, chat: bool, prompts: list[list[int]], n: int, echo: list[str] | None, score_only: bool,
                 texts: TokenTexts | None, token_ids: bool, tools: ToolPlan | None = None):
        """``prompts``: each choice's (each prompt ``n`` times in a row); ``echo``: each choice's echoed text."""
        self.chat, self.score_only, self.texts, self.token_ids = chat, score_only, texts, token_ids
        self.tools = tools
        self.items = [Choice(i, ids, i % n == 0, None if echo is None else echo[i],
                             tool_stream=None if tools is None else ToolStream(tools)) for i, ids in enumerate(prompts)]

    # -- the whole answer
    def add(self, i: int, ev: Event) -> None:
        c = self.items[i]
        if ev.token_id is not None:
            c.toks.append(ev.token_id)
            c.starts.append(self._offset(c, ev))
        c.emitted += len(ev.text)
        if ev.logprobs is not None:
            c.lps.append(ev.logprobs)
        if ev.prompt_logprobs is not None:
            c.prompt_lps = ev.prompt_logprobs
        c.text.append(ev.text)
        c.last = ev

    def failure(self) -> Event | None:
        """The event of a choice that did not finish well (an error first, else one without an end), if any."""
        for c in self.items:
            if c.last is not None and c.last.finish_reason == "error":
                return c.last
        for c in self.items:
            if c.last is None or not c.last.finished or c.last.finish_reason == "error":
                return c.last or Event(None, "", True, "error", error="the request did not finish")
        return None

    def body(self) -> tuple[list[dict[str, Any]], dict[str, int]]:
        """The ``choices`` and ``usage`` of the answer, once every choice has finished well."""
        out = []
        for c in self.items:
            assert c.last is not None
            text, toks, lps = ("", [], []) if self.score_only else ("".join(c.text), c.toks, c.lps)
            choice: dict[str, Any] = {"index": c.index, "logprobs": None, "finish_reason": self._reason(c.last)}
            if self.chat and self.tools is not None:
                content, calls = self.tools.calls(text)
                choice["message"] = {"role": "assistant", "content": content} | ({"tool_calls": calls} if calls else {})
                choice["finish_reason"] = self.tools.finish_reason(calls, choice["finish_reason"])
            elif self.chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = (c.echo or "") + text
            if self.texts is not None and self.chat:
                choice["logprobs"] = {"content": [chat_entry(lp, self.texts) for lp in lps]}
            elif self.texts is not None:
                items = self._echoed(c, c.prompt_lps) + [(lp.token, lp) for lp in lps]
                # (a token inside a stop string, streamed before the stop was known, starts at the text's end)
                offsets = self._echo_offsets(c) + [len(c.echo or "") + min(s, len(text)) for s in c.starts[:len(lps)]]
                choice["logprobs"] = completion_logprobs(items, self.texts, offsets)
            if self.token_ids:
                choice["token_ids"] = toks
            out.append(choice)
        return out, self.usage()

    def usage(self) -> dict[str, Any]:
        """OpenAI's usage; ``prompt_tokens_details.cached_tokens``: the prompt tokens read from cached prefix pages."""
        prompt = sum(len(c.ids) for c in self.items if c.first_of_prompt)
        done = 0 if self.score_only else sum(c.last.completion_tokens for c in self.items if c.last is not None)
        cached = sum(c.last.cached_tokens for c in self.items if c.first_of_prompt and c.last is not None)
        return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done,
                "prompt_tokens_details": {"cached_tokens": cached}}

    # -- streamed
    def opening(self) -> list[dict[str, Any]]:
        """The chunks before any token: chat's assistant role, per choice."""
        return [self._chunk(c, "", role=True) for c in self.items] if self.chat else []

    def chunks(self, i: int, ev: Event) -> list[dict[str, Any]]:
        """The chunks ``ev`` of choice ``i`` streams (the echoed prompt with a first token, the token, the finish)."""
        c = self.items[i]
        c.last = ev
        out = []
        if ev.token_id is not None and c.echo is not None and not c.echoed:
            c.echoed = True
            ch = self._chunk(c, c.echo)
            if self.texts is not None:
                ch["logprobs"] = completion_logprobs(self._echoed(c, ev.prompt_logprobs), self.texts,
                                                     self._echo_offsets(c))
            out.append(ch)
        if ev.token_id is not None and not self.score_only:
            c.starts.append(self._offset(c, ev))  # (a Responses stream's text, cut before a call, keeps its tokens')
            text = ev.text if c.tool_stream is None else c.tool_stream.feed(ev.text) or None
            ch = self._chunk(c, text)
            # (a tool call's text is held back until it parses: a token that adds nothing else sends no chunk)
            held = c.tool_stream is not None and text is None and not self.token_ids and (
                self.texts is None or ev.logprobs is None)
            if self.texts is not None and ev.logprobs is not None:
                if self.chat:
                    ch["logprobs"] = {"content": [chat_entry(ev.logprobs, self.texts)]}
                else:
                    ch["logprobs"] = completion_logprobs([(ev.logprobs.token, ev.logprobs)], self.texts,
                                                         [len(c.echo or "") + self._offset(c, ev)])
            if self.token_ids:
                ch["token_ids"] = [ev.token_id]
            if not held:
                out.append(ch)
        c.emitted += len(ev.text)
        if ev.finished and ev.finish_reason != "error":
            reason = self._reason(ev)
            if c.tool_stream is not None:
                rest = c.tool_stream.finish()
                if rest:
                    out.append(self._chunk(c, rest))
                if c.tool_stream.calls:
                    ch = self._chunk(c, None)
                    ch["delta"]["tool_calls"] = [{"index": k} | call for k, call in enumerate(c.tool_stream.calls)]
                    out.append(ch)
                reason = c.tool_stream.plan.finish_reason(c.tool_stream.calls, reason)
            ch = self._chunk(c, None if self.chat else "")
            ch["finish_reason"] = reason
            out.append(ch)
        return out

    # -- pieces
    def _chunk(self, c: Choice, text: str | None, role: bool = False) -> dict[str, Any]:
        ch: dict[str, Any] = {"index": c.index, "logprobs": None, "finish_reason": None}
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            ch["delta"] = delta
        else:
            ch["text"] = text or ""
        return ch

    @staticmethod
    def _offset(c: Choice, ev: Event) -> int:
        """Where ``ev``'s token's text starts in the choice's generated text (the engine's count: the text sent so far
        lags it while characters that may start a stop string are held back)."""
        return c.emitted if ev.text_offset is None else ev.text_offset

    def _reason(self, ev: Event) -> str | None:
        return "length" if self.score_only else ev.finish_reason

    @staticmethod
    def _echoed(c: Choice, prompt_lps: list[TokenLogprobs] | None) -> list[tuple[int, TokenLogprobs | None]]:
        return echoed(c.ids, prompt_lps) if c.echo is not None else []

    def _echo_offsets(self, c: Choice) -> list[int]:
        assert self.texts is not None
        return text_offsets(c.ids, self.texts, c.echo) if c.echo is not None else []
