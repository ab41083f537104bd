"""Config variants the tiny reference checkpoints of test_reference.py do not take: each matches the Hugging Face
reference (fp32, eager) over a prompt longer than its sliding window, prefilled whole and in chunks that cross it,
or loads where transformers loads."""

import dataclasses
import json

import pytest
import torch
import transformers

from tiny_models import COMMON, build, configs
from waferline import LLM
from waferline.errors import ConfigError
from waferline.model.context import StepBatch
from waferline.model.load import load_model
from waferline.spec.configs import ENGINE_MODEL_TYPES, parse_hf_config

IDS = [1] + [(7 * j + 3) % 120 + 3 for j in range(23)]  # 24 tokens: past every window below


def _absent(*fields):
    """An edit that leaves ``fields`` out of config.json."""
    return lambda c: [c.pop(k) for k in fields]


VARIANTS = {
    # transformers applies a Qwen3-MoE sliding window to every layer (its config has no layer_types)
    "qwen3_moe_sliding": ("qwen3_moe", dict(use_sliding_window=True, sliding_window=6), None),
    # a Qwen3 config.json written before layer_types: the layers from max_window_layers on slide
    "qwen3_no_layer_types": ("qwen3", dict(use_sliding_window=True, sliding_window=6, max_window_layers=1),
                             lambda c: c.pop("layer_types")),
    # transformers' Llama attention has no window: sliding_window and layer_types are not read (a window was applied)
    "llama_sliding_window_not_read": ("llama", dict(sliding_window=6, layer_types=[
        "sliding_attention", "full_attention"]), None),
    # gpt-oss's clamp read from the config (it was always 7.0, which random weights never reach)
    "gpt_oss_swiglu_limit": ("gpt_oss", dict(swiglu_limit=0.3), None),
    # a routed scaling of 0 (only the shared expert counts) is 0, not the default (`or 1.0` took 0 for absent)
    "deepseek_v3_routed_scaling_zero": ("deepseek_v3", dict(routed_scaling_factor=0.0), None),
    # a dense Granite-4.0 hybrid (no experts: the FFN is shared_mlp alone)
    "granite_dense": ("granitemoehybrid", dict(num_local_experts=0), None),
    # DeepSeek-V2's router never renormalises the top-k weights, whatever norm_topk_prob says
    "deepseek_v2_norm_topk": ("deepseek_v2", dict(norm_topk_prob=True), None),
    # a hub-style yarn scaling without original_max_position_embeddings: max_position_embeddings stands in
    "yarn_no_original": ("qwen3", {}, lambda c: (c.pop("rope_parameters", None), c.update(
        rope_theta=10000.0, rope_scaling={"type": "yarn", "factor": 4.0}))),
    # MLA's latent norms (q_a_layernorm, kv_a_layernorm) use the reference's constant epsilon 1e-6, not rms_norm_eps
    # (Kimi K2's is 1e-5): they took rms_norm_eps
    "deepseek_v3_rms_norm_eps": ("deepseek_v3", dict(rms_norm_eps=1e-2), None),
    "deepseek_v2_rms_norm_eps": ("deepseek_v2", dict(rms_norm_eps=1e-2), None),
    "kimi_linear_rms_norm_eps": ("kimi_linear", dict(rms_norm_eps=1e-2), None),
    # DeepSeek's softmax scale takes YaRN's mscale_all_dim under any scaled rope_type, as transformers folds it in
    # (it was yarn only)
    "deepseek_v3_linear_rope_mscale_all_dim": ("deepseek_v3", dict(rope_parameters=dict(
        rope_type="linear", rope_theta=10000.0, factor=4.0, mscale_all_dim=0.5)), None),
    # Kimi Linear's MLA has no rotary embedding: rope settings change nothing (mscale_all_dim scaled its softmax; a
    # dynamic rope_type, which it never builds, refused the model)
    "kimi_linear_yarn_not_read": ("kimi_linear", dict(rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=16, mscale=1.0,
        mscale_all_dim=0.5)), None),
    "kimi_linear_dynamic_rope_not_read": ("kimi_linear", dict(rope_parameters=dict(
        rope_type="dynamic", rope_theta=10000.0, factor=2.0)), None),
    # rope_scaling beside transformers-5 rope_parameters: transformers takes rope_scaling
    "rope_scaling_beside_rope_parameters": ("llama", {}, lambda c: c.update(
        rope_scaling={"rope_type": "linear", "factor": 2.0})),
    # the linear-attention convs apply hidden_act (they always applied SiLU), V4's experts too
    "qwen3_next_hidden_act": ("qwen3_next", dict(hidden_act="gelu"), None),
    "kimi_linear_hidden_act": ("kimi_linear", dict(hidden_act="gelu"), None),
    "deepseek_v4_hidden_act": ("deepseek_v4", dict(hidden_act="gelu"), None),
    # no shared expert: transformers saves one of width 0 (its empty tensors were "tensors the config does not account
    # for"); Nemotron-H reads no n_shared_experts at all (its shared expert was dropped)
    "deepseek_v2_no_shared_expert": ("deepseek_v2", dict(n_shared_experts=0), None),
    "deepseek_v3_no_shared_expert": ("deepseek_v3", dict(n_shared_experts=0), None),
    "kimi_linear_no_shared_expert": ("kimi_linear", dict(n_shared_experts=0), None),
    "nemotron_h_n_shared_experts_0": ("nemotron_h", dict(n_shared_experts=0), None),
    "granite_shared_mlp_width_0": ("granitemoehybrid", dict(shared_intermediate_size=0), None),
    "qwen3_next_shared_expert_width_0": ("qwen3_next", dict(shared_expert_intermediate_size=0), None),
    # mlp_bias where transformers reads it: the shared experts' biases too (they were left over) ...
    "deepseek_v2_mlp_bias": ("deepseek_v2", dict(mlp_bias=True), None),
    "nemotron_h_mlp_bias": ("nemotron_h", dict(mlp_bias=True), None),
    "deepseek_v4_mlp_bias": ("deepseek_v4", dict(mlp_bias=True), None),
    # ... and not where it does not (waferline asked for biases the checkpoint has not)
    "qwen3_mlp_bias_not_read": ("qwen3", dict(mlp_bias=True), None),
    "deepseek_v3_mlp_bias_not_read": ("deepseek_v3", dict(mlp_bias=True), None),
    # Nemotron-H: Mamba projection biases from use_bias (mamba_proj_bias was read); its attention has no biases
    "nemotron_h_use_bias": ("nemotron_h", dict(use_bias=True), None),
    "nemotron_h_attention_bias_not_read": ("nemotron_h", dict(attention_bias=True), None),
    # the DeepSeek routers transformers builds whatever scoring_func / topk_method say (they were read: other scores)
    "deepseek_v2_scoring_func_not_read": ("deepseek_v2", dict(scoring_func="sigmoid"), None),
    "deepseek_v2_moe_layer_freq_not_read": ("deepseek_v2", dict(moe_layer_freq=2), None),
    "deepseek_v3_moe_layer_freq_not_read": ("deepseek_v3", dict(moe_layer_freq=2), None),
    "deepseek_v3_router_fields_not_read": ("deepseek_v3", dict(scoring_func="softmax", topk_method="greedy"), None),
    # DeepSeek-V3.2's dense layers are where mlp_layer_types says (first_k_dense_replace was read)
    "deepseek_v32_mlp_layer_types": ("deepseek_v32", dict(mlp_layer_types=["dense", "sparse", "dense"]), None),
    # partial_rotary_factor where transformers' attention rotates whole heads (waferline rotated the share) ...
    "llama_partial_rotary_not_read": ("llama", dict(partial_rotary_factor=0.5, rope_parameters=dict(
        rope_type="default", rope_theta=10000.0)), None),
    "granite_partial_rotary_not_read": ("granitemoehybrid", {}, lambda c: c.update(partial_rotary_factor=0.5)),
    # ... Bamba's top-level one, over which transformers sets half (it was read), and Qwen3-Next's default, a quarter
    # (it was the whole head)
    "bamba_partial_rotary_top_level": ("bamba", {}, lambda c: (c["rope_parameters"].pop("partial_rotary_factor", None),
                                                               c.update(partial_rotary_factor=1.0))),
    "qwen3_next_partial_rotary_absent": ("qwen3_next", {}, lambda c: (
        c.pop("partial_rotary_factor", None), c["rope_parameters"].pop("partial_rotary_factor", None))),
    # fields a config.json leaves out read as transformers' defaults (the engine's own fallbacks differed)
    "qwen3_moe_norm_topk_prob_absent": ("qwen3_moe", dict(norm_topk_prob=False), lambda c: c.pop("norm_topk_prob")),
    "mixtral_rms_norm_eps_absent": ("mixtral", {}, lambda c: c.pop("rms_norm_eps")),
    "gpt_oss_rms_norm_eps_absent": ("gpt_oss", {}, lambda c: c.pop("rms_norm_eps")),
    "bamba_rms_norm_eps_absent": ("bamba", {}, lambda c: c.pop("rms_norm_eps")),
    "granite_rms_norm_eps_absent": ("granitemoehybrid", {}, lambda c: c.pop("rms_norm_eps")),
    "nemotron_h_layer_norm_epsilon_absent": ("nemotron_h", {}, lambda c: c.pop("layer_norm_epsilon")),
    "kimi_linear_rms_norm_eps_absent": ("kimi_linear", {}, lambda c: c.pop("rms_norm_eps")),
    "deepseek_v2_shared_experts_absent": ("deepseek_v2", {}, lambda c: c.pop("n_shared_experts")),
    "deepseek_v3_router_fields_absent": ("deepseek_v3", dict(
        num_hidden_layers=4, n_routed_experts=16, n_shared_experts=1, routed_scaling_factor=2.5, n_group=8,
        topk_group=4, first_k_dense_replace=3), lambda c: [c.pop(k) for k in (
            "n_shared_experts", "routed_scaling_factor", "n_group", "topk_group", "first_k_dense_replace")]),
    # ... and sizes, the rotary base and settings, Granite's attention scale (they were hidden_size / heads, 10000, no
    # q LoRA, no shared expert, 1 / sqrt(head_dim)): each model built as transformers reads the config without them
    "qwen3_head_dim_absent": ("qwen3", dict(head_dim=128), _absent("head_dim", "max_position_embeddings")),
    "qwen3_moe_kv_heads_absent": ("qwen3_moe", dict(num_attention_heads=8, num_key_value_heads=4),
                                  _absent("num_key_value_heads", "max_position_embeddings")),
    "mixtral_defaults_absent": ("mixtral", dict(num_attention_heads=16, num_key_value_heads=8),
                                _absent("num_key_value_heads", "rope_parameters", "max_position_embeddings")),
    "gpt_oss_defaults_absent": ("gpt_oss", dict(num_attention_heads=16, num_key_value_heads=8, head_dim=64,
                                                sliding_window=128), _absent(
        "head_dim", "num_key_value_heads", "sliding_window", "rope_parameters", "max_position_embeddings")),
    "gpt_oss_rope_theta_absent": ("gpt_oss", {}, lambda c: c["rope_parameters"].pop("rope_theta")),
    # (a hub-style rope_theta alone: transformers' yarn settings with that base)
    "gpt_oss_rope_theta_alone": ("gpt_oss", dict(rope_parameters=dict(
        rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
        original_max_position_embeddings=4096, rope_theta=5000.0)), lambda c: (c.pop("rope_parameters"), c.update(
            rope_theta=5000.0))),
    "granite_defaults_absent": ("granitemoehybrid", dict(shared_intermediate_size=1024, attention_multiplier=1.0),
                                _absent("shared_intermediate_size", "attention_multiplier", "max_position_embeddings")),
    "nemotron_h_defaults_absent": ("nemotron_h", dict(
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, mamba_head_dim=64, n_groups=8, chunk_size=128,
        moe_shared_expert_intermediate_size=7688), _absent(
            "num_key_value_heads", "head_dim", "mamba_head_dim", "n_groups", "chunk_size",
            "moe_shared_expert_intermediate_size")),
    "bamba_kv_heads_absent": ("bamba", dict(num_attention_heads=16, num_key_value_heads=8),
                              _absent("num_key_value_heads", "max_position_embeddings")),
    "qwen3_next_defaults_absent": ("qwen3_next", dict(num_key_value_heads=2, head_dim=256,
                                                      shared_expert_intermediate_size=512), _absent(
        "num_key_value_heads", "head_dim", "shared_expert_intermediate_size", "max_position_embeddings")),
    "deepseek_v2_q_lora_rank_absent": ("deepseek_v2", dict(q_lora_rank=1536),
                                       _absent("q_lora_rank", "max_position_embeddings")),
    "deepseek_v3_q_lora_rank_absent": ("deepseek_v3", dict(q_lora_rank=1536),
                                       _absent("q_lora_rank", "num_nextn_predict_layers")),
    "deepseek_v32_q_lora_rank_absent": ("deepseek_v32", dict(q_lora_rank=1536),
                                        _absent("q_lora_rank", "max_position_embeddings")),
    "deepseek_v4_defaults_absent": ("deepseek_v4", dict(num_attention_heads=8, o_groups=8, o_lora_rank=1024), _absent(
        "o_groups", "o_lora_rank", "num_nextn_predict_layers", "max_position_embeddings")),
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
    use_sliding_window (false by default), from max_window_layers on where layer_types is absent; Llama's none."""
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
    assert windows(model_type="llama", sliding_window=6, layer_types=["sliding_attention"] * 4) == [None] * 4
    assert windows(model_type="llama", sliding_window=0, layer_types=["sliding_attention"] * 4) == [None] * 4


