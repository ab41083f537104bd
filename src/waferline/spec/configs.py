"""Hugging Face ``config.json`` -> ModelSpec: one parser per ``model_type`` (hub spellings and transformers-5.x
spellings), multimodal configs flattened to their language model. Needs no torch."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from waferline.errors import ConfigError
from waferline.files import broken_link
from waferline.spec.model import (
    AttentionSpec,
    CompressedAttentionSpec,
    DenseFFNSpec,
    DSASpec,
    FFNSpec,
    GatedDeltaNetSpec,
    KimiDeltaSpec,
    LayerSpec,
    Mamba1Spec,
    Mamba2Spec,
    MixerSpec,
    MLASpec,
    ModelSpec,
    MoESpec,
)

MODEL_TYPE_ALIASES = {"kimi_k2": "deepseek_v3", "kimi_k25": "deepseek_v3"}
ENGINE_MODEL_TYPES = ("llama", "qwen3", "qwen3_moe", "mixtral", "deepseek_v2", "deepseek_v3", "deepseek_v32",
                      "deepseek_v4", "gpt_oss", "granitemoehybrid", "nemotron_h", "bamba", "sol", "qwen3_next",
                      "kimi_linear")


def _flatten_text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Multimodal configs (Llama 4, Kimi K2.5) nest the language model under text_config."""
    tc = cfg.get("text_config")
    if isinstance(tc, dict) and "hidden_size" not in cfg:
        merged = dict(tc)
        merged.setdefault("model_type", cfg.get("model_type"))
        if cfg.get("model_type") in ("llama4",):
            merged["model_type"] = "llama4"
        for k in ("tie_word_embeddings", "_waferline"):
            if k in cfg:
                merged.setdefault(k, cfg[k])
        return merged
    return cfg


def _get(cfg: dict[str, Any], *names: str, default: Any = KeyError) -> Any:
    for n in names:
        if n in cfg and cfg[n] is not None:
            return cfg[n]
    if default is KeyError:
        raise KeyError(names)
    return default


def _spellings(names: str | tuple[str, ...]) -> str:
    """A field as errors name it: every spelling the parser accepts ("'a' (or 'b', 'c')"), so that a config written in
    any of them is recognised."""
    names = (names,) if isinstance(names, str) else names
    rest = f" (or {', '.join(map(repr, names[1:]))})" if len(names) > 1 else ""
    return f"{names[0]!r}{rest}"


def _float(v: Any) -> float:
    """A float from config.json, where transformers writes inf as {"__float__": "Infinity"}."""
    if isinstance(v, dict) and "__float__" in v:
        return float(v["__float__"])
    return float(v)


# MoE model types whose parser would fall back to a dense FFN when the expert count is absent: the count is
# required (refused when absent, never guessed). The field and transformers' config-class default, for the message.
_EXPERT_COUNT = {"qwen3_moe": ("num_experts", "Qwen3MoeConfig", 128),
                 "qwen3_next": ("num_experts", "Qwen3NextConfig", 512),
                 "deepseek_v2": ("n_routed_experts", "DeepseekV2Config", 64),
                 "deepseek_v3": ("n_routed_experts", "DeepseekV3Config", 256),
                 "deepseek_v32": ("n_routed_experts", "DeepseekV32Config", 256),
                 "granitemoehybrid": ("num_local_experts", "GraniteMoeHybridConfig", 8),
                 "jamba": ("num_experts", "JambaConfig", 16)}
# config fields of a routed-expert count and of top-k, by spelling (the first present is the one named in errors)
_EXPERT_FIELDS = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")
_TOPK_FIELDS = ("num_experts_per_tok", "num_experts_per_token", "experts_per_token", "moe_top_k")


def _require_expert_count(cfg: dict[str, Any], mt: str) -> None:
    """A MoE model_type without its expert count would be read as a dense model (wrong parameters, wrong speed):
    refuse it, naming the field (transformers would take its config class's default, which a hand-written config
    rarely means)."""
    if mt not in _EXPERT_COUNT:
        return
    field, cls, default = _EXPERT_COUNT[mt]
    names = (field, "num_local_experts") if mt == "qwen3_moe" else (field,)
    if all(cfg.get(n) is None for n in names):
        raise ConfigError(
            f"config for model_type {mt!r} has no {_spellings(names)}, its number of routed experts (transformers' "
            f"{cls} default is {default}): give it (0 for a model without experts)"
        )


def _check_accounting(spec: ModelSpec, cfg: dict[str, Any], mt: str, defaulted: Any = ()) -> None:
    """Values the accounting cannot take: top-k outside 1..num_experts (more active than total parameters), key/value
    heads that are not a divisor of the query heads, no positions. (``defaulted``: the fields transformers' defaults
    filled in, which the config does not give.)"""
    def named(fields: tuple[str, ...], fallback: str) -> str:
        return next((f for f in fields if cfg.get(f) is not None), fallback)

    if not isinstance(spec.max_position_embeddings, int) or spec.max_position_embeddings < 1:
        raise ConfigError(f"config max_position_embeddings must be an integer >= 1, got "
                          f"{spec.max_position_embeddings!r}")
    for layer in [*spec.layers, *spec.mtp_layers]:
        ffn, mixer = layer.ffn, layer.mixer
        if isinstance(ffn, MoESpec):
            e_name, k_name = named(_EXPERT_FIELDS, "num_experts"), named(_TOPK_FIELDS, "num_experts_per_tok")
            E, k = ffn.num_experts, ffn.top_k
            if not isinstance(E, int) or isinstance(E, bool) or E < 1:
                raise ConfigError(f"config {e_name} (routed experts) must be an integer >= 1 in a {mt} MoE layer, "
                                  f"got {E!r}")
            if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= E:
                raise ConfigError(f"config {k_name} (experts per token, top-k) must be an integer from 1 to "
                                  f"{e_name} = {E}, got {k!r}")
        window = getattr(mixer, "sliding_window", None)
        if isinstance(mixer, CompressedAttentionSpec):  # (the window it keeps: sliding_window - 1 tokens)
            window = mixer.window + 1
        if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
            w_name = "attention_chunk_size" if mt == "llama4" else "sliding_window"
            raise ConfigError(f"config {w_name} must be an integer >= 1 (tokens a layer attends to), got {window!r}")
        rotated = None
        if isinstance(mixer, AttentionSpec) and _uses_rope(cfg, mt):
            rotated = int(mixer.head_dim * partial_rotary(cfg, mt))
        elif isinstance(mixer, CompressedAttentionSpec):  # (as DeepSeek-V4 reads it: model/v4_attention.py rope_dim)
            partial, qk = cfg.get("partial_rotary_factor"), cfg.get("qk_rope_head_dim") or 64
            rotated = (int(qk) if _positive(qk) else 0) if partial is None else int(mixer.head_dim * partial)
        if rotated is not None and (rotated < 2 or rotated % 2 or rotated > mixer.head_dim):
            raise ConfigError(f"config head_dim {mixer.head_dim} rotates {rotated} channels of each head (its "
                              "partial_rotary_factor share): rotary embeddings turn channel pairs, so that must be an "
                              "even number from 2 to head_dim")
        if isinstance(mixer, AttentionSpec):
            h, kv = mixer.num_heads, mixer.num_kv_heads
            kv_name = named(("num_key_value_heads", "num_attention_groups"), "num_key_value_heads")
            if not isinstance(kv, int) or isinstance(kv, bool) or not 1 <= kv <= h or h % kv:
                note = f" (transformers' {mt} default: the config gives none)" if kv_name in defaulted else ""
                raise ConfigError(f"config {kv_name} must be an integer from 1 to num_attention_heads = {h} that "
                                  f"divides it (each key/value head serves a whole group of query heads), got {kv!r}"
                                  f"{note}")


# rotary embeddings transformers builds (its ROPE_INIT_FUNCTIONS, and "default"), and the fields each needs
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3", "proportional")
_ROPE_NEEDS = {"linear": ("factor",), "dynamic": ("factor",), "longrope": ("short_factor", "long_factor"),
               "llama3": ("factor", "low_freq_factor", "high_freq_factor")}
