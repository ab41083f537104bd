"""FFN modules (waferline.model.moe) against the Hugging Face blocks on tiny random checkpoints saved to disk."""

from __future__ import annotations

import glob
import math
import warnings
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

from waferline.errors import CheckpointError, ConfigError  # noqa: E402
from waferline.model.moe import DenseFFN, MoE, dense_names, dense_prefix, hf_act, moe_kwargs, moe_prefix  # noqa: E402
from waferline.model.weights import WeightSource  # noqa: E402
from waferline.spec.configs import parse_hf_config  # noqa: E402
from waferline.spec.model import DenseFFNSpec, MoESpec  # noqa: E402

ATOL = RTOL = 1e-5
D = 32
E = 8
K = 2
I_EXPERT = 16
I_SHARED = 24
ATTN = dict(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, vocab_size=64)
MLA = dict(kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)


# ----------------------------------------------------------------------------- helpers


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Weights with unit-scale outputs (HF's 0.02 init makes every output ~1e-4 and routing near-uniform)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if not p.is_floating_point() or "inv_freq" in name:
                continue
            if name.endswith("e_score_correction_bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            elif p.dim() >= 2:
                fan_in = (
                    p.shape[-1] if "gpt_oss" not in type(model).__module__ or "experts" not in name else p.shape[-2]
                )
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(fan_in))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def _save(model: torch.nn.Module, tmp_path) -> dict[str, torch.Tensor]:
    """The tensors exactly as ``save_pretrained`` writes them to disk."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(tmp_path)
    out: dict[str, torch.Tensor] = {}
    for f in sorted(glob.glob(str(tmp_path / "*.safetensors"))):
        out.update(load_file(f))
    assert out, "save_pretrained wrote no safetensors"
    return out


@dataclass
class Case:
    flavor: str
    model: torch.nn.Module  # the whole tiny HF model (weights randomised)
    block: Callable[[torch.Tensor], torch.Tensor]  # HF reference: [1, N, D] -> [1, N, D]
    layer: int
    spec: MoESpec
    kwargs: dict[str, Any]
    fused: Callable[[], dict[str, torch.Tensor]]  # the block's in-memory (fused) tensors under its prefix
    hf_config: Any = None


def _make(flavor: str, variant: str = "") -> Case:
    T = transformers
    torch.manual_seed(0)
    if flavor == "qwen3_moe":
        norm = variant != "nonorm"
        cfg = T.Qwen3MoeConfig(
            **ATTN,
            hidden_size=D,
            num_hidden_layers=1,
            head_dim=8,
            intermediate_size=48,
            moe_intermediate_size=I_EXPERT,
            num_experts=E,
            num_experts_per_tok=K,
            norm_topk_prob=norm,
        )
        model = T.Qwen3MoeForCausalLM(cfg)
        mod, layer = model.model.layers[0].mlp, 0
        spec = MoESpec(hidden_size=D, num_experts=E, top_k=K, expert_intermediate=I_EXPERT, norm_topk_prob=norm)
        block = mod
    elif flavor == "mixtral":
        cfg = T.MixtralConfig(**ATTN, hidden_size=D, num_hidden_layers=1, intermediate_size=I_EXPERT,
                              num_local_experts=E, num_experts_per_tok=K)
        model = T.MixtralForCausalLM(cfg)
        mod, layer = model.model.layers[0].mlp, 0
        spec = MoESpec(hidden_size=D, num_experts=E, top_k=K, expert_intermediate=I_EXPERT)
        block = mod
    elif flavor == "deepseek_v2":
        method = variant or "group_limited_greedy"
        cfg = T.DeepseekV2Config(**ATTN, **MLA, hidden_size=D, num_hidden_layers=2, intermediate_size=48,
                                 moe_intermediate_size=I_EXPERT, n_routed_experts=E, num_experts_per_tok=K,
                                 n_shared_experts=2, first_k_dense_replace=1, topk_method=method, n_group=4,
                                 topk_group=2, routed_scaling_factor=1.5, norm_topk_prob=False)
        model = T.DeepseekV2ForCausalLM(cfg)
        mod, layer = model.model.layers[1].mlp, 1
        grouped = method == "group_limited_greedy"
        spec = MoESpec(hidden_size=D, num_experts=E, top_k=K, expert_intermediate=I_EXPERT, num_shared=2,
                       shared_intermediate=2 * I_EXPERT, n_group=4 if grouped else 1, topk_group=2 if grouped else 1,
                       norm_topk_prob=False, routed_scaling=1.5)
        block = mod
    elif flavor in ("deepseek_v3", "sol"):
        cfg = T.DeepseekV3Config(**ATTN, **MLA, hidden_size=D, num_hidden_layers=2, intermediate_size=48,
                                 moe_intermediate_size=I_EXPERT, n_routed_experts=E, num_experts_per_tok=K,
                                 n_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2,
                                 routed_scaling_factor=2.5, norm_topk_prob=True)
        model = T.DeepseekV3ForCausalLM(cfg)
        mod, layer = model.model.layers[1].mlp, 1
        spec = MoESpec(hidden_size=D, num_experts=E, top_k=K, expert_intermediate=I_EXPERT, num_shared=1,
                       shared_intermediate=I_EXPERT, scoring="sigmoid", correction_bias=True, n_group=4, topk_group=2,
                       norm_topk_prob=True, routed_scaling=2.5)
        block = mod
    elif flavor == "glm4_moe":
        cfg = T.Glm4MoeConfig(**ATTN, hidden_size=D, num_hidden_layers=2, head_dim=8, intermediate_size=48,
                              moe_intermediate_size=I_EXPERT, n_routed_experts=E, num_experts_per_tok=K,
                              n_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2,
                              routed_scaling_factor=1.8, norm_topk_prob=True)
        model = T.Glm4MoeForCausalLM(cfg)
        mod, layer = model.model.layers[1].mlp, 1
        spec = MoESpec(hidden_size=D, num_experts=E, top_k=K, expert_intermediate=I_EXPERT, num_shared=1,
                       shared_intermediate=I_EXPERT, scoring="sigmoid", correction_bias=True, n_group=4, topk_group=2,
                       norm_topk_prob=True, routed_scaling=1.8)
        block = mod
    elif flavor == "gpt_oss":
        # hidden 48 != 2 * intermediate 32 so a transposed load cannot pass by accident; limit 1.5 so the clamp bites
        cfg = T.GptOssConfig(**ATTN, hidden_size=48, num_hidden_layers=1, head_dim=8, intermediate_size=I_EXPERT,
                             num_local_experts=E, num_experts_per_tok=K, swiglu_limit=1.5)
        model = T.GptOssForCausalLM(cfg)
        mod, layer = model.model.layers[0].mlp, 0
        spec = MoESpec(hidden_size=48, num_experts=E, top_k=K, expert_intermediate=I_EXPERT, expert_bias=True,
                       router_bias=True, softmax_after_topk=True)

        def block(x):
            return mod(x)[0]
    elif flavor == "granitemoehybrid":
        cfg = T.GraniteMoeHybridConfig(**ATTN, hidden_size=D, num_hidden_layers=1, intermediate_size=I_EXPERT,
                                       shared_intermediate_size=I_SHARED, num_local_experts=E, num_experts_per_tok=K,
                                       layers_block_type=["attention"], mamba_n_heads=8, mamba_d_head=8)
        model = T.GraniteMoeHybridForCausalLM(cfg)
        lay, layer = model.model.layers[0], 0
        mod = lay
        spec = MoESpec(hidden_size=D, num_experts=E, top_k=K, expert_intermediate=I_EXPERT, num_shared=1,
                       shared_intermediate=I_SHARED)

        def block(x):
            return lay.block_sparse_moe(x) + lay.shared_mlp(x)
    elif flavor == "nemotron_h":
        cfg = T.NemotronHConfig(vocab_size=64, hidden_size=D, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                intermediate_size=48, moe_intermediate_size=I_EXPERT,
                                moe_shared_expert_intermediate_size=I_SHARED, n_routed_experts=E, num_experts_per_tok=K,
                                n_group=4, topk_group=2, routed_scaling_factor=1.7, layers_block_type=["moe", "mlp"])
        model = T.NemotronHForCausalLM(cfg)
        mod, layer = model.model.layers[0].mixer, 0
        spec = MoESpec(hidden_size=D, num_experts=E, top_k=K, expert_intermediate=I_EXPERT, num_shared=1,
                       shared_intermediate=I_SHARED, gated=False, scoring="sigmoid", correction_bias=True, n_group=4,
                       topk_group=2, norm_topk_prob=True, routed_scaling=1.7)
        block = mod
    elif flavor == "qwen3_next":
        cfg = T.Qwen3NextConfig(**ATTN, hidden_size=D, num_hidden_layers=1, head_dim=8, intermediate_size=48,
                                moe_intermediate_size=I_EXPERT, shared_expert_intermediate_size=I_SHARED, num_experts=E,
                                num_experts_per_tok=K, layer_types=["full_attention"])
        model = T.Qwen3NextForCausalLM(cfg)
        mod, layer = model.model.layers[0].mlp, 0
        spec = MoESpec(hidden_size=D, num_experts=E, top_k=K, expert_intermediate=I_EXPERT, num_shared=1,
                       shared_intermediate=I_SHARED, shared_gate=True, norm_topk_prob=bool(cfg.norm_topk_prob))
        block = mod
    else:  # pragma: no cover
        raise AssertionError(flavor)
    model.eval()
    _randomise(model, seed=zlib.crc32(f"{flavor}:{variant}".encode()))
    hf_prefix = {"granitemoehybrid": f"model.layers.{layer}.", "nemotron_h": f"model.layers.{layer}.mixer."}.get(
        flavor, f"model.layers.{layer}.mlp.")

    def fused() -> dict[str, torch.Tensor]:
        return {hf_prefix + k: v.detach().clone() for k, v in mod.state_dict().items() if "inv_freq" not in k}

    kw = moe_kwargs(flavor, cfg.to_dict())
    del kw["flavor"]
    return Case(flavor, model, block, layer, spec, kw, fused, cfg)


def _ours(case: Case, tensors: dict[str, torch.Tensor], **extra: Any) -> tuple[MoE, WeightSource]:
    src = WeightSource.from_dict(tensors)
    moe = MoE(case.spec, torch.float32, flavor=case.flavor, **case.kwargs, **extra)
    moe.load_hf(src, moe_prefix(case.flavor, case.layer, src))
    return moe, src


def _check(case: Case, moe: MoE, n: int, seed: int = 1) -> None:
    x = torch.randn(n, case.spec.hidden_size, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        ref = case.block(x[None]).reshape(n, -1)
        got = moe(x)
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=RTOL)


FLAVORS = ["qwen3_moe", "mixtral", "deepseek_v2", "deepseek_v3", "sol", "glm4_moe", "gpt_oss", "granitemoehybrid",
           "nemotron_h", "qwen3_next"]
VARIANTS = [(f, "") for f in FLAVORS] + [("qwen3_moe", "nonorm"), ("deepseek_v2", "greedy")]


# ----------------------------------------------------------------------------- MoE vs HF


@pytest.mark.parametrize("flavor,variant", VARIANTS, ids=[f"{f}-{v}" if v else f for f, v in VARIANTS])
def test_moe_matches_hf_from_saved_checkpoint(flavor, variant, tmp_path):
    case = _make(flavor, variant)
    tensors = _save(case.model, tmp_path)
    moe, src = _ours(case, tensors)
    for n in (1, 37):
        _check(case, moe, n, seed=n)
    # every tensor of the block in the checkpoint was consumed
    prefix = moe_prefix(flavor, case.layer, src)
    block_names = [
        k
        for k in src.names_with_prefix(prefix)
        if flavor != "granitemoehybrid" or k.startswith((prefix + "block_sparse_moe.", prefix + "shared_mlp."))
    ]
    assert set(block_names) <= src.used, sorted(set(block_names) - src.used)


@pytest.mark.parametrize("flavor", FLAVORS)
def test_moe_matches_hf_from_fused_layout(flavor):
    """The 5.24 in-memory layout (experts.gate_up_proj [E, 2I, D] / experts.up_proj / experts.down_proj)."""
    case = _make(flavor)
    moe, src = _ours(case, case.fused())
    _check(case, moe, 37, seed=5)
    _check(case, moe, 1, seed=6)


@pytest.mark.parametrize("flavor", ["deepseek_v3", "gpt_oss", "nemotron_h", "deepseek_v2"])
def test_gather_and_grouped_paths_agree(flavor, tmp_path):
    case = _make(flavor)
    tensors = _save(case.model, tmp_path)
    gather, _ = _ours(case, tensors, gather_max=10**9)
    gather.gather_on_cpu = True  # on CPU the engine takes the sorted path; force the accelerator path here
    grouped, _ = _ours(case, tensors, gather_max=0)
    for n in (1, 5, 37):
        _check(case, gather, n, seed=10 + n)
        _check(case, grouped, n, seed=10 + n)


def test_routing_is_non_trivial():
    """The tiny configs really exercise groups and the correction bias (else the V3 test proves little)."""
    case = _make("deepseek_v3")
    moe, _ = _ours(case, case.fused())
    x = torch.randn(200, D, generator=torch.Generator().manual_seed(3))
    w, idx = moe.route(x)
    scores = torch.sigmoid(x @ moe.gate_weight.T)
    plain = scores.topk(K, dim=-1).indices
    biased = (scores + moe.e_score_correction_bias).topk(K, dim=-1).indices
    same = lambda a, b: (a.sort(dim=-1).values == b.sort(dim=-1).values).all(dim=-1)  # noqa: E731
    assert (~same(idx, plain)).any(), "correction bias never changed a selection"
    assert (~same(idx, biased)).any(), "group limit never changed a selection"
    torch.testing.assert_close(w.sum(-1), torch.full((200,), 2.5))
    assert idx.unique().numel() == E
    # the group limit holds: the chosen experts come from at most topk_group groups
    assert ((idx // (E // 4)).sort(-1).values.diff(dim=-1) != 0).sum(-1).le(1).all()


def test_decode_batch_sizes_and_bf16_smoke(tmp_path):
    case = _make("deepseek_v3")
    tensors = _save(case.model, tmp_path)
    moe, _ = _ours(case, tensors)
    for n in (2, 8, 64):
        _check(case, moe, n, seed=20 + n)
    bf = MoE(case.spec, torch.bfloat16, flavor="deepseek_v3")
    bf.load_hf(WeightSource.from_dict(tensors), "model.layers.1.mlp.")
    x = torch.randn(9, D)
    y = bf(x.bfloat16())
    assert y.dtype == torch.bfloat16 and y.shape == (9, D)
    torch.testing.assert_close(y.float(), moe(x), atol=0.15, rtol=0.05)
    # batch dims are flattened and restored
    assert moe(x.view(3, 3, D)).shape == (3, 3, D)


# ----------------------------------------------------------------------------- dense FFN


def test_dense_ffn_matches_llama_mlp_with_bias(tmp_path):
    T = transformers
    cfg = T.LlamaConfig(**ATTN, hidden_size=D, num_hidden_layers=1, intermediate_size=48, mlp_bias=True)
    model = T.LlamaForCausalLM(cfg).eval()
    _randomise(model, 7)
    tensors = _save(model, tmp_path)
    src = WeightSource.from_dict(tensors)
    ffn = DenseFFN(DenseFFNSpec(D, 48, gated=True, bias=True), act=hf_act("llama", cfg.to_dict()))
    ffn.load_hf(src, dense_prefix("llama", 0, src), dense_names("llama"))
    x = torch.randn(37, D)
    with torch.no_grad():
        torch.testing.assert_close(ffn(x), model.model.layers[0].mlp(x), atol=ATOL, rtol=RTOL)


def test_dense_ffn_matches_nemotron_h_relu2_mlp(tmp_path):
    case = _make("nemotron_h")
    tensors = _save(case.model, tmp_path)
    src = WeightSource.from_dict(tensors)
    ffn = DenseFFN(DenseFFNSpec(D, 48, gated=False), act=hf_act("nemotron_h", case.hf_config.to_dict()))
    assert ffn.act_name == "relu2"
    prefix = dense_prefix("nemotron_h", 1, src)
    assert prefix == "backbone.layers.1.mixer."
    ffn.load_hf(src, prefix, dense_names("nemotron_h"))
    x = torch.randn(37, D)
    with torch.no_grad():
        torch.testing.assert_close(ffn(x), case.model.model.layers[1].mixer(x), atol=ATOL, rtol=RTOL)


def test_dense_ffn_matches_deepseek_dense_layer_and_granite_shared_mlp(tmp_path):
    case = _make("deepseek_v3")
    src = WeightSource.from_dict(_save(case.model, tmp_path / "ds"))
    ffn = DenseFFN(DenseFFNSpec(D, 48))
    ffn.load_hf(src, dense_prefix("deepseek_v3", 0, src))
    x = torch.randn(5, D)
    with torch.no_grad():
        torch.testing.assert_close(ffn(x), case.model.model.layers[0].mlp(x), atol=ATOL, rtol=RTOL)
    g = _make("granitemoehybrid")
    src = WeightSource.from_dict(_save(g.model, tmp_path / "gr"))
    ffn = DenseFFN(DenseFFNSpec(D, I_SHARED))
    ffn.load_hf(src, dense_prefix("granitemoehybrid", 0, src), dense_names("granitemoehybrid"))
    with torch.no_grad():
        torch.testing.assert_close(ffn(x), g.model.model.layers[0].shared_mlp(x), atol=ATOL, rtol=RTOL)


# ----------------------------------------------------------------------------- errors and prefixes


def test_misshaped_expert_tensor_is_a_checkpoint_error(tmp_path):
    case = _make("qwen3_moe")
    tensors = _save(case.model, tmp_path)
    bad = "model.layers.0.mlp.experts.3.up_proj.weight"
    tensors[bad] = torch.zeros(I_EXPERT + 1, D)
    with pytest.raises(CheckpointError, match=r"experts\.3\.up_proj\.weight") as ei:
        _ours(case, tensors)
    assert "[17, 32]" in str(ei.value) and "[16, 32]" in str(ei.value)


def test_misshaped_fused_and_missing_tensors_are_checkpoint_errors(tmp_path):
    case = _make("gpt_oss")
    tensors = _save(case.model, tmp_path)
    name = "model.layers.0.mlp.experts.gate_up_proj"
    tensors[name] = tensors[name].transpose(1, 2).contiguous()  # [E, 2I, D] instead of [E, D, 2I]
    with pytest.raises(CheckpointError, match=r"experts\.gate_up_proj"):
        _ours(case, tensors)
    tensors["model.layers.0.mlp.experts.gate_up_proj_blocks"] = torch.zeros(1, dtype=torch.uint8)
    with pytest.raises(CheckpointError, match="MXFP4"):
        _ours(case, tensors)
    case = _make("deepseek_v3")
    tensors = _save(case.model, tmp_path / "ds")
    del tensors["model.layers.1.mlp.gate.e_score_correction_bias"]
    with pytest.raises(CheckpointError, match="e_score_correction_bias"):
        _ours(case, tensors)


def test_moe_kwargs_from_config():
    case = _make("gpt_oss")
    assert case.kwargs == {"act": "silu", "swiglu_alpha": 1.702, "swiglu_limit": 1.5}
    assert moe_kwargs("nemotron_h", {"mlp_hidden_act": "relu2", "hidden_act": "silu"})["act"] == "relu2"
    assert MoE(MoESpec(hidden_size=D, num_experts=E, top_k=K, expert_intermediate=I_EXPERT, gated=False),
               flavor="nemotron_h").act_name == "relu2"
    # a null or non-numeric clamp is refused by name (it was a bare TypeError from float(None))
    for key, bad in (("swiglu_limit", None), ("swiglu_alpha", "1.7"), ("swiglu_limit", True)):
        with pytest.raises(ConfigError, match=f"{key} must be a number"):
            moe_kwargs("gpt_oss", {key: bad})
    assert moe_kwargs("gpt_oss", {"swiglu_limit": 10})["swiglu_limit"] == 10.0


def test_prefixes_and_config_errors():
    assert moe_prefix("mixtral", 3) == "model.layers.3.block_sparse_moe."
    src = WeightSource.from_dict({"model.layers.3.mlp.gate.weight": torch.zeros(E, D)})
    assert moe_prefix("mixtral", 3, src) == "model.layers.3.mlp."
    assert moe_prefix("nemotron_h", 2) == "backbone.layers.2.mixer."
    assert moe_prefix("granitemoehybrid", 0) == "model.layers.0."
    with pytest.raises(ConfigError):
        moe_prefix("nope", 0)
    spec = MoESpec(hidden_size=D, num_experts=E, top_k=K, expert_intermediate=I_EXPERT)
    with pytest.raises(ConfigError):
        MoE(spec, flavor="nope")
    with pytest.raises(ConfigError):
        MoE(spec, act="bogus", flavor="mixtral")
    with pytest.raises(ConfigError):
        MoE(MoESpec(hidden_size=D, num_experts=E, top_k=K, expert_intermediate=I_EXPERT, n_group=3, topk_group=1),
            flavor="deepseek_v3")
    with pytest.raises(ConfigError, match="top_k=5"):
        MoE(MoESpec(hidden_size=D, num_experts=E, top_k=5, expert_intermediate=I_EXPERT, n_group=4, topk_group=2),
            flavor="deepseek_v3")


# ----------------------------------------------------------------------------- spec parser agreement

PARSER_CASES = [f for f in FLAVORS if f != "sol"]  # qwen3_moe: 5.24 writes the count as num_local_experts


@pytest.mark.parametrize("flavor", PARSER_CASES)
def test_spec_parser_gives_the_spec_these_tests_use(flavor):
    """parse_hf_config on the saved config.json yields the MoESpec used above (so the engine, which builds
    MoE from the parsed spec, gets the behaviour these tests check)."""
    case = _make(flavor)
    cfg = case.hf_config.to_dict()
    spec = parse_hf_config(cfg)
    got = spec.layers[case.layer].ffn
    assert got == case.spec, f"parser: {got}\n tests: {case.spec}"


@pytest.mark.parametrize("flavor", ["deepseek_v3", "gpt_oss", "nemotron_h", "qwen3_moe"])
def test_grouped_products_path_matches_the_sorted_one(flavor, tmp_path, monkeypatch):
    # the accelerator's path (bf16 experts through torch._grouped_mm, no host read), forced on CPU, against the
    # engine's sorted path on the same bf16 block and against the fp32 block (itself checked against transformers)
    case = _make(flavor)
    tensors = _save(case.model, tmp_path)
    ref, src = _ours(case, tensors)
    bf = MoE(case.spec, torch.bfloat16, flavor=case.flavor, **case.kwargs)
    bf.load_hf(WeightSource.from_dict(tensors), moe_prefix(case.flavor, case.layer, src))
    calls = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    for n in (1, 5, 37):
        x = torch.randn(n, case.spec.hidden_size, generator=torch.Generator().manual_seed(30 + n))
        with torch.no_grad():
            bf.grouped_on_cpu = False
            sorted_y = bf(x.bfloat16()).float()
            before = len(calls)
            bf.grouped_on_cpu = True
            grouped_y = bf(x.bfloat16()).float()
            assert len(calls) > before  # the grouped products ran
            torch.testing.assert_close(grouped_y, sorted_y, atol=0.03, rtol=0.02)
            torch.testing.assert_close(grouped_y, ref(x), atol=0.15, rtol=0.05)
