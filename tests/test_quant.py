"""W4A16: int4 matmul paths vs dequantized fp32, RTN/GPTQ, import of compressed-tensors and GPTQ checkpoints,
int4 generation vs fp32, the quantize CLI, and file bytes vs the ModelSpec accounting."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tiny_models import build
from waferline import cli, kernels
from waferline.errors import CheckpointError, ConfigError
from waferline.model.context import StepBatch
from waferline.model.load import load_model, open_weights
from waferline.model.quant import (
    Int4Source,
    Int4Weight,
    QuantLinear,
    QuantOptions,
    gptq_quantize,
    pack_nibbles,
    quantize_checkpoint,
    quantize_model,
    rtn_quantize,
    unpack_nibbles,
)
from waferline.model.weights import WeightSource
from waferline.spec.configs import spec_from_pretrained

torch.manual_seed(0)


def _bf16_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Error allowed for a bf16-activation matmul: a few bf16 ulps of sum |x||w| per output."""
    return 2.0 ** -7 * (x.abs().float() @ w.abs().t()) + 1e-6


# ----------------------------------------------------------------------------- matmul paths


CPU_KERNEL = "cpu_waferline" if kernels.available() else "cpu_int4pack"  # ours where the fused operators build


@pytest.mark.parametrize("lead,N,K,G,sym,backend,force", [
    ((), 64, 256, 32, True, CPU_KERNEL, False),        # the kernel
    ((), 64, 128, 128, False, CPU_KERNEL, False),
    ((), 40, 128, 64, False, CPU_KERNEL, False),       # int4pack: N % 16 != 0, padded to 48 for it, sliced back
    ((), 24, 96, 32, False, CPU_KERNEL, False),        # K % 64 == 32: the kernel's 32-input tail
    ((), 24, 96, 48, False, "dequant", False),         # odd group size: dequantise-then-matmul
    ((), 32, 64, 16, True, "dequant", False),          # group 16: the kernels reject it
    ((3,), 32, 128, 32, True, CPU_KERNEL, False),      # stacked experts
    ((3,), 20, 96, 48, False, "dequant", False),
    ((), 40, 128, 64, False, "cpu_int4pack", True),    # ATen's int4pack where waferline's kernel is not built
    ((3,), 32, 128, 32, True, "cpu_int4pack", True),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [5, 20])
def test_int4_matmul_matches_dequantized_fp32(lead, N, K, G, sym, backend, force, dtype, rows):
    w = torch.randn(*lead, N, K)
    t = rtn_quantize(w, G, symmetric=sym, scale_dtype=torch.bfloat16)
    q = Int4Weight(t, backend=backend if force else None)
    assert q.backend == backend
    deq = t.dequantize()
    x = torch.randn(rows, K).to(dtype)
    if not lead:
        y = q.linear(x)
        assert y.dtype == dtype and y.shape == (rows, N)
        ref = x.float() @ deq.t()
        assert ((y.float() - ref).abs() <= _bf16_bound(x, deq)).all()
        assert torch.allclose(q.dequantize(), deq, rtol=2 ** -7, atol=1e-6)
        ql = QuantLinear(q, torch.randn(N).to(dtype), dtype)
        assert ((ql(x).float() - ql.bias.float() - ref).abs() <= 2 * _bf16_bound(x, deq) + 2e-2).all()
    else:
        experts = torch.tensor([2, 0, 2, 1, 0] * (rows // 5))
        y = q.expert_linear(x, experts)
        for m, e in enumerate(experts.tolist()):
            ref = x[m:m + 1].float() @ deq[e].t()
            assert ((y[m:m + 1].float() - ref).abs() <= _bf16_bound(x[m:m + 1], deq[e])).all()
            one = q.expert_linear(x[m:m + 1], e).float()
            assert ((one - y[m:m + 1].float()).abs() <= 2 * _bf16_bound(x[m:m + 1], deq[e])).all()


def test_pack_nibbles_and_rtn_error_bounds():
    codes = torch.randint(0, 16, (7, 64), dtype=torch.uint8)
    assert torch.equal(unpack_nibbles(pack_nibbles(codes)), codes)
    assert pack_nibbles(torch.tensor([[3, 10]], dtype=torch.uint8)).item() == 3 | (10 << 4)
    w = torch.randn(48, 256) * torch.rand(48, 1) * 3
    for sym in (True, False):
        t = rtn_quantize(w, 64, symmetric=sym)
        assert t.codes.dtype == torch.uint8 and int(t.codes.max()) <= 15
        assert (t.zeros is None) == sym and t.scales.shape == (48, 4)
        err = (t.dequantize() - w).abs().view(48, 4, 64)
        step = t.scales.float().unsqueeze(-1)
        assert (err <= 0.5 * step * 1.001 + 2 ** -8 * w.abs().max()).all()  # half a step (+ bf16 rounding of the zero)
        rel = (t.dequantize() - w).norm() / w.norm()
        assert rel < 0.12  # ~ step / sqrt(12) for Gaussian weights


def test_gptq_beats_rtn_on_calibration_activations():
    g = torch.Generator().manual_seed(1)
    K, N = 128, 64
    mix = torch.randn(K, K, generator=g) * torch.logspace(0, -2, K).unsqueeze(0)
    X = torch.randn(2048, K, generator=g) @ mix.t() + 0.05 * torch.randn(2048, K, generator=g)  # correlated inputs
    W = torch.randn(N, K, generator=g) / math.sqrt(K)
    H = X.t() @ X
    for sym in (True, False):
        rtn = rtn_quantize(W, 32, sym).dequantize()
        gq = gptq_quantize(W, H, 32, sym).dequantize()
        e_rtn = (X @ (W - rtn).t()).norm()
        e_gptq = (X @ (W - gq).t()).norm()
        assert e_gptq < 0.8 * e_rtn, (sym, float(e_gptq), float(e_rtn))


# ----------------------------------------------------------------------------- whole models


def _logprobs(model, ids: list[int]) -> torch.Tensor:
    caches = model.new_caches(1)
    h = model(torch.tensor([ids]), caches, StepBatch.make([0], [0], len(ids)))
    return torch.log_softmax(model.logits(h[0]), dim=-1)


def _dequantize_in_place(model):
    """Put every int4 weight of ``model`` back as an ordinary fp weight holding its dequantized matrix."""
    from torch import nn

    from waferline.model.layers import Linear

    for path, owner, leaf in _int4_weights(model):
        if leaf == "weight":
            parent, _, child = path[: -len(".weight")].rpartition(".")
            lin = Linear(owner.in_features, owner.out_features, owner.bias is not None, owner.dtype)
            lin.weight.data.copy_(owner.int4.dequantize())
            if owner.bias is not None:
                lin.bias.data.copy_(owner.bias)
            setattr(model.get_submodule(parent), child, lin)
        else:
            q = getattr(owner, "q_" + leaf[2:])
            setattr(owner, leaf, nn.Parameter(q.dequantize(), requires_grad=False))
            delattr(owner, "q_" + leaf[2:])
    assert not _int4_weights(model)
    return model


def _int4_weights(model):
    out = []
    for name, mod in model.named_modules():
        if isinstance(mod, QuantLinear):
            out.append((f"{name}.weight", mod, "weight"))
        for leaf in ("gate_up", "up", "down"):
            if isinstance(getattr(mod, "q_" + leaf, None), Int4Weight):
                out.append((f"{name}.w_{leaf}", mod, "w_" + leaf))
    return out


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("llama16")
    build("llama", d)
    return d


def test_int4_llama_close_to_fp32_and_exact_vs_dequantized(llama_dir):
    from waferline import LLM, SamplingParams

    ids = [1, 17, 42, 99, 5, 64, 3, 77, 12, 8, 120, 33]
    fp = LLM(str(llama_dir))
    q4 = LLM(str(llama_dir), weight_bits=4, group_size=32)
    assert len(_int4_weights(q4.model)) == 2 * 6  # q, k, v, o, gate_up (fused), down per layer
    a, b = fp.prompt_logprobs(ids), q4.prompt_logprobs(ids)
    drift = (a.exp() * (a - b)).sum(-1)  # KL(fp32 || int4) per position
    assert drift.mean() < 0.04 and drift.max() < 0.1, drift  # g32 RTN on a random tiny model: ~0.03 nats
    # the int4 engine equals an fp32 model holding the dequantized weights, up to bf16 activation rounding
    twin = load_model(llama_dir)
    quantize_model(twin, QuantOptions(group_size=32))
    c = _logprobs(_dequantize_in_place(twin), ids)
    assert (b - c).abs().max() < 5e-2 and (b - c).abs().mean() < 5e-3  # vs ~0.7 / 0.19 for int4 vs fp32
    out_fp = fp.generate([ids], SamplingParams(max_tokens=8))[0].token_ids
    out_q4 = q4.generate([ids], SamplingParams(max_tokens=8))[0].token_ids
    assert len(out_q4) == 8 and out_q4[:2] == out_fp[:2]
    with pytest.raises(ConfigError, match="weight_bits"):
        LLM(str(llama_dir), weight_bits=8)


# ----------------------------------------------------------------------------- imports


def _ct_pack(q_signed: torch.Tensor) -> torch.Tensor:
    """compressed-tensors pack-quantized: value + 8, eight 4-bit values per int32 (value j at bits 4j)."""
    u = (q_signed.to(torch.int32) + 8).view(q_signed.shape[0], -1, 8)
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    return (u << shifts).sum(-1, dtype=torch.int64).to(torch.int32)


def test_import_compressed_tensors_kimi_experts(tmp_path):
    """Kimi K2.6 layout: deepseek_v3 with symmetric group-32 int4 routed experts, everything else 16-bit."""
    d = tmp_path / "kimi"
    build("deepseek_v3", d)
    cfg = json.loads((d / "config.json").read_text())
    tensors = load_file(str(d / "model.safetensors"))
    expert = re.compile(r"mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")
    ref: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    out = {}
    for name, w in tensors.items():
        if not expert.search(name):
            out[name] = w
            continue
        N, K = w.shape
        scale = (w.view(N, K // 32, 32).abs().amax(-1) / 7.5).to(torch.bfloat16)
        q = (
            torch.clamp(torch.round(w.view(N, K // 32, 32) / scale.float().unsqueeze(-1)), -8, 7)
            .to(torch.int8)
            .view(N, K)
        )
        base = name[: -len(".weight")]
        out[base + ".weight_packed"] = _ct_pack(q)
        out[base + ".weight_scale"] = scale
        out[base + ".weight_shape"] = torch.tensor([N, K])
        ref[name] = ((q.float().view(N, K // 32, 32) * scale.float().unsqueeze(-1)).view(N, K), w)
    assert ref
    save_file(out, str(d / "model.safetensors"))
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32},
            }
        },
        "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|down)_proj.*"],
    }
    (d / "config.json").write_text(json.dumps(cfg))
    src = Int4Source(open_weights(d), cfg)
    for name, (deq, orig) in ref.items():
        got = src.canonical(name).dequantize()
        assert torch.equal(got, deq)  # exactly the stored weights
        assert (got - orig).abs().max() <= 0.5 * orig.abs().max() / 7.5 * 1.05
    model = load_model(d)
    moe = model.layers[1].ffn
    assert moe.w_gate_up is None and moe.q_gate_up.shape == (8, 64, 64) and moe.q_down.backend == CPU_KERNEL
    for e in range(8):
        p = f"model.layers.1.mlp.experts.{e}."
        want = torch.cat([ref[p + "gate_proj.weight"][0], ref[p + "up_proj.weight"][0]])
        assert torch.allclose(moe.q_gate_up.dequantize(e), want, rtol=2 ** -7, atol=1e-6)
        assert torch.allclose(moe.q_down.dequantize(e), ref[p + "down_proj.weight"][0], rtol=2 ** -7, atol=1e-6)
    assert not isinstance(model.layers[1].mixer.o_proj, QuantLinear)  # attention stays 16-bit, as in the file
    ids = [3, 9, 27, 81, 5, 17, 33]
    twin = _dequantize_in_place(load_model(d))
    assert (_logprobs(model, ids) - _logprobs(twin, ids)).abs().max() < 5e-2


def _gptq_pack_rows(q: torch.Tensor) -> torch.Tensor:
    """[K, N] 4-bit values -> int32 [K/8, N]: value k = 8i + j at bits 4j of row i."""
    K, N = q.shape
    shifts = torch.arange(0, 32, 4, dtype=torch.int64).view(1, 8, 1)
    v = (q.to(torch.int64).view(K // 8, 8, N) << shifts).sum(1)
    return torch.where(v >= 1 << 31, v - (1 << 32), v).to(torch.int32)


def _gptq_pack_cols(q: torch.Tensor) -> torch.Tensor:
    return _gptq_pack_rows(q.t().contiguous()).t().contiguous()


@pytest.mark.parametrize("checkpoint_format", ["gptq", "gptq_v2"])
def test_import_gptq_checkpoint(tmp_path, llama_dir, checkpoint_format):
    d = tmp_path / "gptq"
    d.mkdir()
    cfg = json.loads((llama_dir / "config.json").read_text())
    tensors = load_file(str(llama_dir / "model.safetensors"))
    G = 32
    out, ref = {}, {}
    for name, w in tensors.items():
        if not re.search(r"layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight$", name):
            out[name] = w
            continue
        N, K = w.shape
        wg = w.t().reshape(K // G, G, N)
        lo, hi = wg.amin(1), wg.amax(1)
        scale = ((hi - lo) / 15).to(torch.float16)
        zp = torch.clamp(torch.round(-lo / scale.float()), 0, 15)
        q = torch.clamp(torch.round(wg / scale.float().unsqueeze(1)) + zp.unsqueeze(1), 0, 15).reshape(K, N)
        base = name[: -len(".weight")]
        out[base + ".qweight"] = _gptq_pack_rows(q)
        out[base + ".qzeros"] = _gptq_pack_cols(zp - (1 if checkpoint_format == "gptq" else 0))
        out[base + ".scales"] = scale
        out[base + ".g_idx"] = (torch.arange(K) // G).to(torch.int32)
        deq = ((q.view(K // G, G, N) - zp.unsqueeze(1)) * scale.float().unsqueeze(1)).reshape(K, N).t()
        ref[name] = (deq, w)
    save_file(out, str(d / "model.safetensors"))
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": G, "desc_act": False, "sym": False,
                                  "checkpoint_format": checkpoint_format}
    (d / "config.json").write_text(json.dumps(cfg))
    src = Int4Source(open_weights(d), cfg)
    for name, (deq, orig) in ref.items():
        got = src.canonical(name).dequantize()
        assert torch.allclose(got, deq, rtol=1e-6, atol=1e-6)
        assert (got - orig).abs().max() < 0.1 * orig.abs().max()
    model = load_model(d)
    attn = model.layers[0].mixer
    assert isinstance(attn.q_proj, QuantLinear) and isinstance(attn.k_proj, QuantLinear)
    k_ref = ref["model.layers.0.self_attn.k_proj.weight"][0]  # the kernel holds scale and zero in bf16:
    assert (attn.k_proj.weight - k_ref).abs().max() <= 2 ** -7 * k_ref.abs().max()
    ids = [1, 2, 3, 4, 5, 6]
    twin = _dequantize_in_place(load_model(d))
    assert (_logprobs(model, ids) - _logprobs(twin, ids)).abs().max() < 5e-2
    # act-order (permuted g_idx) is refused with a clear message
    out["model.layers.0.self_attn.q_proj.g_idx"] = torch.randperm(64).to(torch.int32) // G
    save_file(out, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match="act-order"):
        load_model(d)


def _gptq_source(q: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None, qc: dict):
    """An Int4Source over one GPTQ linear ``l`` (q: 4-bit values [K, N], packed here by rows as GPTQ stores them)."""
    t = {"l.qweight": _gptq_pack_rows(q), "l.qzeros": qzeros, "l.scales": scales}
    if g_idx is not None:
        t["l.g_idx"] = g_idx.to(torch.int32)
    return Int4Source(WeightSource.from_dict(t), {"quantization_config": {"quant_method": "gptq", "bits": 4, **qc}})


def _gptq_reference(q, zp, scales, g_idx):
    """GPTQModel's dequantize_weight: scales[g_idx] * (q - zeros[g_idx]), as [N, K]."""
    return (scales.float()[g_idx] * (q.float() - zp.float()[g_idx])).t()


def test_gptq_v1_zero_point_of_zero_reads_as_gptqmodel_writes_it():
    # GPTQModel writes a v1 file as the v2 int32 words minus 0x11111111 (convert_gptq_v2_to_v1_format_module), so a
    # zero point of 0 borrows from the next one: zeros 0..7 are the v2 word 0x76543210 and the v1 word 0x654320FF
    v2, v1 = 0x76543210, 0x654320FF
    assert _gptq_pack_cols(torch.arange(8).view(1, 8)).item() == v2 and (v2 - 0x11111111) & 0xFFFFFFFF == v1
    torch.manual_seed(1)
    K, N, G = 64, 16, 32
    q = torch.randint(0, 16, (K, N))
    zp = torch.randint(1, 16, (K // G, N))
    zp[0, :8] = torch.arange(8)
    zp[1, 11] = 0
    scales = (torch.rand(K // G, N) * 0.01 + 0.001).to(torch.float16)
    g_idx = torch.arange(K) // G
    want = _gptq_reference(q, zp, scales, g_idx)
    words_v2 = _gptq_pack_cols(zp)
    assert words_v2[0, 0].item() == v2
    for fmt, qzeros in (("gptq_v2", words_v2), ("gptq", words_v2 - 0x11111111)):
        got = _gptq_source(q, qzeros, scales, g_idx, {"checkpoint_format": fmt, "group_size": G}).canonical("l.weight")
        assert torch.allclose(got.dequantize(), want, rtol=1e-6, atol=1e-7), fmt


def test_gptq_format_is_read_from_format_as_transformers_and_gptqmodel_read_it():
    # transformers' GPTQConfig and GPTQModel name the layout "format" ("checkpoint_format" being the older name)
    torch.manual_seed(2)
    K, N, G = 64, 16, 32
    q = torch.randint(0, 16, (K, N))
    scales = (torch.rand(K // G, N) * 0.01 + 0.001).to(torch.float16)
    zp = torch.full((K // G, N), 8)
    g_idx = torch.arange(K) // G
    got = _gptq_source(q, _gptq_pack_cols(zp), scales, g_idx, {"format": "gptq_v2", "group_size": G})
    assert torch.allclose(got.canonical("l.weight").dequantize(), _gptq_reference(q, zp, scales, g_idx), rtol=1e-6,
                          atol=1e-7)
    for fmt in ("marlin", "bitblas"):  # other layouts of the codes: refused by name, not read as the GPTQ one
        with pytest.raises(CheckpointError, match=f"checkpoint_format '{fmt}'"):
            _gptq_source(q, _gptq_pack_cols(zp), scales, g_idx, {"checkpoint_format": fmt})


@pytest.mark.parametrize("with_g_idx", [True, False])
def test_gptq_last_group_shorter_than_the_group_size(with_g_idx):
    # K = 96 in groups of 64 (GPTQModel's g_idx = k // group_size): one group of 64, then one of 32
    torch.manual_seed(3)
    K, N, G = 96, 16, 64
    q = torch.randint(0, 16, (K, N))
    zp = torch.randint(1, 16, (2, N))
    scales = (torch.rand(2, N) * 0.01 + 0.001).to(torch.float16)
    g_idx = torch.arange(K) // G
    src = _gptq_source(q, _gptq_pack_cols(zp - 1), scales, g_idx if with_g_idx else None, {"group_size": G})
    got = src.canonical("l.weight")
    assert got.group_size == 32
    assert torch.allclose(got.dequantize(), _gptq_reference(q, zp, scales, g_idx), rtol=1e-6, atol=1e-7)


# compressed-tensors' own pack_to_int32(q, 4) of q[r, k] = (3k + 5r) % 16 - 8 (K = 32), from compressed-tensors 0.20.1
_CT_WORDS = [[0x52FC9630, 0xDA741EB8, 0x52FC9630, 0xDA741EB8], [0xA741EB85, 0x2FC9630D, 0xA741EB85, 0x2FC9630D]]


def _ct_source(tensors: dict, G: int):
    qc = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                           "group_size": G}}}}
    return Int4Source(WeightSource.from_dict(tensors), {"quantization_config": qc})


def test_compressed_tensors_codes_read_as_the_library_packs_them():
    k = torch.arange(32)
    q = torch.stack([(3 * k + 5 * r) % 16 - 8 for r in range(2)])
    words = torch.tensor([[w - (1 << 32) if w >= 1 << 31 else w for w in row] for row in _CT_WORDS], dtype=torch.int32)
    assert torch.equal(_ct_pack(q), words)
    scale = torch.tensor([[0.5], [0.25]], dtype=torch.bfloat16)
    src = _ct_source({"l.weight_packed": words, "l.weight_scale": scale, "l.weight_shape": torch.tensor([2, 32])}, 32)
    assert torch.equal(src.canonical("l.weight").dequantize(), q.float() * scale.float())


@pytest.mark.parametrize("G", [32, 64, 128])
def test_compressed_tensors_checkpoint_written_by_the_library(G):
    ct = pytest.importorskip("compressed_tensors.compressors.pack_quantized")
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    torch.manual_seed(4)
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=G)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    tensors, want = {}, {}
    for i, (N, K) in enumerate([(48, 256), (256, 128), (40, 384)]):
        w = torch.randn(N, K)
        scale, _ = calculate_qparams(w.view(N, K // G, G).amin(-1), w.view(N, K // G, G).amax(-1), args)
        c = ct.PackedQuantizationCompressor.compress({"weight": w, "weight_scale": scale.to(torch.bfloat16)}, scheme)
        tensors.update({f"l{i}.{k}": v for k, v in c.items()})
        codes = ct.unpack_from_int32(c["weight_packed"], 4, c["weight_shape"])
        want[f"l{i}.weight"] = dequantize(codes, c["weight_scale"].float(), None, args, dtype=torch.float32)
        lib = ct.PackedQuantizationCompressor.decompress(c, scheme)["weight"]  # the library's, in the scale's bf16
        assert torch.equal(want[f"l{i}.weight"].to(torch.bfloat16), lib)
    src = _ct_source(tensors, G)
    for name, w in want.items():
        assert torch.equal(src.canonical(name).dequantize(), w)


@pytest.mark.parametrize("K,G", [(96, 64), (100, 32), (48, 64), (128, 32)])
def test_compressed_tensors_last_group_shorter_than_the_group_size(K, G):
    """llm-compressor quantizes a weight whose K inputs the group size does not divide in ceil(K/G) groups, the last
    one short; its scales read as equal groups (K / ceil(K/G) inputs each: 48 for K = 96, G = 64) gave other weights
    than the file's."""
    torch.manual_seed(5)
    N, n = 8, -(-K // G)
    w = torch.randn(N, K)
    scale = torch.stack([w[:, g * G:(g + 1) * G].abs().amax(-1) / 7.5 for g in range(n)], -1).to(torch.bfloat16)
    per_input = scale.float().repeat_interleave(G, -1)[:, :K]
    q = torch.clamp(torch.round(w / per_input), -8, 7)
    packed = _ct_pack(torch.nn.functional.pad(q, (0, -K % 8)))  # (a row padded to whole int32 words)
    src = _ct_source({"l.weight_packed": packed, "l.weight_scale": scale, "l.weight_shape": torch.tensor([N, K])}, G)
    assert torch.equal(src.canonical("l.weight").dequantize(), q * per_input)


# ----------------------------------------------------------------------------- the quantize CLI and the accounting


# a writer killed while it writes the int4 file (as `waferline demo` / `twin` are, by a SIGKILL or the OOM killer)
_KILLED_WRITING = """
import os, signal, sys
import safetensors.torch as st
from waferline.model.quant import QuantOptions, quantize_checkpoint
real = st.save_file
def save_file(tensors, path, metadata=None):
    real(dict(list(tensors.items())[:2]), path, metadata=metadata)  # part of it, then the kill
    os.kill(os.getpid(), signal.SIGKILL)
st.save_file = save_file
quantize_checkpoint(sys.argv[1], sys.argv[2], QuantOptions(group_size=32))
"""


def test_a_writer_killed_part_way_leaves_no_copy_behind_once_the_next_has_written(tmp_path, llama_dir):
    """The int4 copies `demo`, `twin` and `calibrate` make go through a temporary directory beside the output; one
    whose writer was killed stayed there for good (the next run wrote the output, and no run looked again). The next
    writer removes it; the temporary directory of a writer still running is left alone."""
    import os
    import socket
    import subprocess
    import sys

    out = tmp_path / "q4"
    run = subprocess.run([sys.executable, "-c", _KILLED_WRITING, str(llama_dir), str(out)], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == -9, run.stderr
    killed = list(tmp_path.glob(".q4.tmp-*"))
    assert len(killed) == 1 and not out.exists()
    live = tmp_path / f".q4.tmp-{socket.gethostname()}-{os.getpid()}-running"  # (this process: a writer alive)
    live.mkdir()
    elsewhere = tmp_path / f".q4.tmp-{socket.gethostname()}x-4194305-other"  # another host's: not judged here
    elsewhere.mkdir()
    quantize_checkpoint(llama_dir, out, QuantOptions(group_size=32))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, elsewhere.name, "q4"])
    assert load_model(out).spec.num_layers == spec_from_pretrained(llama_dir).num_layers


def test_quantize_cli_end_to_end(tmp_path, llama_dir, capsys):
    out = tmp_path / "q4"
    assert cli.main(["quantize", "--model", str(llama_dir), "--out", str(out), "--group-size", "32", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["tensors_int4"] == 14 and summary["bytes_out"] < 0.5 * summary["bytes_in"]
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "waferline" and qc["group_size"] == 32 and "lm_head" in qc["always_16bit"]
    assert not list(tmp_path.glob(".q4.tmp-*"))  # the temporary directory was renamed into place
    assert cli.main(["generate", "--model", str(out), "--prompt-ids", "1 2 3", "--max-tokens", "4", "--json"]) == 0
    gen = json.loads(capsys.readouterr().out)
    assert len(gen["token_ids"]) == 4
    # --weight-bits 4 on the 16-bit checkpoint quantizes on load (RTN)
    assert cli.main(["generate", "--model", str(llama_dir), "--prompt-ids", "1 2 3", "--max-tokens", "4", "--json",
                     "--weight-bits", "4", "--group-size", "32"]) == 0
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) == 4
    # refuses to overwrite, to re-quantize, and GPTQ without calibration; each with exit status 2
    assert cli.main(["quantize", "--model", str(llama_dir), "--out", str(out), "--json"]) == 2
    assert cli.main(["quantize", "--model", str(out), "--out", str(tmp_path / "again"), "--json"]) == 2
    assert cli.main(["quantize", "--model", str(llama_dir), "--out", str(tmp_path / "g"), "--method", "gptq"]) == 2
    err = capsys.readouterr().err
    assert "--force" in err and "already quantized" in err and "--calibration" in err
    # GPTQ with token-id calibration, asymmetric, through the CLI (progress bar on stderr)
    calib = tmp_path / "calib.txt"
    calib.write_text(" ".join(str(int(t)) for t in torch.randint(3, 128, (600,))))
    assert cli.main(["quantize", "--model", str(llama_dir), "--out", str(tmp_path / "g"), "--method", "gptq",
                     "--calibration", str(calib), "--asymmetric", "--group-size", "32"]) == 0
    assert "wrote" in capsys.readouterr().out
    m = load_model(tmp_path / "g")
    assert m.layers[0].mixer.q_proj.int4.symmetric is False


@pytest.mark.parametrize("G,sym", [(32, True), (64, False)])
def test_int4_file_bytes_match_modelspec_accounting(tmp_path, G, sym):
    from waferline.demo import SOL_DEMO_CONFIG
    from waferline.model.init import write_random_checkpoint

    src = write_random_checkpoint(SOL_DEMO_CONFIG, tmp_path / "sol")
    s = quantize_checkpoint(src, tmp_path / "sol4", QuantOptions(group_size=G, symmetric=sym))
    tensors = load_file(str(tmp_path / "sol4" / "model.safetensors"))
    data = sum(t.numel() * t.element_size() for t in tensors.values())
    spec = spec_from_pretrained(src)
    assert data == spec.weight_bytes(4, G, zeros=not sym)
    assert data < 0.4 * spec.weight_bytes(16)
    assert s["modules_not_quantized"] == ["model.layers.2.self_attn.kv_b_proj.weight",
                                          "model.layers.5.self_attn.kv_b_proj.weight"]
    assert s["not_in_file_layout"] == []  # (kept by the default --keep, not by the layout)
    assert tensors["model.layers.2.self_attn.kv_b_proj.weight"].dtype == torch.bfloat16
    if G != 32:
        return
    # the sol model (Mamba-2, MLA, MoE + shared expert) runs int4 and matches its dequantized twin (bf16 activation
    # rounding can flip a near-tie in the routers, so compare the mean; int4 vs fp32 itself drifts ~0.15 here)
    model = load_model(tmp_path / "sol4")
    assert len(_int4_weights(model)) == 36
    twin = _dequantize_in_place(load_model(tmp_path / "sol4"))
    ids = list(range(3, 40))
    assert (_logprobs(model, ids) - _logprobs(twin, ids)).abs().mean() < 1e-2


def test_gpt_oss_fused_experts_are_int4_in_the_file_stored_transposed(tmp_path):
    """gpt-oss's fused experts keep the input dimension on axis -2 (``gate_up_proj [E, D, 2I]``): the file stores
    them with their last two axes swapped (listed in quantization_config's "transposed"), they load back as the codes
    quantize_model makes from the same 16-bit checkpoint, and the dequantized view keeps the checkpoint's layout."""
    build("gpt_oss", tmp_path / "g")
    f = str(tmp_path / "g" / "model.safetensors")  # a bf16 checkpoint: both sides start from the same values
    save_file({k: v.to(torch.bfloat16) for k, v in load_file(f).items()}, f, metadata={"format": "pt"})
    s = quantize_checkpoint(tmp_path / "g", tmp_path / "g4", QuantOptions(group_size=32))
    assert s["not_in_file_layout"] == [] and s["modules_not_quantized"] == []
    experts = [f"model.layers.{i}.mlp.experts.{w}" for i in (0, 1) for w in ("down_proj", "gate_up_proj")]
    cfg = json.loads((tmp_path / "g4" / "config.json").read_text())
    assert cfg["quantization_config"]["transposed"] == experts
    tensors = load_file(str(tmp_path / "g4" / "model.safetensors"))
    assert not set(experts) & set(tensors)
    assert tensors[experts[1] + ".qweight"].shape == (4, 64, 32) and tensors[experts[1] + ".scales"].shape == (4, 64, 2)
    data = sum(t.numel() * t.element_size() for t in tensors.values())
    spec = spec_from_pretrained(tmp_path / "g")
    assert data == spec.weight_bytes(4, 32)  # (the expert biases 16-bit)
    layer0 = sum(t.numel() * t.element_size() for k, t in tensors.items()
                 if k.startswith("model.layers.0.mlp.experts."))
    assert layer0 == 4 * spec.layers[0].ffn.expert_bytes(4, 32)  # (what the planner places per expert)
    src = Int4Source(open_weights(tmp_path / "g4"), cfg)
    w16 = load_file(f)[experts[1]].float()
    assert src.get(experts[1]).shape == w16.shape == (4, 64, 64)
    assert (src.get(experts[1]) - w16).abs().max() < w16.abs().max() / 8  # its own layout: int4 error (<= 1/15)
    m4 = load_model(tmp_path / "g4")
    ref = load_model(tmp_path / "g")
    quantize_model(ref, QuantOptions(group_size=32))
    assert len(_int4_weights(m4)) == len(_int4_weights(ref)) == 2 * 6
    for i in (0, 1):
        for leaf in ("q_gate_up", "q_down"):
            a, b = getattr(m4.layers[i].ffn, leaf), getattr(ref.layers[i].ffn, leaf)
            if a.backend in ("dequant", "cpu_waferline"):  # (the ATen kernels' layouts are opaque)
                ta, tb = a.int4_tensor(), b.int4_tensor()
                assert torch.equal(ta.codes, tb.codes) and torch.equal(ta.scales, tb.scales)
            assert torch.equal(a.dequantize(), b.dequantize())
    ids = list(range(3, 40))
    assert (_logprobs(m4, ids) - _logprobs(ref, ids)).abs().max() < 1e-5


def test_a_group_that_does_not_divide_k_halves_and_the_accounting_counts_its_scales(tmp_path):
    """docs/w4a16.md: a weight whose K the group size does not divide takes the largest halving of G that does (the
    config records the G asked for, the loader reads each tensor's own), and the ModelSpec accounting counts the
    scales the file holds (gpt-oss's K = 2880 at the default 128: groups of 64)."""
    build("mixtral", tmp_path / "m")  # experts' w2: K = intermediate_size = 48, not a multiple of 32
    s = quantize_checkpoint(tmp_path / "m", tmp_path / "m4", QuantOptions(group_size=32))
    assert s["modules_not_quantized"] == []
    cfg = json.loads((tmp_path / "m4" / "config.json").read_text())
    assert cfg["quantization_config"]["group_size"] == 32
    tensors = load_file(str(tmp_path / "m4" / "model.safetensors"))
    w2 = "model.layers.0.block_sparse_moe.experts.0.w2"
    assert tensors[w2 + ".scales"].shape == (64, 3)  # groups of 16
    assert load_model(tmp_path / "m4").layers[0].ffn.q_down.group_size == 16
    data = sum(t.numel() * t.element_size() for t in tensors.values())
    spec = spec_from_pretrained(tmp_path / "m")
    assert data == spec.weight_bytes(4, 32)
    expert = sum(t.numel() * t.element_size() for k, t in tensors.items()
                 if k.startswith("model.layers.0.block_sparse_moe.experts.0."))
    # w1, w3 [48, 64] in groups of 32 and w2 [64, 48] in groups of 16: codes, then bf16 scales
    assert expert == spec.layers[0].ffn.expert_bytes(4, 32) == 3 * 48 * 64 // 2 + 2 * 48 * 2 * 2 + 64 * 3 * 2


@pytest.mark.parametrize("model_type,G,sym,overrides", [
    ("llama", 32, False, {"intermediate_size": 72}),  # down_proj: no group of 32 or 16 divides K = 72: 16-bit
    ("gpt_oss", 128, True, {}),  # every K < 128: one group per row; the experts' biases 16-bit
    ("deepseek_v3", 32, True, {}),  # MLA (q_b_proj: K = 48, groups of 16; kv_b_proj kept 16-bit), a shared expert
    ("deepseek_v32", 32, False, {}),  # + the lightning indexer
    ("granitemoehybrid", 32, True, {}),  # Mamba-2, a shared expert of width 48
    ("qwen3_next", 32, True, {}),  # gated DeltaNet (value width 48), gated attention, a gated shared expert
    ("kimi_linear", 32, True, {}),  # KDA, NoPE MLA
    ("deepseek_v4", 32, False, {}),  # compressed attention, its indexer, a grouped output (K = 48), hyper-connections
    ("deepseek_v2", 32, True, {"mlp_bias": True}),  # biases on the dense FFN and the shared experts (16-bit)
    ("nemotron_h", 32, True, {"mlp_bias": True, "use_bias": True}),  # + Mamba-2 projection biases; relu² experts
])
def test_int4_file_bytes_equal_the_accounting(tmp_path, model_type, G, sym, overrides):
    """The planner's int4 bytes are the file's, each matrix's groups as ``waferline quantize`` sizes them (DeepSeek-V4's
    token -> expert tables are buffers, not weights: not counted)."""
    build(model_type, tmp_path / "m", **overrides)
    s = quantize_checkpoint(tmp_path / "m", tmp_path / "m4", QuantOptions(group_size=G, symmetric=sym))
    tensors = load_file(str(tmp_path / "m4" / "model.safetensors"))
    data = sum(t.numel() * t.element_size() for k, t in tensors.items() if not k.endswith(".tid2eid"))
    assert data == spec_from_pretrained(tmp_path / "m").weight_bytes(4, G, zeros=not sym)
    if model_type == "llama":
        assert s["modules_not_quantized"] == [f"model.layers.{i}.mlp.down_proj.weight" for i in (0, 1)]


def test_an_int4_file_names_the_weights_its_layout_cannot_hold(tmp_path, capsys):
    """A tensor not named ``X.weight`` is stored only transposed: transformers' fused expert save
    (``experts.gate_up_proj [E, 2I, D]``, the input dimension last) stays 16-bit in the file, and quantize says so."""
    from waferline.model.quant_commands import _print_summary

    build("qwen3_moe", tmp_path / "q")
    f = str(tmp_path / "q" / "model.safetensors")
    t = load_file(f)
    for i in (0, 1):
        p = f"model.layers.{i}.mlp.experts."
        n = sorted({int(k[len(p):].split(".")[0]) for k in t if k.startswith(p)})
        t[p + "gate_up_proj"] = torch.stack([torch.cat([t.pop(f"{p}{e}.gate_proj.weight"),
                                                        t.pop(f"{p}{e}.up_proj.weight")]) for e in n])
        t[p + "down_proj"] = torch.stack([t.pop(f"{p}{e}.down_proj.weight") for e in n])
    save_file(t, f, metadata={"format": "pt"})
    s = quantize_checkpoint(tmp_path / "q", tmp_path / "q4", QuantOptions(group_size=32))
    assert sorted(s["not_in_file_layout"]) == [f"layers.{i}.ffn.{w}" for i in (0, 1) for w in ("w_down", "w_gate_up")]
    _print_summary(s)
    assert "4 matmuls the int4 file cannot hold" in capsys.readouterr().out
    assert len(_int4_weights(load_model(tmp_path / "q4"))) == 2 * 4  # the attention projections


def test_an_fp16_checkpoint_written_int4_keeps_its_fp16_tensors_and_loads_as_quantized_on_load(tmp_path, llama_dir):
    """The 16-bit tensors of an fp16 checkpoint (embeddings, head, norms) were rounded to bf16 in
    the int4 file: it loaded as another model than the one quantized on load (log-probs ~0.02 apart)."""
    from waferline import LLM

    src = shutil.copytree(llama_dir, tmp_path / "fp16")
    f = str(src / "model.safetensors")
    save_file({k: v.to(torch.float16) for k, v in load_file(f).items()}, f, metadata={"format": "pt"})
    quantize_checkpoint(src, tmp_path / "q4", QuantOptions(group_size=32))
    tensors = load_file(str(tmp_path / "q4" / "model.safetensors"))
    assert {tensors[k].dtype for k in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight")} == {
        torch.float16}
    ids = [1, 17, 42, 99, 5, 64, 3, 77, 12, 8, 120, 33]
    for dtype in ("float32", "float16"):
        assert torch.equal(LLM(tmp_path / "q4", dtype=dtype).prompt_logprobs(ids),
                           LLM(src, dtype=dtype, weight_bits=4, group_size=32).prompt_logprobs(ids)), dtype


@pytest.mark.parametrize("bad", ["transposed", "three groups", "integer"])
def test_int4_scales_of_another_layout_are_a_checkpoint_error(tmp_path, llama_dir, bad):
    """Scales that do not fit their codes ([K/G, N] as GPTQ lays them out, a group that does not divide K, integer
    scales) raised a RuntimeError from a reshape deep in the load, or loaded as zeros."""
    out = tmp_path / "q4"
    quantize_checkpoint(llama_dir, out, QuantOptions(group_size=32))
    f = str(out / "model.safetensors")
    t = load_file(f)
    name = "model.layers.0.mlp.up_proj.scales"
    t[name] = {"transposed": t[name].t(), "three groups": torch.cat([t[name]] * 2, -1)[:, :3],
               "integer": t[name].to(torch.int32)}[bad].contiguous()
    save_file(t, f, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"up_proj\.weight' has scales of shape .* need float scales"):
        load_model(out)


def test_quantize_model_keeps_requested_modules_16bit(llama_dir):
    m = load_model(llama_dir)
    res = quantize_model(m, QuantOptions(group_size=32, keep=(r"layers\.1\.", r"\.w_down$")))
    assert res["quantized"] == 5 and isinstance(m.layers[0].mixer.o_proj, QuantLinear)
    assert m.layers[0].ffn.w_down is not None and not isinstance(m.layers[1].mixer.q_proj, QuantLinear)
    with pytest.raises(ConfigError, match="only 4-bit"):
        quantize_model(m, QuantOptions(bits=3))


def test_an_int4_kv_b_proj_gives_its_absorbed_weights_once(tmp_path):
    """An int4 kv_b_proj (--quantize-kv-b, or an imported checkpoint that quantizes it) makes its weight from its codes
    at each read: MLA's kept W_UK / W_UV, stamped with that fresh tensor, were made again at every call (a dequantize
    and two copies per MLA layer per decode step)."""
    from waferline.model.attention import MLAttention

    build("deepseek_v3", tmp_path)
    m = load_model(tmp_path)
    quantize_model(m, QuantOptions(group_size=32, keep=()))
    mla = next(x for x in m.modules() if isinstance(x, MLAttention))
    assert isinstance(mla.kv_b_proj, QuantLinear)
    first = mla.absorbed()
    assert mla.absorbed() is first and torch.equal(first[0], mla.absorbed()[0])


def test_move_model_repacks_int4_weights_exactly_for_the_device():
    # a model whose int4 weights were packed for another backend is repacked for the target device's kernel from
    # the exact codes, scales and zeros (a GPU gets tinygemm's layout this way; here: dequant -> this CPU's kernel)
    from torch import nn

    from waferline.model.quant import Int4Weight, QuantLinear, choose_backend, move_model

    g = torch.Generator().manual_seed(0)
    asym = rtn_quantize(torch.randn(48, 256, generator=g), 64, symmetric=False)
    sym = rtn_quantize(torch.randn(3, 32, 128, generator=g), 64)  # stacked experts
    root = nn.Module()
    root.proj = QuantLinear(Int4Weight(asym, "cpu", backend="dequant"))
    root.experts = Int4Weight(sym, "cpu", backend="dequant")
    x = torch.randn(5, 256, generator=g).to(torch.bfloat16)
    before = root.proj(x).float()
    assert move_model(root, "cpu") is root
    want = choose_backend(torch.device("cpu"), 256, 64)
    assert root.proj.int4.backend == want and root.experts.backend == choose_backend(torch.device("cpu"), 128, 64)
    for mod, t in ((root.proj.int4, asym), (root.experts, sym)):
        got = mod.int4_tensor() if mod.backend in ("dequant", "cpu_waferline") else None
        if got is not None:
            assert torch.equal(got.codes, t.codes) and torch.equal(got.scales, t.scales)
            assert (got.zeros is None) == (t.zeros is None) and (t.zeros is None or torch.equal(got.zeros, t.zeros))
        assert torch.equal(mod.dequantize(), t.dequantize())
    ref = x.float() @ asym.dequantize().t()
    assert (root.proj(x).float() - ref).abs().max() <= 0.05 * ref.abs().max() + (before - ref).abs().max()
    # an opaque kernel layout cannot be read back: moving it elsewhere says so
    opaque = nn.Module()
    opaque.w = Int4Weight(asym, "cpu", backend="cpu_int4pack")
    if choose_backend(torch.device("cpu"), 256, 64) != "cpu_int4pack":
        with pytest.raises(ConfigError, match="cannot be repacked"):
            move_model(opaque, "cpu")


def test_int4_checkpoint_bound_for_another_device_loads_readable_codes(tmp_path, llama_dir, capsys):
    # an int4 checkpoint loaded for a GPU keeps plain nibbles (loading_for), which move_model repacks exactly; loaded
    # for the CPU it is packed for this CPU's kernel, as always
    from waferline.model.quant import loading_for, move_model

    out = tmp_path / "q4"
    assert cli.main(["quantize", "--model", str(llama_dir), "--out", str(out), "--group-size", "32", "--json"]) == 0
    capsys.readouterr()
    plain = load_model(out)
    with loading_for("cuda"):  # (only the layout is chosen here: no GPU is touched)
        bound = load_model(out)
    with loading_for("cpu"):
        cpu = load_model(out)

    def weights(m):
        return {n: w for n, w in m.named_modules() if isinstance(w, Int4Weight)}

    assert len(weights(bound)) == len(weights(plain)) > 0 and {w.backend for w in weights(bound).values()} == {
        "dequant"
    }
    assert {w.backend for w in weights(cpu).values()} == {w.backend for w in weights(plain).values()} != {"dequant"}
    move_model(bound, "cpu")
    for name, w in weights(bound).items():
        ref = weights(plain)[name]
        assert w.backend == ref.backend
        assert torch.equal(w.dequantize(), ref.dequantize())


def test_quantize_refuses_what_it_cannot_do_before_the_work(tmp_path, llama_dir, capsys):
    """A group size outside the supported ones, an --out that cannot be written, calibration ids past the vocabulary,
    a --keep that keeps every weight, and a negative token budget: one-line errors, nothing written."""
    with pytest.raises(ConfigError, match="group size must be one of 16, 32, 64, 128, 256"):
        QuantOptions(group_size=48).validate()
    with pytest.raises(SystemExit):
        cli.main(["quantize", "--model", str(llama_dir), "--out", str(tmp_path / "q"), "--group-size", "48"])
    assert "invalid choice: 48" in capsys.readouterr().err
    blocker = tmp_path / "file.txt"
    blocker.write_text("x")
    assert cli.main(["quantize", "--model", str(llama_dir), "--out", str(blocker / "q")]) == 2
    assert "cannot write" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="no weight was quantized"):
        quantize_checkpoint(llama_dir, tmp_path / "kept", QuantOptions(keep=(".*",)))
    calib = tmp_path / "ids.txt"
    calib.write_text(" ".join(["99999"] * 64))
    assert cli.main(["quantize", "--model", str(llama_dir), "--out", str(tmp_path / "g"), "--method", "gptq",
                     "--calibration", str(calib)]) == 2
    assert "token ids past the vocabulary" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["quantize", "--model", str(llama_dir), "--out", str(tmp_path / "g"), "--method", "gptq",
                  "--calibration", str(calib), "--calibration-tokens", "-5"])
    assert "expected an integer >= 1, got -5" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.txt", "ids.txt"]  # (nothing half-written)
    # a source that cannot load is said before any progress bar is drawn (an empty bar came first)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text('{"model_type": "llama"}')
    assert cli.main(["quantize", "--model", str(bad), "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "num_hidden_layers" in err and len(err.strip().splitlines()) == 1
    (bad / "config.json").write_text((llama_dir / "config.json").read_text())  # (a config, no weight files)
    assert cli.main(["quantize", "--model", str(bad), "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "quantize rtn" not in err and len(err.strip().splitlines()) == 1


def test_quantize_a_config_json_that_is_not_a_json_object_is_one_line(tmp_path, capsys):
    """A config.json holding a list (or any JSON that is not an object): one line naming the file, as generate, serve,
    plan and demo say it (quantize was an AttributeError traceback from reading its quantization_config)."""
    bad = tmp_path / "bad"
    bad.mkdir()
    for text in ("[]", "3"):
        (bad / "config.json").write_text(text)
        assert cli.main(["quantize", "--model", str(bad), "--out", str(tmp_path / "q")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and "config.json holds one JSON object" in err, err
        assert len(err.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad"]


def test_quantize_out_dot_is_refused_before_the_work(tmp_path, llama_dir, capsys, monkeypatch):
    """`quantize --out .` (the current directory, empty) quantized the whole checkpoint, then failed with a ValueError
    traceback (a directory named '.' cannot be renamed into place) and left a temporary directory in it."""
    import waferline.model.load as load_mod

    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    monkeypatch.setattr(load_mod, "load_model", lambda *a, **k: pytest.fail("loaded before --out was checked"))
    for out in (".", "..", "sub/.."):
        assert cli.main(["quantize", "--model", str(llama_dir), "--out", out, "--json"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: --out ") and len(err.strip().splitlines()) == 1, err
    assert list(here.iterdir()) == []


def test_quantize_out_a_link_to_nothing_is_refused_before_the_work(tmp_path, llama_dir, capsys, monkeypatch):
    """An --out that is a symbolic link to a path that does not exist passed the checks, the whole checkpoint was
    quantized, then the rename onto the link failed: "cannot write OUT: Not a directory"."""
    import waferline.model.load as load_mod

    link = tmp_path / "q4"
    link.symlink_to(tmp_path / "gone")
    monkeypatch.setattr(load_mod, "load_model", lambda *a, **k: pytest.fail("loaded before --out was checked"))
    for force in ([], ["--force"]):
        assert cli.main(["quantize", "--model", str(llama_dir), "--out", str(link), "--json", *force]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: --out ") and "symbolic link" in err and len(err.strip().splitlines()) == 1, err
    with pytest.raises(ConfigError, match="symbolic link"):
        quantize_checkpoint(llama_dir, link, QuantOptions(group_size=32))
    assert link.is_symlink() and sorted(p.name for p in tmp_path.iterdir()) == ["q4"]


def test_weights_kept_16bit_are_listed_one_name_each(tmp_path):
    """quantization_config's "modules_not_quantized" (and the summary's) held one comma-joined string per kept
    matmul ("...experts.0.down_proj.weight, ...experts.1.down_proj.weight, ...") where several checkpoint tensors
    feed it: not names a reader can look up."""
    build("qwen3_moe", tmp_path / "m")
    s = quantize_checkpoint(tmp_path / "m", tmp_path / "m4", QuantOptions(group_size=32, keep=(r"layers\.1\.mlp",)))
    qc = json.loads((tmp_path / "m4" / "config.json").read_text())["quantization_config"]
    names = set(load_file(str(tmp_path / "m4" / "model.safetensors")))
    expected = sorted(n for n in names if n.startswith("model.layers.1.mlp.experts.") and n.endswith("_proj.weight"))
    assert expected and qc["modules_not_quantized"] == s["modules_not_quantized"] == expected


def test_quantize_checkpoint_refuses_an_out_that_would_destroy_the_model(tmp_path, llama_dir):
    """The Python API checks ``out`` as the CLI does: with ``force=True`` and an ``out`` holding the model it wrote
    the int4 checkpoint there and deleted the source checkpoint (then failed reading its size), and an ``out`` naming
    a file was a NotADirectoryError traceback."""
    import shutil

    model = tmp_path / "models" / "llama"
    shutil.copytree(llama_dir, model)
    note = tmp_path / "todo.txt"
    note.write_text("keep me")
    for out, message in ((tmp_path / "models", "contains --model"), (tmp_path, "contains --model"),
                         (note, "is a file")):
        for force in (True, False):
            with pytest.raises(ConfigError, match=message):
                quantize_checkpoint(model, out, QuantOptions(group_size=32), force=force)
    assert sorted(p.name for p in model.iterdir()) == sorted(p.name for p in llama_dir.iterdir())
    assert note.read_text() == "keep me" and sorted(p.name for p in tmp_path.iterdir()) == ["models", "todo.txt"]
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["llama"]


def test_a_calibration_file_of_ids_with_a_stray_word_is_a_one_line_error(tmp_path, llama_dir, capsys):
    """A token-id calibration file holding a non-integer past its first ids was a ValueError traceback from int()."""
    calib = tmp_path / "ids.txt"
    calib.write_text(" ".join(["5"] * 1200) + " 12.5\n")
    assert cli.main(["quantize", "--model", str(llama_dir), "--out", str(tmp_path / "g"), "--method", "gptq",
                     "--calibration", str(calib), "--json"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "'12.5'" in err and len(err.strip().splitlines()) == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ids.txt"]


def test_too_few_calibration_tokens_are_said_as_the_option_not_the_file(tmp_path, llama_dir, capsys):
    """--calibration-tokens 2 with a file of 600 ids said "calibration file ... gives only 10 tokens" (the file is read
    only as far as the budget needs), while --calibration-tokens 10 ran GPTQ on 10 tokens: both are now refused as
    the option, whatever the file."""
    calib = tmp_path / "ids.txt"
    calib.write_text(" ".join(str(3 + i % 100) for i in range(600)))
    for n in ("2", "10", "15"):
        assert cli.main(["quantize", "--model", str(llama_dir), "--out", str(tmp_path / "g"), "--method", "gptq",
                         "--calibration", str(calib), "--calibration-tokens", n, "--json"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: calibration tokens must be >= 16") and f"got {n}" in err, err
        assert len(err.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ids.txt"]


def test_quantize_refuses_a_calibration_file_or_architecture_it_cannot_use_before_loading(tmp_path, llama_dir, capsys,
                                                                                          monkeypatch):
    """GPTQ's calibration file was read only after the whole model had loaded (and the progress bar was drawn): a file
    of too few tokens, or text for a checkpoint without a tokenizer, failed after that; so did a model_type the
    planner places but the engine cannot load. Each is now a one-line error before the model loads."""
    import shutil

    import waferline.model.load as load_mod

    monkeypatch.setattr(load_mod, "load_model", lambda *a, **k: pytest.fail("loaded before the inputs were checked"))
    (tmp_path / "few.txt").write_text("5 6 7")
    (tmp_path / "text.txt").write_text("some words of text, and the checkpoint has no tokenizer")
    for calib, message in (("few.txt", "gives only 3 tokens"), ("text.txt", "has no tokenizer")):
        with pytest.raises(ConfigError, match=message):
            quantize_checkpoint(llama_dir, tmp_path / "g", QuantOptions(method="gptq"), str(tmp_path / calib))
        assert cli.main(["quantize", "--model", str(llama_dir), "--out", str(tmp_path / "g"), "--method", "gptq",
                         "--calibration", str(tmp_path / calib)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1, err
    planner_only = tmp_path / "mistral"
    shutil.copytree(llama_dir, planner_only)
    cfg = json.loads((planner_only / "config.json").read_text())
    (planner_only / "config.json").write_text(json.dumps(dict(cfg, model_type="mistral", sliding_window=None)))
    assert cli.main(["quantize", "--model", str(planner_only), "--out", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "planner-only" in err and len(err.strip().splitlines()) == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["few.txt", "mistral", "text.txt"]
