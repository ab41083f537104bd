"""Compressed / sparse attention in the accounting: cache held (capacity) vs cache read per decode token (speed)."""

import pytest

from waferline.plan.place import place
from waferline.sim.cost import layer_table
from waferline.sim.pipeline import simulate
from waferline.spec.catalog import load_model, model_config
from waferline.spec.configs import ENGINE_MODEL_TYPES, SUPPORTED_MODEL_TYPES, parse_hf_config
from waferline.spec.model import (
    CompressedAttentionSpec,
    DSASpec,
    GatedDeltaNetSpec,
    KimiDeltaSpec,
    LayerSpec,
    Mamba2Spec,
    MLASpec,
)

# a small latent: kv_lora 32 + rope 8 = 40 elements = 80 B/token at 16-bit
MLA = MLASpec(hidden_size=64, num_heads=4, q_lora_rank=16, kv_lora_rank=32, qk_nope_head_dim=8, qk_rope_head_dim=8,
              v_head_dim=8)
# + an indexer key of 16 elements at fp8 + a 4-byte scale = 20 B/token; top-100 tokens attended
DSA = DSASpec(hidden_size=64, num_heads=4, q_lora_rank=16, kv_lora_rank=32, qk_nope_head_dim=8, qk_rope_head_dim=8,
              v_head_dim=8, index_n_heads=2, index_head_dim=16, index_topk=100, index_bits=8)
# shared K=V of 32 elements (64 B at 16-bit) per entry; window 10; 4x compression; top-5 entries; index key 20 B
CSA = CompressedAttentionSpec(hidden_size=64, num_heads=4, head_dim=32, q_lora_rank=16, compress_ratio=4, window=10,
                              index_topk=5, index_n_heads=2, index_head_dim=16)
HCA = CompressedAttentionSpec(hidden_size=64, num_heads=4, head_dim=32, q_lora_rank=16, compress_ratio=8, window=10)


def test_a_recurrent_state_is_read_and_written_back_every_decode_step():
    """A decode step reads a Mamba-2 / Gated DeltaNet / KDA layer's whole state and writes it back (the engine's
    ssm_update and delta rule update it in place): twice the bytes a sequence holds, whatever its context; a hybrid
    model's attention layers still read their cache once."""
    m2 = Mamba2Spec(hidden_size=64, num_heads=4, head_dim=16, state_size=8, n_groups=1, conv_kernel=4)
    gdn = GatedDeltaNetSpec(hidden_size=64, num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=16,
                            conv_kernel=4)
    kda = KimiDeltaSpec(hidden_size=64, num_heads=4, head_dim=16, conv_kernel=4)
    # Mamba-2: conv (64 + 2 x 8) x 3 at 2 B + 4 x 16 x 8 fp32; GDN: conv (2 x 32 + 64) x 3 at 2 B + 4 x 16 x 16 fp32
    assert m2.state_bytes_per_seq(16) == 80 * 3 * 2 + 512 * 4
    assert gdn.state_bytes_per_seq(16) == 128 * 3 * 2 + 1024 * 4
    for mixer in (m2, gdn, kda):
        layer = LayerSpec(0, mixer, None, 64)
        for ctx in (1, 1000):
            assert layer.cache_bytes_per_seq(ctx) == mixer.state_bytes_per_seq(16)
            assert layer.cache_read_bytes_per_seq(ctx) == 2 * mixer.state_bytes_per_seq(16)
    spec = load_model("qwen3-next-80b-a3b")
    state = sum(lay.mixer.state_bytes_per_seq(16) for lay in spec.layers if lay.mixer.kind == "gdn")
    attn = sum(lay.cache_bytes_per_seq(4096) for lay in spec.layers if lay.mixer.kind == "gqa")
    assert spec.cache_read_bytes_per_seq(4096) == spec.cache_bytes_per_seq(4096) + state == attn + 2 * state
    rows = layer_table(spec, 16, 16, 4096)
    assert sum(r.cache_read for r in rows) == attn + 2 * state


def test_mla_reads_its_whole_cache():
    layer = LayerSpec(0, MLA, None, 64)
    assert MLA.cache_bytes_per_token(16) == 80
    for ctx in (1, 100, 1000):
        assert layer.cache_bytes_per_seq(ctx) == 80 * ctx
        assert layer.cache_read_bytes_per_seq(ctx) == 80 * ctx


