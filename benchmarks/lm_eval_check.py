"""lm-evaluation-harness against `waferline serve`: a multiple-choice task scored through the server (the harness's
`local-completions` model: `echo` + `logprobs`, token-id prompts), side by side with the same log-likelihoods computed
by the engine directly (`LLM.prompt_logprobs`), at several harness batch sizes (a batch = one request with several
prompts). Prints one table and writes JSON.

    python benchmarks/lm_eval_check.py --lm-eval /path/to/venv/bin/lm_eval

The task is built from the checkpoint's held-out text (sol-mini's `heldout.txt`: plays it was not trained on): each
document is a line, and the choices are the line that follows it and three lines drawn from elsewhere (seeded); the
harness picks the choice of highest log-likelihood (`acc`; chance 0.25). The direct column splits context and
continuation as the harness does (trailing whitespace of the context moves into the continuation) and sums the
continuation's log-probabilities; "max |d loglik|" compares every choice's served and direct values.

lm-evaluation-harness is not a waferline dependency (it brings its own torch): install it in an environment of its own
(`pip install torch` first, for a CPU build where one is local, then `pip install "lm_eval[api]" transformers`) and
pass its `lm_eval` executable. The harness tokenizes through the server (`tokenizer_backend=remote`: `/tokenize`,
`/detokenize`, `/tokenizer_info`).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from serve_load import _free_port, wait_ready

ROOT = Path(__file__).resolve().parents[1]


TASK_YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
"""
NEXT_LINE = """output_type: multiple_choice
doc_to_text: "{{context}}\\n"
doc_to_choice: "{{choices}}"
doc_to_target: label
target_delimiter: ""
metric_list:
  - metric: acc
"""
ROLLING = """output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list:
  - metric: bits_per_byte
"""
TASKS = {"waferline_next_line": ("acc", NEXT_LINE), "waferline_rolling": ("bits_per_byte", ROLLING)}


def build_tasks(text: Path, out: Path, docs: int, paragraphs: int, seed: int = 0) -> None:
    """Two tasks from ``text``, their YAML in ``out``: multiple choice over ``docs`` lines (the next line or three
    drawn from elsewhere) and the log-likelihood of ``paragraphs`` paragraphs (short enough for one window)."""
    lines = [ln.strip() for ln in text.read_text().splitlines() if len(ln.strip()) > 25]
    paras = [p.strip() for p in text.read_text().split("\n\n") if 200 <= len(p.strip()) <= 1500][:paragraphs]
    if len(lines) < 2 * docs + 8 or len(paras) < paragraphs:
        sys.exit(f"{text} has {len(lines)} usable lines and {len(paras)} paragraphs: too few for {docs} documents "
                 f"and {paragraphs} paragraphs")
    rng = random.Random(seed)
    rows = []
    for i in range(0, 2 * docs, 2):
        others = rng.sample([ln for j, ln in enumerate(lines) if abs(j - i) > 2], 3)
        rows.append({"context": lines[i], "choices": [" " + lines[i + 1]] + [" " + o for o in others], "label": 0})
    for name, docs_of in (("waferline_next_line", rows), ("waferline_rolling", [{"text": p} for p in paras])):
        data = out / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in docs_of))
        (out / f"{name}.yaml").write_text(TASK_YAML.format(name=name, data=data) + TASKS[name][1])


def harness_split(context: str, continuation: str) -> tuple[str, str]:
    """The harness's context/continuation split: the context's trailing whitespace belongs to the continuation."""
    n = len(context) - len(context.rstrip())
    return (context[:-n], context[-n:] + continuation) if n else (context, continuation)


def direct(model: Path, task: str, docs: list[dict[str, Any]]) -> tuple[list[list[float]], float]:
    """Each request's log-likelihood from the engine in this process (per document: each choice's, or the text's
    after the end-of-sequence token the harness puts first), and the task's metric from them."""
    from waferline import LLM

    llm = LLM(model)
    tok = llm.tokenizer

    def loglik(ids: list[int], start: int) -> float:
        lp = llm.prompt_logprobs(ids)
        return sum(lp[i - 1, ids[i]].item() for i in range(start, len(ids)))

    out = []
    for d in docs:
        if task == "waferline_rolling":
            out.append([loglik([tok.eos_token_id] + tok.encode(d["text"], add_special_tokens=False), 1)])
            continue
        row = []
        for choice in d["choices"]:
            ctx, cont = harness_split(d["context"] + "\n", choice)
            row.append(loglik(tok.encode(ctx + cont, add_special_tokens=False),
                              len(tok.encode(ctx, add_special_tokens=False))))
        out.append(row)
    if task == "waferline_rolling":  # bits per byte over the whole text
        metric = -sum(r[0] for r in out) / sum(len(d["text"].encode()) for d in docs) / math.log(2)
    else:
        metric = sum(max(range(len(r)), key=r.__getitem__) == d["label"] for r, d in zip(out, docs)) / len(docs)
    return out, metric