# positive numbers (partial_rotary_factor: at most 1), in the rope settings or beside them
_ROPE_NUMBERS = ("rope_theta", "compress_rope_theta", "factor", "low_freq_factor", "high_freq_factor",
                 "original_max_position_embeddings", "partial_rotary_factor")


def _positive(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def _check_rope_numbers(where: str, p: dict[str, Any], fields: tuple[str, ...] = _ROPE_NUMBERS) -> None:
    for f in fields:
        v = p.get(f)
        if v is None:
            continue
        if f == "partial_rotary_factor" and not (_positive(v) and v <= 1):
            raise ConfigError(f"config {where}{f} must be a number > 0 and <= 1 (the share of a head rotated), "
                              f"got {v!r}")
        if not _positive(v):
            raise ConfigError(f"config {where}{f} must be a number > 0, got {v!r}")


def _uses_rope(cfg: dict[str, Any], mt: str) -> bool:
    """Whether the model reads rotary settings (Nemotron-H and Jamba have none; Granite 4.0 hybrids only with
    position_embedding_type rope)."""
    if mt in ("nemotron_h", "jamba"):
        return False
    return mt != "granitemoehybrid" or cfg.get("position_embedding_type") == "rope"


# model types whose transformers attention rotates whole heads: their default rotary reads no partial_rotary_factor
# (a scaled one reads it, and the model then fails: tables for a share, heads rotated whole)
WHOLE_HEAD_ROTARY = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "gpt_oss", "granitemoehybrid")


def partial_rotary(cfg: dict[str, Any], mt: str) -> float:
    """The share of an attention head that is rotated, as transformers reads it: the whole head where its attention
    reads no partial_rotary_factor; Bamba's from the rope settings alone, else half (transformers sets half over the
    top-level field); Qwen3-Next's a quarter where the config gives none."""
    if mt in WHOLE_HEAD_ROTARY:
        return 1.0
    rp = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    partial = rp.get("partial_rotary_factor", None if mt == "bamba" else cfg.get("partial_rotary_factor"))
    return float({"bamba": 0.5, "qwen3_next": 0.25}.get(mt, 1.0) if partial is None else partial)


def _check_rope(name: str, p: dict[str, Any]) -> None:
    kind = p.get("rope_type") or p.get("type") or "default"
    if kind not in ROPE_TYPES:
        raise ConfigError(f"config {name} has rope_type {kind!r}, which is no rotary embedding transformers builds "
                          f"(known: {', '.join(ROPE_TYPES)})")
    for f in _ROPE_NEEDS.get(kind, ()):
        if p.get(f) is None:
            raise ConfigError(f"config {name} of rope_type {kind!r} has no {f!r}")
    _check_rope_numbers(f"{name}.", p)


def _check_settings(cfg: dict[str, Any], mt: str) -> None:
    """Settings the engine reads besides the sizes: the norm epsilon and the rotary embedding. A value that makes no
    model (an epsilon <= 0, a base <= 0, a rope type transformers does not build) is one ConfigError naming the field,
    for the planner as for the engine, not NaN logits or a traceback at load."""
    for k in ("rms_norm_eps", "layer_norm_epsilon", "norm_eps"):
        v = cfg.get(k)
        if v is not None and not _positive(v):
            raise ConfigError(f"config {k} must be a number > 0, got {v!r}")
    if not _uses_rope(cfg, mt):
        return
    _check_rope_numbers("", cfg, ("rope_theta", "compress_rope_theta", "original_max_position_embeddings",
                                  "partial_rotary_factor"))
    for k in ("rope_scaling", "rope_parameters"):
        rp = cfg.get(k)
        if rp is None:
            continue
        if not isinstance(rp, dict):
            raise ConfigError(f"config {k} must be an object (rope_type, rope_theta, factor, ...) or null, got {rp!r}")
        nested = {n: v for n, v in rp.items() if isinstance(v, dict)}  # (DeepSeek-V4: one per rope kind)
        for n, p in nested.items() or [(None, rp)]:
            _check_rope(k if n is None else f"{k}.{n}", p)
    rp = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    kind, partial = rp.get("rope_type") or rp.get("type") or "default", rp.get(
        "partial_rotary_factor", cfg.get("partial_rotary_factor"))
    if mt in WHOLE_HEAD_ROTARY and kind != "default" and partial is not None and partial < 1:
        raise ConfigError(f"config partial_rotary_factor {partial} with rope_type {kind!r}: transformers' {mt} "
                          f"attention rotates whole heads, and its {kind} rotary, made for that share of a head, fails "
                          "on them; remove partial_rotary_factor (or give 1.0)")


def _head_dim(cfg: dict[str, Any]) -> int:
    hd = cfg.get("head_dim")
    return int(hd) if hd else cfg["hidden_size"] // cfg["num_attention_heads"]


def _gqa(cfg: dict[str, Any], window: int | None = None, **kw: Any) -> AttentionSpec:
    return AttentionSpec(
        hidden_size=cfg["hidden_size"], num_heads=cfg["num_attention_heads"],
        num_kv_heads=_get(cfg, "num_key_value_heads", default=cfg["num_attention_heads"]),
        head_dim=_head_dim(cfg), sliding_window=window, **kw)


def _mla(cfg: dict[str, Any]) -> MLASpec:
    return MLASpec(
        hidden_size=cfg["hidden_size"], num_heads=cfg["num_attention_heads"],
        q_lora_rank=cfg.get("q_lora_rank") or None, kv_lora_rank=cfg["kv_lora_rank"],
        qk_nope_head_dim=cfg["qk_nope_head_dim"], qk_rope_head_dim=cfg["qk_rope_head_dim"],
        v_head_dim=cfg["v_head_dim"], attention_bias=bool(cfg.get("attention_bias", False)))


def _dsa(cfg: dict[str, Any]) -> DSASpec:
    """MLA + lightning indexer (DeepSeek-V3.2 ``index_*`` fields; defaults are transformers' DeepseekV32Config)."""
    index_head_dim = int(cfg.get("index_head_dim") or 128)
    if cfg["qk_rope_head_dim"] > index_head_dim:  # (the indexer's keys carry the rope channels; transformers fails)
        raise ConfigError(f"config qk_rope_head_dim {cfg['qk_rope_head_dim']} is over index_head_dim {index_head_dim}: "
                          "the indexer's heads hold the rotary channels")
    return DSASpec(
        hidden_size=cfg["hidden_size"], num_heads=cfg["num_attention_heads"],
        q_lora_rank=cfg.get("q_lora_rank") or None, kv_lora_rank=cfg["kv_lora_rank"],
        qk_nope_head_dim=cfg["qk_nope_head_dim"], qk_rope_head_dim=cfg["qk_rope_head_dim"],
        v_head_dim=cfg["v_head_dim"], index_n_heads=int(cfg.get("index_n_heads") or 64),
        index_head_dim=index_head_dim, index_topk=int(cfg.get("index_topk") or 2048),
        index_bits=int(cfg.get("index_bits") or 8), attention_bias=bool(cfg.get("attention_bias", False)))


COMPRESSED_LAYER_TYPES = {"csa": "compressed_sparse_attention", "hca": "heavily_compressed_attention",
                          "swa": "sliding_attention"}
DEFAULT_COMPRESS_RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}


def _compressed(cfg: dict[str, Any], layer_type: str) -> CompressedAttentionSpec:
    """DeepSeek-V4-style attention (field names and defaults as transformers' DeepseekV4Config): CSA = compressed
    4x + top-k indexer, HCA = compressed 128x attended densely, both with a sliding window of recent tokens (the
    cache holds ``sliding_window - 1`` of them: a query sees those and itself). ``index_bits`` as the config says,
    8 (fp8 + scale) when it says nothing."""
    layer_type = COMPRESSED_LAYER_TYPES.get(layer_type, layer_type)
    rates = dict(DEFAULT_COMPRESS_RATES, **(cfg.get("compress_rates") or {}))
    if layer_type == "sliding_attention":
        ratio = 0
    elif layer_type in rates:
        ratio = int(rates[layer_type])
    else:
        raise ConfigError(f"unknown compressed attention layer type {layer_type!r} "
                          f"(known: {', '.join(sorted(set(COMPRESSED_LAYER_TYPES.values())))})")
    sparse = layer_type == "compressed_sparse_attention"
    window = int(128 if cfg.get("sliding_window") is None else cfg["sliding_window"]) - 1
    return CompressedAttentionSpec(
        hidden_size=cfg["hidden_size"], num_heads=cfg["num_attention_heads"], head_dim=_head_dim(cfg),
        q_lora_rank=cfg["q_lora_rank"], compress_ratio=ratio, window=window,
        index_topk=int(cfg.get("index_topk") or 512) if sparse else 0,
        index_n_heads=int(cfg.get("index_n_heads") or 64) if sparse else 0,
        index_head_dim=int(cfg.get("index_head_dim") or 128) if sparse else 0,
        index_bits=8 if cfg.get("index_bits") is None else int(cfg["index_bits"]),
        o_groups=int(cfg.get("o_groups") or 1), o_lora_rank=int(cfg.get("o_lora_rank") or 0))