def _hf_config(mt):
    """The config.json transformers writes for the tiny ``mt`` model (sol: the demo's)."""
    if mt == "sol":
        from waferline.demo import SOL_DEMO_CONFIG

        return json.loads(json.dumps(SOL_DEMO_CONFIG))
    return json.loads(json.dumps(transformers.AutoConfig.for_model(mt, **configs()[mt]).to_dict()))


def _eps(c):
    c["layer_norm_epsilon" if "layer_norm_epsilon" in c else "rms_norm_eps"] = -1e-6


# value -> the field the one-line error names; each applied to every model_type that reads it
BAD_SETTINGS = {
    "negative eps": (_eps, "eps(ilon)? must be a number > 0"),
    "zero eps": (lambda c: c.update(rms_norm_eps=0.0), "rms_norm_eps must be a number > 0"),
    "eps a string": (lambda c: c.update(rms_norm_eps="1e-6"), "rms_norm_eps must be a number > 0"),
    "unknown rope type": (lambda c: c.update(rope_scaling={"rope_type": "bogus"}), "rope_type 'bogus'"),
    "old rope type spelling": (lambda c: c.update(rope_scaling={"type": "bogus", "factor": 2.0}), "rope_type 'bogus'"),
    "rope settings a string": (lambda c: c.update(rope_scaling="yarn"), "rope_scaling must be an object"),
    "rope_theta <= 0": (lambda c: (c.pop("rope_parameters", None), c.update(rope_theta=0)), "rope_theta must be"),
    "rope_theta inside <= 0": (lambda c: c.update(rope_parameters={"rope_type": "default", "rope_theta": -1.0}),
                               "rope_parameters.rope_theta must be"),
    "linear rope without factor": (lambda c: c.update(rope_scaling={"rope_type": "linear"}), "has no 'factor'"),
    "llama3 rope without its fields": (lambda c: c.update(rope_scaling={"rope_type": "llama3", "factor": 8.0}),
                                       "has no 'low_freq_factor'"),
    "rope factor <= 0": (lambda c: c.update(rope_scaling={"rope_type": "linear", "factor": 0}), "factor must be"),
    "partial rotary > 1": (lambda c: c.update(partial_rotary_factor=2.0), "partial_rotary_factor must be"),
}
NO_ROPE = ("nemotron_h",)  # (no rotary embedding: its settings are never read)


