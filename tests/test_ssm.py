"""Mamba2Mixer against the Hugging Face mixers of bamba, nemotron_h and granitemoehybrid (tiny, random, fp32)."""

from __future__ import annotations

import pytest
import torch

from waferline.model.context import StepBatch
from waferline.model.ssm import Mamba2Mixer, hf_mixer_kwargs, hf_mixer_prefix
from waferline.model.weights import WeightSource
from waferline.spec.model import Mamba2Spec

transformers = pytest.importorskip("transformers")
from transformers.cache_utils import Cache, LinearAttentionLayer  # noqa: E402

HIDDEN, HEADS, HEAD_DIM, STATE, GROUPS, CONV, CHUNK = 64, 8, 16, 16, 2, 4, 8
ATOL = 1e-5
FAMILIES = ["bamba", "nemotron_h", "granitemoehybrid"]


def _hf_mixer(family: str):
    """(HF mixer module, config dict) for a one-layer tiny config of ``family``."""
    common = dict(vocab_size=32, hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2)
    if family == "bamba":
        from transformers import BambaConfig
        from transformers.models.bamba.modeling_bamba import BambaMixer as cls

        cfg = BambaConfig(
            **common,
            num_hidden_layers=1,
            attn_layer_indices=[],
            mamba_n_heads=HEADS,
            mamba_d_head=HEAD_DIM,
            mamba_d_state=STATE,
            mamba_n_groups=GROUPS,
            mamba_d_conv=CONV,
            mamba_expand=2,
            mamba_chunk_size=CHUNK,
            mamba_proj_bias=True,
            mamba_conv_bias=True,
            rms_norm_eps=1e-5,
        )
    elif family == "granitemoehybrid":
        from transformers import GraniteMoeHybridConfig
        from transformers.models.granitemoehybrid.modeling_granitemoehybrid import GraniteMoeHybridMambaLayer as cls

        cfg = GraniteMoeHybridConfig(
            **common,
            num_hidden_layers=1,
            layer_types=["mamba"],
            mamba_n_heads=HEADS,
            mamba_d_head=HEAD_DIM,
            mamba_d_state=STATE,
            mamba_n_groups=GROUPS,
            mamba_d_conv=CONV,
            mamba_expand=2,
            mamba_chunk_size=CHUNK,
            mamba_proj_bias=False,
            mamba_conv_bias=True,
            rms_norm_eps=1e-6,
        )
    elif family == "nemotron_h":
        from transformers import NemotronHConfig
        from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer as cls

        # a large time_step_min so that HF's dt clamp (chunked path only) actually bites with the dt_bias below
        cfg = NemotronHConfig(
            **common,
            head_dim=16,
            layers_block_type=["linear_attention"],
            mamba_num_heads=HEADS,
            mamba_head_dim=HEAD_DIM,
            ssm_state_size=STATE,
            n_groups=GROUPS,
            conv_kernel=CONV,
            expand=2,
            chunk_size=CHUNK,
            use_bias=False,
            use_conv_bias=True,
            time_step_min=0.05,
            layer_norm_epsilon=1e-5,
        )
    else:  # pragma: no cover
        raise ValueError(family)
    torch.manual_seed(0)
    hf = cls(cfg, layer_idx=0).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # HF init leaves these trivially constant: randomise so the test can fail
        hf.A_log.copy_(torch.empty(HEADS).uniform_(-1.0, 1.5, generator=g))
        lo, hi = (-5.0, 0.5) if family == "nemotron_h" else (-2.0, 1.0)
        hf.dt_bias.copy_(torch.empty(HEADS).uniform_(lo, hi, generator=g))
        hf.D.copy_(torch.randn(HEADS, generator=g))
        hf.norm.weight.copy_(1.0 + 0.3 * torch.randn(hf.norm.weight.shape, generator=g))
        if hf.conv1d.bias is not None:
            hf.conv1d.bias.copy_(0.2 * torch.randn(hf.conv1d.bias.shape, generator=g))
        if hf.in_proj.bias is not None:
            hf.in_proj.bias.copy_(0.1 * torch.randn(hf.in_proj.bias.shape, generator=g))
            hf.out_proj.bias.copy_(0.1 * torch.randn(hf.out_proj.bias.shape, generator=g))
    return hf, cfg.to_dict()


