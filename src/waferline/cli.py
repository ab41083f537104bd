"""The `waferline` command line: generate, demo, info, quantize, serve, and the planner's catalog / plan / simulate /
validate / calibrate / twin."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from waferline._version import __version__
from waferline.argtypes import nonnegative_int, out_path, positive_int, utf8_text
from waferline.engine_flags import GROUP_SIZE, check_engine_flags, default_threads, stage_convert
from waferline.errors import UsageError, WaferlineError, counted

NUM_SPECULATIVE_TOKENS = 4  # most draft tokens per step unless --num-speculative-tokens says otherwise
DEMO_SPECULATIVE_TOKENS = 3  # the demo's (sol-mini's MTP head accepts about this many)


def _has_tokenizer(model: Path) -> bool:
    return (model / "tokenizer.json").is_file() or (model / "tokenizer_config.json").is_file()


def _check_generate_flags(args: argparse.Namespace) -> None:
    """Refuse flags that the chosen engine or sampling mode would ignore, before anything loads."""
    if args.prompt is not None and args.prompt_ids is not None:
        raise UsageError("--prompt and --prompt-ids both give the prompt: give one of them")
    if args.prompt is None and args.prompt_ids is None:
        raise UsageError("give --prompt TEXT or --prompt-ids '1 2 3'")
    check_engine_flags(args)
    if args.speculative:  # (an unknown method, a draft path that is no checkpoint: before the target loads)
        from waferline.engine.speculative.serving import check_serve_method

        check_serve_method(args.speculative, NUM_SPECULATIVE_TOKENS if args.num_speculative_tokens is None
                           else args.num_speculative_tokens)
    model = Path(args.model)
    if not (model / "config.json").is_file():  # (first: what is wrong with the checkpoint before what it lacks)
        raise UsageError(f"--model {args.model}: not a checkpoint directory (config.json + *.safetensors)"
                         + ("; pass the directory that holds it" if model.is_file() else ""))
    if (args.stop or args.prompt is not None) and model.is_dir() and not _has_tokenizer(model):
        flag = "--stop" if args.stop else "--prompt"
        raise UsageError(f"{flag} needs the checkpoint's tokenizer and {args.model} has none (no tokenizer.json)"
                         + ("; drop --stop" if args.stop else ": pass --prompt-ids '1 2 3'"))
    if args.temperature == 0:
        sampling = [f for f, v in (("--top-p", args.top_p), ("--top-k", args.top_k), ("--seed", args.seed))
                    if v is not None]
        if sampling:
            raise UsageError(f"{', '.join(sampling)}: {'this applies' if len(sampling) == 1 else 'these apply'} to "
                             "sampling, and --temperature 0 (the default) decodes greedily; add --temperature T > 0 "
                             f"or drop {'it' if len(sampling) == 1 else 'them'}")


def _cmd_generate(args: argparse.Namespace) -> int:
    from waferline.engine.llm import LLM
    from waferline.engine.sampling import SamplingParams

    _check_generate_flags(args)
    pipe: dict = {}
    if args.afd:  # attention/FFN disaggregation
        pipe = {"afd": True, "attention_ranks": args.attention_ranks or 1, "ffn_ranks": args.ffn_ranks or 1,
                "micro_batches": args.micro_batches}
    elif args.stages is not None or args.layers_per_stage is not None:  # pipeline of stage processes
        from waferline.engine.pipeline import serve_from_env, torchrun_rank

        if torchrun_rank() > 0:  # under torchrun, ranks >= 1 serve their stage until rank 0 shuts down
            return serve_from_env(args.model, args.dtype, stages=args.stages, layers_per_stage=args.layers_per_stage,
                                  device=args.device or "cpu", threads_per_stage=args.torch_threads,
                                  convert=stage_convert(args))
        pipe = {"stages": args.stages, "layers_per_stage": args.layers_per_stage, "micro_batches": args.micro_batches}
    if args.speculative:
        k = NUM_SPECULATIVE_TOKENS if args.num_speculative_tokens is None else args.num_speculative_tokens
        pipe.update(speculative=args.speculative, num_speculative_tokens=k)
    if args.head_bits != 16:
        pipe["head_bits"] = args.head_bits
    if args.device is not None:
        pipe["device"] = args.device
    pipeline = bool(pipe.keys() & {"stages", "layers_per_stage", "afd"})
    threads = args.torch_threads
    if threads is None and not pipeline and args.device in (None, "cpu"):
        threads = default_threads()  # (as serve's engine: the same flags, the same output)
    if threads is not None:  # (this process, and every stage or rank process: as serve's flag)
        import torch

        torch.set_num_threads(threads)
        if pipeline:
            pipe["threads_per_stage"] = threads
    prompt: str | list[int]
    if args.prompt_ids is not None:
        try:
            prompt = [int(t) for t in args.prompt_ids.replace(",", " ").split()]
        except ValueError:
            raise UsageError(f"--prompt-ids takes integers separated by spaces or commas, got {args.prompt_ids!r}"
                             ) from None
    else:
        prompt = args.prompt
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=1.0 if args.top_p is None else args.top_p, top_k=args.top_k or 0, seed=args.seed,
                            stop=args.stop or [], logprobs=args.logprobs, presence_penalty=args.presence_penalty,
                            frequency_penalty=args.frequency_penalty, repetition_penalty=args.repetition_penalty,
                            json_object=args.json_object,
                            json_schema=_file_or_text(args.json_schema, "--json-schema"), regex=args.regex,
                            choice=args.choice, grammar=_file_or_text(args.grammar, "--grammar"))
    group_size = GROUP_SIZE if args.group_size is None else args.group_size
    llm = LLM(args.model, dtype=args.dtype, weight_bits=args.weight_bits, group_size=group_size, **pipe)
    try:
        out = llm.generate([prompt], params)[0]
    finally:
        llm.close()
    tps = out.metrics.get("decode_tokens_per_s", 0.0)
    spec = {k: v for k, v in out.metrics.items() if k.startswith("spec_")}  # speculative: acceptance, accepted length
    lps = [{"token_id": lp.token, "logprob": lp.logprob, "top": [list(t) for t in lp.top]}
           for lp in out.logprobs or []]
    if args.json:
        print(json.dumps({"token_ids": out.token_ids, "text": out.text, "tokens_per_s": tps,
                          "ttft_s": out.metrics.get("ttft_s"), "finish_reason": out.finish_reason, **spec}
                         | ({"logprobs": lps} if out.logprobs is not None else {})))
    else:
        if isinstance(prompt, str):
            print(prompt + out.text)
        else:
            # (the token ids stand for the text only where there is no tokenizer: with one, an output a stop string
            # cut to nothing, or that stopped at its first token, is empty)
            print(out.text if out.text or llm.tokenizer is not None else " ".join(map(str, out.token_ids)))
        print(f"\n[{counted(len(out.token_ids), 'token')}, {tps:.1f} tok/s decode, "
              f"TTFT {out.metrics.get('ttft_s', 0) * 1e3:.0f} ms, finish: {out.finish_reason}]", file=sys.stderr)
        if spec and not spec.get("spec_drafted", 1.0):  # (not "acceptance 0.00": no draft was rejected)
            print(f"[speculative {args.speculative}: nothing drafted (no draft found, or adaptive k chose plain "
                  f"steps), {spec['spec_mean_accepted_length']:.2f} tokens per decode step]", file=sys.stderr)
        elif spec:
            print(f"[speculative {args.speculative}: acceptance {spec['spec_acceptance_rate']:.2f}, "
                  f"{spec['spec_mean_accepted_length']:.2f} tokens per decode step]", file=sys.stderr)
        for e in lps:  # (--logprobs: one line per generated token)
            print(f"  {e['token_id']:>7} {e['logprob']:9.4f}  " + "  ".join(f"{i}:{v:.4f}" for i, v in e["top"]),
                  file=sys.stderr)
    return 0


def _file_or_text(value: str | None, flag: str = "") -> str | None:
    """A flag that takes a file or the text itself: the file's text where ``value`` names a file. A directory, or a
    name that can only be a file's (a known suffix, or a path from / ./ ../ with no spaces: no JSON Schema, Lark or
    GBNF text begins so), is refused rather than parsed as the text."""
    try:
        if value is None or "\n" in value or not Path(value).is_file():
            if value is not None and "\n" not in value and Path(value).is_dir():
                raise UsageError(f"{flag + ' ' if flag else ''}{value} is a directory: give a file, or the text itself")
            if value is not None and (value.endswith((".json", ".lark", ".gbnf", ".txt", ".jinja")) or (
                    value.startswith(("/", "./", "../")) and not any(c.isspace() for c in value))):
                raise UsageError(f"{flag + ': ' if flag else ''}no file at {value}")  # (a file's name, not a text)
            return value
    except OSError:  # (text longer than a file name may be)
        return value
    try:
        return Path(value).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"cannot read {value}: {e}") from None


def _cmd_info(args: argparse.Namespace) -> int:

    from waferline.spec.catalog import load_model

    spec = load_model(args.model)
    s = spec.summary()
    s["weight_bytes"] = {str(b): spec.weight_bytes(b) for b in (16, 8, 4)}
    s["cache_bytes_per_token"] = {str(b): spec.cache_bytes_per_token(b) for b in (16, 8)}
    # (a long sequence: what each further token adds, past the sliding windows, and what it holds beyond that)
    growth = {str(b): spec.cache_growth(b) for b in (16, 8)}
    s["cache_bytes_per_context_token"] = {b: g[0] for b, g in growth.items()}
    s["cache_bytes_fixed_per_seq"] = {b: g[1] for b, g in growth.items()}
    if spec.mtp_layers:  # (not in params_total or weight_bytes, as DeepSeek reports 671B without its MTP module)
        s["mtp_layers"] = len(spec.mtp_layers)
        s["mtp_params"] = spec.mtp_params()
        s["mtp_weight_bytes"] = {str(b): spec.mtp_weight_bytes(b) for b in (16, 8, 4)}
    if args.json:
        print(json.dumps(s, indent=2))
    else:
        for k, v in s.items():
            print(f"{k:>24}: {v}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from waferline.demo import run_demo

    if args.num_speculative_tokens is not None and not args.speculative:
        raise UsageError("--num-speculative-tokens needs --speculative METHOD")
    k = DEMO_SPECULATIVE_TOKENS if args.num_speculative_tokens is None else args.num_speculative_tokens
    if args.max_tokens < 1:  # (before the int4 copy and the stage processes, not after them)
        raise UsageError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise UsageError(f"--out {args.out} is a file: give a directory for the demo's files")
    if args.prompt is not None and not args.prompt.strip():
        raise UsageError("--prompt is empty: give some text to continue (or leave it out for the default line)")
    if args.speculative:
        from waferline.engine.speculative.serving import check_serve_method

        check_serve_method(args.speculative, k)
        from waferline.demo import BUNDLED, SOL_DEMO_CONFIG
        from waferline.engine.speculative.serving import check_speculative

        # what the checkpoint must hold for the method (MTP layers, a draft's vocabulary), read from its files: the
        # engine refused it only after the int4 copy and the timing run (the bundled sol-mini when it is there)
        if args.model is not None or (BUNDLED / "model.safetensors").is_file():
            check_speculative(args.model or BUNDLED, args.speculative, k)
        elif args.speculative == "mtp" and not SOL_DEMO_CONFIG.get("num_nextn_predict_layers"):
            raise UsageError(f"--speculative mtp: sol-mini is not at {BUNDLED}, and the small random checkpoint the "
                             "demo runs instead has no MTP head; use ngram or draft:PATH, or rebuild sol-mini with: "
                             "python train/sol_mini.py")
    if args.model is not None and (Path(args.model) / "config.json").is_file() and not _has_tokenizer(Path(args.model)):
        raise UsageError(f"--model {args.model} has no tokenizer (no tokenizer.json), and the demo streams text")
    return run_demo(out_dir=args.out, max_tokens=args.max_tokens, json_out=args.json, report=not args.no_report,
                    prompt=args.prompt, model=args.model, weight_bits=args.weight_bits,
                    layers_per_stage=args.layers_per_stage, speculative=args.speculative, num_speculative_tokens=k)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="waferline", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"waferline {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    g = sub.add_parser("generate", help="generate text from a Hugging Face checkpoint directory",
                       description="Load a checkpoint (config.json + safetensors) and continue a prompt.")
    g.add_argument("--model", required=True, help="checkpoint directory (config.json + *.safetensors)")
    g.add_argument("--prompt", type=utf8_text, help="prompt text (needs tokenizer.json in the checkpoint)")
    g.add_argument("--prompt-ids", help="prompt as token ids, e.g. '1 2 3' (for checkpoints without a tokenizer)")
    g.add_argument("--max-tokens", type=int, default=32, help="tokens to generate (default 32)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=None,
                   help="with --temperature > 0: nucleus sampling (default 1.0 = off)")
    g.add_argument("--top-k", type=int, default=None,
                   help="with --temperature > 0: sample from the k likeliest (0 = off, the default)")
    g.add_argument("--seed", type=int, default=None,
                   help="with --temperature > 0: seed for sampling (reproducible output)")
    g.add_argument("--stop", action="append", type=utf8_text, help="stop string (repeatable)")
    g.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="each generated token's log-probability and the N (0-20) likeliest tokens' (with --json: "
                        "a 'logprobs' list; else one line per token on stderr)")
    g.add_argument("--presence-penalty", type=float, default=0.0,
                   help="OpenAI's presence penalty on generated tokens (-2 to 2; default 0)")
    g.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="OpenAI's frequency penalty on generated tokens (-2 to 2; default 0)")
    g.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="repetition penalty on prompt and generated tokens, as transformers applies it "
                        "(default 1 = off)")
    so = g.add_mutually_exclusive_group()
    so.add_argument("--json-object", action="store_true",
                    help="structured output: the text is one JSON object (JSON mode; tell the model so in the prompt)")
    so.add_argument("--json-schema", metavar="SCHEMA",
                    help="structured output: a JSON object valid under this JSON Schema (a file, or the JSON itself)")
    so.add_argument("--regex", help="structured output: text that matches this regular expression")
    so.add_argument("--choice", action="append", help="structured output: one of these strings (repeatable)")
    so.add_argument("--grammar", metavar="GRAMMAR",
                    help="structured output: a sentence of this grammar (Lark, or llama.cpp's GBNF; a file or the "
                         "text)")
    g.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16"],
        help="compute dtype (default float32; with int4 weights, bfloat16 is W4A16 and runs the fused CPU "
             "layer operators: one stream decoded 2x faster on an AVX2 CPU)",
    )
    g.add_argument("--json", action="store_true", help="print {token_ids, text, tokens_per_s, ttft_s, finish_reason} "
                   "as JSON (+ logprobs and spec_* when asked for)")
    g.add_argument(
        "--weight-bits",
        type=int,
        default=16,
        choices=[16, 4],
        help="4 = int4 weights, 16-bit compute (RTN on load for a 16-bit checkpoint, each pipeline stage its own "
             "layers, each AFD rank its part; int4 checkpoints load as int4)",
    )
    g.add_argument("--group-size", type=int, default=None,
                   help=f"int4 group size for --weight-bits 4 on a 16-bit checkpoint (default {GROUP_SIZE})")
    g.add_argument("--head-bits", type=int, default=16, choices=[16, 8],
                   help="8 = int8 LM head (per-row scales; halves the largest matrix read per token of a small model), "
                        "16 = as loaded (default)")
    g.add_argument("--device", default=None,
                   help="cpu (default) or cuda[:N]: where the engine's weights, caches and steps live (a pipeline's "
                        "stages each take a GPU of their own; AFD runs on CPU; off the CPU: torch ops, and the "
                        "single-process engine's greedy decode as CUDA graphs)")
    g.add_argument("--torch-threads", type=positive_int, default=None,
                   help="torch intra-op threads (default: the cores less one, as serve's engine, or "
                        "OMP_NUM_THREADS where set; with --stages / --afd: of every stage or rank process, default "
                        "the cores divided among them); 1 is fastest for small models on a busy machine, where "
                        "threads wait on each other")
    g.add_argument("--stages", type=int, default=None,
                   help="run as a pipeline of S stage processes (layers split by work, the LM head counted on the "
                        "last stage; see docs/pipeline.md)")
    g.add_argument(
        "--layers-per-stage", type=int, default=None, help="pipeline with K layers per stage (1 = one wafer, one layer)"
    )
    g.add_argument("--micro-batches", type=int, default=None,
                   help="micro-batches in flight in the pipeline (default: stages); with --afd, micro-batches "
                        "ping-ponging between attention and FFN ranks (default 2)")
    g.add_argument(
        "--afd",
        action="store_true",
        help="attention/FFN disaggregation: attention ranks (mixers, caches, sampling) and FFN ranks (experts "
        "sharded by expert) as processes, two micro-batches ping-ponging (see docs/afd.md)",
    )
    g.add_argument(
        "--attention-ranks",
        type=positive_int,
        default=None,
        metavar="M",
        help="with --afd: attention ranks, each serving every layer for its share of the sequences (default 1)",
    )
    g.add_argument("--ffn-ranks", type=positive_int, default=None, metavar="N",
                   help="with --afd: FFN ranks; MoE experts are split across them, unevenly when N does not divide "
                        "the expert count (default 1)")
    g.add_argument("--speculative", default=None, metavar="METHOD",
                   help="speculative decoding (exact): ngram | mtp | draft:PATH (a checkpoint sharing the tokenizer); "
                        "also under --stages / --layers-per-stage and --afd (drafting in this process)")
    g.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K",
                   help=f"with --speculative: most draft tokens per step (default {NUM_SPECULATIVE_TOKENS}; adapted to "
                        "the observed acceptance and the measured "
                        "cost of a step)")
    g.set_defaults(func=_cmd_generate)

    i = sub.add_parser("info", help="architecture and accounting of a model: catalog id, checkpoint dir or "
                                    "config.json",
                       description="Parameters, bytes at 16/8/4 bits and cache bytes per token, from the ModelSpec; a "
                                   "model's MTP modules (mtp_layers, mtp_params, mtp_weight_bytes: embeddings and "
                                   "LM head shared) are counted apart, not in params_total or weight_bytes.")
    i.add_argument("model", help="catalog model id (`waferline catalog models`), checkpoint directory or config.json")
    i.add_argument("--json", action="store_true", help="print the numbers as one JSON object")
    i.set_defaults(func=_cmd_info)

    d = sub.add_parser(
        "demo",
        help="the demo: sol-mini streams Shakespeare, the planner sizes gpt-5.6-sol, a report is written",
        description="Loads sol-mini (waferline's own Sol architecture in miniature), streams a continuation with a "
                    "live "
        "tokens/s, prints what the planner predicts for gpt-5.6-sol on WSE-3 wafers, and writes "
        "demo_out/waferline-report.html.",
    )
    d.add_argument(
        "--out", type=out_path, default="demo_out",
        help="where the demo writes its checkpoint and report (default demo_out/)"
    )
    d.add_argument("--max-tokens", type=int, default=160, help="tokens to stream (default 160)")
    d.add_argument("--prompt", default=None, type=utf8_text, help="prompt to continue (default: a Romeo line)")
    d.add_argument("--model", default=None, help="checkpoint directory (default: the bundled models/sol-mini)")
    d.add_argument("--no-report", action="store_true", help="skip the HTML report")
    d.add_argument("--layers-per-stage", type=nonnegative_int, default=1,
                   help="layers per pipeline stage process (default 1: one wafer, one layer); 0 = single process")
    d.add_argument(
        "--weight-bits",
        type=int,
        default=4,
        choices=[4, 16],
        help="4 = int4 weights (default): an RTN int4 copy written once into --out and reused while it is the copy of "
             "this checkpoint (its weights, config and tokenizer); 16 = the 16-bit file as is (an int4 --model runs as "
             "int4 either way)",
    )
    d.add_argument("--json", action="store_true", help="also print a JSON summary on stdout")
    d.add_argument("--speculative", default=None, metavar="METHOD",
                   help="exact speculative decoding through the pipeline: ngram (prompt lookup, drafted on stage 0) | "
                        "mtp (sol-mini's MTP head) | draft:PATH (a checkpoint sharing the "
                        "tokenizer); the demo then reports acceptance and mean accepted length")
    d.add_argument("--num-speculative-tokens", type=positive_int, default=None, metavar="K",
                   help=f"most draft tokens per step with --speculative (default {DEMO_SPECULATIVE_TOKENS}; adapted to "
                        "the observed acceptance "
                        "and the measured cost of a step)")
    d.set_defaults(func=_cmd_demo)

    import importlib

    for modname in COMMAND_MODULES:  # each module adds its subcommands with register(subparsers)
        try:
            mod = importlib.import_module(modname)
        except ModuleNotFoundError as e:
            if e.name != modname:
                raise
            continue
        mod.register(sub)
    return p


# modules that contribute subcommands (a module not present yet is skipped)
COMMAND_MODULES = ("waferline.plan.commands", "waferline.sim.commands", "waferline.model.quant_commands",
                   "waferline.server.commands")


def main(argv: list[str] | None = None) -> int:
    try:  # (building the parser imports every command's module: a Ctrl-C then is as clean as one later)
        parser = build_parser()
        args = parser.parse_args(argv)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    previous = _on_sigterm_stop()
    try:
        return int(args.func(args) or 0)
    except WaferlineError as e:  # one line: a message may quote another library's error, newlines and all
        print("error: " + " ".join(line.strip() for line in str(e).splitlines() if line.strip()), file=sys.stderr)
        return 2
    except Terminated:
        print("terminated", file=sys.stderr)
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # stdout closed early (e.g. piped into `head`): nothing left to say
        with contextlib.suppress(OSError):
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - the interpreter's exit flush must not fail again
        return 1
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread: everything that stops cleanly on Ctrl-C (a pipeline shutting its stage
    processes down, quantize removing its temporary directory) stops the same way."""


def _raise_terminated(signum: int, frame: Any) -> None:
    if isinstance(sys.exc_info()[1], KeyboardInterrupt):  # already stopping (torchrun sends SIGINT, then SIGTERM)
        return
    raise Terminated()


def _on_sigterm_stop() -> Any:
    """Make SIGTERM raise Terminated while a command runs; returns the handler to restore (None: not installed,
    outside the main thread or where a handler of someone else's is already in place)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    current = signal.getsignal(signal.SIGTERM)
    if current not in (signal.SIG_DFL, None):
        return None
    signal.signal(signal.SIGTERM, _raise_terminated)
    return current


if __name__ == "__main__":
    sys.exit(main())