def _mamba2(cfg: dict[str, Any]) -> Mamba2Spec:
    """(Nemotron-H's in/out projections take their bias from ``use_bias``: transformers reads no mamba_proj_bias
    there, though its config writes one.)"""
    d = cfg["hidden_size"]
    heads = _get(cfg, "mamba_n_heads", "mamba_num_heads")
    expand = _get(cfg, "mamba_expand", "expand", default=2)
    hd = _get(cfg, "mamba_d_head", "mamba_head_dim", default="auto")
    if hd == "auto":
        hd = expand * d // heads
    limit = cfg.get("time_step_limit") or cfg.get("mamba_dt_limit") or (0.0, float("inf"))
    return Mamba2Spec(
        hidden_size=d, num_heads=heads, head_dim=int(hd),
        state_size=_get(cfg, "mamba_d_state", "ssm_state_size"),
        n_groups=_get(cfg, "mamba_n_groups", "n_groups", default=1),
        conv_kernel=_get(cfg, "mamba_d_conv", "conv_kernel", default=4),
        conv_bias=bool(_get(cfg, "mamba_conv_bias", "use_conv_bias", default=True)),
        proj_bias=bool(cfg.get("use_bias") if cfg.get("model_type") == "nemotron_h"
                       else _get(cfg, "mamba_proj_bias", "use_bias", default=False)),
        chunk_size=_get(cfg, "mamba_chunk_size", "chunk_size", default=256),
        time_step_limit=(_float(limit[0]), _float(limit[1])),
        norm_eps=_get(cfg, "rms_norm_eps", "layer_norm_epsilon", default=1e-5))


# model types whose transformers MLPs (dense, and shared experts) read ``mlp_bias``; the others have no MLP biases,
# whatever the config says (sol: waferline's own, which reads it)
_MLP_BIAS_TYPES = ("llama", "bamba", "deepseek_v2", "deepseek_v4", "nemotron_h", "sol")


def _mlp_bias(cfg: dict[str, Any]) -> bool:
    mt = cfg.get("model_type")
    return bool(cfg.get("mlp_bias", False)) and MODEL_TYPE_ALIASES.get(mt, mt) in _MLP_BIAS_TYPES


def _dense(cfg: dict[str, Any], inter: int | None = None, gated: bool = True) -> DenseFFNSpec:
    return DenseFFNSpec(hidden_size=cfg["hidden_size"], intermediate_size=inter or cfg["intermediate_size"],
                        gated=gated, bias=_mlp_bias(cfg))


# model types whose transformers model never ties its LM head to the embedding, whatever tie_word_embeddings says
# (their checkpoints carry a head of its own)
_UNTIED_TYPES = ("nemotron_h", "kimi_linear")


def _spec(
    cfg: dict[str, Any], name: str, mt: str, layers: list[LayerSpec], mtp: list[LayerSpec] | None = None
) -> ModelSpec:
    return ModelSpec(
        name=name, model_type=mt, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"], layers=layers,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)) and mt not in _UNTIED_TYPES,
        max_position_embeddings=int(cfg.get("max_position_embeddings") or 4096), mtp_layers=mtp or [], hf_config=cfg)


def _layer_types(cfg: dict[str, Any], n: int, default: list[str] | None = None,
                 known: tuple[str, ...] = ("full_attention", "sliding_attention")) -> list[str]:
    """Per-layer attention kind from `layer_types` (one of ``known`` per layer), else ``default`` (full attention)."""
    lt = cfg.get("layer_types")
    if lt is None:
        return default or ["full_attention"] * n
    if not isinstance(lt, list):
        raise ConfigError(f"layer_types must be a list of {n} layer kinds, got {lt!r}")
    if len(lt) != n:
        raise ConfigError(f"layer_types has {len(lt)} entries but num_hidden_layers is {n}")
    bad = [t for t in lt if t not in known]
    if bad:
        raise ConfigError(f"layer_types has {bad[0]!r} for a {cfg.get('model_type')} layer (known: {', '.join(known)})")
    return list(lt)


def _llama_like_windows(cfg: dict[str, Any], n: int, mt: str) -> list[int | None]:
    """Each layer's sliding window as transformers reads the config: Mistral, Mixtral and Qwen3-MoE apply
    ``sliding_window`` to every layer; Qwen2/Qwen3 only with ``use_sliding_window`` (default false), to the layers
    ``layer_types`` marks, or where it is absent to those from ``max_window_layers`` (default 28) on. Llama's
    attention has no window, whatever ``sliding_window`` and ``layer_types`` say."""
    if mt == "llama":
        _layer_types(cfg, n)  # (transformers refuses an unknown kind, though its Llama reads none)
        return [None] * n
    w = cfg.get("sliding_window", 4096 if mt == "mistral" else None)  # (MistralConfig's default: key absent)
    if mt in ("qwen2", "qwen3", "qwen3_moe") and not cfg.get("use_sliding_window", False):
        w = None
    if mt in ("mistral", "mixtral", "qwen3_moe"):
        return [w] * n
    if cfg.get("layer_types") is None and mt in ("qwen2", "qwen3"):
        return [w if i >= int(cfg.get("max_window_layers", 28)) else None for i in range(n)]
    return [w if t == "sliding_attention" else None for t in _layer_types(cfg, n)]


def _parse_llama_like(cfg: dict[str, Any], name: str, mt: str) -> ModelSpec:
    n = cfg["num_hidden_layers"]
    qk_norm = mt in ("qwen3", "qwen3_moe")
    bias = bool(cfg.get("attention_bias", False))
    windows = _llama_like_windows(cfg, n, mt)
    layers = []
    sparse_step = cfg.get("decoder_sparse_step", 1) or 1
    mlp_only = set(cfg.get("mlp_only_layers") or [])
    for i in range(n):
        # (Qwen2's q/k/v projections always carry a bias, its o_proj never: it reads no attention_bias)
        mixer = _gqa(cfg, window=windows[i], qk_norm=qk_norm, qkv_bias=bias or mt == "qwen2",
                     o_bias=bias and mt != "qwen2")
        n_exp = _get(cfg, "num_experts", "num_local_experts", default=0)
        if mt == "qwen3_moe" and i not in mlp_only and n_exp > 0 and (i + 1) % sparse_step == 0:
            ffn: FFNSpec = MoESpec(hidden_size=cfg["hidden_size"], num_experts=n_exp,
                                   top_k=cfg["num_experts_per_tok"], expert_intermediate=cfg["moe_intermediate_size"],
                                   norm_topk_prob=bool(cfg.get("norm_topk_prob", True)))
        elif mt == "mixtral":
            ffn = MoESpec(hidden_size=cfg["hidden_size"], num_experts=_get(cfg, "num_local_experts", "num_experts"),
                          top_k=cfg["num_experts_per_tok"], expert_intermediate=cfg["intermediate_size"])
        else:
            ffn = _dense(cfg)
        layers.append(LayerSpec(i, mixer, ffn, cfg["hidden_size"]))
    return _spec(cfg, name, mt, layers)


def _or_default(cfg: dict[str, Any], key: str, default: float) -> float:
    """``cfg[key]`` as a float, ``default`` where it is absent or null (0 stays 0: ``x or default`` took it for
    absent)."""
    v = cfg.get(key)
    return default if v is None else _float(v)