def run_harness(lm_eval: str, base: str, name: str, tasks: Path, task: str, batch: int, out: Path) -> dict:
    """One harness run of ``task`` at ``batch`` prompts per request: its metric, each document's served
    log-likelihoods, its time."""
    args = f"model={name},base_url={base}/v1/completions,tokenizer_backend=remote,tokenized_requests=True," \
           "num_concurrent=1,max_retries=1"
    t0 = time.perf_counter()
    res = subprocess.run([lm_eval, "--model", "local-completions", "--model_args", args, "--batch_size", str(batch),
                          "--tasks", task, "--include_path", str(tasks), "--output_path", str(out), "--log_samples"],
                         capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        sys.exit(f"lm_eval failed ({task}, batch {batch}):\n{res.stderr[-3000:]}")
    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"][task]
    samples = [json.loads(ln) for ln in next(out.rglob("samples_*.jsonl")).read_text().splitlines()]
    samples.sort(key=lambda s: s["doc_id"])
    served = [[float(r[0][0]) if isinstance(r[0], list) else float(r[0]) for r in s["resps"]] for s in samples]
    return {"task": task, "batch": batch, "metric": results[f"{TASKS[task][0]},none"], "served": served,
            "docs": [s["doc"] for s in samples], "wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lm-eval", default=shutil.which("lm_eval"), help="the harness's lm_eval executable")
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "sol-mini", help="checkpoint to serve")
    ap.add_argument("--text", type=Path, help="text to build the tasks from (default: the checkpoint's heldout.txt)")
    ap.add_argument("--docs", type=int, default=100, help="documents of the multiple-choice task (4 choices each)")
    ap.add_argument("--paragraphs", type=int, default=20, help="documents of the log-likelihood task")
    ap.add_argument("--batch-sizes", default="1,16", help="harness batch sizes (prompts per request), comma-separated")
    ap.add_argument("--threads", type=int, default=None, help="torch threads of the server (default: torch's)")
    ap.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "lm_eval_check.json")
    a = ap.parse_args()
    from waferline.errors import ConfigError
    from waferline.files import check_writable, write_text_atomic

    try:  # (before the run: a path that cannot be written fails here, not after the run)
        check_writable(a.json, "--json")
    except ConfigError as e:
        ap.error(str(e))
    try:
        batches = [int(b) for b in a.batch_sizes.split(",")]
    except ValueError:
        ap.error(f"--batch-sizes {a.batch_sizes}: expected comma-separated integers")
    if not a.lm_eval or not Path(a.lm_eval).exists():
        sys.exit("lm_eval not found: install lm-evaluation-harness in an environment of its own and pass "
                 "--lm-eval /path/to/bin/lm_eval (see this script's --help)")
    text = a.text or a.model / "heldout.txt"
    if not text.is_file():
        sys.exit(f"no text to build the tasks from: {text} (give --text)")
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        build_tasks(text, tmp_path, a.docs, a.paragraphs)
        port = _free_port()
        cmd = [sys.executable, "-m", "waferline.cli", "serve", "--model", str(a.model), "--port", str(port)]
        if a.threads:
            cmd += ["--torch-threads", str(a.threads)]
        server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        base = f"http://127.0.0.1:{port}"
        try:
            wait_ready(base, server)
            runs = [run_harness(a.lm_eval, base, a.model.name, tmp_path, t, b, tmp_path / f"{t}-{b}")
                    for t in TASKS for b in batches]
        finally:
            server.terminate()
            server.wait(30)
        ref = {t: direct(a.model, t, next(r["docs"] for r in runs if r["task"] == t)) for t in TASKS}
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"lm-evaluation-harness (local-completions) on `waferline serve --model {a.model.name}`, "
                        "and the engine directly")
    for col in ("task", "metric", "harness batch", "requests", "served", "direct", "max |d loglik|", "wall (s)"):
        table.add_column(col, justify="right")
    rows = []
    for r in runs:
        lls, metric = ref[r["task"]]
        diff = max(abs(s - d) for rs, rd in zip(r["served"], lls) for s, d in zip(rs, rd))
        n_req = -(-sum(len(x) for x in lls) // r["batch"])
        rows.append({"task": r["task"], "metric": TASKS[r["task"]][0], "batch": r["batch"], "requests": n_req,
                     "served": r["metric"], "direct": metric, "max_abs_loglik_diff": diff, "wall_s": r["wall_s"]})
        table.add_row(r["task"].removeprefix("waferline_"), TASKS[r["task"]][0], str(r["batch"]), str(n_req),
                      f"{r['metric']:.4f}", f"{metric:.4f}", f"{diff:.1e}", f"{r['wall_s']:.1f}")
    Console(width=max(110, Console().width)).print(table)
    print("wall: the whole harness run (its start, tokenizer and task load included)")
    write_text_atomic(a.json, json.dumps({"model": a.model.name, "docs": a.docs, "paragraphs": a.paragraphs,
                                          "runs": rows, "note": "wall includes the harness's start (tokenizer and "
                                          "task load)"}, indent=2), make_parents=True)
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
