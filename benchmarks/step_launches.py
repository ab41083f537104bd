"""How many device operations one decode step issues on the engine's device path: the count that bounds an
eager GPU step on a slow host (each operation is a kernel launch from Python) and the kernels a captured CUDA graph
replays (each at least a few microseconds on the GPU, however small).

    python benchmarks/step_launches.py [--baseline /tmp/base] [--models llama-gpu dsv3-gpu qwen3moe] [--device cuda]

For each model (decode_speed_models' architectures and layer counts, narrowed to hidden 256: an operation count does
not depend on the widths; ``--full-width`` keeps their own) one request of a 64-token prompt decodes; every ATen
operation of its decode steps is recorded under a TorchDispatchMode and sorted into: **launches** (an operation that
writes a new or an existing tensor: a kernel on a GPU), **views** (every output shares an input's storage: metadata
only, no kernel; a no-op ``.to()`` or ``.contiguous()`` among them) and **host tensors** (``torch.tensor(...)`` of
Python values inside the step: on a GPU each is a host-to-device copy) and **host reads** (a device tensor read back
to the host: ``.item()``, ``int()``/``float()``/``bool()`` of a tensor, ``.tolist()``, ``.cpu()``, ``.numpy()``,
``torch.nonzero``, a boolean-mask index, ``repeat_interleave`` of tensor repeats; on a GPU each waits for the queued
kernels; on CPU every tensor counts, with ``--device cuda`` only those not on the host). On CPU the engine runs its
fused C++ operators; this script turns them off (``WAFERLINE_KERNELS=0``) and has MoE blocks run their experts as
grouped products (``grouped_on_cpu``, as on a GPU, for bf16), so the CPU runs the operations a GPU runs, except MLA's
absorbed products, which a CPU computes in fp32 (casts a GPU does not run). A composite operation (``rms_norm``,
``scaled_dot_product_attention``) counts once: one fused kernel on a GPU, several on CPU. The table adds the eager
step's time (no CUDA graph: ``cuda_graphs=False``; best of 5 runs of ``--time-steps`` steps, ``--threads`` torch
threads, default one); with ``--device cuda`` the steps run on the GPU. ``--static`` counts the fixed-shape step that
a CUDA graph captures instead (engine/graphs.py, run uncaptured: the kernels a replay runs; attention over the step's
fixed end, later keys masked). With ``--baseline TREE`` each model is counted under that source tree as well (a
checkout of waferline; each tree in its own process, ``PYTHONPATH=<tree>/src``), side by side. Counts are exact and
repeatable; times are not. Writes ``benchmarks/results/step_launches.json`` (``--out``)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

NARROW = dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=128, vocab_size=4096)
HEADS = {"llama": dict(num_attention_heads=8, num_key_value_heads=2),
         "qwen3_moe": dict(num_attention_heads=8, num_key_value_heads=4, head_dim=32),
         "deepseek_v3": dict(num_attention_heads=8, num_key_value_heads=8, q_lora_rank=128, kv_lora_rank=64,
                             qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32)}

CHILD = r"""
import json, sys
sys.path.insert(0, sys.argv[2])
import torch
from step_launches import count_decode
from waferline import LLM

a = json.loads(sys.argv[1])
torch.set_num_threads(a["threads"])
llm = LLM(a["model"], dtype=a["dtype"], device=a["device"], cuda_graphs=False)
llm._graphs_on_cpu = a["static"]  # the fixed-shape step a CUDA graph captures, run uncaptured
for m in llm.model.modules():  # on CPU, MoE blocks choose their experts as a GPU does (grouped products)
    if hasattr(m, "grouped_on_cpu"):
        m.grouped_on_cpu = True
