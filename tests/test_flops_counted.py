"""The spec's FLOPs per decode token (what the planner / simulator compute time is made of) against the FLOPs the
engine executes for one token, counted by torch's FlopCounterMode on tiny random checkpoints."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from conftest import tiny_checkpoints
from waferline import kernels
from waferline.model.context import StepBatch
from waferline.model.load import load_model
from waferline.spec.model import DSASpec, Mamba2Spec

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
def counted(monkeypatch):
    """(model, context) -> (FLOPs per layer, FLOPs of the logits) of one decode token after ``context`` tokens, on
    the eager path (waferline's fused operators off: the counter sees only ATen's operators)."""
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", _sdpa_matmuls)
    prev = kernels.use(False)

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

    yield run
    kernels.use(prev)


def _not_counted(mixer) -> float:
    """What one token's spec FLOPs hold that the counter cannot see, less what the engine computes beyond them, at
    context 0 (the token attends to itself): Mamba-2's state update and readout are elementwise; the engine's MLA
    multiplies the probabilities by whole cached rows (latent and rotary key) and keeps the latent's columns, and
    its indexer weighs the heads' scores with a product."""
    if isinstance(mixer, Mamba2Spec):
        return mixer.attention_flops(0)
    if isinstance(mixer, DSASpec):
        return -2.0 * (mixer.num_heads * mixer.qk_rope_head_dim + mixer.index_n_heads)
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
