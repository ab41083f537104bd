"""AFD on an int4 checkpoint (`waferline quantize`): the attention ranks load its mixers as the one-process loader does
(its codes; layers it keeps 16-bit stay so), each FFN rank the slice of every stored int4 expert tensor that holds its
experts (per-expert keys renamed, fused ``[E, ...]`` codes / scales / zeros sliced), the shared experts and dense FFNs
whole, and the MTP drafter its head; the answers are the single-process engine's on the same checkpoint (the AFD
engine refused int4 checkpoints: "the AFD engine runs 16-bit checkpoints so far")."""

import pytest
import torch

import tiny_models
from waferline import LLM, SamplingParams
from waferline.engine.afd import ExpertSlice, load_attention_side, load_ffn_side, make_layout
from waferline.model.quant import DEFAULT_KEEP, Int4Source, QuantOptions, is_int4, quantize_checkpoint
from waferline.model.weights import WeightSource
from waferline.spec.configs import spec_from_pretrained

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
LOGPROB_TOL = 1e-5


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """int4 checkpoints of tiny random MoE models: DeepSeek-V3 (MLA; layer 0 dense, 1-3 MoE with 8 per-expert-key
    experts and a shared expert), the same with layer 1 kept 16-bit (`quantize --keep`), and Granite-MoE-hybrid
    (Mamba-2 + GQA; fused ``[E, ...]`` expert tensors) quantized asymmetric (zeros as well as scales)."""
    tmp = tmp_path_factory.mktemp("afd_int4")
    tiny_models.build("deepseek_v3", tmp / "dsv3", num_hidden_layers=4)
    tiny_models.build("granitemoehybrid", tmp / "granite")
    out = {"dsv3": tmp / "dsv3-int4", "dsv3-keep": tmp / "dsv3-keep", "granite": tmp / "granite-int4",
           "dsv3-16bit": tmp / "dsv3"}
    quantize_checkpoint(tmp / "dsv3", out["dsv3"], QuantOptions(group_size=32))
    keep = QuantOptions(group_size=32, keep=(r"layers\.1\.", *DEFAULT_KEEP))  # (layer 1 in 16-bit)
    quantize_checkpoint(tmp / "dsv3", out["dsv3-keep"], keep)
    quantize_checkpoint(tmp / "granite", out["granite"], QuantOptions(group_size=32, symmetric=False))
    return out


def _prompts(vocab: int) -> list[list[int]]:
    return [[(i * 7 + j * 3 + 1) % vocab for j in range(n)] for i, n in enumerate([5, 23, 3, 16, 11])]


def _answers(llm: LLM, prompts: list[list[int]]) -> dict:
    return {"greedy": [o.token_ids for o in llm.generate(prompts, GREEDY)],
            "sampled": [o.token_ids for o in llm.generate(prompts[:3], SAMPLED)],
            "lp": llm.prompt_logprobs(prompts[3])}


# (checkpoint, attention ranks M, FFN ranks N, conversion flags)
CASES = [("dsv3", 1, 2, {}), ("dsv3", 2, 1, {}), ("dsv3-keep", 1, 2, {"weight_bits": 4, "head_bits": 8}),
         ("granite", 2, 2, {})]


@pytest.mark.parametrize("name,M,N,flags", CASES, ids=[f"{c}-M{m}-N{n}" for c, m, n, _ in CASES])
def test_afd_on_an_int4_checkpoint_answers_as_one_process(ckpts, name, M, N, flags):
    """Greedy and seeded sampled tokens equal, prompt log-probs within 1e-5 (fp32), against the single-process engine
    on the same int4 checkpoint and flags (weight_bits=4 names what an int4 checkpoint loads as: its kept layer stays
    16-bit, as in one process; head_bits=8 puts the attention ranks' head in int8)."""
    one = LLM(ckpts[name], **flags)
    prompts = _prompts(one.spec.vocab_size)
    ref = _answers(one, prompts)
    if name == "dsv3":  # (the int4 weights answer otherwise than the 16-bit original: the check can fail)
        assert [o.token_ids for o in LLM(ckpts["dsv3-16bit"]).generate(prompts, GREEDY)] != ref["greedy"]
    with LLM(ckpts[name], afd=True, attention_ranks=M, ffn_ranks=N, threads_per_rank=1, **flags) as llm:
        model = llm._pipeline.runner.model
        assert is_int4(model) and (getattr(model, "lm_head_int8", None) is not None) == ("head_bits" in flags)
        got = _answers(llm, prompts)
    where = f"{name} M={M} N={N}"
    assert got["greedy"] == ref["greedy"], where
    assert got["sampled"] == ref["sampled"], where
    diff = (got["lp"] - ref["lp"]).abs().max().item()
    assert diff < LOGPROB_TOL, f"{where}: prompt log-probs differ by {diff:.2e}"


