"""Adaptive K: how many tokens each step drafts.

Each row keeps an estimate α of its per-token acceptance (exponential average of accepted / drafted).
The step's K maximises the expected speedup  E(k) · c(B, 0) / c(B, k)  where  E(k) = (1 − α^(k+1)) / (1 − α)  is the
expected number of tokens a step emits and  c(B, k) = (overhead + B·(k + 1)) + k·draft_cost·(overhead + B)  is the
cost of a step with B rows in tokens-equivalent: a forward costs t0 + t1·N for N tokens, ``overhead`` = t0 / t1
(measured by ``benchmarks/speculative.py``), and a drafted token costs ``draft_cost`` of a one-token target step
(0 for n-grams, about 1 / layers for an MTP head, the layer ratio for a draft model). That is the prior: the engines
time every step (B rows x T tokens) and every drafting pass, and measured costs replace the prior (``AdaptiveK.record``;
one plain step in 16 keeps the plain cost measured; a lone slow step, a GC pause, moves no estimate). When even k = 1
does not pay — a large batch, a low acceptance, or a verify that costs much more than a plain step — the step is a
plain decode step: speculation backs off by itself as the batch grows. A row that has not drafted for 64 steps
drafts one token (in a step that drafts nothing else, every row does), so its acceptance and a verify's cost are
measured again: a sequence whose drafts pay again drafts again. Greedy steps in which no row drafts (k = 0, or no
n-gram match) run as plain greedy decode does, in bursts of steps from one Python call (``speculator.burst_len``: 1,
2, 4, then 8 after such steps in a row), so a speculative run whose drafts do not pay costs about what plain decoding
does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from waferline.engine.sampling import SamplingParams


def expected_tokens(alpha: float, k: int) -> float:
    """Expected tokens one verify step emits with k drafts of per-token acceptance alpha: (1 − α^(k+1)) / (1 − α)."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