def test_dsa_capacity_and_read_by_hand():
    layer = LayerSpec(0, DSA, None, 64)
    assert DSA.cache_bytes_per_token(16) == 80 + 20
    assert DSA.cache_bytes_per_token(8) == 40 + 20  # the indexer keys stay fp8 whatever the KV precision
    # capacity: every token keeps its latent and its index key
    assert layer.cache_bytes_per_seq(1000) == 100 * 1000
    # at or below top-k: everything is read (same latent bytes as MLA, plus the index keys)
    assert layer.cache_read_bytes_per_seq(60) == 100 * 60
    assert layer.cache_read_bytes_per_seq(100) == 100 * 100
    # beyond top-k: 100 latents + all 1000 index keys
    assert layer.cache_read_bytes_per_seq(1000) == 80 * 100 + 20 * 1000
    # FLOPs: indexer 2 * 2 heads * 16 per cached token + absorbed MLA (2 * 4 * (2 * 32 + 8) = 576) per attended
    assert DSA.attention_flops(1000) == 2 * 2 * 16 * 1000 + 576 * 100
    assert MLA.attention_flops(1000) == 576 * 1000


def test_dsa_reads_fewer_latent_bytes_than_mla_only_beyond_top_k():
    mla, dsa = LayerSpec(0, MLA, None, 64), LayerSpec(0, DSA, None, 64)
    for ctx in (10, 100):
        # the latent part read equals MLA's; the rest is the index keys
        assert dsa.cache_read_bytes_per_seq(ctx) - 20 * ctx == mla.cache_read_bytes_per_seq(ctx)
    for ctx in (1000, 10_000, 100_000):
        assert dsa.cache_read_bytes_per_seq(ctx) < mla.cache_read_bytes_per_seq(ctx)
        assert dsa.cache_bytes_per_seq(ctx) > mla.cache_bytes_per_seq(ctx)  # holds more, reads less


def test_dsa_params_add_the_indexer():
    # wq_b 16 x (2 x 16) + wk 64 x 16 (matmuls); weights_proj 64 x 2 + k_norm 2 x 16 (kept 16-bit)
    assert DSA.matmul_params() - MLA.matmul_params() == 16 * 32 + 64 * 16
    assert DSA.small_params() - MLA.small_params() == 64 * 2 + 32
    assert DSA.kept_16bit_params() == MLA.kept_16bit_params()


def test_csa_capacity_and_read_by_hand():
    layer = LayerSpec(0, CSA, None, 64)
    # compressor state once a window has closed: the last window's first-series values (16-bit) and gates (fp32),
    # 4 tokens x (32 kv + 16 index) elements each = 1152 B; the open window's tokens: values and gates of two series,
    # 2 x (2 x 32 + 2 x 16) elements = 384 B each
    overlap, pending = 4 * (32 + 16) * (2 + 4), 2 * (2 * 32 + 2 * 16) * 2
    # 1000 tokens: window 10 x 64 B + 250 entries x (64 B kv + 20 B index key), no open window
    assert layer.cache_bytes_per_seq(1000) == 10 * 64 + 250 * (64 + 20) + overlap
    assert layer.cache_bytes_per_seq(1003) == 10 * 64 + 250 * (64 + 20) + overlap + 3 * pending
    # read: window + top-5 entries + all 250 index keys
    assert layer.cache_read_bytes_per_seq(1000) == 10 * 64 + 5 * 64 + 250 * 20
    # short context: 8 tokens -> window 8, 2 entries (fewer than top-5): every entry is read
    assert layer.cache_read_bytes_per_seq(8) == layer.cache_bytes_per_seq(8) - overlap == 8 * 64 + 2 * (64 + 20)
    assert CSA.cache_bytes_per_token(16) == (64 + 20) / 4
    # FLOPs: 4 * heads * head_dim per attended (window + top-k) + indexer 2 * 2 * 16 per entry
    assert CSA.attention_flops(1000) == 4 * 4 * 32 * (10 + 5) + 2 * 2 * 16 * 250