@pytest.mark.parametrize("mt", sorted(ENGINE_MODEL_TYPES))
@pytest.mark.parametrize("bad", sorted(BAD_SETTINGS))
def test_settings_that_make_no_model_are_one_config_error(mt, bad):
    """A norm epsilon or rotary setting that makes no model is refused when the config is read (info, plan and the
    engine alike), naming the field: it used to decode NaN (eps -1 printed `0 0 0`), or fail at load with a
    traceback (a linear rope without its factor), or be ignored (a bogus rope_scaling beside rope_parameters)."""
    edit, message = BAD_SETTINGS[bad]
    cfg = _hf_config(mt)
    parse_hf_config(cfg)
    edit(cfg)
    if mt in NO_ROPE and "eps" not in bad:  # (no rotary embedding: its settings are never read, so not refused)
        parse_hf_config(cfg)
        return
    with pytest.raises(ConfigError, match=message):
        parse_hf_config(cfg)


@pytest.mark.parametrize("mt,edit", [
    ("mixtral", dict(sliding_window=0)), ("mixtral", dict(sliding_window=-4)), ("mistral", dict(sliding_window=0)),
    ("qwen3_moe", dict(use_sliding_window=True, sliding_window=-1)),
    ("qwen3", dict(use_sliding_window=True, sliding_window=0, layer_types=["sliding_attention"] * 2)),
    ("gpt_oss", dict(sliding_window=0)),
    ("gpt_oss", dict(sliding_window=8.5)), ("deepseek_v4", dict(sliding_window=0)),
])
def test_sliding_windows_below_one_token_are_refused(mt, edit):
    cfg = _hf_config(mt) if mt in configs() else dict(COMMON, model_type=mt, num_hidden_layers=2, intermediate_size=96)
    with pytest.raises(ConfigError, match="sliding_window must be an integer >= 1"):
        parse_hf_config(dict(cfg, **edit))


