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
