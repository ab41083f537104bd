"""Pipeline-parallel engine: stages as processes, activations streamed over torch.distributed, micro-batches with
token feedback from the last stage to the first, chunked pipelined prefill, and a watchdog.

The calling process is stage 0 and the scheduler's (it embeds, runs its layers; the scheduler owns the requests and
drives the stages through ``serving.PipelineRunner``); stages
1..S-1 are worker processes (``waferline.engine.stage``). Every stage owns its layers, their weights and the
per-sequence caches of those layers; the last stage computes logits and samples with the single-process engine's
sampling code and per-row seeds, so outputs match ``LLM`` without stages.

Modules: ``driver`` (``Pipeline``: start-up and the chain), ``serving`` (``PipelineRunner``: the scheduler's steps
as micro-batches, verify groups and rollbacks), ``supervise`` (start-up checks, the watchdog, fault naming, shutdown),
``launch`` (the stage split, torchrun rendezvous, ``serve_from_env`` for ranks >= 1). The names below are the public
ones.
"""

from waferline.engine.pipeline.driver import DEFAULT_HANG_TIMEOUT_S, DEFAULT_PREFILL_CHUNK, Pipeline
from waferline.engine.pipeline.launch import (
    _rendezvous_env,
    ids_downstream,
    serve_from_env,
    stage_ranges,
    torchrun_rank,
)
from waferline.engine.pipeline.supervise import START_TIMEOUT_S, WATCH_INTERVAL_S, StageError, _status_error

__all__ = ["Pipeline", "StageError", "stage_ranges", "ids_downstream", "torchrun_rank", "serve_from_env",
           "DEFAULT_HANG_TIMEOUT_S", "DEFAULT_PREFILL_CHUNK", "START_TIMEOUT_S", "WATCH_INTERVAL_S",
           # internals that tests reach for
           "_status_error", "_rendezvous_env"]
