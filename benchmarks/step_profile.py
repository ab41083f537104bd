"""Where a decode step's time goes, thread by thread: decode steps of one checkpoint under `perf record`, each thread's
samples sorted into the step's kinds of work, and the same steps on 1 and on N threads (how much of the step runs
serially).

    python benchmarks/step_profile.py --model benchmarks/.cache/dsv3/hf [--variant bf16|int4] [--batch 8]
                                      [--threads 2] [--seconds 8] [--burst 1] [--json PATH]

The step is one decode forward of B rows (64-token prompts already cached) plus logits and argmax, through
``step_logits``, positions cycling over 64..191; with ``--burst 8`` the steps run as the engine's greedy
decode runs them, 8 back to back per call (``greedy_steps``). The profile is Linux `perf record -e
cpu-clock` (a software clock: works in VMs without hardware counters) of this process for --seconds, after warm-up;
each sample is sorted by the function it was in: the weight products (waferline's bf16 / int4 / int8 kernels), the
OpenMP runtime (a thread waiting at a barrier or for work: on 2 threads, the worker waits while the main thread runs
serial work, and either waits for the other at the end of a split), attention kernels, the Python interpreter, the C
library (malloc), torch's own ops, other waferline ops, and the rest. Without `perf` (or without permission to use
it) only the thread split is printed. Shares are of each thread's samples; both threads are on a CPU the whole time
(OpenMP workers spin while they wait), so the worker's "OpenMP wait" is the share of the step it had nothing to do.

Thread split: the best of --rounds blocks of 24 steps on 1 thread and on --threads threads, alternating in one process;
if a step were serial part S plus parallel part P (P / N on N threads), S = (N t_N - t_1) / (N - 1) — a rough reading:
memory-bound work does not halve on two threads either, so S also counts what bandwidth keeps from scaling.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

KINDS = [  # (kind, substrings of the sampled function's name or library); the first that matches wins
    ("weight products", ("bf16_row_pair", "bf16_span", "bf16_tile", "bf16_row_avx2", "int4_i16", "int4_rows",
                         "int4_span", "int4_tile", "int8_rows", "int8_tile", "few_rows_generic", "dense_span",
                         "i4_span")),
    ("OpenMP wait", ("libgomp", "libiomp")),
    ("attention", ("gqa_rows", "gqa_item", "gqa_values", "dot4", "dot16", "sum16_lanes", "mla_", "softmax_masked",
                   "attend")),
    ("python interpreter", ("libpython", "_PyEval", "_Py")),
    ("C library", ("libc.so", "ld-linux")),
    ("torch ops", ("libtorch", "libc10")),
    ("other waferline ops", ("waferline_cpu_ops",)),
    ("kernel", ("kallsyms",)),
]


def kind_of(sym: str) -> str:
    for kind, keys in KINDS:
        if any(k in sym for k in keys):
            return kind
    return "other"


def classify(script_out: str) -> dict[str, dict[str, float]]:
    """`perf script -F tid,ip,sym,dso` text of samples without call chains (one line each: thread id, address,
    function, library) -> {thread id: {kind: share of that thread's samples}}."""
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for tid, sym in _samples(script_out):
        counts[tid][kind_of(sym)] += 1
    return {tid: {k: v / sum(c.values()) for k, v in c.most_common()} for tid, c in counts.items()}


def _samples(script_out: str):
    for line in script_out.splitlines():
        parts = line.split(None, 2)  # thread id, address, "function (library)"
        if len(parts) == 3 and parts[0].isdigit():
            yield parts[0], parts[2]


def top_functions(script_out: str, n: int) -> list[tuple[str, str, float]]:
    """The n functions with the most samples over all threads: (function, its kind, share of all samples)."""
    c = collections.Counter(sym for _, sym in _samples(script_out))
    total = sum(c.values()) or 1
    return [(sym.rsplit(" (", 1)[0], kind_of(sym), v / total) for sym, v in c.most_common(n)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="checkpoint directory")
    ap.add_argument("--variant", default="bf16", choices=["bf16", "int4"],
                    help="bf16 (16-bit head) or int4 (RTN g128, int8 head, as decode_speed.py's waferline int4)")
    ap.add_argument("--batch", type=int, default=8, help="rows per step (default 8)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads for the profile (default 2)")
    ap.add_argument("--burst", type=int, default=1,
                    help="greedy steps run back to back per call (DecoderModel.greedy_steps, as LLM's greedy decode "
                         "runs them: 8); default 1, a step_logits call per step")
    ap.add_argument("--seconds", type=float, default=8.0, help="how long perf records (default 8)")
    ap.add_argument("--rounds", type=int, default=8, help="alternating 1 / N thread rounds for the split (default 8)")
    ap.add_argument("--top", type=int, default=12, help="list this many of the most-sampled functions (default 12)")
    ap.add_argument("--json", default=None, help="write the result here")
    a = ap.parse_args(argv)
    if not (Path(a.model) / "config.json").is_file():
        ap.error(f"--model {a.model}: no config.json there")
    if a.batch < 1 or a.threads < 1 or a.seconds <= 0 or a.burst < 1:
        ap.error("--batch, --threads, --seconds and --burst must be positive")

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from waferline.errors import ConfigError
    from waferline.files import check_writable, write_text_atomic

    if a.json:
        try:  # (before the run: a path that cannot be written fails here, not after the run)
            check_writable(a.json, "--json")
        except ConfigError as e:
            ap.error(str(e))
    from waferline import kernels
    from waferline.model.context import StepBatch
    from waferline.model.load import load_model

    if not kernels.available():
        print("the fused operators are not built here (waferline.kernels.available() is False): nothing to profile",
              file=sys.stderr)
        return 1
    m = load_model(a.model, torch.bfloat16)
    if a.variant == "int4":
        from waferline.model.quant import QuantOptions, is_int4, quantize_model

        if not is_int4(m):  # (a checkpoint saved as int4 is already)
            quantize_model(m, QuantOptions(group_size=128))
        m.quantize_head(8)
    B, V = a.batch, m.spec.vocab_size
    caches = m.new_caches(B)
    res: dict = {"model": a.model, "variant": a.variant, "batch": B, "threads": a.threads, "burst": a.burst}
    with torch.inference_mode():
        for b in range(B):
            m((torch.arange(3, 67)[None] * (b + 1)) % V, caches, StepBatch.make([b], [0], 64))

        def step(i: int) -> None:  # a step, or a burst of --burst steps (the first, with no plan yet: a step)
            toks, pos = (torch.arange(B)[:, None] * 997 + 5 + i) % V, 64 + i * a.burst % 128
            if a.burst > 1 and m.greedy_steps(toks, caches, [StepBatch.make(list(range(B)), [pos + j] * B, 1)
                                                             for j in range(a.burst)]) is not None:
                return
            m.step_logits(toks, caches, StepBatch.make(list(range(B)), [pos] * B, 1), argmax=True)

        def block(threads: int, n: int = 24) -> float:
            torch.set_num_threads(threads)
            for i in range(2):
                step(i)
            t = time.perf_counter()
            for i in range(n):
                step(i)
            return (time.perf_counter() - t) / (n * a.burst)

        best = {1: float("inf"), a.threads: float("inf")}
        for r in range(a.rounds):
            for th in (1, a.threads) if r % 2 == 0 else (a.threads, 1):
                best[th] = min(best[th], block(th))
        t1, tn, n = best[1], best[a.threads], a.threads
        res["ms_per_step"] = {"1": round(1e3 * t1, 3), str(n): round(1e3 * tn, 3)}
        if n > 1:
            res["serial_ms"] = round(1e3 * max(0.0, (n * tn - t1) / (n - 1)), 3)
        print(f"{Path(a.model).name if Path(a.model).name != 'hf' else Path(a.model).parent.name} {a.variant} "
              f"batch {B}: {1e3 * t1:.2f} ms a step on 1 thread, {1e3 * tn:.2f} on {n} ({t1 / tn:.2f}x)"
              + (f"; serial part ~{res['serial_ms']:.2f} ms (S + P/N reading)" if n > 1 else ""))

        torch.set_num_threads(a.threads)
        perf = shutil.which("perf")
        if perf is None:
            print("no `perf` on PATH: no per-thread profile")
        else:
            with tempfile.TemporaryDirectory() as d:
                data = Path(d) / "perf.data"
                rec = subprocess.Popen([perf, "record", "-q", "-e", "cpu-clock", "-F", "2000", "-p", str(os.getpid()),
                                        "-o", str(data), "--", "sleep", str(a.seconds)],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                i = 0
                while rec.poll() is None:
                    step(i)
                    i += 1
                err = rec.stderr.read() if rec.stderr else ""
                out = subprocess.run([perf, "script", "-i", str(data), "-F", "tid,ip,sym,dso"], capture_output=True,
                                     text=True).stdout if data.is_file() else ""
            shares = classify(out)
            if not shares:
                print(f"perf recorded nothing ({(err.strip().splitlines() or ['no samples'])[-1][:200]})")
            else:
                res["steps_profiled"] = i * a.burst
                res["threads_profile"] = {tid: {k: round(v, 4) for k, v in s.items()} for tid, s in shares.items()}
                from rich.console import Console
                from rich.table import Table

                tids = sorted(shares, key=int)
                t = Table(title=f"share of each thread's samples, {i * a.burst} steps ({tids[0]}: the main thread)")
                t.add_column("kind")
                for tid in tids:
                    t.add_column(f"thread {tid}", justify="right")
                for kind in [k for k, _ in KINDS] + ["other"]:
                    if any(shares[tid].get(kind) for tid in tids):
                        t.add_row(kind, *[f"{100 * shares[tid].get(kind, 0):.1f}%" for tid in tids])
                con = Console(width=120)
                con.print(t)
                top = top_functions(out, a.top)
                res["top_functions"] = [{"function": f, "kind": k, "share": round(v, 4)} for f, k, v in top]
                con.print(f"the {a.top} functions with the most samples (all threads):")
                for f, k, v in top:
                    con.print(f"  {100 * v:5.1f}%  {k:<20} {f[:90]}", markup=False, highlight=False)
    if a.json:
        write_text_atomic(a.json, json.dumps(res, indent=1) + "\n", make_parents=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
