"""Tiny random Hugging Face checkpoints for every supported model_type, built and saved by the tests themselves."""

from __future__ import annotations

from pathlib import Path

import torch

from waferline.model.context import StepBatch

VOCAB = 128
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def configs() -> dict[str, dict]:
    """model_type -> kwargs for the transformers config class (small, but every code path switched on)."""
    dsv3 = dict(
        COMMON,
        num_hidden_layers=3,
        intermediate_size=96,
        moe_intermediate_size=32,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        q_lora_rank=48,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        num_key_value_heads=4,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=10000.0,
            factor=4.0,
            original_max_position_embeddings=64,
            beta_fast=32.0,
            beta_slow=1.0,
            mscale=1.0,
            mscale_all_dim=1.0,
        ),
    )
    dsv2 = dict(COMMON, num_hidden_layers=3, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
                n_shared_experts=2, num_experts_per_tok=2, n_group=4, topk_group=2, topk_method="group_limited_greedy",
                first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                v_head_dim=16, routed_scaling_factor=1.5, num_key_value_heads=4)
    mamba = dict(mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=2, mamba_d_conv=4, mamba_expand=2,
                 mamba_chunk_size=8)
    return {
        "llama": dict(
            COMMON,
            num_hidden_layers=2,
            intermediate_size=96,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
        "qwen3": dict(COMMON, num_hidden_layers=2, intermediate_size=96, head_dim=24),
        "qwen3_moe": dict(
            COMMON,
            num_hidden_layers=2,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            head_dim=16,
            norm_topk_prob=True,
        ),
        "mixtral": dict(COMMON, num_hidden_layers=2, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2),
        "deepseek_v2": dsv2,
        "deepseek_v3": dsv3,
        # MLA + lightning indexer picking 4 tokens per query (fewer than the test prompts: the selection decides);
        # indexer keys cached in fp32 (index_bits, waferline's own field) so they score as the reference does. 32
        # heads: a token then scores exactly 0 (every head's ReLU at 0) next to never, so top-k rarely ties, where the
        # reference's pick among equal scores is torch.topk's arbitrary one
        "deepseek_v32": dict(dsv3, index_n_heads=32, index_head_dim=16, index_topk=4, index_bits=32),
        "gpt_oss": dict(
            COMMON,
            num_hidden_layers=2,
            intermediate_size=32,
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
        ),
        "granitemoehybrid": dict(
            COMMON,
            num_hidden_layers=4,
            intermediate_size=32,
            shared_intermediate_size=48,
            num_local_experts=4,
            num_experts_per_tok=2,
            position_embedding_type="rope",
            layer_types=["mamba", "attention", "mamba", "mamba"],
            embedding_multiplier=2.0,
            residual_multiplier=0.7,
            attention_multiplier=0.2,
            logits_scaling=1.5,
            **mamba,
        ),
        "nemotron_h": dict(
            COMMON,
            head_dim=16,
            intermediate_size=96,
            layers_block_type=["mamba", "moe", "attention", "mlp"],
            mamba_num_heads=8,
            mamba_head_dim=16,
            ssm_state_size=16,
            n_groups=2,
            conv_kernel=4,
            expand=2,
            chunk_size=8,
            n_routed_experts=8,
            n_shared_experts=1,
            moe_intermediate_size=32,
            moe_shared_expert_intermediate_size=48,
            num_experts_per_tok=2,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=1.5,
        ),
        "bamba": dict(COMMON, num_hidden_layers=3, intermediate_size=96, attn_layer_indices=[1], **mamba),
        # linear attention (2 key heads serving 4 value heads, value width != key width; prefill in chunks of 8,
        # linear_chunk_size being waferline's own field), gated attention with partial rotary, MoE with a gated
        # shared expert, and one dense layer
        "qwen3_next": dict(
            COMMON, num_hidden_layers=4, intermediate_size=96, head_dim=16,
            layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=12,
            linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=48, mlp_only_layers=[2], norm_topk_prob=True, linear_chunk_size=8,
        ),
        # KDA layers (chunks of 8) around one NoPE MLA layer, a dense first layer, then grouped sigmoid MoE with a
        # shared expert
        "kimi_linear": dict(
            COMMON, num_hidden_layers=4, intermediate_size=96, num_key_value_heads=4, q_lora_rank=None,
            kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
            layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
            mlp_layer_types=["dense", "sparse", "sparse", "sparse"], linear_num_heads=4, linear_head_dim=16,
            linear_conv_kernel_dim=4, num_local_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
            n_shared_experts=1, moe_intermediate_size=32, routed_scaling_factor=2.5, linear_chunk_size=8,
        ),
        # windows, compression ratios and top-k well below the test prompts (7, 13, 20 tokens) so every path runs
        "deepseek_v4": dict(
            COMMON, num_hidden_layers=4, num_key_value_heads=1, head_dim=32, partial_rotary_factor=0.25,
            q_lora_rank=48, o_groups=2, o_lora_rank=24, moe_intermediate_size=32, n_routed_experts=8,
            n_shared_experts=1, num_experts_per_tok=2, routed_scaling_factor=1.5, swiglu_limit=1.0, sliding_window=6,
            layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                         "compressed_sparse_attention"],
            mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
            compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
            # 16 indexer heads: an entry's score is 0 only when every head's ReLU is (a tie top-k breaks arbitrarily)
            index_n_heads=16, index_head_dim=16, index_topk=2, hc_mult=3,
            rope_parameters=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64, beta_fast=32.0,
                                 beta_slow=1.0),
        ),
    }


