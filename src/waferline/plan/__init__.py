"""The planner: Plan / Stage (the seam the engine and the simulator share), placement (``waferline.plan.place``) and
its CLI commands."""

from waferline.plan.plan import Plan, SpeculativeConfig, Stage

__all__ = ["Plan", "SpeculativeConfig", "Stage"]
