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


def build_task(text: Path, out: Path, docs: int, seed: int = 0) -> Path:
    """A multiple-choice task of ``docs`` documents from ``text`` (lines of 26+ characters): its YAML in ``out``."""
    lines = [ln.strip() for ln in text.read_text().splitlines() if len(ln.strip()) > 25]
    if len(lines) < 2 * docs + 8:
        sys.exit(f"{text} has {len(lines)} usable lines: too few for {docs} documents")
    rng = random.Random(seed)
    rows = []
    for i in range(0, 2 * docs, 2):
        others = rng.sample([ln for j, ln in enumerate(lines) if abs(j - i) > 2], 3)
        rows.append({"context": lines[i], "choices": [" " + lines[i + 1]] + [" " + o for o in others], "label": 0})
    data = out / "next_line.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (out / "next_line.yaml").write_text(f"""task: waferline_next_line
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}\\n"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
target_delimiter: ""
metric_list:
  - metric: acc
""")
    return data


def harness_split(context: str, continuation: str) -> tuple[str, str]:
    """The harness's context/continuation split: the context's trailing whitespace belongs to the continuation."""
    n = len(context) - len(context.rstrip())
    return (context[:-n], context[-n:] + continuation) if n else (context, continuation)


def direct_logliks(model: Path, docs: list[dict[str, Any]]) -> list[list[float]]:
    """Each choice's log-likelihood given its document's context, from the engine in this process."""
    from waferline import LLM

    llm = LLM(model)
    tok = llm.tokenizer
    out = []
    for d in docs:
        row = []
        for choice in d["choices"]:
            ctx, cont = harness_split(d["context"] + "\n", choice)
            ids = tok.encode(ctx + cont, add_special_tokens=False)
            n_ctx = len(tok.encode(ctx, add_special_tokens=False))
            lp = llm.prompt_logprobs(ids)
            row.append(sum(lp[i - 1, ids[i]].item() for i in range(n_ctx, len(ids))))
        out.append(row)
    return out


def run_harness(lm_eval: str, base: str, name: str, tasks: Path, batch: int, out: Path) -> dict:
    """One harness run at ``batch`` prompts per request: its acc, each document's served log-likelihoods, its time."""
    args = f"model={name},base_url={base}/v1/completions,tokenizer_backend=remote,tokenized_requests=True," \
           "num_concurrent=1,max_retries=1"
    t0 = time.perf_counter()
    res = subprocess.run([lm_eval, "--model", "local-completions", "--model_args", args, "--batch_size", str(batch),
                          "--tasks", "waferline_next_line", "--include_path", str(tasks), "--output_path", str(out),
                          "--log_samples"], capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        sys.exit(f"lm_eval failed (batch {batch}):\n{res.stderr[-3000:]}")
    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"]["waferline_next_line"]
    samples = [json.loads(ln) for ln in next(out.rglob("samples_*.jsonl")).read_text().splitlines()]
    samples.sort(key=lambda s: s["doc_id"])
    served = [[float(r[0][0]) for r in s["resps"]] for s in samples]
    return {"batch": batch, "acc": results["acc,none"], "served": served, "docs": [s["doc"] for s in samples],
            "wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lm-eval", default=shutil.which("lm_eval"), help="the harness's lm_eval executable")
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "sol-mini", help="checkpoint to serve")
    ap.add_argument("--text", type=Path, help="text to build the task from (default: the checkpoint's heldout.txt)")
    ap.add_argument("--docs", type=int, default=100, help="documents in the task (4 choices each)")
    ap.add_argument("--batch-sizes", default="1,16", help="harness batch sizes (prompts per request), comma-separated")
    ap.add_argument("--threads", type=int, default=None, help="torch threads of the server (default: torch's)")
    ap.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "lm_eval_check.json")
    a = ap.parse_args()
    if not a.lm_eval or not Path(a.lm_eval).exists():
        sys.exit("lm_eval not found: install lm-evaluation-harness in an environment of its own and pass "
                 "--lm-eval /path/to/bin/lm_eval (see this script's --help)")
    text = a.text or a.model / "heldout.txt"
    if not text.is_file():
        sys.exit(f"no text to build the task from: {text} (give --text)")
    batches = [int(b) for b in a.batch_sizes.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        build_task(text, tmp_path, a.docs)
        port = _free_port()
        cmd = [sys.executable, "-m", "waferline.cli", "serve", "--model", str(a.model), "--port", str(port)]
        if a.threads:
            cmd += ["--torch-threads", str(a.threads)]
        server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        base = f"http://127.0.0.1:{port}"
        try:
            wait_ready(base, server)
            runs = [run_harness(a.lm_eval, base, a.model.name, tmp_path, b, tmp_path / f"out{b}") for b in batches]
        finally:
            server.terminate()
            server.wait(30)
        direct = direct_logliks(a.model, runs[0]["docs"])
    direct_acc = sum(max(range(len(r)), key=r.__getitem__) == d["label"] for r, d in zip(direct, runs[0]["docs"]))
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"lm-evaluation-harness (local-completions) on `waferline serve --model {a.model.name}`: "
                        f"{a.docs} documents x 4 choices")
    for col in ("harness batch", "requests", "acc served", "acc direct", "max |d loglik|", "wall (s)"):
        table.add_column(col, justify="right")
    rows = []
    for r in runs:
        diff = max(abs(s - d) for rs, rd in zip(r["served"], direct) for s, d in zip(rs, rd))
        n_req = -(-4 * a.docs // r["batch"])
        rows.append({"batch": r["batch"], "acc_served": r["acc"], "acc_direct": direct_acc / a.docs,
                     "max_abs_loglik_diff": diff, "wall_s": r["wall_s"], "requests": n_req})
        table.add_row(str(r["batch"]), str(n_req), f"{r['acc']:.2f}", f"{direct_acc / a.docs:.2f}", f"{diff:.1e}",
                      f"{r['wall_s']:.1f}")
    Console().print(table)
    print("wall: the whole harness run (its start, tokenizer and task load included)")
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps({"model": a.model.name, "docs": a.docs, "runs": rows,
                                  "note": "wall includes the harness's start (tokenizer and task load)"}, indent=2))
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
