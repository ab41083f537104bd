"""Sweep gpt-5.6-sol over 1-200 WSE-3 wafers x 3 KV variants x speculation on/off; print a table and the time; write
JSON."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from waferline.plan.place import place
from waferline.plan.plan import SpeculativeConfig
from waferline.sim.pipeline import simulate
from waferline.spec.catalog import load_model

VARIANTS = ("gpt-5.6-sol-mla", "gpt-5.6-sol-hybrid", "gpt-5.6-sol-gqa")


def sweep(hardware: str, weight_bits: int, max_devices: int, prompt: int, output: int) -> list[dict]:
    out = []
    for name in VARIANTS:
        spec = load_model(name)
        for n in range(1, max_devices + 1):
            for method in ("none", "mtp"):
                plan = place(spec, hardware, devices=n, weight_bits=weight_bits, context=prompt + output,
                             speculative=SpeculativeConfig(method))
                row = {"model": name, "devices": n, "speculative": method, "fits": plan.fits, "stages": plan.num_stages}
                # predicted even when it does not fit
                r = simulate(plan, prompt_len=prompt, output_len=output, spec=spec)
                row.update(tok_s_user=r.decode_tokens_per_s_per_user, ttft_s=r.ttft_s, step_ms=r.step_latency_s * 1e3)
                out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--hardware", default="wse-3")
    ap.add_argument("--weight-bits", type=int, default=4)
    ap.add_argument("--max-devices", type=int, default=200)
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--output-len", type=int, default=500)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "sweep_sol.json"))
    args = ap.parse_args()
    from waferline.errors import ConfigError
    from waferline.files import check_writable, write_text_atomic

    try:  # (before the run: a path that cannot be written fails here, not after the run)
        check_writable(args.out, "--out")
    except ConfigError as e:
        ap.error(str(e))
    for name in VARIANTS:  # parse configs outside the timed region (catalog cache)
        load_model(name)
    t0, c0 = time.perf_counter(), time.process_time()
    rows = sweep(args.hardware, args.weight_bits, args.max_devices, args.prompt_len, args.output_len)
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    from rich.console import Console
    from rich.table import Table

    t = Table(
        title=f"gpt-5.6-sol on {args.hardware}, {args.weight_bits}-bit weights, prompt {args.prompt_len}, output "
              f"{args.output_len}"
    )
    for c in (
        "variant",
        "fewest that fit",
        "tok/s/user @fewest",
        "tok/s/user @80",
        "tok/s/user @80 +MTP",
        "best tok/s/user (devices)",
        "TTFT @80 ms",
    ):
        t.add_column(c, justify="right" if c != "variant" else "left")
    for name in VARIANTS:
        rs = [r for r in rows if r["model"] == name and r["fits"]]
        if not rs:
            t.add_row(name, "does not fit", "", "", "", "", "")
            continue
        fewest = min(r["devices"] for r in rs)
        at = {(r["devices"], r["speculative"]): r for r in rs}
        best = max((r for r in rs if r["speculative"] == "mtp"), key=lambda r: r["tok_s_user"])
        g = lambda d, m, k="tok_s_user": f"{at[(d, m)][k]:,.0f}" if (d, m) in at else "-"  # noqa: E731
        t.add_row(
            name,
            str(fewest),
            g(fewest, "none"),
            g(80, "none"),
            g(80, "mtp"),
            f"{best['tok_s_user']:,.0f} ({best['devices']})",
            f"{at[(80, 'none')]['ttft_s'] * 1e3:,.1f}" if (80, "none") in at else "-",
        )
    Console(width=160).print(t)
    print(
        f"{len(rows)} plans placed and simulated ({sum(r['fits'] for r in rows)} fit) in {elapsed:.3f} s wall, "
        f"{cpu:.3f} s CPU"
    )
    out = Path(args.out)
    write_text_atomic(out, json.dumps({"seconds": elapsed, "cpu_seconds": cpu, "args": vars(args), "rows": rows},
                                      indent=1), make_parents=True)
    print(f"wrote {out}")


if __name__ == "__main__":
    import sys

    from waferline.errors import WaferlineError

    try:
        main()
    except WaferlineError as e:  # (a bad --hardware, --data or --weight-bits: one line, as the CLI says it)
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
