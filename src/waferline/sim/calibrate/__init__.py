"""`waferline calibrate`: measure this machine and fit the host-engine model's figures to it.

The simulator (``sim/cost.py``, ``pipeline.py``, ``serving.py``) never imports this package; it reads the hardware
YAML it writes. Modules, by what they measure:

- ``common``: the calibration models, timing helpers, the fits' least squares, running a probe in a fresh process;
- ``ops``: this machine's operators outside the engine (bandwidths, matmuls, the linear sweep, fused operators, CUDA);
- ``opcount``: counting the aten ops, bytes and products the engine runs, and pricing them;
- ``engine``: the single-process engine's per-op, per-step and in-engine product costs, speculation, the canary;
- ``pipeline``: costs between processes (gloo link, pipeline hops and stage CPU, oversubscription, AFD, ceilings);
- ``hardware_yaml``: every probe in turn, written as a hardware YAML; the median of several calibrations.
"""
