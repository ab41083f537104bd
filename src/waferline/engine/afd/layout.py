"""AFD's split: M attention ranks and N FFN ranks, the expert range of each FFN rank, and AFD plans."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from waferline.engine.pipeline.supervise import StageError
from waferline.errors import ConfigError, counted
from waferline.plan.place import expert_split

if TYPE_CHECKING:
    from waferline.plan.plan import Plan
    from waferline.spec.model import ModelSpec

DISPATCH, STATS = 6, 8  # (message kinds 1-4 are the pipeline's: BEGIN, STEP, SHUTDOWN, FEEDBACK)
DEFAULT_MICRO_BATCHES = 2


class AFDError(StageError):
    """An attention or FFN rank died, hung or failed; the message names it. The engine is unusable afterwards."""


# ---------------------------------------------------------------- the split

@dataclass
class Layout:
    """Who holds what: M attention ranks, N FFN ranks, per FFN layer its kind and expert split."""

    attention_ranks: int
    ffn_ranks: int
    kinds: dict[int, str]  # layer -> "moe" | "dense" (layers with an FFN only)
    splits: dict[int, list[tuple[int, int]]]  # MoE layer -> expert range per FFN rank
    shared: dict[int, bool]  # MoE layer -> has shared experts

    @property
    def world(self) -> int:
        return self.attention_ranks + self.ffn_ranks

    def describe(self, rank: int) -> str:
        M = self.attention_ranks
        if rank < M:
            return f"attention rank {rank}" + (" (the driver)" if rank == 0 else "")
        n = rank - M
        rng = sorted({r[n] for r in self.splits.values()})
        ex = ", ".join(f"experts {a}-{b - 1}" if b - a > 1 else f"expert {a}" for a, b in rng if b > a)
        return f"FFN rank {n}" + (f" ({ex})" if ex else "")


def make_layout(spec: ModelSpec, attention_ranks: int, ffn_ranks: int) -> Layout:
    """Check M and N against the model and fix the expert split; clear errors for what AFD cannot run."""
    from waferline.spec.model import DenseFFNSpec, MoESpec

    M, N = int(attention_ranks), int(ffn_ranks)
    if M < 1 or N < 1:
        raise ConfigError(
            f"AFD needs at least one attention rank and one FFN rank (got attention_ranks={M}, ffn_ranks={N})"
        )
    kinds, splits, shared = {}, {}, {}
    for i, layer in enumerate(spec.layers):
        f = layer.ffn
        if f is None:
            continue
        if isinstance(f, MoESpec):
            if f.num_experts < N:
                raise ConfigError(f"layer {i} has {counted(f.num_experts, 'expert')} but {N} FFN ranks were asked for: "
                                  f"every FFN rank needs at least one expert; use ffn_ranks <= {f.num_experts}")
            kinds[i], splits[i], shared[i] = "moe", expert_split(f.num_experts, N), bool(f.shared_intermediate)
        elif isinstance(f, DenseFFNSpec):
            kinds[i] = "dense"
        else:
            raise ConfigError(f"layer {i}: AFD cannot run FFN kind {f.kind!r}")
    if not kinds:
        raise ConfigError(f"{spec.name}: no layer has an FFN, so there is nothing to disaggregate; run it without AFD")
    if not splits and N > len(kinds):
        raise ConfigError(f"{spec.name} is dense (no MoE layers): its {counted(len(kinds), 'FFN layer')} go to FFN "
                          f"ranks whole, so at most {counted(len(kinds), 'FFN rank')} can hold something; got {N}")
    return Layout(M, N, kinds, splits, shared)


def is_afd_plan(plan: Plan | None) -> bool:
    """Whether a Plan (or a plan JSON path) has attention and FFN stages."""
    if isinstance(plan, (str, Path)):
        from waferline.plan.plan import Plan

        plan = Plan.load(plan)
    return bool(plan.afd) or any(s.role in ("attention", "ffn") for s in plan.stages)


def plan_ranks(plan: Plan, spec: ModelSpec) -> tuple[int, int, int | None]:
    """(attention ranks, FFN ranks, micro-batches) of an AFD Plan the engine can run: every attention stage holds every
    layer (a data-parallel replica) and every FFN stage the FFN of every layer (an expert shard)."""
    att = [s for s in plan.stages if s.role == "attention"]
    ffn = [s for s in plan.stages if s.role == "ffn"]
    full = [s for s in plan.stages if s.role == "full"]
    if full or not att or not ffn:
        raise ConfigError("the AFD engine runs plans with 'attention' and 'ffn' stages only; plan with --afd")
    every = list(range(spec.num_layers))
    with_ffn = [i for i, layer in enumerate(spec.layers) if layer.ffn is not None]
    for s in att:
        if sorted(s.layers) != every:
            raise ConfigError(f"plan stage {s.index} (attention) holds layers {s.layers[:4]}...: the AFD engine runs "
                              "data-parallel attention ranks that each hold every layer; plan with "
                              "--afd --attention-ranks M --ffn-ranks N")
    for s in ffn:
        if sorted(s.layers) not in (every, with_ffn):
            raise ConfigError(
                f"plan stage {s.index} (ffn) holds layers {s.layers[:4]}...: the AFD engine shards experts "
                "(every FFN rank serves every layer); plan with --afd --attention-ranks M --ffn-ranks N"
            )
    return len(att), len(ffn), plan.micro_batches
