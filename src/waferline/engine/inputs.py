"""What ``LLM`` accepts, checked: its process options, its device, token-id prompts; and what it reads from a
checkpoint directory before loading (its end-of-sequence ids, whether it holds int4 weights)."""

from __future__ import annotations

import json
import numbers
from pathlib import Path
from typing import Any

import torch

from waferline.errors import ConfigError


def eos_ids(directory: Path, cfg: dict[str, Any], tokenizer: Any = None) -> set[int]:
    """The checkpoint's end-of-sequence token ids (config.json, then generation_config.json); where neither file has
    the field, the tokenizer's (vLLM adds the tokenizer's always). A field set to null names none: a request runs to
    max_tokens (random demo checkpoints do that)."""
    ids: set[int] = set()
    sources = [cfg]
    gen = directory / "generation_config.json"
    if gen.is_file():
        try:
            sources.append(json.loads(gen.read_text()))
        except ValueError:  # (not JSON, or not UTF-8 text: ignored, as transformers ignores one it cannot parse)
            pass
    for src in sources:
        e = src.get("eos_token_id") if isinstance(src, dict) else None
        if isinstance(e, int):
            ids.add(e)
        elif isinstance(e, list):
            ids.update(x for x in e if isinstance(x, int))
    named = any(isinstance(src, dict) and "eos_token_id" in src for src in sources)
    if not named and getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


def is_token_id(t: Any) -> bool:
    """An integer (a Python or numpy integer; not a bool, a float or a string of digits)."""
    return isinstance(t, numbers.Integral) and not isinstance(t, bool)


def shown(x: Any) -> str:
    text = repr(x)
    return f"{type(x).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


# the options LLM passes to a Pipeline (engine/pipeline/) or to AFD (engine/afd/)
PIPELINE_OPTIONS = frozenset({"plan", "prefill_chunk", "threads_per_stage", "hang_timeout_s", "start_method", "launch",
                              "load_kwargs"})
AFD_OPTIONS = frozenset({"plan", "prefill_chunk", "threads_per_stage", "hang_timeout_s", "start_method",
                         "attention_ranks", "ffn_ranks", "threads_per_rank"})
PROCESS_OPTIONS = PIPELINE_OPTIONS | AFD_OPTIONS | {"afd"}
# the LLM options that are counts (an integer, or None for the default; thread counts: the process engines' own check)
INT_OPTIONS = frozenset({"max_model_len", "stages", "layers_per_stage", "micro_batches", "weight_bits", "group_size",
                         "head_bits", "num_speculative_tokens", "prefill_chunk", "attention_ranks", "ffn_ranks"})


def plan_group_size(plan: Any, weight_bits: int, group_size: int | None) -> int:
    """The int4 group size a 16-bit checkpoint is quantized at on load: the one given, else a 4-bit plan's, else 128;
    ConfigError where the one given is not the 4-bit plan's (the plan's memory and predictions are at its own)."""
    placed = plan.group_size if plan is not None and plan.weight_bits == 4 and weight_bits == 4 else None
    if group_size is not None and placed is not None and group_size != placed:
        raise ConfigError(f"group_size={group_size} but the plan places int4 weights in groups of {placed}: drop the "
                          "option (the plan's is taken) or place the plan with it")
    return group_size if group_size is not None else placed or 128


def check_numbers(options: dict[str, Any]) -> None:
    """Refuse (ConfigError) a count in ``options`` (INT_OPTIONS) given as anything but an integer (2.5, "4", True),
    and weight or LM-head bits the engine has no kernels for, or a process start method multiprocessing has not."""
    for name, value in options.items():
        if name in INT_OPTIONS and value is not None and not is_token_id(value):
            raise ConfigError(f"{name} must be an integer, got {shown(value)}")
    if options.get("weight_bits", 16) not in (16, 4):
        raise ConfigError(f"weight_bits must be 16 or 4, got {options['weight_bits']}")
    if options.get("head_bits", 16) not in (16, 8):
        raise ConfigError(f"head_bits must be 16 or 8, got {options['head_bits']}")
    if options.get("start_method", "forkserver") not in ("forkserver", "spawn", "fork"):
        raise ConfigError(f"start_method must be 'forkserver', 'spawn' or 'fork', got {options['start_method']!r}")


def check_engine_options(options: dict[str, Any], allowed: frozenset[str], engine: str) -> None:
    """Refuse (ConfigError) the options in ``options`` that only the other engine over processes takes."""
    other = sorted(set(options) - allowed)
    if other:
        raise ConfigError(f"{engine} does not take {', '.join(other)} (the other engine's option"
                          f"{'s' if len(other) > 1 else ''}; help(waferline.LLM) lists each engine's)")


