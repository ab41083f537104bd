"""ModelSpec accounting against published facts, and config parsing across spellings."""

import json
import re

import pytest

from waferline.errors import ConfigError
from waferline.spec.configs import parse_hf_config
from waferline.spec.model import MoESpec, group_for, matmul_bytes, quantized_bytes

DSV3 = dict(model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
            moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128,
            n_shared_experts=1, n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536,
            qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, topk_method="noaux_tc", n_group=8, topk_group=4,
            num_experts_per_tok=8, moe_layer_freq=1, first_k_dense_replace=3, norm_topk_prob=True,
            scoring_func="sigmoid", num_nextn_predict_layers=1, max_position_embeddings=163840)
KIMI_K2 = dict(DSV3, model_type="kimi_k2", vocab_size=163840, num_attention_heads=64, n_routed_experts=384,
               first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=2.827)
LLAMA_405B = dict(model_type="llama", vocab_size=128256, hidden_size=16384, intermediate_size=53248,
                  num_hidden_layers=126, num_attention_heads=128, num_key_value_heads=8)


def within(x, target, rel=0.02):
    return abs(x - target) <= rel * target


def test_deepseek_v3_published_facts():
    s = parse_hf_config(DSV3)
    assert s.cache_bytes_per_token(16) == 70272
    assert within(s.params_total(), 671e9)
    assert within(s.params_active(), 37e9)
    assert len(s.mtp_layers) == 1 and s.mtp_params() > 10e9  # the MTP module is not part of the 671B


def test_kimi_k2_published_facts():
    s = parse_hf_config(KIMI_K2)
    assert s.model_type == "deepseek_v3"
    assert within(s.params_total(), 1.04e12)
    assert within(s.params_active(), 32e9, rel=0.05)  # Moonshot rounds to "32B activated"
    assert s.cache_bytes_per_token(16) == 70272


def test_llama_405b_cache():
    s = parse_hf_config(LLAMA_405B)
    assert s.cache_bytes_per_token(16) == 516096
    assert within(s.params_total(), 405e9)


def test_quantized_bytes_overhead():
    assert quantized_bytes(1024, 16) == 2048
    assert quantized_bytes(1024, 4, group_size=32) == 512 + 32 * 2
    assert quantized_bytes(1024, 4, group_size=128, zeros=True) == 512 + 8 * 4
    s = parse_hf_config(DSV3)
    w4, w16 = s.weight_bytes(4, group_size=32), s.weight_bytes(16)
    assert 0.25 < w4 / w16 < 0.32


def test_each_matrix_takes_the_group_waferline_quantize_gives_it():
    """int4 scales per matrix: G where it divides K, else its largest halving >= 16 that does (gpt-oss's K = 2880 at
    128: groups of 64), one group per row where K < G, and 16-bit where none divides K (as the files hold them)."""
    assert [group_for(k, 128) for k in (4096, 2880, 48, 7, 200)] == [128, 64, 48, None, None]
    assert matmul_bytes([(4096, 64, 2)], 4) == quantized_bytes(4096 * 64 * 2, 4)
    assert matmul_bytes([(2880, 64, 1)], 4) == 2880 * 64 / 2 + 64 * 45 * 2
    assert matmul_bytes([(2880, 64, 1)], 4, zeros=True) == 2880 * 64 / 2 + 64 * 45 * 4
    assert matmul_bytes([(48, 10, 3)], 4, 128) == 48 * 30 / 2 + 30 * 2
    assert matmul_bytes([(72, 10, 1), (64, 10, 1)], 4, 32) == 72 * 10 * 2 + 64 * 10 / 2 + 20 * 2
    assert matmul_bytes([(72, 10, 1)], 16, 32) == matmul_bytes([(72, 10, 1)], 4, 32) == 1440
    oss = parse_hf_config(dict(model_type="gpt_oss", vocab_size=201088, hidden_size=2880, intermediate_size=2880,
                               num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                               num_local_experts=32, num_experts_per_tok=4))
    # one expert: gate, up and down [2880 x 2880] in groups of 64 (45 scales a row), its biases 16-bit
    assert oss.layers[0].ffn.expert_bytes(4) == 3 * 2880 * 2880 / 2 + 3 * 2880 * 45 * 2 + 3 * 2880 * 2