@pytest.mark.parametrize("mt,field", [("bamba", "mamba_chunk_size"), ("granitemoehybrid", "mamba_chunk_size"),
                                      ("nemotron_h", "chunk_size")])
def test_a_mamba_chunk_of_no_tokens_is_refused(mt, field):
    """A Mamba-2 prefill chunk of 0 tokens makes no scan (transformers divides by it): the config was accepted and
    the first prefill raised ZeroDivisionError."""
    with pytest.raises(ConfigError, match=f"config {field} must be an integer >= 1, got 0"):
        parse_hf_config(dict(_hf_config(mt), **{field: 0}))
    parse_hf_config(dict(_hf_config(mt), **{field: 3}))


@pytest.mark.parametrize("mt,types,message", [
    ("llama", ["full_attention", "sliding_attnetion"], "layer_types has 'sliding_attnetion'"),
    ("qwen3", "full_attention", "layer_types must be a list"),
    ("gpt_oss", ["full_attention", "linear_attention"], "layer_types has 'linear_attention'"),
    ("qwen3_next", ["linear_attention", "full_attention"], "layer_types has 2 entries but num_hidden_layers is 4"),
    ("qwen3_next", ["linear_attention", "full_attention", "linear_attention", "bogus"], "layer_types has 'bogus'"),
])
def test_layer_types_that_name_no_layer_are_refused(mt, types, message):
    """transformers refuses unknown layer_types entries and a list of the wrong length; they were read as full
    attention (or an IndexError)."""
    with pytest.raises(ConfigError, match=message):
        parse_hf_config(dict(_hf_config(mt), layer_types=types))


