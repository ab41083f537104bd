"""The spec's FLOPs per decode token (what the planner / simulator compute time is made of) against the FLOPs the
engine executes for one token, counted by torch's FlopCounterMode on tiny random checkpoints; and the simulator's
FLOPs per token an MTP module drafts against the engine's MTP drafter's."""

from types import SimpleNamespace

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from conftest import tiny_checkpoints
from test_speculative import SOL
from tiny_models import configs
from waferline import kernels
from waferline.engine.sampling import SamplingParams
from waferline.engine.speculative.drafters import MTPDrafter
from waferline.model.context import StepBatch
from waferline.model.init import write_random_checkpoint
from waferline.model.load import load_model
from waferline.sim.cost import layer_table
from waferline.sim.pipeline import _with_input_projection
from waferline.spec.model import DSASpec, Mamba2Spec, MLASpec

TYPES = ["qwen3_moe", "qwen3_next", "bamba", "deepseek_v32", "deepseek_v4"]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return tiny_checkpoints(tmp_path_factory, TYPES)


def _sdpa_matmuls(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """torch's fused attention as its two matmuls (the counter does not see into the CPU's fused kernel)."""
    s = torch.matmul(q, k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, float("-inf"))
    return torch.matmul(torch.softmax(s.float(), -1).to(v.dtype), v)


@pytest.fixture
def eager(monkeypatch):
    """The eager path: waferline's fused operators off and torch's fused attention as matmuls (the counter sees only
    ATen's operators)."""
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", _sdpa_matmuls)
    prev = kernels.use(False)
    yield
    kernels.use(prev)


@pytest.fixture
def counted(eager):
    """(model, context) -> (FLOPs per layer, FLOPs of the logits) of one decode token after ``context`` tokens, on
    the eager path."""

    def run(model, context):
        caches = model.new_caches(1)
        torch.manual_seed(0)
        with torch.inference_mode():
            if context:
                model(torch.randint(3, model.spec.vocab_size, (1, context)), caches, StepBatch.make([0], [0], context))
            tok = torch.randint(3, model.spec.vocab_size, (1, 1))
            batch = StepBatch.make([0], [context], 1)
            batch.memo["tokens"] = tok  # (DeepSeek-V4's hash-routed layers)
            h, per_layer = model.embed_tokens(tok), []
            for layer, cache in zip(model.layers, caches):
                with FlopCounterMode(display=False) as fc:
                    h = layer(h, cache, batch)
                per_layer.append(fc.get_total_flops())
            with FlopCounterMode(display=False) as fc:
                model.logits(h[:, 0])
        return per_layer, fc.get_total_flops()

    return run


def _not_counted(mixer, context: int = 0) -> float:
    """What one token's spec FLOPs hold that the counter cannot see, less what the engine computes beyond them,
    after ``context`` tokens (at 0 the token attends to itself): Mamba-2's state update and readout are elementwise;
    the engine's MLA multiplies the probabilities by whole cached rows (latent and rotary key) and keeps the
    latent's columns, and its indexer weighs the heads' scores with a product."""
    n = context + 1  # (tokens attended)
    if isinstance(mixer, Mamba2Spec):
        return mixer.attention_flops(0)
    if isinstance(mixer, MLASpec):
        return -2.0 * mixer.num_heads * mixer.qk_rope_head_dim * n
    if isinstance(mixer, DSASpec):
        return -2.0 * (mixer.num_heads * mixer.qk_rope_head_dim * min(n, mixer.index_topk) + mixer.index_n_heads * n)
    return 0.0


@pytest.mark.parametrize("model_type", TYPES)
def test_spec_flops_match_the_engines_counted_flops(ckpts, counted, model_type):
    """Every matmul of a decode token is in the spec: DeepSeek-V4's hyper-connections (the stream map and mix
    around each part, the head's collapse), DSA's indexer weights_proj and Qwen3-Next's shared-expert gate were
    left out."""
    model = load_model(ckpts[model_type])
    spec = model.spec
    per_layer, head = counted(model, 0)
    for layer, flops in zip(spec.layers, per_layer):
        assert flops == layer.flops_per_token(1) - _not_counted(layer.mixer), (model_type, layer.index)
    assert head == spec.lm_head_flops_per_token()


@pytest.mark.parametrize("model_type", ["qwen3_next", "bamba"])
def test_attention_flops_grow_with_context_as_counted(ckpts, counted, model_type):
    """Attention's score and value FLOPs grow by the spec's per token of context; Mamba-2's and Gated DeltaNet's
    stay constant."""
    model = load_model(ckpts[model_type])
    spec = model.spec
    base = counted(model, 0)[0]
    for context in (7, 64):
        per_layer = counted(model, context)[0]
        for layer, flops, flops0 in zip(spec.layers, per_layer, base):
            assert flops - flops0 == layer.flops_per_token(context + 1) - layer.flops_per_token(1), (context, layer)


# checkpoints with an MTP module (the engine's MTP path: DeepSeek-V2 / V3 / V3.2's and sol's MTP layers; transformers
# drops MTP weights, so these are written by waferline's own writer)
MTP = {
    "deepseek_v3": dict(configs()["deepseek_v3"], model_type="deepseek_v3", num_nextn_predict_layers=1),  # MLA + MoE
    "deepseek_v32": dict(configs()["deepseek_v32"], model_type="deepseek_v32", num_nextn_predict_layers=1),  # DSA
    "sol": SOL,  # MLA + dense, as sol-mini's
    "sol:gqa+moe": dict(SOL, mtp_mixer_type="gqa", mtp_ffn_type="moe"),
    "sol:mamba2": dict(SOL, mtp_mixer_type="mamba2"),
}


@pytest.fixture(scope="module")
def mtp_ckpts(tmp_path_factory):
    return {name: write_random_checkpoint(cfg, tmp_path_factory.mktemp(name.replace(":", "_")), seed=3)
            for name, cfg in MTP.items()}


def _counted_draft(model, context: int) -> int:
    """FLOPs of the engine's MTP drafter proposing one token after ``context`` committed pairs: the MTP module (its
    norms, eh_proj over [embedding, hidden state], its layer) over one (hidden state, token) pair, the shared final
    norm and LM head (the embedding lookup is not a matmul)."""
    torch.manual_seed(0)
    seq = torch.randint(3, model.spec.vocab_size, (context + 2,)).tolist()
    drafter = MTPDrafter(model)
    with torch.inference_mode():
        drafter.begin([seq], [torch.randn(context + 1, model.spec.hidden_size)])  # (the first ``context`` pairs)
        with FlopCounterMode(display=False) as fc:
            (proposal,) = drafter.propose([0], [seq], [1], SamplingParams(temperature=0.0), [None])
    assert len(proposal.tokens) == 1 and drafter.committed[0] == context + 1
    return fc.get_total_flops()


@pytest.mark.parametrize("name", list(MTP))
def test_mtp_draft_flops_match_the_engines_counted_flops(mtp_ckpts, eager, name):
    """What the simulator charges an MTP module for one drafted token (``_draft_time``: the MTP layer with its
    eh_proj, and the LM head) is what the engine's MTP drafter computes, at the same context."""
    model = load_model(mtp_ckpts[name])
    spec = model.spec
    assert len(model.mtp) == 1
    mtp = SimpleNamespace(layers=spec.mtp_layers[:1], name=spec.name + ":mtp")
    for context in (0, 7):
        lc = _with_input_projection(layer_table(mtp, 16, 16, context + 1)[0], spec.hidden_size, 16, 128)
        want = lc.mixer_flops + lc.ffn_flops + spec.lm_head_flops_per_token()
        assert _counted_draft(model, context) == want - _not_counted(spec.mtp_layers[0].mixer, context), context


def _counted_first_draft(model, context: int, n: int) -> int:
    """FLOPs of the engine's MTP drafter's first step after a verify step emitted ``n`` tokens (n - 1 accepted drafts
    and the bonus token), ``context`` + 1 pairs committed before: the pairs of the n emitted tokens through the MTP
    module, the LM head over the last."""
    torch.manual_seed(0)
    D, V = model.spec.hidden_size, model.spec.vocab_size
    seq = torch.randint(3, V, (context + 2,)).tolist()
    drafter = MTPDrafter(model)
    greedy = SamplingParams(temperature=0.0)
    with torch.inference_mode():
        drafter.begin([seq], [torch.randn(context + 1, D)])
        (first,) = drafter.propose([0], [seq], [n - 1], greedy, [None])
        drafter.accepted([0], [seq], [n - 1], [n - 1], torch.randn(1, n, D))
        seq = seq + first.tokens + torch.randint(3, V, (1,)).tolist()
        with FlopCounterMode(display=False) as fc:
            drafter.propose([0], [seq], [1], greedy, [None])
    assert drafter.committed[0] == context + 1 + n
    return fc.get_total_flops()


@pytest.mark.parametrize("name", ["deepseek_v3", "sol:gqa+moe"])  # (a Mamba-2 chunk scans by matmuls)
def test_mtp_first_draft_after_a_verify_runs_over_the_emitted_tokens(mtp_ckpts, eager, name):
    """After a verify step emitted n tokens the engine's MTP drafter runs its layer over all n (their true hidden
    states), its LM head over the last; the simulator's first draft step (``_one_layer_step`` at t = n) charges
    exactly that."""
    from waferline.sim.cost import load_params
    from waferline.sim.pipeline import _one_layer_step
    from waferline.spec.catalog import load_hardware

    model = load_model(mtp_ckpts[name])
    spec = model.spec
    mtp = SimpleNamespace(layers=spec.mtp_layers[:1], name=spec.name + ":mtp")
    mixer = spec.mtp_layers[0].mixer
    context = 5
    for n in (2, 4):
        want = spec.lm_head_flops_per_token()
        end = context + 1 + n  # (the engine scores each of the n against every key up to the last, later ones masked)
        lc = _with_input_projection(layer_table(mtp, 16, 16, end)[0], spec.hidden_size, 16, 128)
        want += n * (lc.mixer_flops + lc.ffn_flops - _not_counted(mixer, end - 1))
        assert _counted_first_draft(model, context, n) == want, n
    # the simulator's step over t positions: its layer's FLOPs t times, the LM head's once, per sequence
    hw = load_hardware("h100-sxm")
    ctx = SimpleNamespace(plan=SimpleNamespace(weight_bits=16), spec=spec, hw=hw,
                          prm=load_params().for_hardware(hw))
    lc = _with_input_projection(layer_table(mtp, 16, 16, 64)[0], spec.hidden_size, 16, 128)
    head_f = spec.lm_head_flops_per_token()
    fl = hw.peak_flops(16) * ctx.prm.flops_eff
    for t in (1.0, 2.5, 4.0):
        step = _one_layer_step(ctx, lc, 1, 3, spec.lm_head_bytes(16), head_f)(t)
        assert step.compute * fl == pytest.approx(3 * (t * (lc.mixer_flops + lc.ffn_flops) + head_f), rel=1e-9)
