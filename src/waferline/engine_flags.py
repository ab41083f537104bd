"""The engine flags `waferline generate` and `waferline serve` share, checked one way for both: a combination the
engine would ignore or cannot honour is refused with the reason, before anything loads."""

from __future__ import annotations

import argparse
from pathlib import Path

from waferline.errors import UsageError

GROUP_SIZE = 128  # int4 group size on load unless --group-size says otherwise (LLM's default)


def default_threads() -> int | None:
    """A single-process engine's torch threads where none are given (generate and serve alike, so that the same
    flags give the same output: fp32 products may round differently on another thread count): the cores torch would
    take less one. An intra-op team waits at every operator for its slowest thread, and where any other thread shares
    the cores (a server's event loop tokenizing and streaming, anything else running) one of the team is descheduled
    a scheduler slice at a time: on 2 cores, 2 threads decoded at 0.20x the rate of 1 beside one busy process, and a
    server of 16 clients gave 0.64-0.67x (1.27x on an idle machine; docs/results/serve.md). vLLM's CPU backend
    leaves one core to its serving side too. None (torch's own choice) where ``OMP_NUM_THREADS`` says how many."""
    import os

    if "OMP_NUM_THREADS" in os.environ:
        return None
    import torch

    return max(1, torch.get_num_threads() - 1)


def _need(given: list[str], what: str) -> None:
    if given:
        raise UsageError(f"{' and '.join(given)} {'need' if len(given) > 1 else 'needs'} {what}")


def check_engine_flags(args: argparse.Namespace) -> None:
    """Refuse engine flags (``args`` of generate or serve) that do not go together: AFD's ranks without --afd, two
    engines at once, pipeline options in one process, --group-size where nothing is quantized on load, a speculation
    length without a method."""
    pipeline = args.stages is not None or args.layers_per_stage is not None
    if not args.afd:
        _need([f for f, v in (("--attention-ranks", args.attention_ranks), ("--ffn-ranks", args.ffn_ranks))
               if v is not None], "--afd")
    elif pipeline:
        raise UsageError("--afd and --stages/--layers-per-stage are two different engines: give one of them")
    if args.stages is not None and args.layers_per_stage is not None:
        raise UsageError("give --stages S or --layers-per-stage K, not both")
    if not (pipeline or args.afd):
        _need([f for f, v in (("--micro-batches", args.micro_batches),
                              ("--hang-timeout", getattr(args, "hang_timeout", None))) if v is not None],
              "--stages S, --layers-per-stage K or --afd")
    if args.afd and args.device not in (None, "cpu"):
        raise UsageError(f"--device {args.device}: AFD's ranks run on CPU processes (gloo) so far; drop --device")
    _need(["--num-speculative-tokens"] if args.num_speculative_tokens is not None and not args.speculative else [],
          "--speculative METHOD")
    from waferline.engine.inputs import is_int4_checkpoint

    model = Path(args.model)
    int4 = is_int4_checkpoint(model)  # (False where there is no config.json: the caller names that)
    if args.group_size is not None:
        if args.weight_bits != 4:
            raise UsageError("--group-size is the int4 group size: it needs --weight-bits 4")
        if int4:
            raise UsageError(f"--group-size: {args.model} is an int4 checkpoint and loads with the groups it was "
                             "quantized with; drop --group-size")


def stage_convert(args: argparse.Namespace) -> dict[str, int]:
    """What a torchrun rank >= 1 does to its stage's layers once loaded (``convert_loaded``): the driver's
    --weight-bits, --group-size and --head-bits, from the same command line."""
    return {"weight_bits": args.weight_bits, "group_size": args.group_size or GROUP_SIZE, "head_bits": args.head_bits}
