"""What the simulator predicts: ``SimResult`` (a plan under a workload) and its per-stage ``StageTiming``."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class StageTiming:
    """One stage's share of a decode step (seconds)."""

    index: int
    role: str
    layers: str
    devices: int
    compute: float
    memory: float
    fixed: float
    comm: float
    hop: float
    total: float
    fabric: float = 0.0  # activation vectors streamed through a wafer's mesh (part of total)
    fabric_distance: float = 0.0  # the part of ``fabric`` spent crossing the layers' regions (hops)
    # on wafers: the share of the stage's cores its layers' regions take (laid out for its decode step; 0 elsewhere)
    cores_used: float = 0.0
    # (compute, memory) of each op (a layer, the LM head), of which the step took the larger (sim/explain.py's levers;
    # empty where the result does not carry them); not written out
    ops: list[tuple[float, float]] = field(default_factory=list, repr=False, compare=False)


@dataclass
class SimResult:
    """What the simulator predicts for a plan and a workload."""

    model: str
    hardware: str
    num_devices: int
    num_stages: int
    fits: bool
    concurrency: int
    micro_batches: int
    prompt_len: int
    output_len: int
    step_latency_s: float  # one decode step of one micro-batch through every stage, hops included
    decode_tokens_per_s_per_user: float
    aggregate_tokens_per_s: float
    ttft_s: float
    prefill_s: float  # TTFT without the fitted request overhead
    end_to_end_s: float  # the last answer token (after the hidden reasoning tokens, if any)
    bound: str  # what limits decode: latency | bandwidth | compute | pipeline
    reasoning_tokens: int = 0  # hidden tokens a reasoning model generates before its output_len answer tokens
    first_answer_s: float | None = None  # the first answer token: TTFT plus the reasoning tokens' decode
    stages: list[StageTiming] = field(default_factory=list)
    speculative: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    # attention/FFN ranks: the stages are the ranks of two sides that run at once (each rank carries its side's
    # totals), so the step is not the sum of the stages
    sides_overlap: bool = False
    # figure -> [low, high] 90% interval from the fit's parameter sets (sim.intervals.attach_intervals; empty unless
    # asked for: the planner's sweeps skip it)
    intervals: dict[str, list[float] | None] = field(default_factory=dict)
    # micro-batches of the largest size and, where the others hold a sequence less (the engine splits the sequences
    # near-equally), the stages' timings on one of those (sim/explain.py's interval); not written out
    full_micro_batches: int | None = field(default=None, repr=False, compare=False)
    smaller_stages: list[StageTiming] = field(default_factory=list, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.first_answer_s is None:
            self.first_answer_s = self.ttft_s + self.reasoning_tokens / self.decode_tokens_per_s_per_user

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for s in d["stages"]:
            del s["ops"]
        del d["full_micro_batches"], d["smaller_stages"]
        for k, v in d.pop("intervals").items():
            d[f"{k}_interval"] = v
        return d