@dataclass
class AdaptiveK:
    """Chooses each step's number of drafts from the observed acceptance and the batch size (see the module doc).

    ``overhead``: a forward's fixed cost in per-token units (t(N tokens) ≈ t0 + t1·N, overhead = t0 / t1);
    ``cost_table``: measured (N tokens, seconds) points of one forward, used instead of that line when given
    (piecewise linear; on CPUs the step from 1 token (gemv) to 2 (gemm) is far from linear);
    ``draft_cost``: a drafted token's cost relative to a one-token target step. ``enabled`` False: always k_max.

    ``measure``: learn what steps really cost while decoding. The engine calls ``record(B, T, seconds)`` after
    each step of B rows x T tokens (and ``record_draft`` for drafting time); a measured (B, T) replaces the prior
    (the line or table above, scaled to the measured seconds). A verify of T tokens may cost far more than T/1 of a
    plain step (different kernels, a Mamba-2 trail) — or hardly more (a pipeline's hops): either way K follows the
    measurement. So that a plain step's cost is known too, a row set that has not taken one for
    ``explore_every`` steps takes one, and a row that has not drafted for ``probe_every`` steps drafts one token.
    (Off for seeded sampling: see ``reproducible_k``.)"""

    k_max: int
    enabled: bool = True
    overhead: float = 24.0
    cost_table: list[tuple[int, float]] | None = None
    draft_cost: float = 0.0
    prior: float = 0.6
    decay: float = 0.7
    alpha: dict[int, float] = field(default_factory=dict)
    measure: bool = False
    explore_every: int = 16
    explore_run: int = 1  # plain steps in a row when exploring (a pipeline: its micro-batches, so they run alike)
    observed: dict[tuple[int, int], float] = field(default_factory=dict)  # (B, T) -> seconds (EMA)
    draft_s: dict[int, float] = field(default_factory=dict)  # B -> seconds per drafted token step (EMA)
    since_plain: dict[int, int] = field(default_factory=dict)  # B -> steps since the last plain step
    warm: set[tuple[int, Any]] = field(default_factory=set)  # (table, key) measured at least once
    last: dict[tuple[int, Any], float] = field(default_factory=dict)  # (table, key) -> its latest measurement
    probe_every: int = 64
    since_draft: dict[int, int] = field(default_factory=dict)  # row -> steps since it last drafted

    def observe(self, row: int, drafted: int, accepted: int) -> None:
        if drafted > 0:
            a = self.alpha.get(row, self.prior)
            self.alpha[row] = self.decay * a + (1 - self.decay) * accepted / drafted

    def stepped(self, rows: list[int], steps: int) -> None:
        """``rows`` took ``steps`` more plain steps without a ``choose`` of their own (a burst's steps after its first):
        they count towards a row's probe, which is due after ``probe_every`` steps, not calls."""
        for b in rows:
            self.since_draft[b] = self.since_draft.get(b, 0) + steps

    def record(self, B: int, T: int, seconds: float) -> None:
        """A measured step of B rows x T tokens (T = 1: a plain step); ignored unless ``measure``. The first step of a
        shape is not kept (it pays one-time costs: buffers, caches growing), the next one is estimated with the one
        after it (the faster of the two: it may be a pause too); then a faster step replaces the estimate
        and a slower one moves it a quarter of the way towards the faster of it and the shape's previous step: on a
        shared machine noise only slows steps down, and one slow step (a GC pause) must not price a verify width out
        (a width the controller stops choosing is measured again only when a row probes)."""
        if self.measure:
            self._estimate(self.observed, (B, T), seconds)

    def record_draft(self, B: int, k: int, seconds: float) -> None:
        """Measured drafting time of B rows x k drafted tokens (a drafter that runs apart from the target's step),
        estimated as steps are (``record``)."""
        if k > 0 and self.measure:
            self._estimate(self.draft_s, B, seconds / k)

    def _estimate(self, table: dict, key: Any, seconds: float) -> None:
        if (id(table), key) not in self.warm:
            self.warm.add((id(table), key))
            return
        old, prev = table.get(key), self.last.get((id(table), key))
        self.last[(id(table), key)] = seconds
        if prev is None:  # (the first kept step waits for the next: a lone pause must not become the estimate)
            return
        if old is None or seconds < old:
            table[key] = min(seconds, prev)
        else:  # (a lone slow step moves nothing: the next one must be slow too)
            table[key] = old + 0.25 * max(min(seconds, prev) - old, 0.0)

    def cost(self, n: int) -> float:
        """Prior cost of one forward over n tokens (tokens-equivalent, or seconds with a cost table)."""
        pts = sorted({n: t for n, t in sorted(self.cost_table or [], key=lambda p: -p[1])}.items())  # min per n
        if not pts:
            return self.overhead + n
        if n <= pts[0][0]:
            return pts[0][1]
        for (n0, t0), (n1, t1) in zip(pts, pts[1:]):
            if n <= n1:
                return t0 + (t1 - t0) * (n - n0) / (n1 - n0)
        (n0, t0), (n1, t1) = pts[-2:] if len(pts) > 1 else (pts[0], (pts[0][0] + 1, pts[0][1]))
        return t1 + (t1 - t0) / max(n1 - n0, 1) * (n - n1)

    def step_cost(self, B: int, T: int) -> float:
        """Cost of a step of B rows x T tokens: measured when it was, else the prior scaled to the measurements."""
        got = self.observed.get((B, T))
        if got is not None:
            return got
        same = sorted((t, v) for (b, t), v in self.observed.items() if b == B)
        if len(same) >= 2:  # steps of these rows measured at two widths or more: linear in T between (or past) them
            (t0, v0), (t1, v1) = next(((p, q) for p, q in zip(same, same[1:]) if T < q[0]), same[-2:])
            return max(v0 + (v1 - v0) * (T - t0) / (t1 - t0), min(v0, v1))
        prior = self.cost(B * T)
        if self.observed:
            ratios = sorted(v / self.cost(b * t) for (b, t), v in self.observed.items())
            return prior * ratios[len(ratios) // 2]
        return prior

    def gain(self, alpha: float, k: int, batch: int) -> float:
        base = self.step_cost(batch, 1)
        if batch in self.draft_s and self.observed:
            draft = k * self.draft_s[batch]
        else:
            draft = k * self.draft_cost * base
        return expected_tokens(alpha, k) * base / (self.step_cost(batch, k + 1) + draft)

    def choose(self, rows: list[int], batch: int | None = None) -> list[int]:
        """Each row's K; ``batch``: the rows of the step they will run in, where fewer than ``rows`` (steps in flight
        split the rows between them: engine/overlap.py), so that the step's measured cost is the one weighed."""
        if not self.enabled:
            return [self.k_max] * len(rows)
        B = batch or len(rows)
        if self.measure:
            n = self.since_plain.get(B, self.explore_every - 4)  # a new batch size: a plain step soon, to measure it
            if n < 0 or n >= self.explore_every:  # exploring: explore_run plain steps (3 where never measured: the
                # first is not kept, the next waits for a third; a short run would draft on the prior meanwhile)
                self.since_plain[B] = n + 1 if n < 0 else 1 - (self.explore_run if (B, 1) in self.observed else 3)
                return [0] * len(rows)
        ks = []
        for b in rows:
            a = min(self.alpha.get(b, self.prior), 0.99)
            gains = [self.gain(a, k, B) for k in range(self.k_max + 1)]
            ks.append(max(range(self.k_max + 1), key=lambda k: gains[k]))
        # a row that has not drafted for probe_every steps drafts one token, so that its acceptance (and the cost of a
        # verify, which the controller no longer measures once it stops choosing one) is measured again; in a step
        # that drafts nothing else every row does (one probe step for the batch)
        due = [k == 0 and self.since_draft.get(b, 0) >= self.probe_every for b, k in zip(rows, ks)]
        if any(due) and self.k_max > 0:
            ks = [1 if k == 0 and (d or max(ks) == 0) else k for k, d in zip(ks, due)]
        for b, k in zip(rows, ks):
            self.since_draft[b] = 0 if k > 0 else self.since_draft.get(b, 0) + 1
        # the step's cost is set by the largest k: rows with a smaller k still pay for the padded width
        if self.measure:
            self.since_plain[B] = 0 if max(ks) == 0 else max(self.since_plain.get(B, self.explore_every - 4), 0) + 1
        return ks


def reproducible_k(params: SamplingParams) -> bool:
    """A seeded sampled run must repeat exactly, and which tokens it samples depends on the K of every step: its rows
    then draft the largest K (capped by what is left of max_tokens and the context), never a K chosen from
    wall-clock measurements (greedy output does not depend on K, so greedy and unseeded rows take adaptive K)."""
    return params.temperature > 0 and params.seed is not None