def _spec(family: str, cfg: dict) -> Mamba2Spec:
    if family == "nemotron_h":
        return Mamba2Spec(hidden_size=HIDDEN, num_heads=HEADS, head_dim=HEAD_DIM, state_size=STATE, n_groups=GROUPS,
                          conv_kernel=CONV, conv_bias=cfg["use_conv_bias"], proj_bias=cfg["use_bias"],
                          chunk_size=cfg["chunk_size"], time_step_limit=tuple(cfg["time_step_limit"]),
                          norm_eps=cfg["layer_norm_epsilon"])
    return Mamba2Spec(hidden_size=HIDDEN, num_heads=HEADS, head_dim=HEAD_DIM, state_size=STATE, n_groups=GROUPS,
                      conv_kernel=CONV, conv_bias=cfg["mamba_conv_bias"], proj_bias=cfg["mamba_proj_bias"],
                      chunk_size=cfg["mamba_chunk_size"], time_step_limit=tuple(cfg["time_step_limit"]),
                      norm_eps=cfg["rms_norm_eps"])


def _ours(family: str, hf, cfg: dict, layer: int = 3, **overrides) -> Mamba2Mixer:
    """Our mixer loaded from the HF mixer's weights, as they would sit in a full checkpoint at ``layer``."""
    prefix = hf_mixer_prefix(family, layer)
    src = WeightSource.from_dict({prefix + k: v.detach().clone() for k, v in hf.state_dict().items()})
    # (the dt clamp of the installed transformers' mixer: nemotron_h's changed in 5.25)
    overrides.setdefault("time_step_limit", tuple(float(v) for v in hf.time_step_limit))
    mixer = Mamba2Mixer(_spec(family, cfg), **(hf_mixer_kwargs(family, cfg) | overrides))
    mixer.load_hf(src, prefix)
    assert src.unused() == []
    return mixer


def _hf_cache() -> Cache:
    return Cache(layers=[LinearAttentionLayer()])


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, atol=ATOL, rtol=ATOL)


@pytest.fixture(params=FAMILIES)
def family(request) -> str:
    return request.param


@torch.no_grad()
def test_prefill_then_decode_matches_hf(family):
    hf, cfg = _hf_mixer(family)
    ours = _ours(family, hf, cfg)
    x = torch.randn(2, 26, HIDDEN, generator=torch.Generator().manual_seed(2))
    cache = ours.new_cache(4)
    slots = [2, 0]
    hf_cache = _hf_cache()
    # 1. prefill of 21 tokens: three chunks of 8, the last one partial
    _close(ours(x[:, :21], cache, StepBatch.make(slots, [0, 0], 21)), hf(x[:, :21], cache=hf_cache))
    _close(cache.ssm[slots], hf_cache.layers[0].recurrent_states[0])
    _close(cache.conv[slots], hf_cache.layers[0].conv_states[0][..., 1:])  # HF keeps K columns, we keep K-1
    # 2. five decode steps
    for t in range(21, 26):
        _close(ours(x[:, t:t + 1], cache, StepBatch.make(slots, [t, t], 1)), hf(x[:, t:t + 1], cache=hf_cache))
    _close(cache.ssm[slots], hf_cache.layers[0].recurrent_states[0])


@torch.no_grad()
def test_chunked_prefill_continues_from_state(family):
    hf, cfg = _hf_mixer(family)
    ours = _ours(family, hf, cfg)
    x = torch.randn(1, 21, HIDDEN, generator=torch.Generator().manual_seed(3))
    one, two = ours.new_cache(2), ours.new_cache(2)
    full = ours(x, one, StepBatch.make([1], [0], 21))
    part = torch.cat(
        [ours(x[:, :13], two, StepBatch.make([1], [0], 13)), ours(x[:, 13:], two, StepBatch.make([1], [13], 8))], 1
    )
    _close(part, full)
    _close(two.ssm, one.ssm)
    _close(two.conv, one.conv)
    # HF's own continuation path agrees too
    hf_cache = _hf_cache()
    hf_part = torch.cat([hf(x[:, :13], cache=hf_cache), hf(x[:, 13:], cache=hf_cache)], 1)
    _close(part, hf_part)