def _deepseek_moe(cfg: dict[str, Any], mt: str) -> MoESpec:
    scoring = cfg.get("scoring_func") or ("sigmoid" if mt == "deepseek_v3" else "softmax")
    topk_method = cfg.get("topk_method") or ("noaux_tc" if mt == "deepseek_v3" else "greedy")
    grouped = topk_method in ("group_limited_greedy", "noaux_tc")
    n_shared = cfg.get("n_shared_experts") or 0
    return MoESpec(
        hidden_size=cfg["hidden_size"], num_experts=_get(cfg, "n_routed_experts", "num_experts"),
        top_k=cfg["num_experts_per_tok"], expert_intermediate=cfg["moe_intermediate_size"],
        num_shared=n_shared, shared_intermediate=n_shared * cfg["moe_intermediate_size"],
        shared_bias=bool(n_shared) and _mlp_bias(cfg), scoring=scoring, correction_bias=topk_method == "noaux_tc",
        n_group=(cfg.get("n_group") or 1) if grouped else 1, topk_group=(cfg.get("topk_group") or 1) if grouped else 1,
        # (transformers' DeepSeek-V2 router never renormalises the top-k weights, whatever norm_topk_prob says)
        norm_topk_prob=mt != "deepseek_v2" and bool(cfg.get("norm_topk_prob", mt == "deepseek_v3")),
        routed_scaling=_or_default(cfg, "routed_scaling_factor", 1.0))


def _parse_deepseek(cfg: dict[str, Any], name: str, mt: str) -> ModelSpec:
    """(The router as transformers builds it: DeepSeek-V3 / V3.2 always sigmoid scores with the correction bias and
    grouped top-k, DeepSeek-V2 always softmax scores, top-k greedy or group_limited_greedy; the scoring_func and
    topk_method a config writes beside those are not read, nor moe_layer_freq: experts on every layer from
    first_k_dense_replace on. DeepSeek-V3.2 takes its dense layers from mlp_layer_types where the config has it.)"""
    n = cfg["num_hidden_layers"]
    first_dense = cfg.get("first_k_dense_replace", 0) or 0
    has_moe = (cfg.get("n_routed_experts") or 0) > 0
    if mt == "deepseek_v2":
        method = cfg.get("topk_method") or "greedy"
        if method not in ("greedy", "group_limited_greedy"):
            raise ConfigError(f"config topk_method {method!r}: a deepseek_v2 router selects experts 'greedy' or "
                              "'group_limited_greedy' (transformers' DeepSeek-V2 builds no other)")
        router = dict(cfg, scoring_func="softmax", topk_method=method)
    else:
        router = dict(cfg, scoring_func="sigmoid", topk_method="noaux_tc")
    mlp_types = cfg.get("mlp_layer_types") if mt == "deepseek_v32" else None
    if mlp_types is not None and (not isinstance(mlp_types, list) or len(mlp_types) != n
                                  or any(t not in ("dense", "sparse") for t in mlp_types)):
        raise ConfigError(f"config mlp_layer_types must be a list of {n} entries 'dense' or 'sparse' (one per layer), "
                          f"got {mlp_types!r}")

    def layer(i: int) -> LayerSpec:
        if mlp_types is not None and i < n:
            moe = has_moe and mlp_types[i] == "sparse"
        else:
            moe = has_moe and i >= first_dense
        mixer: MixerSpec = _dsa(cfg) if mt == "deepseek_v32" else _mla(cfg)
        ffn = _deepseek_moe(router, "deepseek_v3" if mt == "deepseek_v32" else mt) if moe else _dense(cfg)
        return LayerSpec(i, mixer, ffn, cfg["hidden_size"])

    layers = [layer(i) for i in range(n)]
    mtp = [layer(n + j) for j in range(cfg.get("num_nextn_predict_layers", 0) or 0)]
    # each MTP module also has enorm, hnorm, a 2d->d projection (embeddings/head shared with the main model)
    return _spec(cfg, name, mt, layers, mtp)


def _parse_gpt_oss(cfg: dict[str, Any], name: str, mt: str) -> ModelSpec:
    n = cfg["num_hidden_layers"]
    types = _layer_types(cfg, n, ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)])
    layers = []
    for i in range(n):
        window = cfg.get("sliding_window") if types[i] == "sliding_attention" else None
        mixer = _gqa(cfg, window=window, sinks=True, qkv_bias=bool(cfg.get("attention_bias", True)),
                     o_bias=bool(cfg.get("attention_bias", True)))
        ffn = MoESpec(hidden_size=cfg["hidden_size"], num_experts=_get(cfg, "num_local_experts", "num_experts"),
                      top_k=_get(cfg, "num_experts_per_tok", "experts_per_token"),
                      expert_intermediate=cfg["intermediate_size"], expert_bias=True, router_bias=True,
                      softmax_after_topk=True)
        layers.append(LayerSpec(i, mixer, ffn, cfg["hidden_size"]))
    return _spec(cfg, name, mt, layers)


def _hybrid_kinds(cfg: dict[str, Any], n: int | None) -> list[str]:
    """Per-layer block kinds of a Mamba hybrid, normalised to mamba / attention / mlp / moe."""
    kinds = cfg.get("layers_block_type") or cfg.get("layer_types")
    if kinds is None and cfg.get("hybrid_override_pattern"):
        code = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
        try:
            kinds = [code[c] for c in cfg["hybrid_override_pattern"]]
        except KeyError as e:
            raise ConfigError(
                f"hybrid_override_pattern has unknown layer code {e.args[0]!r} (known: M * - E)"
            ) from None
    if kinds is None and "attn_layer_indices" in cfg and n is not None:
        attn = set(cfg.get("attn_layer_indices") or [])
        kinds = ["attention" if i in attn else "mamba" for i in range(n)]
    if kinds is None:
        raise KeyError(("layers_block_type", "layer_types", "hybrid_override_pattern", "attn_layer_indices"))
    norm = {"mamba": "mamba", "linear_attention": "mamba", "attention": "attention", "full_attention": "attention",
            "mlp": "mlp", "moe": "moe"}
    try:
        kinds = [norm[k] for k in kinds]
    except KeyError as e:
        raise ConfigError(f"unknown hybrid layer kind {e.args[0]!r} (known: {', '.join(norm)})") from None
    if n is not None and len(kinds) != n:
        raise ConfigError(f"the hybrid layer pattern has {len(kinds)} entries but num_hidden_layers is {n}")
    return kinds


def _parse_bamba(cfg: dict[str, Any], name: str, mt: str) -> ModelSpec:
    n = cfg["num_hidden_layers"]
    kinds = _hybrid_kinds(cfg, n)
    layers = []
    for i, k in enumerate(kinds):
        mixer = (
            _mamba2(cfg)
            if k == "mamba"
            else _gqa(cfg, qkv_bias=bool(cfg.get("attention_bias")), o_bias=bool(cfg.get("attention_bias")))
        )
        if mt == "granitemoehybrid" and (cfg.get("num_local_experts") or 0) > 0:
            ffn: FFNSpec = MoESpec(hidden_size=cfg["hidden_size"], num_experts=cfg["num_local_experts"],
                                   top_k=cfg["num_experts_per_tok"], expert_intermediate=cfg["intermediate_size"],
                                   num_shared=1 if cfg.get("shared_intermediate_size") else 0,
                                   shared_intermediate=cfg.get("shared_intermediate_size") or 0)
        elif mt == "granitemoehybrid":
            ffn = _dense(cfg, inter=cfg.get("shared_intermediate_size") or cfg["intermediate_size"])
        else:
            ffn = _dense(cfg)
        layers.append(LayerSpec(i, mixer, ffn, cfg["hidden_size"]))
    return _spec(cfg, name, mt, layers)


