"""A wafer layer's region (sim/cost.py region_share) under more wafers: a layer is never slower for them."""

import pytest

from waferline.plan.place import place
from waferline.sim.pipeline import simulate


def _per_layer(model: str, hw: str, bits: int, batch: int, devices: int) -> tuple[list[float], object]:
    """Each stage's decode step without its hop, per layer (the stages without the LM head), and the result."""
    plan = place(model, hw, devices=devices, weight_bits=bits, context=1500, batch=batch)
    r = simulate(plan, prompt_len=1000, output_len=500)
    return [(t.total - t.hop) / len(s.layers) for t, s in zip(r.stages, plan.stages) if not s.has_lm_head], r


def test_a_region_is_laid_out_for_the_micro_batch_a_stage_steps():
    """Llama-3.1-405B, 16-bit on WSE-3, 8 sequences in 8 micro-batches of one: the regions were laid out for a step
    of all 8 sequences at once, so a layer with a wafer to itself (44 wafers) took a larger region than that one-token
    step wants and was slower than a layer sharing its wafer with two others (42 wafers: 42.38 vs 42.21 us)."""
    per42, r42 = _per_layer("llama-3.1-405b", "wse-3", 16, 8, 42)
    per44, r44 = _per_layer("llama-3.1-405b", "wse-3", 16, 8, 44)
    assert r42.micro_batches == r44.micro_batches == 8
    assert max(per44) <= min(per42) * (1 + 1e-9)
    assert max(per44) == pytest.approx(min(per44), rel=1e-9)  # (1, 2 or 3 layers a wafer: alike)


def test_a_region_within_one_wafer_is_not_split_over_the_stages_wafers():
    """gpt-5.6-sol, 4-bit on WSE-2: 160 wafers give each layer's stage two, but its region (the fewest cores that
    hold its ~19 GB) fits one of them, so there is nothing to exchange between them: as fast as on 159 (one layer a
    wafer, 79 idle), where charging a split layer's exchanges made it 241 tok/s instead of 322."""
    per159, r159 = _per_layer("gpt-5.6-sol", "wse-2", 4, 1, 159)
    per160, r160 = _per_layer("gpt-5.6-sol", "wse-2", 4, 1, 160)
    assert all(s.num_devices == 2 for s in place("gpt-5.6-sol", "wse-2", devices=160, weight_bits=4,
                                                 context=1500).stages)
    assert all(t.comm == 0.0 for t in r160.stages)
    assert max(per160) <= min(per159) * (1 + 1e-9)
    assert r160.decode_tokens_per_s_per_user >= r159.decode_tokens_per_s_per_user * (1 - 1e-9)


def test_a_layer_larger_than_a_wafer_still_exchanges_its_halves():
    """gpt-5.6-sol at 16 bits (~72 GB a layer) spans two WSE-3 wafers: the split layer pays its two exchanges."""
    _, r = _per_layer("gpt-5.6-sol", "wse-3", 16, 1, 160)
    assert all(t.comm > 0.0 for t in r.stages)


def test_a_multi_wafer_stage_fills_the_wafers_its_bytes_need_and_crosses_between_them():
    """Eight 405B layers (16-bit, ~52 GB with their cache) fill two WSE-3 wafers: a stage of two or of three crosses
    one wafer boundary a step (one transfer), not an exchange per layer (104 us a stage), and a third wafer, which the
    regions do not need, leaves the step as it was."""
    out = []
    for devices in (32, 48):
        plan = place("llama-3.1-405b", "wse-3", devices=devices, weight_bits=16, context=1500, layers_per_stage=8)
        assert plan.stages[0].num_devices == devices // 16 and len(plan.stages[0].layers) == 8
        r = simulate(plan, prompt_len=1000, output_len=500)
        t = r.stages[0]
        assert t.comm == pytest.approx(t.hop, rel=1e-9)  # (one transfer of the step's activations, as a hop is)
        out.append(r.decode_tokens_per_s_per_user)
    assert out[1] == pytest.approx(out[0], rel=1e-9)