def test_real_config_conventions_still_read():
    """What released checkpoints write stays accepted: null rope_scaling and sliding_window, the hub's ``type``
    spelling, a Qwen sliding window that use_sliding_window switches off, DeepSeek-V4's nested rope settings."""
    base = dict(COMMON, num_hidden_layers=2, intermediate_size=96)
    parse_hf_config(dict(base, model_type="llama", rope_scaling=None, rope_theta=500000.0))
    parse_hf_config(dict(base, model_type="qwen3", sliding_window=None, use_sliding_window=False))
    parse_hf_config(dict(base, model_type="qwen2", sliding_window=0, use_sliding_window=False))
    parse_hf_config(dict(base, model_type="llama", rope_scaling={"type": "dynamic", "factor": 2.0}))
    parse_hf_config(dict(base, model_type="llama", rope_scaling={"rope_type": "yarn", "factor": 4.0}))
    parse_hf_config(_hf_config("deepseek_v4"))
    parse_hf_config(dict(_hf_config("nemotron_h"), rope_scaling={"rope_type": "bogus"}))  # (never read)


@pytest.mark.parametrize("mt", ["llama", "qwen3", "gpt_oss"])
def test_a_partial_rotary_factor_whole_head_attention_cannot_take_is_refused(mt):
    """transformers' Llama-style attention rotates whole heads: its default rotary reads no partial_rotary_factor,
    but a scaled one (linear, yarn, ...) makes tables for the share and the model fails on the first token; waferline
    rotated the share, a model no reference computes."""
    cfg = _hf_config(mt)
    cfg.pop("rope_parameters", None)
    cfg.update(rope_scaling={"rope_type": "linear", "factor": 2.0}, partial_rotary_factor=0.5)
    with pytest.raises(ConfigError, match="partial_rotary_factor 0.5 with rope_type 'linear'.*rotates whole heads"):
        parse_hf_config(cfg)
    # the default rotary: the share is not read (gpt-oss's, where a config gives none, is transformers' yarn)
    parse_hf_config(dict(cfg, rope_scaling=None, rope_parameters=dict(rope_type="default", rope_theta=1e4)))
    if mt == "gpt_oss":
        with pytest.raises(ConfigError, match="partial_rotary_factor 0.5 with rope_type 'yarn'"):
            parse_hf_config(dict(cfg, rope_scaling=None))