def _parse_nemotron_h(cfg: dict[str, Any], name: str, mt: str) -> ModelSpec:
    kinds = _hybrid_kinds(cfg, cfg.get("num_hidden_layers"))
    cfg = dict(cfg, num_hidden_layers=len(kinds))
    layers = []
    for i, k in enumerate(kinds):
        mixer: MixerSpec | None = None
        ffn: FFNSpec | None = None
        if k == "mamba":
            mixer = _mamba2(cfg)
        elif k == "attention":
            mixer = _gqa(cfg)  # (transformers' Nemotron-H attention has no biases, whatever attention_bias says)
        elif k == "mlp":
            ffn = _dense(cfg, gated=False)
        else:
            if cfg.get("moe_latent_size"):
                raise ConfigError("nemotron_h MoE layers with moe_latent_size are not supported yet")
            # (transformers builds one shared expert of moe_shared_expert_intermediate_size in every MoE layer, of
            # intermediate_size where that is 0 or null: it reads no n_shared_experts)
            shared = cfg.get("moe_shared_expert_intermediate_size") or cfg["intermediate_size"]
            ffn = MoESpec(
                hidden_size=cfg["hidden_size"],
                num_experts=cfg["n_routed_experts"],
                top_k=cfg["num_experts_per_tok"],
                expert_intermediate=cfg["moe_intermediate_size"],
                num_shared=1 if shared else 0,
                shared_intermediate=shared,
                shared_bias=bool(shared) and _mlp_bias(cfg),
                gated=False,
                scoring="sigmoid",
                correction_bias=True,
                n_group=cfg.get("n_group") or 1,
                topk_group=cfg.get("topk_group") or 1,
                norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                routed_scaling=_or_default(cfg, "routed_scaling_factor", 1.0),
            )
        layers.append(LayerSpec(i, mixer, ffn, cfg["hidden_size"]))
    return _spec(cfg, name, mt, layers)


def _parse_sol(cfg: dict[str, Any], name: str, mt: str) -> ModelSpec:
    """waferline's own architecture: per layer a mixer (mla | gqa | mamba2 | dsa | csa | hca) and an FFN
    (dense | moe); the engine runs every combination. dsa is DeepSeek-V3.2's MLA + lightning indexer (``index_*``
    fields); csa / hca are DeepSeek-V4's compressed attention (``sliding_window``, ``compress_rates``, ``o_groups``,
    ``o_lora_rank`` > 0, ``index_*``) on a plain residual, without V4's hyper-connections. Index keys are fp8 + scale
    unless ``index_bits`` says 16 / 32 (or 0 for csa: the KV's precision)."""
    n = cfg["num_hidden_layers"]
    mixers = cfg.get("mixer_types") or ["mla"] * n
    ffns = cfg.get("ffn_types") or ["moe"] * n
    for key, kinds in (("mixer_types", mixers), ("ffn_types", ffns)):
        if not isinstance(kinds, list):
            raise ConfigError(f"sol config: {key} must be a list of num_hidden_layers={n} layer kinds, got {kinds!r}"
                              [:200])
    sigmoid = cfg.get("scoring_func") == "sigmoid"
    method = cfg.get("topk_method") or ("noaux_tc" if sigmoid else "greedy")
    if len(mixers) != n or len(ffns) != n:
        raise ConfigError(
            f"sol config: mixer_types ({len(mixers)}) and ffn_types ({len(ffns)}) must both have "
            f"num_hidden_layers={n} entries"
        )

    def layer(i: int, mixer_kind: str, ffn_kind: str) -> LayerSpec:
        if mixer_kind == "mla":
            mixer: MixerSpec = _mla(cfg)
        elif mixer_kind == "gqa":
            mixer = _gqa(cfg, window=cfg.get("sliding_window") if cfg.get("sliding_window") else None)
        elif mixer_kind == "mamba2":
            mixer = _mamba2(cfg)
        elif mixer_kind == "dsa":
            mixer = _dsa(cfg)
        elif mixer_kind in ("csa", "hca"):
            mixer = _compressed(cfg, mixer_kind)
        else:
            raise ConfigError(f"sol config: layer {i} has mixer {mixer_kind!r}; use mla, gqa, mamba2, dsa, csa or hca")
        if ffn_kind == "dense":
            ffn: FFNSpec = _dense(cfg)
        elif ffn_kind == "moe":
            if method not in ("greedy", "group_limited_greedy", "noaux_tc"):
                raise ConfigError(f"sol config: topk_method {method!r}; use greedy, group_limited_greedy or noaux_tc")
            # (the DeepSeek flavor gives the defaults; norm_topk_prob is the config's for softmax scores too: sol is not
            # transformers' DeepSeek-V2, whose router never renormalises)
            ffn = dataclasses.replace(_deepseek_moe(cfg, "deepseek_v3" if sigmoid else "deepseek_v2"),
                                      norm_topk_prob=bool(cfg.get("norm_topk_prob", sigmoid)))
        else:
            raise ConfigError(f"sol config: layer {i} has ffn {ffn_kind!r}; use dense or moe")
        return LayerSpec(i, mixer, ffn, cfg["hidden_size"])

    layers = [layer(i, m, f) for i, (m, f) in enumerate(zip(mixers, ffns))]
    n_mtp = cfg.get("num_nextn_predict_layers", 0) or 0
    mtp = [layer(n + j, cfg.get("mtp_mixer_type", "mla"), cfg.get("mtp_ffn_type", "dense")) for j in range(n_mtp)]
    return _spec(cfg, name, mt, layers, mtp)


def _parse_glm4_moe(cfg: dict[str, Any], name: str, mt: str) -> ModelSpec:
    n = cfg["num_hidden_layers"]
    first_dense = cfg.get("first_k_dense_replace", 0) or 0
    bias = bool(cfg.get("attention_bias", False))

    def layer(i: int) -> LayerSpec:
        mixer = _gqa(cfg, qkv_bias=bias, qk_norm=bool(cfg.get("use_qk_norm", False)))
        ffn: FFNSpec = (
            _deepseek_moe(dict(cfg, scoring_func="sigmoid", topk_method="noaux_tc"), "deepseek_v3")
            if i >= first_dense
            else _dense(cfg)
        )
        return LayerSpec(i, mixer, ffn, cfg["hidden_size"])

    # the MTP layers (as DeepSeek's: a MoE decoder layer after the last) count for --speculative mtp
    mtp = [layer(n + j) for j in range(cfg.get("num_nextn_predict_layers", 0) or 0)]
    return _spec(cfg, name, mt, [layer(i) for i in range(n)], mtp)


_COMPRESS_RATIO_TYPES = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}