def test_catalog_configs_carry_the_released_fields():
    """Fields of the released config.json files that the catalog had left out or written differently: the Llama 3.3
    Instruct release stops on three ids (<|end_of_text|>, <|eom_id|>, <|eot_id|>); DeepSeek-V4-Flash's compressed
    layers rotate with YaRN (factor 16 from 65,536 positions), which transformers' DeepseekV4Config defaults leave out.
    Neither moves what the planner counts."""
    from waferline.spec.catalog import load_model, model_config

    llama = model_config("llama-3.3-70b")
    assert llama["eos_token_id"] == [128001, 128008, 128009] and llama["head_dim"] == 128
    v4 = model_config("deepseek-v4-flash")
    assert v4["rope_scaling"] == dict(beta_fast=32, beta_slow=1, factor=16, original_max_position_embeddings=65536,
                                      type="yarn")
    assert (v4["qk_rope_head_dim"], v4["bos_token_id"], v4["eos_token_id"]) == (64, 0, 1)
    assert load_model("deepseek-v4-flash").params_total() == 284_332_240_471
    assert load_model("llama-3.3-70b").cache_bytes_per_token(16) == 327_680


def test_every_catalog_matmul_list_adds_up_to_its_parameters():
    """Each mixer's and FFN's (K, N, count) list (which its matmul parameters and the byte accounting are both read
    from) and its small parameters make up all its parameters, counted on their own; the attention and FFN sides of
    a layer add up to the layer. (Against transformers: tests/test_config_variants.py; against the int4 files:
    tests/test_quant.py.)"""
    from waferline.spec.catalog import list_models, load_model

    for m in list_models():
        s = load_model(m)
        for layer in s.layers + s.mtp_layers:
            for p in (layer.mixer, layer.ffn):
                if p is None:
                    continue
                assert p.matmul_params() + p.small_params() == p.params(), (m, layer.index, p.kind)
                if isinstance(p, MoESpec):
                    assert p.expert_bytes(16) == 2 * p.expert_params()
            for bits in (4, 16):
                parts = layer.mixer_weight_bytes(bits, 64) + layer.ffn_weight_bytes(bits, 64)
                assert parts == layer.weight_bytes(bits, 64), (m, layer.index, bits)


def test_sliding_window_and_ssm_cache_bounds():
    oss = dict(model_type="gpt_oss", vocab_size=1000, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
               sliding_window=128, layer_types=["sliding_attention", "full_attention"] * 2)
    s = parse_hf_config(oss)
    per_tok = 2 * 2 * 16 * 2
    assert s.cache_bytes_per_seq(100) == 4 * 100 * per_tok
    assert s.cache_bytes_per_seq(10_000) == 2 * 10_000 * per_tok + 2 * 128 * per_tok
    hyb = dict(model_type="nemotron_h", vocab_size=1000, hidden_size=64, hybrid_override_pattern="M-M*-",
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96, mamba_num_heads=8,
               mamba_head_dim=16, ssm_state_size=16, n_groups=2, conv_kernel=4)
    h = parse_hf_config(hyb)
    assert [(l.mixer.kind if l.mixer else None, l.ffn.kind if l.ffn else None) for l in h.layers] == [
        ("mamba2", None), (None, "dense"), ("mamba2", None), ("gqa", None), (None, "dense")]
    growth = h.cache_bytes_per_seq(2000) - h.cache_bytes_per_seq(1000)
    assert growth == 1000 * 2 * 2 * 16 * 2  # only the one attention layer grows


def test_hybrid_spellings_agree():
    base = dict(model_type="nemotron_h", vocab_size=1000, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, intermediate_size=96, mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2)
    a = parse_hf_config(dict(base, hybrid_override_pattern="M*-E", n_routed_experts=4, num_experts_per_tok=2,
                                      moe_intermediate_size=16, moe_shared_expert_intermediate_size=16))
    b = parse_hf_config(
        dict(
            base,
            layers_block_type=["mamba", "attention", "mlp", "moe"],
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            moe_shared_expert_intermediate_size=16,
        )
    )
    assert a.params_total() == b.params_total() and a.num_layers == 4
    g1 = dict(model_type="granitemoehybrid", vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
              intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, mamba_n_heads=8, mamba_d_head=16,
              mamba_d_state=16)
    x = parse_hf_config(dict(g1, layer_types=["mamba", "attention"]))
    y = parse_hf_config(dict(g1, layers_block_type=["mamba", "attention"]))
    assert x.params_total() == y.params_total()
    q = dict(model_type="mixtral", vocab_size=100, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, intermediate_size=32, num_experts_per_tok=2)
    assert (parse_hf_config(dict(q, num_local_experts=4)).params_total()
            == parse_hf_config(dict(q, num_experts=4)).params_total())