@pytest.mark.parametrize("name", ["dsv3-keep", "granite"])
def test_each_rank_loads_its_part_of_the_int4_checkpoint(ckpts, name):
    """The attention side reads no FFN tensor and holds the checkpoint's int4 mixers; an FFN rank reads only its
    experts' per-expert keys, and holds exactly the one-process model's int4 weights of its experts (a fused tensor's
    slice: codes, scales and zeros), the layers the checkpoint keeps 16-bit in 16-bit."""
    from waferline.model.load import load_model, open_weights

    d = ckpts[name]
    one = load_model(d)
    layout = make_layout(spec_from_pretrained(d), 1, 3)
    src = open_weights(d)
    model, _ = load_attention_side(d, torch.float32, src=src)
    assert not [n for n in src.used if "experts" in n or "shared" in n or "proj" in n and ".mlp." in n]
    for layer, ref in zip(model.layers, one.layers):
        assert is_int4(layer.mixer) == is_int4(ref.mixer)
    assert is_int4(model)
    for rank in range(3):
        src = open_weights(d)
        mods = load_ffn_side(d, torch.float32, rank, layout, src=src)
        read = {int(n.split("experts.")[1].split(".")[0]) for n in src.used if ".experts." in n
                and n.split("experts.")[1][0].isdigit()}
        assert not [n for n in src.used if "attn" in n or "mamba" in n or "embed" in n], rank
        for i, mod in mods.items():
            full = one.layers[i].ffn
            assert is_int4(mod) == is_int4(full), (rank, i)
            if layout.kinds[i] != "moe":
                continue
            e0, e1 = layout.splits[i][rank]
            assert mod.num_experts == e1 - e0
            if name == "dsv3-keep":
                assert read == set(range(e0, e1)), f"FFN rank {rank} read experts {read}"
            for leaf in ("gate_up", "down"):
                q, want = getattr(mod, "q_" + leaf, None), getattr(full, "q_" + leaf, None)
                for j in range(e1 - e0):
                    if want is None:
                        w, ref = getattr(mod, "w_" + leaf), getattr(full, "w_" + leaf)
                        assert q is None and torch.equal(w[j], ref[e0 + j])
                    else:
                        assert torch.equal(q.dequantize(j), want.dequantize(e0 + j)), (rank, i, leaf, j)


def _fused_int4(fmt: str) -> tuple[dict, dict]:
    """One layer's fused int4 experts ``[4, 6, 64]`` in group 32 as ``fmt`` stores them, and the config."""
    torch.manual_seed(0)
    E, N, K, G = 4, 6, 64, 32
    codes = torch.randint(0, 16, (E, N, K), dtype=torch.uint8)
    scales = (torch.rand(E, N, K // G) + 0.5).to(torch.bfloat16)
    base = "model.layers.0.mlp.experts.gate_up_proj"
    router = {"model.layers.0.mlp.gate.weight": torch.randn(E, 64)}
    if fmt == "waferline":
        zeros = torch.randn(E, N, K // G).to(torch.bfloat16)
        packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
        tensors = {base + ".qweight": packed, base + ".scales": scales, base + ".zeros": zeros, **router}
        return tensors, {"quantization_config": {"quant_method": "waferline", "bits": 4, "group_size": G}}
    words = codes.to(torch.int32).view(E, N, K // 8, 8) << torch.arange(0, 32, 4, dtype=torch.int32)
    tensors = {base + ".weight_packed": words.sum(-1, dtype=torch.int64).to(torch.int32),
               base + ".weight_scale": scales, base + ".weight_shape": torch.tensor([E, N, K]), **router}
    group = {"weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": G}}
    return tensors, {"quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                             "config_groups": {"group_0": group}}}


@pytest.mark.parametrize("fmt", ["waferline", "compressed-tensors"])
def test_an_expert_slice_of_fused_int4_experts_slices_every_stored_tensor(fmt):
    """A slice of fused int4 experts reads as the whole tensor's experts e0..e1-1: codes and scales (and zeros) sliced
    along the expert axis, a compressed-tensors ``weight_shape`` [E, N, K] giving the slice's count."""
    tensors, cfg = _fused_int4(fmt)
    name = "model.layers.0.mlp.experts.gate_up_proj.weight"
    whole = Int4Source(WeightSource.from_dict(tensors), cfg).canonical(name)
    view = ExpertSlice(WeightSource.from_dict(tensors), "model.layers.0.mlp.", 1, 3, 4, scope="model.layers.0.")
    part = Int4Source(view, cfg)
    assert part.shape(name) == (2, 6, 64) and view.shape("model.layers.0.mlp.gate.weight") == (2, 64)
    got = part.canonical(name)
    assert torch.equal(got.codes, whole.codes[1:3]) and torch.equal(got.scales, whole.scales[1:3])
    assert (got.zeros is None) == (fmt != "waferline")
    if got.zeros is not None:
        assert torch.equal(got.zeros, whole.zeros[1:3])


def test_the_mtp_drafter_under_afd_on_an_int4_checkpoint(tmp_path):
    """With MTP speculation the AFD engine's drafter loads the int4 checkpoint's MTP head (kept 16-bit in the file, in
    int4 as the layers, as every engine drafts) and the int8 head: seeded sampled tokens are the single-process
    engine's."""
    q = tiny_models.int4_sol_with_mtp(tmp_path)
    prompts = [[7, 8, 9, 10, 11, 12] * 3, list(range(40, 60))]
    sp = SamplingParams(max_tokens=12, temperature=1.0, seed=5, ignore_eos=True)
    with LLM(q, speculative="mtp", head_bits=8) as llm:
        ref = [o.token_ids for o in llm.generate(prompts, sp)]
    with LLM(q, speculative="mtp", head_bits=8, afd=True, ffn_ranks=2, threads_per_rank=1) as llm:
        assert [o.token_ids for o in llm.generate(prompts, sp)] == ref
        drafter = llm._spec.drafter.model
        assert is_int4(drafter.mtp) and drafter.lm_head_int8 is not None
        assert llm._spec.stats.accepted > 0  # (drafts were verified and kept: the drafter ran)