def _parse_deepseek_v4(cfg: dict[str, Any], name: str, mt: str) -> ModelSpec:
    """DeepSeek-V4, as transformers' DeepseekV4Config reads it: per layer CSA / HCA / sliding attention (shared-KV
    MQA, grouped output projection, sinks), ``hc_mult`` hyper-connected residual streams, and a MoE (routed experts
    + one shared expert of ``moe_intermediate_size``, as the reference builds it; the first ``num_hash_layers`` route
    by a token-id table). The indexer keys are held at the KV's precision (the reference's cache) unless the config
    gives ``index_bits``. Not counted: the frozen token -> expert table (a buffer, not a weight)."""
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None and cfg.get("compress_ratios") is not None:
        try:
            types = [_COMPRESS_RATIO_TYPES[int(r)] for r in cfg["compress_ratios"]]
        except KeyError as e:
            raise ConfigError(f"deepseek_v4: compress ratio {e.args[0]} is not 0, 4 or 128") from None
    if types is None:
        types = ["heavily_compressed_attention"] * min(n, 2) + [
            "compressed_sparse_attention" if i % 2 else "heavily_compressed_attention" for i in range(max(n - 2, 0))]
    types = list(types[:n])
    if len(types) != n:
        raise ConfigError(f"deepseek_v4: {len(types)} layer types for num_hidden_layers={n}")
    cfg = dict(cfg, head_dim=cfg.get("head_dim") or 512, index_bits=cfg.get("index_bits", 0))
    rates = dict(cfg.get("compress_rates") or {})
    for key, legacy in (("compressed_sparse_attention", "compress_rate_csa"),
                        ("heavily_compressed_attention", "compress_rate_hca")):
        if cfg.get(legacy):
            rates[key] = cfg[legacy]
    cfg["compress_rates"] = rates
    mlp_types = cfg.get("mlp_layer_types")
    if mlp_types is None:
        n_hash = cfg.get("num_hash_layers")
        n_hash = 3 if n_hash is None else int(n_hash)
        mlp_types = ["hash_moe"] * min(n, n_hash) + ["moe"] * max(0, n - n_hash)
    mlp_types = mlp_types[:n] if isinstance(mlp_types, list) else mlp_types  # (transformers reads the first n)
    if not isinstance(mlp_types, list) or len(mlp_types) != n or any(t not in ("hash_moe", "moe") for t in mlp_types):
        raise ConfigError(f"config mlp_layer_types must be a list of {n} entries 'hash_moe' or 'moe' (one per layer), "
                          f"got {mlp_types!r}"[:300])
    hc = int(cfg.get("hc_mult") or 4)

    def layer(i: int, kind: str, mlp: str) -> LayerSpec:
        ffn = MoESpec(
            hidden_size=cfg["hidden_size"], num_experts=_get(cfg, "n_routed_experts", "num_local_experts"),
            top_k=cfg["num_experts_per_tok"], expert_intermediate=cfg["moe_intermediate_size"],
            num_shared=1, shared_intermediate=cfg["moe_intermediate_size"], shared_bias=_mlp_bias(cfg),
            scoring=cfg.get("scoring_func") or "sqrtsoftplus", correction_bias=mlp != "hash_moe",
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            routed_scaling=_or_default(cfg, "routed_scaling_factor", 1.5))
        return LayerSpec(i, _compressed(cfg, kind), ffn, cfg["hidden_size"], hc_mult=hc)

    layers = [layer(i, types[i], mlp_types[i]) for i in range(n)]
    # the MTP modules (DeepSeek's reference MTPBlock: a whole block of the model, hyper-connected, its attention as the
    # compress ratio listed after the layers' says, sliding-window where none is, its MoE routed by score)
    ratios = list(cfg.get("compress_ratios") or [])
    mtp = [layer(n + j, _COMPRESS_RATIO_TYPES.get(int(ratios[n + j]), "sliding_attention") if n + j < len(ratios)
                 else "sliding_attention", "moe") for j in range(int(cfg.get("num_nextn_predict_layers") or 0))]
    return _spec(cfg, name, mt, layers, mtp)


def _parse_llama4(cfg: dict[str, Any], name: str, mt: str) -> ModelSpec:
    n = cfg["num_hidden_layers"]
    step = cfg.get("interleave_moe_layer_step", 1) or 1
    moe_layers = cfg.get("moe_layers")
    moe_set = set(moe_layers) if moe_layers is not None else {i for i in range(n) if (i + 1) % step == 0}
    # (transformers' Llama 4: a RoPE layer, no_rope_layers[i] == 1, attends within its attention_chunk_size-token
    # chunk; its cache is counted as a window of that size, an upper bound on what a token reads: half on average)
    every = int(cfg.get("no_rope_layer_interval") or 4)  # (transformers' default: every 4th layer global, NoPE)
    rope = cfg.get("no_rope_layers") or [int((i + 1) % every != 0) for i in range(n)]
    chunk = cfg.get("attention_chunk_size", 8192)
    layers = []
    for i in range(n):
        mixer = _gqa(cfg, window=chunk if chunk and rope[i] else None)
        if i in moe_set:
            ffn: FFNSpec = MoESpec(
                hidden_size=cfg["hidden_size"],
                num_experts=cfg["num_local_experts"],
                top_k=cfg["num_experts_per_tok"],
                expert_intermediate=cfg["intermediate_size"],
                num_shared=1,
                shared_intermediate=cfg["intermediate_size"],
                scoring="sigmoid",
            )
        else:
            ffn = _dense(cfg, inter=_get(cfg, "intermediate_size_mlp", "intermediate_size"))
        layers.append(LayerSpec(i, mixer, ffn, cfg["hidden_size"]))
    return _spec(cfg, name, mt, layers)


def _parse_qwen3_next(cfg: dict[str, Any], name: str, mt: str) -> ModelSpec:
    n = cfg["num_hidden_layers"]
    types = _layer_types(cfg, n, [
        "full_attention" if (i + 1) % (cfg.get("full_attention_interval") or 4) == 0 else "linear_attention"
        for i in range(n)
    ], known=("full_attention", "linear_attention"))
    bias = bool(cfg.get("attention_bias", False))
    sparse_step = cfg.get("decoder_sparse_step", 1) or 1
    mlp_only = set(cfg.get("mlp_only_layers") or [])
    layers = []
    for i in range(n):
        if types[i] == "linear_attention":
            mixer: MixerSpec = GatedDeltaNetSpec(
                hidden_size=cfg["hidden_size"],
                num_k_heads=cfg["linear_num_key_heads"],
                num_v_heads=cfg["linear_num_value_heads"],
                head_k_dim=cfg["linear_key_head_dim"],
                head_v_dim=cfg["linear_value_head_dim"],
                conv_kernel=cfg.get("linear_conv_kernel_dim", 4),
                chunk_size=int(cfg.get("linear_chunk_size") or 64),
            )
        else:
            # gated attention: the query projection also produces a per-head output gate (2x q width)
            mixer = _gqa(cfg, qk_norm=True, output_gate=True, qkv_bias=bias, o_bias=bias)
        n_exp = cfg.get("num_experts") or 0
        if i not in mlp_only and n_exp > 0 and (i + 1) % sparse_step == 0:
            ffn: FFNSpec = MoESpec(
                hidden_size=cfg["hidden_size"], num_experts=n_exp, top_k=cfg["num_experts_per_tok"],
                expert_intermediate=cfg["moe_intermediate_size"], num_shared=1,
                shared_intermediate=cfg.get("shared_expert_intermediate_size") or 0, shared_gate=True,
                norm_topk_prob=bool(cfg.get("norm_topk_prob", True)))
        else:
            ffn = _dense(cfg)
        layers.append(LayerSpec(i, mixer, ffn, cfg["hidden_size"]))
    return _spec(cfg, name, mt, layers)


def _kimi_layer_types(cfg: dict[str, Any], n: int) -> list[str]:
    """Per-layer mixer kind of Kimi Linear: ``layer_types`` (transformers), else the hub's ``linear_attn_config``
    (1-based ``full_attn_layers`` / ``kda_layers``), else transformers' default (MLA every 4th layer from layer 4)."""
    types = cfg.get("layer_types")
    lac = cfg.get("linear_attn_config") or {}
    if types is None and "full_attn_layers" in lac and "kda_layers" in lac:
        types = [""] * n
        for j in lac["full_attn_layers"]:
            types[j - 1] = "full_attention"
        for j in lac["kda_layers"]:
            types[j - 1] = "linear_attention"
    if types is None:
        types = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)]
    if len(types) != n:
        raise ConfigError(f"kimi_linear: {len(types)} layer types for num_hidden_layers={n}")
    bad = sorted({t for t in types if t not in ("full_attention", "linear_attention")})
    if bad:
        raise ConfigError(f"kimi_linear: unknown layer type(s) {bad} (known: full_attention, linear_attention)")
    return list(types)


