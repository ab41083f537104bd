"""benchmarks/kv_schemes.py: its five variants share the backbone (only the mixers differ), and a cache filled by
repeating a shorter prefill holds exactly what a real prefill of the whole context holds (the bytes the benchmark
reports and the ModelSpec counts), from which decoding runs."""

from __future__ import annotations

import pytest
import torch

from conftest import script_module
from waferline.model.init import write_random_checkpoint
from waferline.model.load import load_model
from waferline.spec.configs import parse_hf_config

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ks():
    yield from script_module("kv_schemes")


def test_variants_differ_only_in_their_mixers(ks):
    specs = {v: parse_hf_config(ks.config(v)) for v in ks.VARIANTS}
    kinds = {v: [lay.mixer.kind for lay in s.layers] for v, s in specs.items()}
    assert kinds["GQA"] == ["gqa"] * 4 and kinds["MLA"] == ["mla"] * 4 and kinds["DSA"] == ["dsa"] * 4
    assert kinds["V4 (hca/csa)"] == ["compressed"] * 4 and kinds["Mamba-2 hybrid"] == ["mamba2"] * 3 + ["mla"]
    ref = specs["GQA"]
    for s in specs.values():
        assert (s.hidden_size, s.vocab_size, s.num_layers) == (ref.hidden_size, ref.vocab_size, ref.num_layers)
        assert [lay.ffn for lay in s.layers] == [lay.ffn for lay in ref.layers]
        assert {getattr(lay.mixer, "num_heads", 4) for lay in s.layers if lay.mixer.kind != "mamba2"} == {4}


@pytest.mark.parametrize("variant", ["GQA", "DSA", "V4 (hca/csa)", "Mamba-2 hybrid"])
def test_a_repeated_fill_holds_what_a_real_prefill_holds(ks, tmp_path, variant):
    model = load_model(write_random_checkpoint(ks.config(variant), tmp_path / "m"))
    spec, ctx = model.spec, 4 * ks.ALIGN
    real, _ = ks.fill(model, ctx, ctx, 128, 0)
    filled, _ = ks.fill(model, ctx, ks.ALIGN, 128, 3)
    for a, b, layer in zip(real, filled, spec.layers):
        assert ks.held_bytes(a, 0, ctx) == ks.held_bytes(b, 0, ctx) == layer.cache_bytes_per_seq(ctx, 32, 32)
    per_token = sum(ks.held_bytes(c, 0, ctx) for c in real) - sum(
        ks.held_bytes(c, 0, 2 * ks.ALIGN) for c in ks.fill(model, 2 * ks.ALIGN, 2 * ks.ALIGN, 128, 0)[0])
    assert per_token / (2 * ks.ALIGN) == spec.cache_bytes_per_token(32)
    assert ks.decode(model, filled, ctx, 1, 2, 1) > 0
    with pytest.raises(TypeError):
        ks.held_bytes(object(), 0, ctx)
    if variant == "GQA":  # the repeated rows are the prefilled ones
        rows = filled[0].read(0, 2 * ks.ALIGN)
        torch.testing.assert_close(rows[ks.ALIGN: 2 * ks.ALIGN], rows[: ks.ALIGN], rtol=0, atol=0)


def test_the_ratios_are_to_gqa_wherever_it_is_in_the_variants(ks, capsys):
    """With --variants MLA,GQA the "vs GQA" columns divided by the first variant's figures (MLA's bytes per token
    printed as 1.000 "vs GQA") or were left empty (the tokens/s ratios) though GQA ran."""
    def row(variant, per_token, tok_s):
        return {"variant": variant, "mixers": [variant.lower()], "engine_bytes_per_token": per_token,
                "spec_bytes_per_token": per_token,
                "contexts": [{"context": 256, "engine_bytes_per_seq": 256 * per_token,
                              "spec_bytes_per_seq": 256 * per_token, "spec_read_bytes_per_token": 256 * per_token,
                              "decode_tok_s": tok_s, "predicted_tok_s": 2 * tok_s}]}

    rows = [row("MLA", 1280.0, 50.0), row("GQA", 2048.0, 100.0)]
    ks.add_ratios(rows)
    assert [(r["contexts"][0]["measured_vs_gqa"], r["contexts"][0]["predicted_vs_gqa"]) for r in rows] == [
        (0.5, 0.5), (1.0, 1.0)]
    res = {"rows": rows, "dtype": "bfloat16", "host": None, "hardware": "h100-sxm", "threads": 1, "repeats": 1,
           "steps": 2, "real_prefill": 128, "chunk": 128, "machine": {"loadavg_start": [0.0], "loadavg_end": [0.0]}}
    ks.print_tables(res)
    lines = capsys.readouterr().out.splitlines()
    cells = [[c.strip() for c in ln.split("│")[1:-1]] for ln in lines if ln.startswith(("│ MLA", "│ GQA"))]
    assert [c[-1] for c in cells if c[1] in ("mla", "gqa")] == ["0.625", "1.000"]  # bytes per token vs GQA
    assert [c[-2:] for c in cells if c[1] == "256"] == [["0.50", "0.50"], ["1.00", "1.00"]]  # tok/s vs GQA
