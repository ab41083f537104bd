"""How long a burst of plain greedy steps is when a step drafts nothing (``burst_len``)."""

from __future__ import annotations

from waferline.engine import sampling


def burst_len(idle: int) -> int:
    """How many plain greedy steps run back to back (``DecoderModel.greedy_steps``) when a step drafts nothing, after
    ``idle`` steps or bursts in a row that drafted nothing: 1, 2, 4, then sampling.GREEDY_BURST. Where adaptive K has
    found that speculation does not pay, or the n-gram lookup keeps finding no match, the plain steps cost what plain
    greedy decode's do; a row whose drafts pay again waits at most one burst for its next draft."""
    return max(1, min(sampling.GREEDY_BURST, 1 << min(idle, 30)))