def _parse_kimi_linear(cfg: dict[str, Any], name: str, mt: str) -> ModelSpec:
    """Kimi Linear: KDA linear attention in most layers, MLA without rotary (NoPE) in the others, and a DeepSeek-V3
    style MoE (sigmoid router, correction bias, grouped top-k, shared experts) after the first dense layers. Reads
    transformers' field names and the hub's (``num_experts``, ``num_experts_per_token``, ``moe_renormalize``,
    ``num_expert_group``, ``model_max_length``, ``linear_attn_config``)."""
    n = cfg["num_hidden_layers"]
    d = cfg["hidden_size"]
    lac = cfg.get("linear_attn_config") or {}
    types = _kimi_layer_types(cfg, n)
    mlp_types = cfg.get("mlp_layer_types") or [
        "dense" if i < int(cfg.get("first_k_dense_replace", 1) or 0) else "sparse" for i in range(n)]
    if len(mlp_types) != n:
        raise ConfigError(f"kimi_linear: {len(mlp_types)} mlp_layer_types for num_hidden_layers={n}")
    kda = KimiDeltaSpec(
        hidden_size=d, num_heads=int(_get(cfg, "linear_num_heads", default=lac.get("num_heads", 32))),
        head_dim=int(_get(cfg, "linear_head_dim", default=lac.get("head_dim", 128))),
        conv_kernel=int(_get(cfg, "linear_conv_kernel_dim", default=lac.get("short_conv_kernel_size", 4))),
        chunk_size=int(cfg.get("linear_chunk_size") or 64))
    n_shared = int(_get(cfg, "num_shared_experts", "n_shared_experts", default=1))
    moe = MoESpec(
        hidden_size=d, num_experts=_get(cfg, "num_experts", "num_local_experts"),
        top_k=_get(cfg, "num_experts_per_token", "num_experts_per_tok"),
        expert_intermediate=cfg["moe_intermediate_size"], num_shared=n_shared,
        shared_intermediate=n_shared * cfg["moe_intermediate_size"], scoring="sigmoid", correction_bias=True,
        n_group=int(_get(cfg, "num_expert_group", "n_group", default=1)), topk_group=int(cfg.get("topk_group") or 1),
        norm_topk_prob=bool(_get(cfg, "moe_renormalize", "norm_topk_prob", default=True)),
        routed_scaling=_or_default(cfg, "routed_scaling_factor", 2.446))
    layers = []
    for i in range(n):
        mixer: MixerSpec = kda if types[i] == "linear_attention" else _mla(cfg)
        ffn: FFNSpec = moe if mlp_types[i] == "sparse" else _dense(cfg)
        layers.append(LayerSpec(i, mixer, ffn, d))
    ctx = _get(cfg, "max_position_embeddings", "model_max_length", default=4096)
    return _spec(dict(cfg, max_position_embeddings=ctx), name, mt, layers)


def _parse_jamba(cfg: dict[str, Any], name: str, mt: str) -> ModelSpec:
    n = cfg["num_hidden_layers"]
    a_period, a_off = cfg.get("attn_layer_period", 8), cfg.get("attn_layer_offset", 4)
    e_period, e_off = cfg.get("expert_layer_period", 2), cfg.get("expert_layer_offset", 1)
    d = cfg["hidden_size"]
    d_inner = cfg.get("mamba_expand", 2) * d
    layers = []
    for i in range(n):
        if i % a_period == a_off:
            mixer: MixerSpec = _gqa(cfg)
        else:
            mixer = Mamba1Spec(
                hidden_size=d,
                d_inner=d_inner,
                state_size=cfg.get("mamba_d_state", 16),
                conv_kernel=cfg.get("mamba_d_conv", 4),
                dt_rank=cfg.get("mamba_dt_rank") or math.ceil(d / 16),
            )
        if i % e_period == e_off and (cfg.get("num_experts") or 1) > 1:
            ffn: FFNSpec = MoESpec(hidden_size=d, num_experts=cfg["num_experts"], top_k=cfg["num_experts_per_tok"],
                                   expert_intermediate=cfg["intermediate_size"])
        else:
            ffn = _dense(cfg)
        layers.append(LayerSpec(i, mixer, ffn, d))
    return _spec(cfg, name, mt, layers)


def _parse_step3(cfg: dict[str, Any], name: str, mt: str) -> ModelSpec:
    """StepFun Step-3 (text): MFA attention (low-rank query, one shared K/V head of 256), MoE in the layers listed
    by ``moe_layers_enum`` (routed experts + one shared expert of ``share_expert_dim``), dense elsewhere."""
    n = cfg["num_hidden_layers"]
    enum = cfg.get("moe_layers_enum")
    moe_layers = {int(x) for x in (enum.split(",") if isinstance(enum, str) else enum or []) if str(x).strip()}
    d = cfg["hidden_size"]
    mixer = AttentionSpec(hidden_size=d, num_heads=cfg["num_attention_heads"],
                          num_kv_heads=_get(cfg, "num_attention_groups", "num_key_value_heads", default=1),
                          head_dim=_head_dim(cfg), q_rank=int(cfg.get("share_q_dim") or 0))
    moe = MoESpec(hidden_size=d, num_experts=cfg["moe_num_experts"], top_k=cfg["moe_top_k"],
                  expert_intermediate=cfg["moe_intermediate_size"], num_shared=1,
                  shared_intermediate=int(cfg.get("share_expert_dim") or cfg["moe_intermediate_size"]),
                  norm_topk_prob=bool(cfg.get("norm_expert_weight", False)))
    layers = [LayerSpec(i, mixer, moe if i in moe_layers else _dense(cfg), d) for i in range(n)]
    return _spec(dict(cfg, max_position_embeddings=cfg.get("max_position_embedding") or cfg.get("max_seq_len")),
                 name, mt, layers)


_PARSERS = {
    "llama": lambda c, n: _parse_llama_like(c, n, "llama"),
    "mistral": lambda c, n: _parse_llama_like(c, n, "mistral"),
    "qwen2": lambda c, n: _parse_llama_like(c, n, "qwen2"),
    "qwen3": lambda c, n: _parse_llama_like(c, n, "qwen3"),
    "qwen3_moe": lambda c, n: _parse_llama_like(c, n, "qwen3_moe"),
    "mixtral": lambda c, n: _parse_llama_like(c, n, "mixtral"),
    "deepseek_v2": lambda c, n: _parse_deepseek(c, n, "deepseek_v2"),
    "deepseek_v3": lambda c, n: _parse_deepseek(c, n, "deepseek_v3"),
    "deepseek_v32": lambda c, n: _parse_deepseek(c, n, "deepseek_v32"),
    "deepseek_v4": lambda c, n: _parse_deepseek_v4(c, n, "deepseek_v4"),
    "gpt_oss": lambda c, n: _parse_gpt_oss(c, n, "gpt_oss"),
    "bamba": lambda c, n: _parse_bamba(c, n, "bamba"),
    "granitemoehybrid": lambda c, n: _parse_bamba(c, n, "granitemoehybrid"),
    "nemotron_h": lambda c, n: _parse_nemotron_h(c, n, "nemotron_h"),
    "sol": lambda c, n: _parse_sol(c, n, "sol"),
    "glm4_moe": lambda c, n: _parse_glm4_moe(c, n, "glm4_moe"),
    "llama4": lambda c, n: _parse_llama4(c, n, "llama4"),
    "llama4_text": lambda c, n: _parse_llama4(c, n, "llama4"),
    "qwen3_next": lambda c, n: _parse_qwen3_next(c, n, "qwen3_next"),
    "kimi_linear": lambda c, n: _parse_kimi_linear(c, n, "kimi_linear"),
    "jamba": lambda c, n: _parse_jamba(c, n, "jamba"),
    "step3_text": lambda c, n: _parse_step3(c, n, "step3_text"),
}
SUPPORTED_MODEL_TYPES = tuple(sorted(_PARSERS))


# transformers' config-class defaults of fields a config.json may leave out, where the parsers' and the engine's own
# fallbacks differ (the norm epsilon, sizes, the DeepSeek router and shared experts, Qwen3-MoE's renormalisation, the
# rotary base): an absent field reads as transformers reads it. (A size or setting that rests on others is not here:
# transformers derives it as the parsers do. gpt-oss's yarn settings are rope_parameters without rope_theta, which
# transformers takes from rope_theta where the config gives that alone.)
_DSV3_DEFAULTS = dict(n_shared_experts=1, routed_scaling_factor=2.5, n_group=8, topk_group=4, first_k_dense_replace=3,
                      q_lora_rank=1536)
_HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(max_position_embeddings=2048),
    "qwen3": dict(head_dim=128, max_position_embeddings=32768),
    "qwen3_moe": dict(norm_topk_prob=False, num_key_value_heads=4, max_position_embeddings=32768),
    "mixtral": dict(rms_norm_eps=1e-5, num_key_value_heads=8, max_position_embeddings=131072, rope_theta=1e6),
    "gpt_oss": dict(rms_norm_eps=1e-5, head_dim=64, num_key_value_heads=8, sliding_window=128,
                    max_position_embeddings=131072, rope_theta=150000.0, rope_parameters=dict(
                        rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                        original_max_position_embeddings=4096)),
    "bamba": dict(rms_norm_eps=1e-5, num_key_value_heads=8, max_position_embeddings=262144),
    "granitemoehybrid": dict(rms_norm_eps=1e-6, shared_intermediate_size=1024, attention_multiplier=1.0,
                             max_position_embeddings=2048),
    "nemotron_h": dict(layer_norm_epsilon=1e-5, head_dim=128, num_key_value_heads=8, mamba_head_dim=64, n_groups=8,
                       chunk_size=128, moe_shared_expert_intermediate_size=7688),
    "qwen3_next": dict(num_key_value_heads=2, head_dim=256, shared_expert_intermediate_size=512,
                       max_position_embeddings=32768),
    "kimi_linear": dict(rms_norm_eps=1e-5, model_max_length=1048576),
    "deepseek_v2": dict(n_shared_experts=2, q_lora_rank=1536, max_position_embeddings=2048),
    "deepseek_v3": dict(_DSV3_DEFAULTS, num_nextn_predict_layers=1),
    "deepseek_v32": dict(_DSV3_DEFAULTS, max_position_embeddings=163840),
    "deepseek_v4": dict(o_groups=8, o_lora_rank=1024, num_nextn_predict_layers=1, max_position_embeddings=1048576),
}
_NEVER_NULL = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
MAX_LAYERS = 100_000  # (a config's num_hidden_layers past it is a typo: a list of its layers would fill the memory)
# layer sizes beside the ones above, by config spelling: a whole number >= 1 where given (null: the default where the
# model_type has one); and counts that may be 0 (no shared expert, no dense or MTP layer)
_LAYER_SIZES = ("moe_intermediate_size", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                "mamba_n_heads", "mamba_num_heads", "mamba_n_groups", "n_groups", "mamba_d_state", "ssm_state_size",
                "mamba_d_conv", "mamba_expand", "mamba_chunk_size", "chunk_size", "linear_num_key_heads",
                "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim")
_LAYER_COUNTS = ("n_shared_experts", "first_k_dense_replace", "num_nextn_predict_layers",
                 "shared_intermediate_size", "shared_expert_intermediate_size", "moe_shared_expert_intermediate_size")


def _check_layer_sizes(spec: ModelSpec, mt: str) -> None:
    """Every whole-number size of every layer's mixer and FFN as parsed: an integer >= 0. A value a config gives in a
    field not checked by name here or in _check_accounting (a string, a null, a negative number) would otherwise be a
    traceback or a negative parameter count."""
    for layer in [*spec.layers, *spec.mtp_layers]:
        for part in (layer.mixer, layer.ffn):
            if part is None:
                continue
            for f in dataclasses.fields(part):
                v = getattr(part, f.name)
                if str(f.type).split(" ")[0] != "int" or (v is None and "None" in str(f.type)):
                    continue
                if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                    raise ConfigError(f"config for model_type {mt!r} gives layer {layer.index}'s "
                                      f"{type(part).__name__} {f.name} = {v!r}: it must be an integer >= 0")


def parse_hf_config(cfg: dict[str, Any], name: str | None = None) -> ModelSpec:
    """The ModelSpec of a config.json dict; ConfigError for an unknown model_type, a missing field or sizes that
    make no model (a non-positive or non-integer dimension, no layers)."""
    if not isinstance(cfg, dict):
        raise ConfigError(f"a config.json holds one JSON object, got a {type(cfg).__name__}")
    cfg = _flatten_text_config(cfg)
    mt = cfg.get("model_type")
    if mt is None:
        raise ConfigError("config has no 'model_type'; is this a Hugging Face config.json?")
    if not isinstance(mt, str):  # (a list or an object: no model_type to look up)
        raise ConfigError(f"config model_type must be a string such as 'llama', got {mt!r}"[:200])
    mt = MODEL_TYPE_ALIASES.get(mt, mt)
    parser = _PARSERS.get(mt)
    if parser is None:
        raise ConfigError(f"unsupported model_type {mt!r}; the engine runs {', '.join(sorted(ENGINE_MODEL_TYPES))}; "
                          f"the planner also places {', '.join(sorted(set(_PARSERS) - set(ENGINE_MODEL_TYPES)))}")
    defaulted = set(_HF_DEFAULTS.get(mt, {})) - set(cfg)
    cfg = {**_HF_DEFAULTS.get(mt, {}), **cfg}
    for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size",
              "num_key_value_heads", "head_dim", "max_position_embeddings"):
        v = cfg.get(k)
        null = v is None and k in cfg and k in _NEVER_NULL  # (head_dim, num_key_value_heads: null = the default)
        if null or (v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1)):
            raise ConfigError(f"config {k} must be an integer >= 1, got {'null' if v is None else repr(v)}")
    if isinstance(cfg.get("num_hidden_layers"), int) and cfg["num_hidden_layers"] > MAX_LAYERS:
        raise ConfigError(f"config num_hidden_layers must be an integer from 1 to {MAX_LAYERS:,}, got "
                          f"{cfg['num_hidden_layers']:,}")
    mtp = cfg.get("num_nextn_predict_layers")  # (one more layer each: the same list to fill)
    if isinstance(mtp, int) and not isinstance(mtp, bool) and mtp > MAX_LAYERS:
        raise ConfigError(f"config num_nextn_predict_layers must be an integer from 0 to {MAX_LAYERS:,}, got {mtp:,}")
    for k in _LAYER_SIZES:
        v = cfg.get(k)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ConfigError(f"config {k} must be an integer >= 1, got {v!r}")
    for k in (*_EXPERT_FIELDS, *_TOPK_FIELDS, *_LAYER_COUNTS):  # (0 experts: a dense model where the type allows it)
        v = cfg.get(k)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            raise ConfigError(f"config {k} must be an integer >= 0, got {v!r}")
    _require_expert_count(cfg, mt)
    _check_settings(cfg, mt)
    try:
        spec = parser(cfg, name or cfg.get("_name_or_path") or mt)
    except KeyError as e:
        if not isinstance(e.args[0], (str, tuple)):  # (a list the config gives as an object, indexed by layer)
            raise ConfigError(f"config for model_type {mt!r} cannot be read: no entry {e.args[0]!r}") from None
        raise ConfigError(f"config for model_type {mt!r} is missing the field {_spellings(e.args[0])}") from None
    except (TypeError, ValueError, ZeroDivisionError, IndexError) as e:
        raise ConfigError(f"config for model_type {mt!r} cannot be read: {e}") from None
    _check_accounting(spec, cfg, mt, defaulted)
    _check_layer_sizes(spec, mt)
    if not spec.layers or spec.hidden_size < 1 or spec.vocab_size < 1 or spec.params_total() < 1:
        raise ConfigError(f"config for model_type {mt!r} describes no model ({len(spec.layers)} layers, hidden size "
                          f"{spec.hidden_size}, vocabulary {spec.vocab_size})")
    return spec


def read_config_json(path: str | Path) -> dict[str, Any]:
    """A ``config.json`` file's JSON object; ConfigError (the file named) where it is missing, not valid JSON or not
    an object."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"no config file at {path}")
    try:
        cfg = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):  # (a list, a number: one line, not a traceback where it is read)
        raise ConfigError(f"{path}: a config.json holds one JSON object, got a {type(cfg).__name__}")
    return cfg


def spec_from_config_file(path: str | Path, name: str | None = None) -> ModelSpec:
    """The ModelSpec of a ``config.json`` file (named after its directory unless ``name`` is given)."""
    path = Path(path)
    cfg = read_config_json(path)
    try:
        return parse_hf_config(cfg, name=name or path.parent.name)
    except ConfigError as e:  # (the file named: parse_hf_config sees a dict)
        raise ConfigError(f"{path}: {e}") from None


def spec_from_pretrained(directory: str | Path) -> ModelSpec:
    """The ModelSpec of a Hugging Face checkpoint directory (its ``config.json``)."""
    directory = Path(directory)
    cfg = directory / "config.json"
    if not cfg.is_file():
        if broken_link(cfg):
            raise ConfigError(f"{directory}: {broken_link(cfg)}")
        raise ConfigError(f"{directory} has no config.json: pass a Hugging Face checkpoint directory")
    return spec_from_config_file(cfg, name=directory.name)