def test_hca_is_dense_over_compressed_entries():
    layer = LayerSpec(0, HCA, None, 64)
    assert HCA.index_bytes_per_entry() == 0
    assert layer.cache_bytes_per_seq(1000) == layer.cache_read_bytes_per_seq(1000) == (10 + 125) * 64
    assert HCA.cache_bytes_per_token(16) == 64 / 8
    assert HCA.attention_flops(1000) == 4 * 4 * 32 * (10 + 125)


def test_deepseek_v32_config_parses_as_dsa():
    spec = load_model("deepseek-v3.2")
    assert spec.model_type == "deepseek_v32"
    assert "deepseek_v32" in SUPPORTED_MODEL_TYPES and "deepseek_v32" in ENGINE_MODEL_TYPES
    m = spec.layers[5].mixer
    assert isinstance(m, DSASpec) and (m.index_n_heads, m.index_head_dim, m.index_topk) == (64, 128, 2048)
    # 70,272 B MLA latent (as DeepSeek-V3) + 61 x 132 B fp8 index keys = 78,324 B/token
    assert spec.cache_bytes_per_token(16) == 70272 + 61 * 132
    v3 = load_model("deepseek-v3")
    assert spec.params_total() - v3.params_total() == 61 * (DSASpec.indexer_matmul_params(m)
                                                            + DSASpec.indexer_small_params(m))
    assert abs(spec.params_total() - 671e9) < 0.01 * 671e9
    # at 128k a decode token reads ~12% of the cache it holds
    ctx = 131072
    assert spec.cache_read_bytes_per_seq(ctx) == pytest.approx(61 * (1152 * 2048 + 132 * ctx))
    assert spec.cache_read_bytes_per_seq(ctx) < 0.15 * spec.cache_bytes_per_seq(ctx)


def test_hf_spelling_defaults_follow_transformers():
    cfg = {k: v for k, v in model_config("deepseek-v3.2").items() if not k.startswith("index_")}
    m = parse_hf_config(cfg).layers[0].mixer
    assert (m.index_n_heads, m.index_head_dim, m.index_topk) == (64, 128, 2048)


@pytest.mark.parametrize("name", ["deepseek-v3.2", "gpt-5.6-sol-dsa", "gpt-5.6-sol-v4"])
def test_catalog_entries_carry_sources(name):
    w = model_config(name)["_waferline"]
    assert w["source"] and w["assumed"]
    if name.startswith("gpt-5.6"):
        assert "speculative" in w["source"].lower() and w["notes"].startswith("SPECULATIVE")


def test_sol_variants_share_the_mla_backbone():
    mla, dsa, v4 = (load_model(f"gpt-5.6-sol-{v}") for v in ("mla", "dsa", "v4"))
    assert [lay.ffn for lay in mla.layers] == [lay.ffn for lay in dsa.layers] == [lay.ffn for lay in v4.layers]
    assert {lay.mixer.kind for lay in dsa.layers} == {"dsa"}
    kinds = [(lay.mixer.compress_ratio, lay.mixer.index_topk) for lay in v4.layers]
    assert kinds[:2] == [(128, 0), (128, 0)] and set(kinds) == {(128, 0), (4, 1024)}
    ctx = 131072
    assert dsa.cache_read_bytes_per_seq(ctx) < 0.15 * mla.cache_read_bytes_per_seq(ctx)
    assert v4.cache_bytes_per_seq(ctx) < 0.2 * mla.cache_bytes_per_seq(ctx)
    assert v4.cache_read_bytes_per_seq(ctx) < dsa.cache_read_bytes_per_seq(ctx)


def test_layer_table_uses_bytes_read():
    spec = load_model("gpt-5.6-sol-dsa")
    lc = layer_table(spec, 4, 16, 131072)[0]
    assert lc.cache_bytes == spec.layers[0].cache_bytes_per_seq(131072)
    assert lc.cache_read == spec.layers[0].cache_read_bytes_per_seq(131072) < 0.15 * lc.cache_bytes
    mlc = layer_table(load_model("gpt-5.6-sol-mla"), 4, 16, 131072)[0]
    assert mlc.cache_read == mlc.cache_bytes


