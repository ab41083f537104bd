"""What speculative decoding did in a run (``SpecStats``, the pipeline's) and how long a burst of plain greedy steps is
when a step drafts nothing (``burst_len``)."""

from __future__ import annotations

from dataclasses import dataclass

from waferline.engine import sampling


@dataclass
class SpecStats:
    steps: int = 0          # verify forwards (of the rows' steps: a row's step counts once)
    row_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    plain_steps: int = 0    # steps where no row drafted (plain decode)

    def metrics(self) -> dict[str, float]:
        return {"spec_acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
                "spec_mean_accepted_length": self.emitted / self.row_steps if self.row_steps else 0.0,
                "spec_drafted": float(self.drafted), "spec_accepted": float(self.accepted),
                "spec_verify_steps": float(self.steps), "spec_plain_steps": float(self.plain_steps)}


def burst_len(idle: int) -> int:
    """How many plain greedy steps run back to back (``DecoderModel.greedy_steps``) when a step drafts nothing, after
    ``idle`` steps or bursts in a row that drafted nothing: 1, 2, 4, then LLM's GREEDY_BURST. Where adaptive K has
    found that speculation does not pay, or the n-gram lookup keeps finding no match, the plain steps cost what plain
    greedy decode's do; a row whose drafts pay again waits at most one burst for its next draft."""
    return max(1, min(sampling.GREEDY_BURST, 1 << min(idle, 30)))