print("RESULT " + json.dumps(count_decode(llm, a["steps"], timed_steps=a["time_steps"])))
"""


def _storages(ts: list) -> set:
    out = set()
    for t in ts:
        try:
            out.add(t.untyped_storage().data_ptr())
        except (NotImplementedError, RuntimeError):  # an opaque tensor (a oneDNN-packed weight): its own
            out.add(id(t))
    return out


def _tensors(x: Any) -> list:
    import torch

    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for y in x for t in _tensors(y)]
    if isinstance(x, dict):
        return [t for y in x.values() for t in _tensors(y)]
    return []


# operations that read a tensor's values back to the host (under inference mode ``bool(t)`` and ``.item()`` reach the
# dispatcher as is_nonzero and item, outside it as _local_scalar_dense)
READS = {"_local_scalar_dense", "item", "is_nonzero", "nonzero", "masked_select", "unique", "_unique", "_unique2",
         "unique_consecutive", "unique_dim", "equal"}
READ_METHODS = ("tolist", "cpu", "numpy")  # (these reach the dispatcher, if at all, as a copy or nothing)


def _reads_back(name: str, args: tuple, kwargs: dict) -> bool:
    """Whether operation ``name`` reads values back to the host: READS, a boolean-mask index (a nonzero inside),
    ``repeat_interleave`` of tensor repeats without ``output_size`` (their sum read back)."""
    import torch

    if name in READS:
        return True
    if name == "index" and len(args) > 1:
        return any(isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8) for t in args[1])
    if name == "repeat_interleave":
        reps = args[1] if len(args) > 1 and isinstance(args[0], torch.Tensor) else args[0] if args else None
        return isinstance(reps, torch.Tensor) and kwargs.get("output_size") is None
    return False


def counter(device: str = "cpu") -> Any:
    """A TorchDispatchMode that sorts every ATen operation run under it into launches (by operation name), views,
    host tensors and host reads (see the module's docstring); ``reads_at`` counts the host reads by where in waferline
    they are made (file:line). Used as a context manager it also counts ``Tensor.tolist``, ``.cpu`` and ``.numpy``
    calls (on ``device`` cpu every tensor's, elsewhere those of tensors not on the host)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.launches: dict[str, int] = {}
            self.views = self.host = self.reads = 0
            self.reads_at: dict[str, int] = {}
            self._saved: dict[str, Any] = {}

        def read(self) -> None:
            self.reads += 1
            at = _caller()
            self.reads_at[at] = self.reads_at.get(at, 0) + 1

        def __enter__(self) -> Any:
            for m in READ_METHODS:
                self._saved[m] = orig = getattr(torch.Tensor, m)

                def wrapped(t: Any, *a: Any, _orig: Any = orig, **k: Any) -> Any:
                    if device == "cpu" or t.device.type != "cpu":
                        self.read()
                    return _orig(t, *a, **k)

                setattr(torch.Tensor, m, wrapped)
            return super().__enter__()

        def __exit__(self, *exc: Any) -> None:
            try:
                super().__exit__(*exc)
            finally:
                for m, orig in self._saved.items():
                    setattr(torch.Tensor, m, orig)
                self._saved.clear()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            name = func.__name__.split(".")[0]
            writes = any(r.alias_info is not None and r.alias_info.is_write for r in func._schema.returns)
            outs = _tensors(out)
            if _reads_back(name, args, kwargs):
                self.read()
            if name == "lift_fresh":
                self.host += 1
            elif name in ("empty", "empty_strided", "empty_like", "detach_", "detach"):
                pass  # an allocation or autograd bookkeeping: no kernel
            elif not writes and outs and _storages(outs) <= _storages(_tensors(args) + _tensors(kwargs)):
                self.views += 1
            else:
                self.launches[name] = self.launches.get(name, 0) + 1
            return out

    return Count()


def _caller() -> str:
    """file:line of the innermost waferline frame on the stack (the code that made the read)."""
    import traceback

    frames = [f for f in traceback.extract_stack() if f"{os.sep}waferline{os.sep}" in f.filename]
    if not frames:
        return "?"
    f = frames[-1]
    return f"{f.filename.rpartition(os.sep + 'waferline' + os.sep)[2]}:{f.lineno}"


def count_decode(llm: Any, steps: int, timed_steps: int = 0) -> dict:
    """Operations per decode step of ``llm`` (an LLM): one greedy request of a 64-token prompt, counted for 1 + steps
    tokens and for 1 token, the difference divided by ``steps`` (``host_reads_at``: the host reads per step by where
    they are made); ``prefill_host_reads`` / ``prefill_host_tensors``: those of the 1-token request (its prefill and
    first token). With ``timed_steps``, also the best of 5 of the eager step's time in ms."""
    import time

    import torch

    from waferline import SamplingParams

    prompt = list(range(10, 74))

    def run(n: int, mode: Any = None) -> None:
        p = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        if mode is None:
            llm.generate([prompt], p)
        else:
            with mode:
                llm.generate([prompt], p)

    run(4)
    device = str(next(iter(llm.model.parameters())).device.type)
    short, long = counter(device), counter(device)
    run(1, short)
    run(1 + steps, long)
    names = set(short.launches) | set(long.launches)
    per = {k: (long.launches.get(k, 0) - short.launches.get(k, 0)) / steps for k in names}
    at = {k: (long.reads_at.get(k, 0) - short.reads_at.get(k, 0)) / steps for k in long.reads_at}
    res = {"launches": sum(per.values()), "views": (long.views - short.views) / steps,
           "host_tensors": (long.host - short.host) / steps, "host_reads": (long.reads - short.reads) / steps,
           "host_reads_at": {k: v for k, v in sorted(at.items()) if v}, "prefill_host_reads": short.reads,
           "prefill_host_tensors": short.host, "by_op": {k: v for k, v in sorted(per.items()) if v}}
    if timed_steps:
        sync = torch.cuda.synchronize if next(iter(llm.model.parameters())).is_cuda else (lambda: None)
        longs, shorts = [], []
        for _ in range(5):
            sync()
            t0 = time.perf_counter()
            run(1 + timed_steps)
            sync()
            t1 = time.perf_counter()
            run(1)
            sync()
            longs.append(t1 - t0)
            shorts.append(time.perf_counter() - t1)
        # (the best of each, then their difference: a slow one-token run in one round made that round's difference
        # small or negative)
        res["eager_step_ms"] = max(0.0, min(longs) - min(shorts)) / timed_steps * 1e3
    return res


def checkpoint(name: str, cache: Path, full_width: bool = False) -> tuple[Path, int]:
    """A random checkpoint of ``name``'s architecture and depth at hidden 256 (at its own widths with
    ``full_width``; cached); returns it and its layers."""
    from decode_speed_models import MODELS
    from waferline.model.init import write_random_checkpoint

    model_type, kw = MODELS[name]
    cfg = dict(kw, model_type=model_type) if full_width else dict(kw, **NARROW, **HEADS.get(model_type, {}),
                                                                  model_type=model_type)
    d = cache / (name + ("-full" if full_width else ""))
    if not (d / "model.safetensors").exists():
        write_random_checkpoint(cfg, d, seed=0)
    return d, int(cfg["num_hidden_layers"])


def count(tree: Path, model: Path, dtype: str, device: str, steps: int, time_steps: int, static: bool,
          threads: int = 1) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree / "src"), WAFERLINE_KERNELS="0")
    arg = json.dumps({"model": str(model), "dtype": dtype, "device": device, "steps": steps,
                      "time_steps": time_steps, "static": static, "threads": threads})
    p = subprocess.run([sys.executable, "-c", CHILD, arg, str(ROOT / "benchmarks")], env=env, capture_output=True,
                       text=True, cwd=tree)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise SystemExit(f"counting under {tree} failed (rc {p.returncode}):\n{p.stderr[-3000:]}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["llama-gpu", "dsv3-gpu", "qwen3moe"],
                    help="decode_speed_models architectures (default: llama-gpu dsv3-gpu qwen3moe)")
    ap.add_argument("--dtype", default="bfloat16", help="model dtype (default bfloat16)")
    ap.add_argument("--device", default="cpu", help="where the steps run: cpu (default) or cuda[:N]")
    ap.add_argument("--steps", type=int, default=8, help="decode steps counted (default 8)")
    ap.add_argument("--static", action="store_true",
                    help="count the fixed-shape step a CUDA graph captures (run uncaptured: the kernels a replay runs)")
    ap.add_argument("--time-steps", type=int, default=32, help="decode steps timed (default 32; 0: no timing)")
    ap.add_argument("--baseline", type=Path, help="a waferline source tree counted beside this one")
    ap.add_argument("--full-width", action="store_true",
                    help="the architectures at their own widths (decode_speed's checkpoints), not narrowed to hidden "
                         "256: the same operations, each moving its real bytes (what a timed step on a GPU reads)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads of the counting process (default 1; decode_speed.py sets its --threads: on a "
                         "GPU host the threads' wake-ups are part of an eager step's host time)")
    ap.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "waferline_step_launches",
                    help="where the narrowed checkpoints are kept")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "step_launches.json")
    a = ap.parse_args(argv)
    if a.steps < 1 or a.time_steps < 0 or a.threads < 1:
        ap.error("--steps and --threads must be at least 1 and --time-steps at least 0")
    from decode_speed_models import MODELS

    unknown = [m for m in a.models if m not in MODELS]
    if unknown:
        ap.error(f"unknown model {', '.join(unknown)}; choose from {', '.join(sorted(MODELS))}")
    if not (a.device == "cpu" or a.device == "cuda" or a.device.startswith("cuda:")):
        ap.error(f"--device {a.device}: give cpu or cuda[:N]")
    if a.device != "cpu":
        import torch

        index = a.device.partition(":")[2]
        if not (torch.cuda.is_available() and (int(index) if index.isdigit() else 0) < torch.cuda.device_count()):
            ap.error(f"--device {a.device}: no such CUDA device here (torch {torch.__version__} sees "
                     f"{torch.cuda.device_count() if torch.cuda.is_available() else 0} CUDA devices)")
    if a.baseline is not None and not (a.baseline / "src" / "waferline").is_dir():
        ap.error(f"--baseline {a.baseline} has no src/waferline: give a checkout of waferline")
    from waferline.errors import ConfigError
    from waferline.files import check_writable, write_text_atomic

    try:  # (before the run: a path that cannot be written fails here, not after the run)
        check_writable(a.out, "--out")
    except ConfigError as e:
        ap.error(str(e))
    trees = ([("baseline", a.baseline.resolve())] if a.baseline else []) + [("tree", ROOT)]
    rows = []
    for name in a.models:
        model, layers = checkpoint(name, a.cache, a.full_width)
        row = {"model": name, "layers": layers}
        for label, tree in trees:
            row[label] = count(tree, model, a.dtype, a.device, a.steps, a.time_steps, a.static, a.threads)
            print(f"  {name} under {label}: {row[label]['launches']:.1f} launches per step", file=sys.stderr)
        rows.append(row)
    head = f"{'model':10s} {'layers':>6s}"
    for label, _ in trees:
        head += f" {label + ' launches/step':>24s} {'per layer':>9s} {'host tensors':>12s} {'host reads':>10s}"
        if a.time_steps:
            head += f" {'step ms':>8s}"
    print(head)
    for row in rows:
        line = f"{row['model']:10s} {row['layers']:6d}"
        for label, _ in trees:
            r = row[label]
            line += (f" {r['launches']:24.1f} {r['launches'] / row['layers']:9.1f} {r['host_tensors']:12.1f}"
                     f" {r.get('host_reads', float('nan')):10.1f}")  # (a baseline tree may not count them)
            if a.time_steps:
                line += f" {r['eager_step_ms']:8.2f}"
        print(line)
    for row in rows:  # where the host reads of a step are made
        for label, _ in trees:
            at = row[label].get("host_reads_at", {})
            if at:
                print(f"{row['model']} under {label}: host reads per step at "
                      + ", ".join(f"{k} ({v:g})" for k, v in at.items()))
    if a.baseline:
        for row in rows:
            print(f"{row['model']}: {row['tree']['launches'] / row['baseline']['launches']:.2f}x the baseline's "
                  "launches per step")
    import torch

    def commit(tree: Path) -> str | None:
        r = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        return r.stdout.strip() or None if r.returncode == 0 else None

    write_text_atomic(a.out, json.dumps({"dtype": a.dtype, "device": a.device, "steps": a.steps,
                                         "torch": torch.__version__, "static": a.static,
                                         "full_width": a.full_width, "threads": a.threads,
                                         "commits": {label: commit(tree) for label, tree in trees}, "rows": rows},
                                        indent=2), make_parents=True)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