@torch.no_grad()
def test_short_prompts_and_continuations_below_conv_kernel(family):
    """T=2 (< conv_kernel-1 new inputs) fresh and continued, against a single prefill."""
    hf, cfg = _hf_mixer(family)
    ours = _ours(family, hf, cfg)
    x = torch.randn(1, 7, HIDDEN, generator=torch.Generator().manual_seed(4))
    a, b = ours.new_cache(1), ours.new_cache(1)
    full = ours(x, a, StepBatch.make([0], [0], 7))
    # (a T=1 part would take the decode path, which for nemotron_h does not clamp dt, as in HF)
    parts = [ours(x[:, i : i + 2], b, StepBatch.make([0], [i], 2)) for i in (0, 2)] + [
        ours(x[:, 4:], b, StepBatch.make([0], [4], 3))
    ]
    _close(torch.cat(parts, 1), full)
    _close(b.ssm, a.ssm)


@torch.no_grad()
def test_rows_do_not_interfere_and_reset(family):
    hf, cfg = _hf_mixer(family)
    ours = _ours(family, hf, cfg)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 11, HIDDEN, generator=g)
    cache = ours.new_cache(4)
    # something unrelated already lives in slot 1
    ours(torch.randn(1, 9, HIDDEN, generator=g), cache, StepBatch.make([1], [0], 9))
    before = (cache.conv[1].clone(), cache.ssm[1].clone())
    both = ours(x[:, :10], cache, StepBatch.make([3, 0], [0, 0], 10))
    step = ours(x[:, 10:], cache, StepBatch.make([3, 0], [10, 10], 1))
    for row, slot in ((0, 3), (1, 0)):
        alone = ours.new_cache(1)
        _close(both[row:row + 1], ours(x[row:row + 1, :10], alone, StepBatch.make([0], [0], 10)))
        _close(step[row:row + 1], ours(x[row:row + 1, 10:], alone, StepBatch.make([0], [10], 1)))
        _close(cache.ssm[slot], alone.ssm[0])
        _close(cache.conv[slot], alone.conv[0])
    assert torch.equal(cache.conv[1], before[0]) and torch.equal(cache.ssm[1], before[1])
    assert cache.ssm[2].abs().max() == 0 and cache.conv[2].abs().max() == 0  # untouched slot
    # reset zeroes exactly the given slots, and a reset slot behaves like a fresh one
    cache.reset(torch.tensor([3]))
    assert cache.ssm[3].abs().max() == 0 and cache.conv[3].abs().max() == 0
    assert cache.ssm[0].abs().max() > 0 and cache.ssm[1].abs().max() > 0
    fresh = ours.new_cache(1)
    _close(ours(x[:1, :10], cache, StepBatch.make([3], [0], 10)), ours(x[:1, :10], fresh, StepBatch.make([0], [0], 10)))


@torch.no_grad()
def test_state_size_is_constant(family):
    hf, cfg = _hf_mixer(family)
    ours = _ours(family, hf, cfg)
    cache = ours.new_cache(2)
    shapes = (tuple(cache.conv.shape), tuple(cache.ssm.shape))
    assert shapes == ((2, ours.spec.conv_dim, CONV - 1), (2, HEADS, HEAD_DIM, STATE))
    assert cache.ssm.dtype == torch.float32
    nbytes = cache.nbytes()
    x = torch.randn(1, 64, HIDDEN, generator=torch.Generator().manual_seed(6))
    n = 0
    for T in (40, 1, 1, 17, 1):
        ours(x[:, n:n + T], cache, StepBatch.make([1], [n], T))
        n += T
        assert (tuple(cache.conv.shape), tuple(cache.ssm.shape)) == shapes and cache.nbytes() == nbytes
    assert nbytes == 2 * ours.spec.state_elems() * 4  # fp32 model: both parts 4 bytes an element


@torch.no_grad()
@pytest.mark.parametrize("clamp", [False, True])
def test_decode_path_equals_scan_path(clamp):
    """Token-by-token decode from an empty state equals one prefill (where HF's dt clamp does not make them differ)."""
    family = "nemotron_h" if clamp else "bamba"
    hf, cfg = _hf_mixer(family)
    ours = _ours(family, hf, cfg, clamp_dt_in_decode=clamp)
    x = torch.randn(2, 19, HIDDEN, generator=torch.Generator().manual_seed(7))
    a, b = ours.new_cache(2), ours.new_cache(2)
    full = ours(x, a, StepBatch.make([0, 1], [0, 0], 19))
    steps = torch.cat([ours(x[:, t:t + 1], b, StepBatch.make([0, 1], [t, t], 1)) for t in range(19)], 1)
    _close(steps, full)
    _close(b.ssm, a.ssm)
    _close(b.conv, a.conv)