@pytest.mark.parametrize("mt,head_dim", [("gpt_oss", 7), ("llama", 9), ("bamba", 6), ("qwen3_next", 4),
                                         ("deepseek_v4", 7)])
def test_an_odd_number_of_rotated_channels_is_refused(mt, head_dim):
    """Rotary embeddings turn channel pairs (transformers refuses an odd head_dim it rotates whole); the engine
    failed at load with a traceback (gpt_oss, deepseek_v4) and the planner counted the model."""
    with pytest.raises(ConfigError, match="rotary embeddings turn channel pairs"):
        parse_hf_config(dict(_hf_config(mt), head_dim=head_dim))


def test_a_dsa_indexer_narrower_than_the_rotary_channels_is_refused():
    """The DSA indexer's keys carry the rotary channels: a qk_rope_head_dim over index_head_dim was a tensor-size
    traceback at the first token (transformers fails on it too) and the planner counted the model."""
    cfg = _hf_config("deepseek_v32")
    with pytest.raises(ConfigError, match="qk_rope_head_dim 32 is over index_head_dim 16"):
        parse_hf_config(dict(cfg, qk_rope_head_dim=32, index_head_dim=16))
    parse_hf_config(dict(cfg, qk_rope_head_dim=16, index_head_dim=16))


ACCOUNTING_ONLY = {  # model types the planner places but tiny_models does not build: small configs, every part on
    "qwen2": dict(COMMON, num_hidden_layers=2, intermediate_size=96),
    "jamba": dict(COMMON, num_hidden_layers=2, intermediate_size=48, attn_layer_period=2, attn_layer_offset=1,
                  expert_layer_period=2, expert_layer_offset=1, num_experts=4, num_experts_per_tok=2,
                  mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=6),
}


@pytest.mark.parametrize("mt", sorted(set(configs()) | set(ACCOUNTING_ONLY)))
def test_parameter_count_is_what_transformers_builds(mt):
    """params_total and every layer's params() equal the parameters of the transformers model of the same config
    (built on the meta device), the router's correction bias (a buffer there, a tensor of the checkpoint) added."""
    cfg = transformers.AutoConfig.for_model(mt, **{**configs(), **ACCOUNTING_ONLY}[mt])
    spec = parse_hf_config(cfg.to_dict())
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)

    def count(module):
        return (sum(p.numel() for p in module.parameters())
                + sum(b.numel() for n, b in module.named_buffers() if n.endswith("e_score_correction_bias")))

    assert [layer.params() for layer in spec.layers] == [count(layer) for layer in model.model.layers]
    assert spec.params_total() == count(model)


@pytest.mark.parametrize("mt,edit", [("deepseek_v2", dict(mlp_bias=True)), ("nemotron_h", dict(mlp_bias=True)),
                                     ("deepseek_v4", dict(mlp_bias=True)), ("nemotron_h", dict(n_shared_experts=0)),
                                     ("nemotron_h", dict(use_bias=True, attention_bias=True)),
                                     ("qwen3", dict(mlp_bias=True)), ("deepseek_v3", dict(mlp_bias=True)),
                                     ("deepseek_v32", dict(mlp_layer_types=["dense", "sparse", "dense"])),
                                     ("deepseek_v2", dict(attention_bias=True)),
                                     ("deepseek_v3", dict(attention_bias=True)),
                                     ("deepseek_v32", dict(attention_bias=True)),
                                     ("kimi_linear", dict(attention_bias=True)),
                                     ("nemotron_h", dict(tie_word_embeddings=True)),
                                     ("kimi_linear", dict(tie_word_embeddings=True)),
                                     ("nemotron_h", dict(moe_shared_expert_intermediate_size=0))])