def test_unsupported_and_missing_fields():
    with pytest.raises(ConfigError, match="unsupported model_type 'bert'.*deepseek_v3"):
        parse_hf_config({"model_type": "bert"})
    with pytest.raises(ConfigError, match="missing the field 'kv_lora_rank'"):
        parse_hf_config({k: v for k, v in DSV3.items() if k != "kv_lora_rank"})
    with pytest.raises(ConfigError, match="no 'model_type'"):
        parse_hf_config({"hidden_size": 4})


def test_deepseek_router_and_layer_fields_transformers_cannot_build_are_refused():
    """A DeepSeek-V2 topk_method other than greedy / group_limited_greedy (transformers' router fails on one with an
    UnboundLocalError; waferline read noaux_tc and asked for a correction bias the checkpoint has not), and a
    DeepSeek-V3.2 mlp_layer_types that names no layer kind, are one error naming the field."""
    v2 = dict(DSV3, model_type="deepseek_v2", q_lora_rank=None, n_group=1, topk_group=1)
    for method in ("greedy", "group_limited_greedy", None):
        parse_hf_config(dict(v2, topk_method=method))
    with pytest.raises(ConfigError, match="config topk_method 'noaux_tc': a deepseek_v2 router selects"):
        parse_hf_config(dict(v2, topk_method="noaux_tc"))
    v32 = dict(DSV3, model_type="deepseek_v32", num_hidden_layers=3)
    assert [l.ffn.kind for l in parse_hf_config(dict(v32, mlp_layer_types=["sparse", "dense", "dense"])).layers] \
        == ["moe", "dense", "dense"]
    for bad in (["dense", "moe", "dense"], ["dense"] * 2, "dense"):
        with pytest.raises(ConfigError, match="config mlp_layer_types must be a list of 3 entries"):
            parse_hf_config(dict(v32, mlp_layer_types=bad))


def test_sol_layers():
    cfg = dict(model_type="sol", vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
               intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1,
               num_experts_per_tok=2, kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8,
               v_head_dim=16, mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=1,
               mixer_types=["mamba2", "mamba2", "mamba2", "mla"], ffn_types=["dense", "moe", "moe", "moe"],
               num_nextn_predict_layers=1)
    s = parse_hf_config(cfg)
    assert [l.mixer.kind for l in s.layers] == ["mamba2", "mamba2", "mamba2", "mla"]
    assert s.cache_bytes_per_token(16) == (32 + 8) * 2
    assert len(s.mtp_layers) == 1
    with pytest.raises(ConfigError, match="mixer 'xyz'"):
        parse_hf_config(dict(cfg, mixer_types=["xyz"] * 4))


def test_sol_router_reads_norm_topk_prob_for_softmax_scores_too():
    """sol has no transformers class: the DeepSeek-V2 router's never-renormalise does not apply to its softmax
    router (the demo's config asks for renormalised weights)."""
    from waferline.demo import SOL_DEMO_CONFIG

    def renorm(**change):
        return {l.ffn.norm_topk_prob for l in parse_hf_config(dict(SOL_DEMO_CONFIG, **change)).layers[1:]}

    assert SOL_DEMO_CONFIG["scoring_func"] == "softmax" and renorm() == {True}
    assert renorm(norm_topk_prob=False) == {False}
    assert renorm(scoring_func="sigmoid") == {True} and renorm(scoring_func="sigmoid", norm_topk_prob=False) == {False}
    cfg = {k: v for k, v in SOL_DEMO_CONFIG.items() if k != "norm_topk_prob"}  # absent: as before, on for sigmoid
    assert {l.ffn.norm_topk_prob for l in parse_hf_config(cfg).layers[1:]} == {False}
    assert {l.ffn.norm_topk_prob for l in parse_hf_config(dict(cfg, scoring_func="sigmoid")).layers[1:]} == {True}


@pytest.mark.parametrize("change, message", [
    (dict(topk_method="noaux-tc"), "sol config: topk_method 'noaux-tc'; use greedy, group_limited_greedy or noaux_tc"),
    (dict(mixer_types="mla"), "sol config: mixer_types must be a list of num_hidden_layers=6 layer kinds, got 'mla'"),
    (dict(ffn_types=6), "sol config: ffn_types must be a list of num_hidden_layers=6 layer kinds, got 6"),
])
def test_sol_config_values_no_layer_reads_are_refused(change, message):
    from waferline.demo import SOL_DEMO_CONFIG

    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_hf_config(dict(SOL_DEMO_CONFIG, **change))


