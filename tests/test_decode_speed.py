"""benchmarks/decode_speed.py's roofline arithmetic: the compute ceiling of waferline's rows and the targets it
flags."""

from __future__ import annotations

import pytest

from conftest import script_module


@pytest.fixture(scope="module")
def ds():
    yield from script_module("decode_speed")


def test_compute_ceiling_prices_body_and_head_at_their_own_rates(ds):
    rates = {"int4@8": 50e9, "int8@8": 100e9, "bf16@8": 80e9, "bf16@1": 40e9}
    # int4 engine: 75 M multiply-adds a token at the int4 rate, the 25 M of its int8 head at the int8 rate
    got = ds.compute_ceiling("wl_int4", 8, 100e6, 25e6, rates)
    assert got == pytest.approx(1 / (75e6 / 50e9 + 25e6 / 100e9))
    assert ds.compute_ceiling("wl_bf16", 1, 100e6, 25e6, rates) == pytest.approx(400.0)
    assert ds.compute_ceiling("wl_bf16", 8, 100e6, 25e6, rates) == pytest.approx(800.0)
    assert ds.compute_ceiling("wl_int4", 1, 100e6, 25e6, rates) is None  # no int4@1 rate measured
    assert ds.compute_ceiling("hf", 8, 100e6, 25e6, rates) is None  # another engine's kernels: no ceiling of ours


def _row(model, engine, batch, tok_s, read_roof, compute=None):
    r = {"model": model, "engine": engine, "batch": batch, "decode_tok_s": tok_s, "read_roofline_tok_s": read_roof}
    if compute is not None:
        r["compute_ceiling_tok_s"] = compute
    return r


def test_targets_flag_a_batch8_target_above_the_compute_ceiling(ds):
    rows = [_row("m", "waferline int4", 1, 200.0, 500.0, 300.0), _row("m", "waferline int4", 8, 500.0, 3000.0, 700.0),
            _row("m", "waferline bf16", 1, 100.0, 160.0, 500.0), _row("m", "waferline bf16", 8, 350.0, 1200.0, 900.0)]
    got = {t["target"]: t for t in ds.targets(rows, [])}
    int4 = got["m: waferline int4 batch 8 aggregate >= 4x batch 1"]
    assert not int4["met"] and int4["value"] == 2.5
    assert "above the compute ceiling of waferline's kernels 700" in int4["above_compute_ceiling"]
    assert "above_roofline" not in int4  # 800 tok/s needed, the read roofline is 3000
    assert "needs_compute_share" not in int4  # (above the ceiling says more)
    bf16 = got["m: waferline bf16 batch 8 aggregate >= 4x batch 1"]
    assert not bf16["met"] and "above_compute_ceiling" not in bf16 and "above_roofline" not in bf16  # 400 < 900
    assert bf16["needs_compute_share"] == ("needs batch 8 at 44% of the compute ceiling of waferline's kernels (900 "
                                           "tok/s); it ran at 39%")
    rows[3]["read_roofline_tok_s"] = 600.0  # bytes-bound (read roofline below the compute ceiling): no compute share
    bf16 = {t["target"]: t for t in ds.targets(rows, [])}["m: waferline bf16 batch 8 aggregate >= 4x batch 1"]
    assert not bf16["met"] and "needs_compute_share" not in bf16


def test_targets_never_flag_a_met_target(ds):
    rows = [_row("m", "waferline bf16", 1, 100.0, 160.0, 150.0), _row("m", "waferline bf16", 8, 450.0, 1200.0, 300.0)]
    (t,) = [t for t in ds.targets(rows, []) if "batch 8" in t["target"]]
    assert t["met"] and "above_compute_ceiling" not in t


def test_product_rate_measures_the_engines_own_products(ds):
    from waferline import kernels

    r1 = ds.product_rate("fp32", 1, 1, reps=2)
    assert r1 is not None and 1e8 < r1 < 1e13  # multiply-adds per second of a real product, not a placeholder
    if kernels.available():
        r8 = ds.product_rate("bf16", 8, 1, reps=2)
        assert r8 is not None and 1e8 < r8 < 1e13