def build(model_type: str, directory: Path, seed: int = 0, **overrides) -> torch.nn.Module:
    """Build a tiny random model of ``model_type`` (config fields in ``overrides`` replaced), save it to ``directory``
    and return the eager reference model."""
    import transformers

    cfg_cls = transformers.AutoConfig.for_model(model_type).__class__
    cfg = cfg_cls(**dict(configs().get(model_type, {}), **overrides))  # (a type not listed: overrides alone)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            # random, non-trivial values everywhere (HF init leaves norms at 1, biases at 0, A_log fixed, ...)
            if p.dim() == 1 and ("norm" in name or name.endswith("D")):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif p.dim() == 1 and "A_log" in name:
                p.copy_(torch.log(torch.rand_like(p) * 4 + 0.5))
            elif p.dim() == 1:
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (1.0 / max(p.shape[-1], 1)) ** 0.5)
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(0.1 * torch.randn_like(b))
            elif name.endswith("tid2eid"):  # hash routing: distinct random experts per token id
                b.copy_(torch.stack([torch.randperm(cfg.n_routed_experts)[: b.shape[1]] for _ in range(b.shape[0])]))
    model.save_pretrained(directory)
    return model


def int4_sol_with_mtp(root: Path) -> Path:
    """A random 2-layer sol checkpoint (MLA + dense, MLA + MoE) with an MTP head, written as int4 (RTN, group 32) under
    ``root / "int4"`` (its 16-bit original under ``root / "fp32"``)."""
    from waferline.demo import SOL_DEMO_CONFIG
    from waferline.model.init import write_random_checkpoint
    from waferline.model.quant import QuantOptions
    from waferline.model.quant.write import quantize_checkpoint

    cfg = dict(SOL_DEMO_CONFIG, num_hidden_layers=2, mixer_types=["mla", "mla"], ffn_types=["dense", "moe"],
               num_nextn_predict_layers=1)
    quantize_checkpoint(write_random_checkpoint(cfg, root / "fp32"), root / "int4", QuantOptions(group_size=32))
    return root / "int4"


def decode_logits(model, prompts, slots, num_slots, steps=4, return_caches=False):
    """Prefill ``prompts`` into ``slots`` one by one, then decode them together greedily; return the logits per step
    (and the caches, to go on from there)."""
    caches = model.new_caches(num_slots)
    last = []
    for p, s in zip(prompts, slots):
        h = model(torch.tensor([p]), caches, StepBatch.make([s], [0], len(p)))
        last.append(model.logits(h[0, -1]))
    out = [torch.stack(last)]
    toks = out[0].argmax(-1)
    lengths = [len(p) for p in prompts]
    for i in range(steps):
        h = model(toks[:, None], caches, StepBatch.make(slots, [n + i for n in lengths], 1))
        out.append(model.logits(h[:, 0]))
        toks = out[-1].argmax(-1)
    return (torch.stack(out), caches) if return_caches else torch.stack(out)