QWEN3_MOE = dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, num_hidden_layers=48,
                 num_attention_heads=32, num_key_value_heads=4, head_dim=128, intermediate_size=6144,
                 moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, max_position_embeddings=40960)


@pytest.mark.parametrize("change, message", [
    # top-k outside 1..E: more active than total parameters (256 of 128), or no expert at all
    (dict(num_experts_per_tok=256), "num_experts_per_tok (experts per token, top-k) must be an integer from 1 to "
                                    "num_experts = 128, got 256"),
    (dict(num_experts_per_tok=0), "from 1 to num_experts = 128, got 0"),
    (dict(num_experts_per_tok=2.5), "num_experts_per_tok must be an integer >= 0, got 2.5"),
    # a MoE model_type without its expert count was read as a dense model (3.3B instead of 30.5B)
    (dict(num_experts=None), "model_type 'qwen3_moe' has no 'num_experts'"),
    (dict(max_position_embeddings=-1), "max_position_embeddings must be an integer >= 1, got -1"),
    (dict(max_position_embeddings=0), "max_position_embeddings must be an integer >= 1, got 0"),
    (dict(num_key_value_heads=64), "num_key_value_heads must be an integer from 1 to num_attention_heads = 32"),
    (dict(num_attention_heads=30), "num_key_value_heads must be an integer from 1 to num_attention_heads = 30 that "
                                   "divides it"),
    (dict(num_key_value_heads=0), "num_key_value_heads must be an integer >= 1, got 0"),
])
def test_config_values_the_accounting_cannot_take_are_refused(tmp_path, change, message):
    cfg = {k: v for k, v in dict(QWEN3_MOE, **change).items() if v is not None}
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_hf_config(cfg)
    from waferline.spec.configs import spec_from_config_file

    p = tmp_path / "m" / "config.json"
    p.parent.mkdir()
    p.write_text(json.dumps(cfg))
    with pytest.raises(ConfigError) as e:  # from a file: the file is named
        spec_from_config_file(p)
    assert str(e.value).startswith(f"{p}: ") and message in str(e.value)


BAMBA = dict(model_type="bamba", vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, intermediate_size=128, attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=16,
             mamba_d_state=16, mamba_n_groups=1, mamba_d_conv=4, mamba_expand=2)


@pytest.mark.parametrize("base, change, message", [
    # a null, a string or a negative layer size was a TypeError traceback, or a negative parameter count
    (QWEN3_MOE, dict(moe_intermediate_size=None), "layer 0's MoESpec expert_intermediate = None: it must be an "
                                                  "integer >= 0"),
    (QWEN3_MOE, dict(moe_intermediate_size="768"), "config moe_intermediate_size must be an integer >= 1, got '768'"),
    (QWEN3_MOE, dict(moe_intermediate_size=0), "config moe_intermediate_size must be an integer >= 1, got 0"),
    (DSV3, dict(kv_lora_rank=None), "layer 0's MLASpec kv_lora_rank = None: it must be an integer >= 0"),
    (DSV3, dict(kv_lora_rank=0), "config kv_lora_rank must be an integer >= 1, got 0"),
    (DSV3, dict(n_shared_experts=-1), "config n_shared_experts must be an integer >= 0, got -1"),
    (DSV3, dict(num_nextn_predict_layers="1"), "config num_nextn_predict_layers must be an integer >= 0, got '1'"),
    (BAMBA, dict(mamba_d_state="x"), "config mamba_d_state must be an integer >= 1, got 'x'"),
    (BAMBA, dict(mamba_n_heads=0), "config mamba_n_heads must be an integer >= 1, got 0"),
    (BAMBA, dict(mamba_d_head=-1), "layer 0's Mamba2Spec head_dim = -1: it must be an integer >= 0"),
    (LLAMA_405B, dict(intermediate_size=None), "layer 0's DenseFFNSpec intermediate_size = None"),
    # a list of that many MTP layers filled the memory; an object for V4's per-layer list was a TypeError traceback
    (DSV3, dict(num_nextn_predict_layers=10**9), "config num_nextn_predict_layers must be an integer from 0 to "
                                                 "100,000, got 1,000,000,000"),
    ("deepseek-v4-flash", dict(mlp_layer_types={}), "config mlp_layer_types must be a list of 43 entries 'hash_moe' "
                                                    "or 'moe' (one per layer), got {}"),
    ("deepseek-v4-flash", dict(mlp_layer_types=["moe"]), "must be a list of 43 entries"),
])
def test_layer_sizes_that_make_no_layer_are_one_error_naming_the_field(base, change, message):
    if isinstance(base, str):
        from waferline.spec.catalog import model_config

        base = model_config(base)
    parse_hf_config(base)
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_hf_config(dict(base, **change))