@torch.no_grad()
def test_nemotron_h_decode_clamp_differs_from_hf_when_forced():
    """A dt clamp at (time_step_min, inf) really is exercised by these weights (else the tests above could not tell a
    clamp from none): in decode when forced, and in the chunked prefill."""
    hf, cfg = _hf_mixer("nemotron_h")
    x = torch.randn(1, 9, HIDDEN, generator=torch.Generator().manual_seed(8))
    limit = (float(cfg["time_step_min"]), float("inf"))
    outs = []
    for clamp in (False, True):
        ours = _ours("nemotron_h", hf, cfg, time_step_limit=limit, clamp_dt_in_decode=clamp)
        c = ours.new_cache(1)
        ours(x[:, :8], c, StepBatch.make([0], [0], 8))
        outs.append(ours(x[:, 8:], c, StepBatch.make([0], [8], 1)))
    assert (outs[0] - outs[1]).abs().max() > 1e-4
    clamped = _ours("nemotron_h", hf, cfg, time_step_limit=limit)
    free = _ours("nemotron_h", hf, cfg, time_step_limit=(0.0, float("inf")))
    run = [m(x, m.new_cache(1), StepBatch.make([0], [0], 9)) for m in (clamped, free)]
    assert (run[0] - run[1]).abs().max() > 1e-4


@torch.no_grad()
def test_snapshot_restore_and_load_errors():
    hf, cfg = _hf_mixer("bamba")
    ours = _ours("bamba", hf, cfg)
    x = torch.randn(1, 12, HIDDEN, generator=torch.Generator().manual_seed(9))
    cache = ours.new_cache(3)
    ours(x[:, :8], cache, StepBatch.make([2], [0], 8))
    snap = cache.snapshot(torch.tensor([2]))
    first = ours(x[:, 8:], cache, StepBatch.make([2], [8], 4))
    cache.restore(torch.tensor([2]), snap)
    _close(ours(x[:, 8:], cache, StepBatch.make([2], [8], 4)), first)

    from waferline.errors import CheckpointError

    sd = {"model.layers.0.mamba." + k: v for k, v in hf.state_dict().items()}
    sd["model.layers.0.mamba.A_log"] = torch.zeros(HEADS + 1)
    with pytest.raises(CheckpointError, match="A_log"):
        ours.load_hf(WeightSource.from_dict(sd), "model.layers.0.mamba.")
    sd["model.layers.0.mamba.A_log"] = hf.A_log.detach()
    del sd["model.layers.0.mamba.D"]
    with pytest.raises(CheckpointError, match="missing"):
        ours.load_hf(WeightSource.from_dict(sd), "model.layers.0.mamba.")


def _tiny_full_model(family: str):
    common = dict(vocab_size=32, hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2, intermediate_size=32)
    mamba = dict(mamba_n_heads=HEADS, mamba_d_head=HEAD_DIM, mamba_d_state=STATE, mamba_n_groups=GROUPS,
                 mamba_d_conv=CONV, mamba_expand=2, mamba_chunk_size=CHUNK)
    if family == "bamba":
        from transformers import BambaConfig, BambaForCausalLM

        return BambaForCausalLM(BambaConfig(**common, num_hidden_layers=2, attn_layer_indices=[0], **mamba))
    if family == "granitemoehybrid":
        from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

        return GraniteMoeHybridForCausalLM(GraniteMoeHybridConfig(
            **common, num_hidden_layers=2, layer_types=["attention", "mamba"], num_local_experts=2,
            num_experts_per_tok=1, shared_intermediate_size=32, **mamba))
    from transformers import NemotronHConfig, NemotronHForCausalLM

    return NemotronHForCausalLM(NemotronHConfig(
        **common, head_dim=16, layers_block_type=["mlp", "linear_attention"], mamba_num_heads=HEADS,
        mamba_head_dim=HEAD_DIM, ssm_state_size=STATE, n_groups=GROUPS, conv_kernel=CONV, expand=2, chunk_size=CHUNK))


