"""The one rule for a prompt prefilled in chunks through pipeline stages, shared by the steady-state TTFT
(``sim/pipeline.py``: chunks of ``PREFILL_CHUNK`` tokens) and the serving simulation (``sim/serving.py``: chunks of
what a step's token budget leaves).

The stages take chunks in order (a flow shop): a chunk holds the pipeline for its slowest stage (``hold``), then the
next one enters behind it; it leaves the last stage ``drain`` (the rest of its pass through every stage and hop) after
its step ends, but never before the chunk ahead of it has left, plus its own slowest stage's time. Each chunk is
priced at its real size (a 513-token prompt is a 512-token chunk and a 1-token chunk, not two of 512)."""

from __future__ import annotations

from collections.abc import Callable


class ChunkExit:
    """When the last chunk so far leaves the pipeline's last stage:
    exit = max(its step's end + its drain, the previous exit + its hold). With chunks of one size this is
    Σ stages(chunk) + (chunks - 1) x slowest; on one stage (no drain, hold = the whole pass) it is the step's end."""

    __slots__ = ("t",)

    def __init__(self) -> None:
        self.t = 0.0

    def after(self, step_end: float, hold: float, drain: float) -> float:
        self.t = max(self.t + hold, step_end + drain)
        return self.t


def pipelined_prefill(prompt: int, chunk: int, price: Callable[[int], tuple[float, float]]) -> float:
    """Seconds from the first chunk entering the pipeline to the last leaving it, for ``prompt`` tokens in chunks of
    ``chunk`` (the last one its real size), back to back. ``price(n)``: (one pass of an n-token chunk through every
    stage and hop, its slowest stage). ``ChunkExit``'s rule in closed form: full chunks Σ stages + (chunks - 1) x
    slowest; a partial last chunk then leaves max(its slowest stage after the full ones' exit, its own pass after it
    enters)."""
    n_full, rest = divmod(prompt, chunk)
    if n_full == 0:
        return price(rest)[0]
    total, slow = price(chunk)
    t = total + (n_full - 1) * slow
    if rest:
        total_r, slow_r = price(rest)
        t = max(t + slow_r, n_full * slow + total_r)
    return t
