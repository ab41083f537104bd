"""AFD's transport: Links that charge their time to a Clock (compute / transfer / idle per rank), and the
attention <-> FFN channel that moves each message in one hop."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

import torch

from waferline.engine.stage import SLOT_BYTES, Link


@dataclass
class Clock:
    """Seconds spent per activity on one rank: compute; transfer (issuing sends, and the part of a wait after the
    peer had sent); idle (the part of a wait before the peer had sent)."""

    compute: float = 0.0
    transfer: float = 0.0
    idle: float = 0.0
    messages: int = 0
    bytes: int = 0

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


class TimedLink(Link):
    """A Link that charges its time to a Clock: issuing sends = transfer; a wait splits into idle (the peer had not
    sent yet) and transfer (sent, not yet here) by the send time the message carries; both ends are on one host,
    where the clocks agree."""

    def __init__(self, pg: Any, device: torch.device, clock: Clock, slot_bytes: int = SLOT_BYTES):
        super().__init__(pg, device, slot_bytes)
        self.clock = clock

    def send(self, dst: int, kind: int, meta: list[int], tensors: list[torch.Tensor] = ()) -> None:
        t = time.perf_counter()
        super().send(dst, kind, meta, tensors)
        self.clock.transfer += time.perf_counter() - t
        self.clock.messages += 1
        self.clock.bytes += sum(x.numel() * x.element_size() for x in tensors) + 8 * len(meta)

    def _wait(self, work: Any, sent_ns: Any) -> None:
        w0 = time.time_ns()
        super()._wait(work, sent_ns)
        a = time.time_ns()
        sent = int(sent_ns()) or w0
        self.clock.transfer += max(0, a - max(sent, w0)) / 1e9
        self.clock.idle += max(0, min(sent, a) - w0) / 1e9


AFD_SLOT_BYTES = 64 * 1024  # attention -> FFN messages travel in slots of this size that the FFN rank posts ahead


class AFLink(TimedLink):
    """The attention <-> FFN channel, built so that gloo moves each message in one hop: an FFN rank keeps a slot of
    ``AFD_SLOT_BYTES`` posted for the next message from every attention rank (Link's slotted messages), and an
    attention rank posts the recv of an FFN rank's reply, whose size it knows, before it dispatches."""

    def __init__(self, pg: Any, clock: Clock, slot_bytes: int = AFD_SLOT_BYTES):
        super().__init__(pg, torch.device("cpu"), clock, slot_bytes)

    # -- FFN -> attention: replies of a size the attention rank knows
    def post_reply(self, src: int, nbytes: int) -> tuple[torch.Tensor, Any]:
        buf = torch.empty(8 + nbytes, dtype=torch.uint8)
        return buf, self._post(src, buf)

    def wait_reply(self, handle: tuple[torch.Tensor, Any]) -> torch.Tensor:
        buf, work = handle
        self._wait(work, lambda: buf[:8].view(torch.int64)[0])
        return buf[8:]

    def send_reply(self, dst: int, tensors: list[torch.Tensor]) -> None:
        t = time.perf_counter()
        parts = [torch.tensor([time.time_ns()], dtype=torch.int64).view(torch.uint8)]
        parts += [x.detach().contiguous().reshape(-1).view(torch.uint8) for x in tensors]
        self._put(dst, torch.cat(parts))
        self.clock.transfer += time.perf_counter() - t
        self.clock.messages += 1
        self.clock.bytes += sum(x.numel() * x.element_size() for x in tensors)


def _split_tail(tail: torch.Tensor, parts: list[tuple[int, torch.dtype]], D: int) -> list[torch.Tensor]:
    """Consecutive [rows, D] tensors of the given dtypes from a message's raw bytes."""
    out, i = [], 0
    for rows, dt in parts:
        nb = rows * D * torch.empty(0, dtype=dt).element_size()
        out.append(tail[i:i + nb].view(dt).view(rows, D) if rows else torch.empty(0, D, dtype=dt))
        i += nb
    return out