def test_targets_say_when_batch8_must_be_the_more_efficient(ds):
    # a MoE: batch 8 reads 2.5x the bytes of batch 1 (read rooflines 400 and 1280 tok/s); batch 1 ran at 250 tok/s
    # (62.5% of its roofline), so 4x (1000 tok/s) needs batch 8 at 78% of its own: flagged with both shares
    rows = [_row("moe", "waferline bf16", 1, 250.0, 400.0), _row("moe", "waferline bf16", 8, 700.0, 1280.0),
            _row("dense", "waferline bf16", 1, 100.0, 160.0), _row("dense", "waferline bf16", 8, 350.0, 1200.0)]
    got = {t["target"]: t for t in ds.targets(rows, []) if "batch 8" in t["target"]}
    moe = got["moe: waferline bf16 batch 8 aggregate >= 4x batch 1"]
    assert not moe["met"]
    assert moe["needs_higher_share"] == ("needs batch 8 at 78% of its read roofline, batch 1 ran at 62% of its own: "
                                         "a batch-8 step reads 2.50x the bytes of a batch-1 step")
    # dense: 4x (400 tok/s) needs 33% of batch 8's roofline, batch 1 ran at 62% of its own: not this flag
    assert "needs_higher_share" not in got["dense: waferline bf16 batch 8 aggregate >= 4x batch 1"]
    rows[1]["decode_tok_s"] = 1010.0  # met: never flagged
    (met,) = [t for t in ds.targets(rows, []) if t["target"].startswith("moe") and "batch 8" in t["target"]]
    assert met["met"] and "needs_higher_share" not in met


def test_gpu_run_adds_the_hbm_roofline_target(ds):
    rows = [dict(_row("m", "waferline bf16", 1, 130.0, 260.0), roofline_tok_s=200.0),
            dict(_row("m", "waferline int4", 1, 100.0, 600.0), roofline_tok_s=500.0),
            dict(_row("m", "transformers bf16", 1, 20.0, 260.0), roofline_tok_s=200.0)]
    got = {t["target"]: t for t in ds.targets(rows, [], hbm=True)}
    assert got["m: waferline bf16 >= 60% of the HBM roofline (batch 1)"] == {
        "target": "m: waferline bf16 >= 60% of the HBM roofline (batch 1)", "value": 0.65, "met": True}
    int4 = got["m: waferline int4 >= 60% of the HBM roofline (batch 1)"]
    assert int4["value"] == 0.2 and not int4["met"]
    assert not any("HBM" in t["target"] for t in ds.targets(rows, []))  # a CPU run has no such target


def test_device_bandwidths_measure_real_copies(ds):
    copy, read = ds.device_bandwidths("cpu", mib=16, reps=2)
    assert 1e8 < copy < 1e13 and 1e8 < read < 1e13


def test_a_step_reads_no_idle_expert_bytes_as_weight_bytes_counts_them(ds):
    """The roofline's step bytes take an idle expert's bytes off as the ModelSpec counts them in weight_bytes (each
    matrix's own int4 groups, its biases 16-bit): with no expert touched, what is left is every layer's other weights
    and the LM head. gpt-oss (K = 2880) at group 128 stores its experts in groups of 64: a flat count of one scale per
    128 weights counted a batch-1 step 9.8% too large."""
    from waferline.spec.catalog import load_model

    spec = load_model("gpt-oss-20b")
    rest = spec.lm_head_bytes(16) + sum(lay.weight_bytes(4, 128) - lay.ffn.num_experts * lay.ffn.expert_bytes(4, 128)
                                        for lay in spec.layers)
    assert ds.step_bytes(spec, 4, 128, 16, 0, 0) == pytest.approx(rest, rel=1e-12)
    touched = 4  # (one token: its top-4 of 32 experts)
    expected = rest + sum(touched * lay.ffn.expert_bytes(4, 128) for lay in spec.layers)
    assert ds.step_bytes(spec, 4, 128, 16, 1, 0) == pytest.approx(expected, rel=1e-12)


def test_an_fp32_step_reads_its_lm_head_at_32_bits(ds):
    """waferline fp32 keeps its LM head fp32 (as loaded): the roofline counted that head at 16 bits (every engine
    without an int8 or Q6_K head was given head_bits 16), the fp32 rows' step 24% short on the --quick llama. By
    default the head is at the embedding's bits; 16-bit rows are as before."""
    from waferline.spec.catalog import load_model

    spec = load_model("llama-3.1-8b")
    assert ds.step_bytes(spec, 32, 128, 32, 0, 0) == pytest.approx(
        spec.weight_bytes(32, 128, embed_bits=32) - spec.embed_bytes(32), rel=1e-12)
    assert ds.step_bytes(spec, 16, 128, 16, 0, 0) == pytest.approx(
        spec.weight_bytes(16, 128) - spec.embed_bytes(16), rel=1e-12)
    assert "wl_fp32" not in ds.HEAD_BITS  # (its head is at its weights' bits)