def _layout_batches(monkeypatch) -> list[tuple[str, int]]:
    """Record the (role, batch) each wafer region is laid out for (``cost.region_share``)."""
    from waferline.sim import cost

    seen: list[tuple[str, int]] = []
    real = cost.region_share

    def spy(region, role, room, proportional, n_dev, hw, prm, fabric, batch, bits):
        seen.append((role, batch))
        return real(region, role, room, proportional, n_dev, hw, prm, fabric, batch, bits)

    monkeypatch.setattr(cost, "region_share", spy)
    return seen


def test_an_afd_ranks_ffn_side_runs_every_step_on_one_layout(monkeypatch):
    """Attention / FFN ranks on wafers: the FFN ranks' regions are laid out once, whatever rows a step routes to them
    (a prompt's prefill or a decode step; they were laid out for each step's rows)."""
    seen = _layout_batches(monkeypatch)
    plan = place("deepseek-v3", "wse-3", afd=True, attention_ranks=2, ffn_ranks=4, weight_bits=4, batch=8)
    simulate(plan, prompt_len=1000, output_len=100)
    ffn = {b for role, b in seen if role == "ffn"}
    assert len(ffn) == 1


def test_simulate_shows_the_share_of_a_stages_cores_its_regions_take(capsys):
    """`simulate` on wafers prints (and `--json` gives, `cores_used`) the share of each stage's cores its layers'
    regions take: one 4-bit gpt-5.6-sol layer alone on a WSE-3 47% (its bytes need 45%), Llama 3.1
    8B's 32 layers and LM head the whole wafer; on GPUs nothing."""
    import json

    from waferline.cli import main
    from waferline.sim.cost import layer_table
    from waferline.spec.catalog import load_hardware, load_model

    plan = place("gpt-5.6-sol", "wse-3", devices=80, weight_bits=4)
    r = simulate(plan)
    lc = layer_table(load_model("gpt-5.6-sol"), 4, 16, plan.context_len)[0]  # (laid out for the plan's context)
    need = (lc.weight_bytes + lc.cache_bytes) / load_hardware("wse-3").usable_bytes()
    assert need <= r.stages[0].cores_used < 0.5  # (at least what holds its bytes; less than half the wafer)
    assert main(["simulate", "llama-3.1-8b", "--hardware", "wse-3", "--no-intervals", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["stages"][0]["cores_used"] == pytest.approx(1.0)
    assert main(["simulate", "gpt-5.6-sol", "--hardware", "wse-3", "--weight-bits", "4", "--devices", "80",
                 "--no-intervals"]) == 0
    assert "│   47% │" in capsys.readouterr().out
    assert simulate(place("llama-3.1-8b", "h100-sxm")).stages[0].cores_used == 0.0


def test_a_serving_run_keeps_one_layout_for_every_batch_it_steps():
    """A deployment is compiled once: a serving run's regions are laid out for the most sequences it can hold, and a
    step of 1 or 256 sequences runs on that layout. Each batch size was priced with regions laid out for it (a steady
    state per size): gpt-5.6-sol, 4-bit on 80 WSE-3, one client's tokens came 3.24 ms apart on a region made for one
    sequence, though the run's regions must hold thousands."""
    from waferline.sim.serving import simulate_serving

    plan = place("gpt-5.6-sol", "wse-3", weight_bits=4, devices=80)
    P, O = 1000, 64
    cores = {b: [s.cores_used for s in simulate(plan, prompt_len=P, output_len=O, concurrency=b,
                                                 layout_concurrency=4096).stages] for b in (1, 16, 256)}
    assert cores[1] == cores[16] == cores[256]
    own = {b: simulate(plan, prompt_len=P, output_len=O, concurrency=b).stages[0].cores_used for b in (1, 256)}
    assert own[1] < own[256]  # (each size's own steady state: a larger region for more sequences' cache)
    r = simulate_serving(plan, users=1, num_requests=3, prompt_len=P, output_len=O)
    laid = simulate(plan, prompt_len=P, output_len=O, concurrency=1, layout_concurrency=r.max_batch)
    alone = simulate(plan, prompt_len=P, output_len=O, concurrency=1)
    assert r.max_batch > 1000
    assert r.itl_mean_s == pytest.approx(1 / laid.decode_tokens_per_s_per_user, rel=1e-9)
    assert abs(r.itl_mean_s * alone.decode_tokens_per_s_per_user - 1) > 1e-3