@torch.no_grad()
def test_loads_from_saved_checkpoint_names(family, tmp_path):
    """The mixer of layer 1 of a tiny saved HF model loads by ``hf_mixer_prefix`` (nemotron_h files say
    ``backbone.``)."""
    import json

    from safetensors.torch import load_file

    torch.manual_seed(0)
    model = _tiny_full_model(family).eval()
    layer = model.model.layers[1]
    hf = layer.mixer if family == "nemotron_h" else layer.mamba
    hf.dt_bias.uniform_(-2.0, 1.0)
    hf.A_log.uniform_(-1.0, 1.5)
    hf.D.normal_()
    model.save_pretrained(tmp_path)
    src = WeightSource.from_dict(load_file(str(tmp_path / "model.safetensors")))
    cfg = json.loads((tmp_path / "config.json").read_text())
    prefix = hf_mixer_prefix(family, 1, src)
    assert prefix == ("backbone.layers.1.mixer." if family == "nemotron_h" else "model.layers.1.mamba.")
    kw = hf_mixer_kwargs(family, cfg) | {"time_step_limit": tuple(float(v) for v in hf.time_step_limit)}
    # (config.json spells inf as {"__float__": "Infinity"}; the spec parser is not what is under test here)
    spec = _spec(family, cfg | {"time_step_limit": (0.0, float("inf"))})
    ours = Mamba2Mixer(spec, **kw)
    ours.load_hf(src, prefix)
    x = torch.randn(1, 21, HIDDEN, generator=torch.Generator().manual_seed(10))
    _close(ours(x, ours.new_cache(1), StepBatch.make([0], [0], 21)), hf(x))


@torch.no_grad()
def test_bf16_runs_and_paths_agree():
    hf, cfg = _hf_mixer("granitemoehybrid")
    ours = _ours("granitemoehybrid", hf, cfg).to(torch.bfloat16)
    x = torch.randn(2, 12, HIDDEN, generator=torch.Generator().manual_seed(11)).to(torch.bfloat16)
    a, b = ours.new_cache(2), ours.new_cache(2)
    assert a.conv.dtype == torch.bfloat16 and a.ssm.dtype == torch.float32
    full = ours(x, a, StepBatch.make([0, 1], [0, 0], 12))
    steps = torch.cat([ours(x[:, t:t + 1], b, StepBatch.make([0, 1], [t, t], 1)) for t in range(12)], 1)
    assert full.dtype == steps.dtype == torch.bfloat16
    ref = _ours("granitemoehybrid", hf, cfg)(
        x.float(), _ours("granitemoehybrid", hf, cfg).new_cache(2), StepBatch.make([0, 1], [0, 0], 12)
    )
    assert (full.float() - ref).abs().max() < 0.05 * ref.abs().max()
    assert (steps.float() - ref).abs().max() < 0.05 * ref.abs().max()


@pytest.mark.parametrize("mt", ["bamba", "qwen3_next"])
def test_a_stage_reset_drops_a_verify_trail_whose_rewind_never_came(mt, tmp_path):
    """A pipeline stage (an AFD attention rank alike) keeps a verify's trail until its keep arrives on a later
    micro-batch. A sequence that ends at its verify, its slot given to the next one at once, never sends it (the
    runner drops it at the reset): the reset dropped the ring snapshots but left the Mamba-2 / linear-attention
    trail (the k + 1 states per layer), kept until the slot's next verify, never for a sequence that does not draft."""
    from tiny_models import build
    from waferline.engine.messages import EMIT_NONE, EMIT_TOKEN, Group, MicroBatch
    from waferline.engine.stage import StageRunner
    from waferline.model.load import load_model

    build(mt, tmp_path)
    rt = StageRunner(load_model(tmp_path, torch.float32), 0, 1, torch.device("cpu"))
    rt.begin({"num_slots": 2})
    prompt = list(range(3, 15))
    rt.forward(MicroBatch(1, [Group(12, [0], [0], [0], [EMIT_NONE])]), [torch.tensor([prompt])])
    rt.forward(MicroBatch(2, [Group(4, [0], [0], [12], [EMIT_TOKEN], drafts=[[5, 6, 7]])]),
               [torch.tensor([[20, 5, 6, 7]])])
    assert rt.rollback.rows and any(getattr(c, "trail", None) for c in rt.caches)
    rt.reset_slots([0])
    assert not rt.rollback.rows
    trails = [sorted(c.trail) for c in rt.caches if hasattr(c, "trail")]
    assert trails and not any(trails), trails  # (slots holding a trail, per recurrent layer)