def test_parameter_count_of_config_variants(mt, edit):
    """The biases and layers the variants above switch on or off are counted as transformers builds them."""
    cfg = transformers.AutoConfig.for_model(mt, **dict(configs()[mt], **edit))
    spec = parse_hf_config(cfg.to_dict())
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    buffers = sum(b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    assert spec.params_total() == sum(p.numel() for p in model.parameters()) + buffers


@pytest.mark.parametrize("mt,edit", [("deepseek_v3", dict(attention_bias=True)),
                                     ("nemotron_h", dict(tie_word_embeddings=True)),
                                     ("nemotron_h", dict(moe_shared_expert_intermediate_size=0))])
def test_the_engine_holds_the_parameters_the_accounting_counts(mt, edit, tmp_path):
    """MLA's attention biases (q_a_proj, kv_a_proj_with_mqa, o_proj under attention_bias) and the LM head of a model
    transformers never ties (Nemotron-H, Kimi Linear: tie_word_embeddings or not) are loaded by the engine, and the
    accounting the planner sizes memory by counted neither; a Nemotron-H shared expert of size 0 is one of
    intermediate_size in transformers' checkpoint, which the engine refused."""
    ref = build(mt, tmp_path, **edit)
    m = load_model(tmp_path)
    buffers = sum(b.numel() for n, b in m.named_buffers() if n.endswith("e_score_correction_bias"))
    assert sum(p.numel() for p in m.parameters()) + buffers == m.spec.params_total()
    ids = torch.tensor([IDS[:6]])
    got = m.logits(m(ids, m.new_caches(1), StepBatch.make([0], [0], 6))[0])
    assert (got - ref(ids).logits[0].detach()).abs().max().item() < 1e-4


def test_mamba2_state_accounting_is_what_the_caches_hold():
    """A bf16 Mamba-2 layer's cache holds its conv window in bf16 and its SSM state in fp32: the bytes per sequence
    the scheduler's budget and the planner count (state_bytes_per_seq at 16 bits) are those."""
    from waferline.model.decoder import DecoderModel
    from waferline.model.ssm import Mamba2Cache

    for mt in ("bamba", "granitemoehybrid", "nemotron_h"):
        spec = parse_hf_config(transformers.AutoConfig.for_model(mt, **configs()[mt]).to_dict())
        caches = DecoderModel(spec, torch.bfloat16).new_caches(3)
        layers = [(layer, c) for layer, c in zip(spec.layers, caches) if isinstance(c, Mamba2Cache)]
        assert layers and all(c.ssm.dtype == torch.float32 and c.conv.dtype == torch.bfloat16 for _, c in layers)
        for layer, cache in layers:
            assert cache.nbytes() == 3 * layer.mixer.state_bytes_per_seq(16) == 3 * layer.cache_bytes_per_seq(99)


@pytest.mark.parametrize("model_type", ["bamba", "nemotron_h"])
def test_a_mamba_model_loaded_under_inference_mode_runs(model_type, tmp_path):
    """Weights loaded inside torch.inference_mode are inference tensors, which keep no version counter: the Mamba-2
    mixer's cached constants read one and the first prefill raised ("Inference tensors do not track version
    counter"). Now they run, with the same log-probs as weights loaded outside it."""
    build(model_type, tmp_path)

    def logits(model):
        return model.logits(model(torch.tensor([IDS[:6]]), model.new_caches(1), StepBatch.make([0], [0], 6))[0])

    outside = load_model(tmp_path)
    with torch.inference_mode():
        want = logits(outside)
        got = logits(load_model(tmp_path))
    assert torch.equal(got, want)


def test_the_defaults_an_absent_field_takes_are_transformers_own():
    """The defaults parse_hf_config fills in for fields a config.json leaves out, and the rotated share of a head
    where none is given, are those of transformers' config classes (they cannot drift from the reference)."""
    from waferline.spec.configs import _HF_DEFAULTS, partial_rotary

    assert _HF_DEFAULTS
    for mt, fields in _HF_DEFAULTS.items():
        ref = transformers.AutoConfig.for_model(mt)
        for k, v in fields.items():
            if k == "rope_theta":  # (transformers keeps it in rope_parameters)
                assert ref.rope_parameters["rope_theta"] == v, (mt, k)
            elif k == "rope_parameters":  # (rope_theta beside them, where a config gives it alone)
                assert {f: x for f, x in ref.rope_parameters.items() if f != "rope_theta"} == v, (mt, k)
            else:
                assert getattr(ref, k) == v, (mt, k)
    for mt in ("bamba", "qwen3_next"):
        want = transformers.AutoConfig.for_model(mt).rope_parameters["partial_rotary_factor"]
        assert partial_rotary({}, mt) == want


# transformers' defaults left out: Qwen3Config's 32 key/value heads is no Qwen3's (16 to 64 query heads, 4 or 8
# key/value heads, always written) and makes no model under 32 query heads; an absent field is all query heads
NOT_TRANSFORMERS_DEFAULT = {("qwen3", "num_key_value_heads")}


@pytest.mark.parametrize("mt", sorted(configs()))
def test_a_config_without_a_field_parses_as_transformers_fills_it(mt):
    """Every field of the config.json transformers writes, left out: the spec is that of the config transformers reads
    from it (its default written in: the same layers, sizes and context), or a ConfigError naming what is missing
    as transformers spells it (sizes with no default that fits a real checkpoint). 16 query heads, so that a default
    count of key/value heads is not all of them."""
    cls = transformers.AutoConfig.for_model(mt).__class__
    full = cls(**dict(configs()[mt], num_attention_heads=16)).to_dict()

    def spec(cfg):
        return dataclasses.replace(parse_hf_config(json.loads(json.dumps(cfg))), hf_config={}, name="")

    for field in full:
        absent = {k: v for k, v in full.items() if k != field}
        try:
            filled = cls.from_dict(json.loads(json.dumps(absent))).to_dict()
        except Exception:  # (transformers reads no model from it either)
            continue
        try:
            want = spec(absent)
        except ConfigError as e:  # (in every spelling the parser takes: transformers' among them)
            assert repr(field) in str(e), (field, str(e))
            continue
        if (mt, field) not in NOT_TRANSFORMERS_DEFAULT:
            assert want == spec(filled), field


@pytest.mark.parametrize("mt", ["deepseek_v2", "deepseek_v3"])
def test_a_null_q_lora_rank_is_no_q_lora(mt):
    """transformers' default q_lora_rank (1536) fills an absent field only: DeepSeek-V2-Lite's explicit null is a
    plain query projection."""
    assert all(layer.mixer.q_lora_rank is None
               for layer in parse_hf_config(dict(_hf_config(mt), q_lora_rank=None)).layers)
    assert all(layer.mixer.q_lora_rank == 1536
               for layer in parse_hf_config({k: v for k, v in _hf_config(mt).items() if k != "q_lora_rank"}).layers)


def test_a_default_key_value_head_count_that_makes_no_model_says_so():
    """Mixtral's default of 8 key/value heads under 4 query heads: transformers builds no model from it, and the error
    says that the count is the default, not one the config gives."""
    cfg = {k: v for k, v in _hf_config("mixtral").items() if k != "num_key_value_heads"}
    with pytest.raises(ConfigError, match=r"num_key_value_heads .* got 8 \(transformers' mixtral default: the config "
                                          r"gives none\)"):
        parse_hf_config(cfg)
    with pytest.raises(ConfigError, match="got 8$"):
        parse_hf_config(dict(cfg, num_key_value_heads=8))


def test_a_yarn_scaling_without_factor_scales_the_softmax_by_its_implied_factor(tmp_path):
    """A YaRN scaling that gives no factor rotates by max_position_embeddings / original_max_position_embeddings;
    DeepSeek's softmax scale (mscale_all_dim) takes the same factor: it raised KeyError 'factor' at load. The model is
    the one whose config writes that factor out."""
    rope = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64, mscale=1.0,
                mscale_all_dim=0.5)
    ref = build("deepseek_v3", tmp_path, max_position_embeddings=256, rope_parameters=rope)
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["rope_parameters"]["factor"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with torch.no_grad():
        want = torch.log_softmax(ref(torch.tensor([IDS]), position_ids=torch.arange(len(IDS))[None],
                                     use_cache=False).logits[0].float(), dim=-1)
    assert (LLM(tmp_path).prompt_logprobs(IDS) - want).abs().max().item() < 1e-4