@pytest.mark.parametrize("mt, field", [("qwen3_next", "num_experts"), ("deepseek_v3", "n_routed_experts"),
                                       ("kimi_k2", "n_routed_experts"), ("granitemoehybrid", "num_local_experts"),
                                       ("jamba", "num_experts")])
def test_moe_types_never_turn_dense_for_want_of_an_expert_count(mt, field):
    base = {"kimi_k2": KIMI_K2, "deepseek_v3": DSV3}.get(mt, dict(QWEN3_MOE, model_type=mt))
    with pytest.raises(ConfigError, match=f"has no '{field}'"):
        parse_hf_config({k: v for k, v in base.items() if k not in ("num_experts", "n_routed_experts")})


def test_sound_configs_still_load_and_zero_experts_is_a_dense_model():
    s = parse_hf_config(QWEN3_MOE)
    assert within(s.params_total(), 30.5e9) and s.params_active() < s.params_total()
    dense = parse_hf_config(dict(QWEN3_MOE, num_experts=0))  # (as transformers reads num_experts 0: no MoE layer)
    assert dense.params_active() == dense.params_total()
    assert parse_hf_config(dict(QWEN3_MOE, num_experts_per_tok=128)).params_active() == pytest.approx(
        s.params_total(), rel=0.01)  # every expert active: active equals total (but never exceeds it)
    mqa = parse_hf_config(dict(QWEN3_MOE, num_key_value_heads=1))
    assert mqa.cache_bytes_per_token(16) * 4 == s.cache_bytes_per_token(16)


def test_every_catalog_model_loads_under_the_checks():
    from waferline.spec.catalog import list_models, load_model

    for m in list_models():
        s = load_model(m)
        assert 0 < s.params_active() <= s.params_total() and s.max_position_embeddings >= 1, m


@pytest.mark.parametrize("model,path,value", [
    # GLM-4.6 normalises q and k per head (q_norm / k_norm of head_dim in every layer of the release)
    ("glm-4.6", ("use_qk_norm",), True),
    # Llama 4 Scout, unlike Maverick: llama3 rotary scaling x16 (bands 1 / 1) and L2-normalised q and k
    ("llama-4-scout", ("text_config", "rope_scaling", "rope_type"), "llama3"),
    ("llama-4-scout", ("text_config", "rope_scaling", "factor"), 16.0),
    ("llama-4-scout", ("text_config", "rope_scaling", "high_freq_factor"), 1.0),
    ("llama-4-scout", ("text_config", "use_qk_norm"), True),
    ("llama-4-maverick", ("text_config", "rope_scaling"), None),
    ("llama-4-maverick", ("text_config", "use_qk_norm"), False),
    # Kimi K2 (Instruct, 128k): YaRN x32 from 4,096 positions, eps 1e-6; K2.6 (256k): x64, beta_fast 32, eps 1e-5
    ("kimi-k2", ("rope_scaling", "factor"), 32.0),
    ("kimi-k2", ("rms_norm_eps",), 1e-6),
    ("kimi-k2.6", ("text_config", "rope_scaling", "factor"), 64.0),
    ("kimi-k2.6", ("text_config", "rope_scaling", "beta_fast"), 32.0),
    ("kimi-k2.6", ("text_config", "rms_norm_eps"), 1e-5),
])
def test_catalog_configs_match_the_released_config_json(model, path, value):
    """Fields of the catalog's configs as the released config.json files have them (each was once copied from a
    sibling model: Scout's from Maverick, Kimi K2's rotary and epsilon from K2.6)."""
    from waferline.spec.catalog import model_config

    cfg = model_config(model)
    for key in path:
        cfg = cfg[key]
    assert cfg == value


def test_catalog_yarn_positions_match_the_context():
    """Every YaRN config in the catalog stretches its original positions to its context (DeepSeek-V3: 40 x 4,096 =
    163,840; Kimi K2: 32 x 4,096 = 131,072, where it once had K2.6's 64)."""
    from waferline.spec.catalog import list_models, model_config

    for m in list_models():
        cfg = model_config(m)
        cfg = cfg.get("text_config", cfg) if "hidden_size" not in cfg else cfg
        rs = cfg.get("rope_scaling") or {}
        if (rs.get("type") or rs.get("rope_type")) == "yarn":
            assert rs["factor"] * rs["original_max_position_embeddings"] == cfg["max_position_embeddings"], m
