"""The planner: Plan / Stage (the seam the engine and the simulator share), placement and its CLI commands."""