def check_device(device: str | None) -> torch.device:
    """The engine's device (default CPU), checked: a known device type, and CUDA only where torch sees a GPU."""
    try:  # (None only is the default: device 0 names a GPU, as device 1 does)
        dev = torch.device("cpu" if device is None else device)
    except (RuntimeError, TypeError) as e:
        raise ConfigError(f"device must be like 'cpu', 'cuda' or 'cuda:1', got {device!r}") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device 'cuda' requested but torch sees no CUDA GPU here; use device='cpu'")
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"device must be a CPU or a CUDA GPU, got {device!r}")
    return dev


def wants_afd(options: dict[str, Any]) -> bool:
    """afd=True, attention_ranks / ffn_ranks, or a Plan with attention and FFN stages (removes the ``afd`` flag)."""
    if options.pop("afd", False) or options.get("attention_ranks") is not None or options.get("ffn_ranks") is not None:
        return True
    if options.get("plan") is None:
        return False
    from waferline.engine.afd import is_afd_plan

    return is_afd_plan(options["plan"])


def is_int4_checkpoint(directory: Path) -> bool:
    from waferline.model.quant import quant_method
    from waferline.spec.configs import read_config_json

    cfg = directory / "config.json"
    if not cfg.is_file():
        return False
    return quant_method(read_config_json(cfg)) is not None  # (not a JSON object: one line naming the file)


def plan_run(options: dict[str, Any], directory: Path, weight_bits: int, speculative: str | None,
             num_tokens: int) -> tuple[str | None, int]:
    """The run's speculation (method, drafts per step) under ``options["plan"]`` where the LLM's options give a Plan
    (read in place where it is a file): the plan's method and draft count where the run names no method. ConfigError
    where the run is not the deployment the plan describes (its memory and predictions are that one's): int4 weights
    or not (an int4 checkpoint loads as int4), another speculative method, or one the engine does not run."""
    from waferline.plan.plan import Plan

    plan = options.get("plan")
    if plan is None:
        return speculative, num_tokens
    if isinstance(plan, (str, Path)):
        plan = options["plan"] = Plan.load(plan)
    if not isinstance(plan, Plan):
        raise ConfigError(f"plan must be a Plan or a plan JSON file, got {type(plan).__name__}")
    from waferline.spec.configs import spec_from_pretrained

    if (directory / "config.json").is_file():  # (a plan of another model: said so first; else the engine names it)
        plan.check_model(spec_from_pretrained(directory), directory)
    int4 = weight_bits == 4 or is_int4_checkpoint(directory)
    if plan.weight_bits not in (4, 16, 32) or (plan.weight_bits == 4) != int4:
        fix = (f"place a plan of int4 weights (waferline plan {directory} ... --weight-bits 4)" if int4 else
               f"pass weight_bits=4, group_size={plan.group_size} (int4 on load), load an int4 checkpoint (waferline "
               "quantize --model DIR --out INT4_DIR), or place a 16-bit plan" if plan.weight_bits == 4 else
               "the engine runs int4 or unquantized weights: place a 16-bit plan")
        raise ConfigError(f"the plan places {plan.weight_bits}-bit weights; {directory} runs "
                          f"{'int4' if int4 else 'unquantized'} weights: {fix}")
    sp = plan.speculative
    theirs = {"none": None, "ngram": "ngram", "mtp": "mtp"}.get(sp.method, f"draft:{sp.draft_model}")
    unrun = sp.method in ("eagle", "medusa") or (sp.method == "draft" and not sp.draft_model)
    if speculative is None:
        if unrun:  # (a draft plan without its draft model runs where the run names the draft's directory)
            raise ConfigError(f"the plan's speculation ({sp.method}{'' if sp.draft_model else ', no draft model'}) "
                              "is not one the engine runs (ngram, mtp or a draft model's directory): place the plan "
                              "with one" + (", or pass speculative='draft:PATH'" if sp.method == "draft" else ""))
        return theirs, (sp.num_tokens or num_tokens) if theirs else num_tokens
    if theirs is None or speculative.split(":")[0] != sp.method:
        placed = "no speculation" if theirs is None else sp.method if unrun else theirs
        raise ConfigError(f"speculative={speculative!r} but the plan places {placed}: drop the "
                          "option (the plan's is taken) or place the plan with it")
    return speculative, num_tokens
