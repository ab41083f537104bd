"""Config variants the tiny reference checkpoints of test_reference.py do not take: each matches the Hugging Face
reference (fp32, eager) over a prompt longer than its sliding window, prefilled whole and in chunks that cross it,
or loads where transformers loads."""

import json

import pytest
import torch
import transformers

from tiny_models import COMMON, build
from waferline import LLM
from waferline.model.context import StepBatch
from waferline.model.load import load_model
from waferline.spec.configs import parse_hf_config

IDS = [1] + [(7 * j + 3) % 120 + 3 for j in range(23)]  # 24 tokens: past every window below

VARIANTS = {
    # transformers applies a Qwen3-MoE sliding window to every layer (its config has no layer_types)
    "qwen3_moe_sliding": ("qwen3_moe", dict(use_sliding_window=True, sliding_window=6), None),
    # a Qwen3 config.json written before layer_types: the layers from max_window_layers on slide
    "qwen3_no_layer_types": ("qwen3", dict(use_sliding_window=True, sliding_window=6, max_window_layers=1),
                             lambda c: c.pop("layer_types")),
    # gpt-oss's clamp read from the config (it was always 7.0, which random weights never reach)
    "gpt_oss_swiglu_limit": ("gpt_oss", dict(swiglu_limit=0.3), None),
    # a dense Granite-4.0 hybrid (no experts: the FFN is shared_mlp alone)
    "granite_dense": ("granitemoehybrid", dict(num_local_experts=0), None),
    # DeepSeek-V2's router never renormalises the top-k weights, whatever norm_topk_prob says
    "deepseek_v2_norm_topk": ("deepseek_v2", dict(norm_topk_prob=True), None),
    # a hub-style yarn scaling without original_max_position_embeddings: max_position_embeddings stands in
    "yarn_no_original": ("qwen3", {}, lambda c: (c.pop("rope_parameters", None), c.update(
        rope_theta=10000.0, rope_scaling={"type": "yarn", "factor": 4.0}))),
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_config_variant_matches_the_reference(name, tmp_path):
    mt, overrides, edit = VARIANTS[name]
    ref = build(mt, tmp_path, **overrides)
    if edit is not None:  # (the file as the hub has it; the reference reads it back as transformers does)
        cfg = json.loads((tmp_path / "config.json").read_text())
        edit(cfg)
        (tmp_path / "config.json").write_text(json.dumps(cfg))
        ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").float().eval()
    with torch.no_grad():
        want = torch.log_softmax(ref(torch.tensor([IDS]), position_ids=torch.arange(len(IDS))[None],
                                     use_cache=False).logits[0].float(), dim=-1)
    assert (LLM(tmp_path).prompt_logprobs(IDS) - want).abs().max().item() < 1e-4, name
    model, rows = load_model(tmp_path), []  # in chunks of 5 that cross the window, then decoding
    caches = model.new_caches(1)
    with torch.inference_mode():
        for a, b in [(0, 5), (5, 10), (10, 15), (15, 20), *((i, i + 1) for i in range(20, len(IDS)))]:
            rows.append(model.logits(model(torch.tensor([IDS[a:b]]), caches, StepBatch.make([0], [a], b - a))[0]))
    got = torch.log_softmax(torch.cat(rows).float(), dim=-1)
    assert (got - want).abs().max().item() < 1e-4, name


def test_sliding_windows_are_read_as_transformers_reads_them():
    """The planner's cache accounting takes the same windows: Mistral's on every layer; Qwen's only with
    use_sliding_window (false by default), from max_window_layers on where layer_types is absent."""
    def windows(**kw):
        cfg = dict(COMMON, num_hidden_layers=4, intermediate_size=96, **kw)
        return [layer.mixer.sliding_window for layer in parse_hf_config(cfg).layers]

    assert windows(model_type="mistral", sliding_window=6) == [6] * 4
    assert windows(model_type="mistral") == [4096] * 4  # (MistralConfig's default where the key is absent)
    assert windows(model_type="mistral", sliding_window=None) == [None] * 4
    assert windows(model_type="qwen3", sliding_window=6, max_window_layers=2) == [None] * 4
    assert windows(model_type="qwen3", sliding_window=6, max_window_layers=2, use_sliding_window=True) == \
        [None, None, 6, 6]
    assert windows(model_type="qwen3", sliding_window=6, use_sliding_window=False,
                   layer_types=["sliding_attention"] * 4) == [None] * 4
