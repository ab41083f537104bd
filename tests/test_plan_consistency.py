"""Answers of the planner and simulator that must agree with one another: one plan, a longer prompt; one layout, a
longer context."""

from __future__ import annotations

import pytest

from waferline.plan.place import place
from waferline.sim.pipeline import simulate
from waferline.spec.catalog import load_model


def test_on_one_wafer_plan_a_longer_prompt_never_prefills_faster():
    """A wafer's regions are laid out for the plan's context, not for the prompt being run: Llama 4 Maverick's dense
    and MoE layers share wafers, and sizing their regions by the prompt's cache made a 2,000-token prompt prefill in
    12.5 ms where a 512-token one took 15.1 ms."""
    plan = place("llama-4-maverick", "wse-2", weight_bits=4, context=131072, batch=64)
    prev = 0.0
    for prompt in (512, 1000, 2000, 4000):
        r = simulate(plan, prompt_len=prompt, output_len=100)
        assert r.prefill_s >= prev
        prev = r.prefill_s


def test_a_compressed_cache_is_counted_at_the_most_it_holds_on_the_way():
    """DeepSeek-V4's compressed layers hold a window's pending tokens until it closes: a sequence holds 18.4 MB at
    1,023 tokens and 13.0 MB at 1,024, so a layout that fits only the latter does not fit a sequence growing to it."""
    spec = load_model("deepseek-v4-flash")
    kw = dict(context=1024, batch=2370, devices=4, layers_per_stage=43)
    full, before = place(spec, "b200", **kw), place(spec, "b200", **{**kw, "context": 1023})
    assert full.stages[0].memory.cache == pytest.approx(before.stages[0].memory.cache)
    assert not full.fits  # (as at 1,023 tokens)
    at = [spec.cache_bytes_per_seq(c) for c in range(1, 1025)]
    assert at[-1] < max(at) <= sum(layer.peak_cache_bytes_per_seq(1024) for layer in spec.layers)


def test_a_compressed_caches_wafer_regions_keep_their_size_on_the_way_to_the_context():
    """DeepSeek-V4's layers hold more cache at 1,023 tokens than at 1,024: the regions of a plan for 1,024 are laid
    out for the most a sequence holds on its way there, so a decode at 1,023 tokens runs on the same cores as one at
    1,024 (laid out for the 1,024-token cache, the regions grew for the shorter one: their mesh distance moved)."""
    plan = place("deepseek-v4-flash", "wse-3", weight_bits=4, context=1024, batch=256)
    runs = [simulate(plan, prompt_len=p, output_len=o) for p, o in ((1000, 23), (1000, 24), (1023, 1), (1024, 1))]
    first = [s.fabric_distance for s in runs[0].stages]
    for r in runs[1:]:
        assert [s.fabric_distance for s in r.stages] == pytest.approx(first, rel=1e-12)