def test_sparse_attention_decodes_faster_at_128k_on_gpus():
    ctx, batch = 131072, 16
    speeds = {}
    for v in ("mla", "dsa", "v4"):
        plan = place(f"gpt-5.6-sol-{v}", "gb200-nvl72", weight_bits=4, context=ctx, batch=batch, devices=16)
        r = simulate(plan, prompt_len=ctx - 500, output_len=500, concurrency=batch)
        speeds[v] = r.decode_tokens_per_s_per_user
    # 16 users at 128k on 16 GPUs: MLA reads 12.1 GB of latents per user per step, DSA 1.6 GB
    assert speeds["dsa"] > 1.05 * speeds["mla"]
    assert speeds["v4"] > speeds["mla"]
    one = {v: simulate(place(f"gpt-5.6-sol-{v}", "gb200-nvl72", weight_bits=4, context=ctx, devices=16),
                       prompt_len=ctx - 500, output_len=500).decode_tokens_per_s_per_user for v in ("mla", "dsa")}
    assert one["dsa"] > one["mla"]  # one user: latency-bound, still (slightly) faster


def test_deepseek_v4_flash_published_facts():
    spec = load_model("deepseek-v4-flash")
    assert spec.model_type == "deepseek_v4" and "deepseek_v4" in ENGINE_MODEL_TYPES
    assert abs(spec.params_total() - 284e9) < 0.01 * 284e9  # published 284B total
    assert 12e9 < spec.params_active() < 14e9  # published "13B" active
    kinds = [(lay.mixer.compress_ratio, lay.mixer.index_topk) for lay in spec.layers]
    # the released schedule (config.json's compress_ratios): 2 sliding-window layers, then CSA / HCA alternating
    assert kinds[:2] == [(0, 0)] * 2 and kinds.count((4, 512)) == 21 and kinds.count((128, 0)) == 20
    # published: at 1M context, V4-Flash holds ~7% of V3.2's KV cache and spends ~10% of its per-token FLOPs
    v32, ctx = load_model("deepseek-v3.2"), 1 << 20
    assert 0.05 < spec.cache_bytes_per_seq(ctx) / v32.cache_bytes_per_seq(ctx) < 0.09
    assert 0.08 < spec.flops_per_token(ctx) / v32.flops_per_token(ctx) < 0.15


def test_deepseek_v4_legacy_spellings():
    cfg = model_config("deepseek-v4-flash")
    modern = parse_hf_config(cfg)
    ratios = [lay.mixer.compress_ratio for lay in modern.layers]
    legacy = dict({k: v for k, v in cfg.items() if k != "compress_rates"}, compress_ratios=ratios,
                  compress_rate_csa=4, compress_rate_hca=128)
    spec = parse_hf_config(legacy)
    assert [lay.mixer for lay in spec.layers] == [lay.mixer for lay in modern.layers]
    assert spec.params_total() == modern.params_total()


def test_host_model_prices_the_cache_bytes_a_decode_token_reads():
    """Waferline's engine on a calibrated host without counted ops (the kv-schemes benchmark's prediction): a decode
    step's memory term is the cache bytes the token reads (DSA: top-k latents + every index key; CSA: window + top-k
    entries + every index key; a recurrent state read and written back), not the bytes the sequence holds."""
    from pathlib import Path

    from waferline.sim.host_params import HostParams
    from waferline.spec.hardware import load_hardware_file

    yaml = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "twin_host_avx2.yaml"
    host, hw = HostParams.load(yaml), load_hardware_file(yaml)
    base = dict(model_type="sol", vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                head_dim=16, intermediate_size=128, ffn_types=["dense"] * 2, max_position_embeddings=65536,
                q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                index_n_heads=2, index_head_dim=16, index_topk=64, index_bits=8, sliding_window=16,
                mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=1, mamba_d_conv=4)
    P, O = 8192, 16
    for mixers in (["dsa", "dsa"], ["hca", "csa"], ["mamba2", "mla"]):
        spec = parse_hf_config(dict(base, mixer_types=mixers))
        plan = place(spec, hw, devices=1, weight_bits=16, context=P + O, batch=1)
        r = simulate(plan, prompt_len=P, output_len=O, spec=spec, hardware=hw, host=host)
        read = spec.cache_read_bytes_per_seq(P + O // 2)
        assert r.stages[0].memory * host.memory_bandwidth == pytest.approx(read, rel=1e-9), mixers
        if mixers[0] != "mamba2":
            assert read < 0.5 * spec.cache_bytes_per_seq(P + O // 2)
