"""The engine's device path (what a GPU runs; on CPU, what runs without waferline's fused operators): torch's fused
attention and RMSNorm in place of the matmul/softmax and pow/mean/rsqrt chains, the same numbers as the Hugging Face
reference, and the operation count of a decode step that a GPU launches one kernel per operation for
(benchmarks/step_launches.py)."""

import pytest
import torch

from conftest import script_module
from tiny_models import build, configs
from waferline import LLM, SamplingParams, kernels
from waferline.model.attention import attend, attend_chain, attend_prefill_cpu, attend_sdpa
from waferline.model.layers import RMSNorm


@pytest.fixture
def device_path():
    prev = kernels.use(False)
    yield
    kernels.use(prev)


@pytest.mark.parametrize("T, masked", [(1, False), (1, True), (5, True), (5, False)])
def test_fused_attention_is_attends_chain(T, masked):
    g = torch.Generator().manual_seed(T)
    B, H, Hkv, D, L = 2, 8, 2, 16, 13
    q = torch.randn(B, T, H, D, generator=g)
    kv = torch.randn(B, L, 2 * Hkv, D, generator=g)  # a cache's rows: keys then values, token-major
    k, v = kv[:, :, :Hkv], kv[:, :, Hkv:]
    blocked = None
    if masked:  # causal at each row's own offset, row 1 also blind to its first 3 keys (a padded row)
        pos = torch.tensor([[L - T + t for t in range(T)], [L - T - 2 + t for t in range(T)]])
        blocked = torch.arange(L)[None, None, :] > pos[:, :, None]
        blocked[1, :, :3] = True
    want = attend_chain(q, k, v, blocked, 0.25)  # matmuls, masked softmax, matmuls in fp32
    for got in (attend_sdpa(q, k, v, blocked, 0.25), attend_prefill_cpu(q, k, v, blocked, 0.25)):
        assert got.shape == want.shape == (B, T, H, D)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    if T > 1:  # a prefill chunk on a CPU with the fused operators: torch's fused attention in fp32 (a 16-bit cache too)
        torch.testing.assert_close(attend(q, k, v, blocked, 0.25), want, atol=1e-5, rtol=1e-5)
        half = attend(q.bfloat16(), k.bfloat16(), v.bfloat16(), blocked, 0.25)
        ref = attend_chain(q.bfloat16(), k.bfloat16(), v.bfloat16(), blocked, 0.25)
        assert half.dtype == torch.bfloat16
        torch.testing.assert_close(half.float(), ref.float(), atol=1e-2, rtol=1e-2)
    # multi-query over latents whose first channels are the values (MLA): attended over the keys, the values kept
    lat = kv[:, :, :1]
    want = attend_chain(q, lat, lat[..., : D // 2], blocked, 0.25)
    got = attend(q, lat, lat[..., : D // 2], blocked, 0.25)  # (T > 1: attend_prefill_cpu; T = 1: the chain)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    prev = kernels.use(False)
    try:
        got = attend(q, lat, lat[..., : D // 2], blocked, 0.25)  # the device path: attend_sdpa
    finally:
        kernels.use(prev)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_on_the_device_path_is_the_references(device_path, dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(0)).to(dtype)
    ours, ref = RMSNorm(64, 1e-5, dtype), LlamaRMSNorm(64, eps=1e-5).to(dtype)
    w = torch.rand(64, generator=torch.Generator().manual_seed(1)).to(dtype) + 0.5
    ours.weight.copy_(w)
    with torch.no_grad():
        ref.weight.copy_(w)
        assert torch.equal(ours(x), ref(x))  # bitwise: fp32 sums, one rounding to bf16, then the weight


@pytest.mark.parametrize("mt", ["llama", "qwen3", "mixtral", "gpt_oss", "deepseek_v3", "bamba"])
def test_the_device_path_matches_the_reference(device_path, mt, tmp_path):
    ref = build(mt, tmp_path)
    llm = LLM(tmp_path)
    ids = [1, 17, 42, 99, 5, 23, 64, 11, 87, 3, 45, 120, 7, 66, 8]
    with torch.no_grad():
        want = torch.log_softmax(ref(torch.tensor([ids])).logits[0].float(), dim=-1)
    got = llm.prompt_logprobs(ids)  # one prefill: the fused attention with a causal mask
    assert got.shape == want.shape == (len(ids), configs()[mt]["vocab_size"])
    assert (got - want).abs().max().item() < 1e-4, mt
    # decode steps (one query per row, no mask), two rows at different positions, against the reference's logits
    p = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
    for o, prompt in zip(llm.generate([ids, ids[:7]], p), [ids, ids[:7]]):
        full = prompt + o.token_ids
        with torch.no_grad():
            lp = torch.log_softmax(ref(torch.tensor([full])).logits[0].float(), dim=-1)
        for i, tok in enumerate(o.token_ids):
            row = lp[len(prompt) - 1 + i]
            assert tok == int(row.argmax())
            assert abs(o.logprobs[i].logprob - float(row[tok])) < 1e-4, (mt, i)


def test_a_decode_step_on_the_device_path_issues_few_operations(device_path, tmp_path):
    # tiny llama (2 layers) in bf16: ~44 operations a layer before the fused attention and RMSNorm (the attention
    # chain's 7 and each norm's 6 are one each) and the one q/k/v product (3 products and a q/k concatenation were 4);
    # each is a kernel launch on a GPU
    gen = script_module("step_launches")
    sl = next(gen)
    try:
        build("llama", tmp_path)
        layers = configs()["llama"]["num_hidden_layers"]
        got = sl.count_decode(LLM(tmp_path, dtype="bfloat16"), steps=4)
        static = LLM(tmp_path, dtype="bfloat16")
        static._graphs_on_cpu = True  # the fixed-shape step a CUDA graph captures, uncaptured
        fixed = sl.count_decode(static, steps=16)
    finally:
        gen.close()
    # its attention covers the step's fixed end with later keys masked: the mask is made once a step, not per layer
    assert fixed["by_op"].get("bitwise_not") == 1 and fixed["by_op"]["scaled_dot_product_attention"] == layers
    assert fixed["host_tensors"] <= 1.5  # its tokens and positions in one copy (two before)
    ops = got["by_op"]
    assert ops.get("scaled_dot_product_attention") == layers
    assert ops.get("rms_norm") == 2 * layers + 1 and "rsqrt" not in ops and "softmax" not in ops
    assert got["launches"] <= 21 * layers + 6, ops
    assert ops.get("linear") == 4 * layers + 1  # q/k/v, o, gate/up, down; the head
    # tensors made from host values per step (on a GPU each is a synchronous copy): the step's tokens, slots and
    # positions in one, and a page table's entry every 16 tokens; a greedy burst, which only a CPU program runs,
    # made its steps' batches (~13 copies a step) before finding it could not run
    assert got["host_tensors"] <= 1.25
    # values read back to the host per step (on a GPU each waits for the queued kernels): the greedy tokens, once
    assert got["host_reads"] == 1 and all(k.startswith("engine/runner.py") for k in got["host_reads_at"]), got
    assert fixed["host_reads"] == 1 / 8  # the static step's greedy bursts: one read per 8 steps, fed on the device


@pytest.mark.parametrize("inference", [True, False])
def test_the_step_counter_counts_reads_back_to_the_host(inference):
    gen = script_module("step_launches")
    sl = next(gen)
    before = [getattr(torch.Tensor, m) for m in ("tolist", "cpu", "numpy")]
    try:
        x = torch.arange(6.0)
        with torch.inference_mode(inference), sl.counter() as c:
            x.sum().item()
            bool(x[1] > 0)
            int(x[2])
            x.tolist()
            x[x > 2]
            torch.nonzero(x)
            x.cpu()
            x.repeat_interleave(torch.tensor([1, 2, 1, 1, 1, 1]))  # (their sum read back: 8 reads so far)
            x.repeat_interleave(torch.tensor([1, 2, 1, 1, 1, 1]), output_size=7)
            x.repeat_interleave(2)
            x.max().to(torch.float64)
    finally:
        gen.close()
    assert c.reads == 8 and sum(c.reads_at.values()) == 8
    assert [getattr(torch.Tensor, m) for m in ("tolist", "cpu", "numpy")] == before  # (put back)


def test_q_k_v_weights_lie_side_by_side_on_the_device_path_only(tmp_path, device_path):
    from waferline.model.layers import side_by_side
    from waferline.model.quant import move_model

    build("llama", tmp_path)

    def qkv(llm):
        return [(a.q_proj.weight, a.k_proj.weight, a.v_proj.weight) for a in
                (m for m in llm.model.modules() if type(m).__name__ == "GQAttention")]

    # with the fused CPU operators: left apart (they take them one by one; the huge-page arena moves whole tensors)
    kernels.use(True)
    if kernels.available():  # (a machine that cannot build them has the device path only)
        assert all(side_by_side(list(w)) is None for w in qkv(LLM(tmp_path)))
    kernels.use(False)
    llm = LLM(tmp_path, huge_pages=False)
    ref = [[t.clone() for t in w] for w in qkv(llm)]
    lp = llm.prompt_logprobs([5, 6, 7, 8])
    for w in qkv(llm):
        whole = side_by_side(list(w))
        assert whole is not None and whole.shape[0] == sum(t.shape[0] for t in w)
    # a move copies each weight on its own; move_model puts them together again, values unchanged
    for a in (m for m in llm.model.modules() if type(m).__name__ == "GQAttention"):
        for name in ("q_proj", "k_proj", "v_proj"):
            getattr(a, name).weight.data = getattr(a, name).weight.data.clone()
    assert all(side_by_side(list(w)) is None for w in qkv(llm))
    move_model(llm.model, "cpu")
    for w, r in zip(qkv(llm), ref):
        assert side_by_side(list(w)) is not None and all(torch.equal(a, b) for a, b in zip(w, r))
    # the product kept from before the move is not used: the step reads the weights where they are now
    assert torch.equal(llm.prompt_logprobs([5, 6, 7, 8]), lp)
    for a in (m for m in llm.model.modules() if type(m).__name__ == "GQAttention"):
        assert a.__dict__["_qkv_kept"][1][0].data_ptr() == a.q_proj.weight.data_ptr()


@pytest.mark.parametrize("mt", ["qwen3_moe", "deepseek_v3"])
def test_grouped_experts_compute_the_sorted_experts(mt, tmp_path):
    # the GPU's MoE path (torch._grouped_mm over the rows sorted by expert, no host read) against the CPU's sorted
    # per-expert products, both in bf16 without the fused operators, for a prefill's many rows and a decode's one
    from waferline.model.moe import MoE

    build(mt, tmp_path)
    prev = kernels.use(False)
    try:
        ids = [1, 17, 42, 99, 5, 23, 64, 11, 87, 3, 45, 120, 7, 66, 8]
        sorted_ = LLM(tmp_path, dtype="bfloat16").prompt_logprobs(ids)
        llm = LLM(tmp_path, dtype="bfloat16")
        calls = []
        for m in llm.model.modules():
            if isinstance(m, MoE):
                m.grouped_on_cpu = True
                real = m._grouped_forward
                m._grouped_forward = lambda *a, _real=real: calls.append(1) or _real(*a)
        grouped = llm.prompt_logprobs(ids)
    finally:
        kernels.use(prev)
    assert calls  # (the grouped path ran)
    torch.testing.assert_close(grouped, sorted_, atol=1e-3, rtol=1e-3)  # (bitwise equal on this CPU's torch)


class _DeviceTensors:
    """Counts ``torch.tensor(..., device=...)`` calls and ``Tensor.to`` calls while in use: on a GPU each makes a
    tensor from host values there, a synchronous host-to-device copy (the GPU's queue drained first)."""

    def __enter__(self):
        self.made = self.moved = 0
        self._tensor, self._to = torch.tensor, torch.Tensor.to

        def tensor(*a, **k):
            self.made += k.get("device") is not None
            return self._tensor(*a, **k)

        def to(t, *a, **k):
            self.moved += 1
            return self._to(t, *a, **k)

        torch.tensor, torch.Tensor.to = tensor, to
        return self

    def __exit__(self, *exc):
        torch.tensor, torch.Tensor.to = self._tensor, self._to


def test_a_prefill_and_a_verify_copy_their_inputs_to_the_device_once(device_path, tmp_path):
    # a prefill call made its tokens, slots, starts, and the rows and positions its head reads as five tensors (five
    # waits on a GPU), a verify its tokens, slots and positions as three: now one each
    build("llama", tmp_path)
    llm = LLM(tmp_path, speculative="ngram", num_speculative_tokens=3)
    prompt = [5, 6, 7, 8, 9] * 6
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    want = llm.generate([prompt], greedy)[0].token_ids
    runner = llm._scheduler.runner
    calls = {"step": [], "verify": []}
    for name in calls:
        real = getattr(runner, name)

        def counted(*a, _real=real, _name=name):
            with _DeviceTensors() as n:
                out = _real(*a)
            calls[_name].append(n.made)
            return out

        setattr(runner, name, counted)
    assert llm.generate([prompt], greedy)[0].token_ids == want
    assert calls["verify"] and all(n == 1 for n in calls["verify"]), calls
    assert calls["step"][0] == 1, calls  # (the prefill step: its one prompt)


def test_a_write_back_copies_its_rows_to_the_device_once_for_every_layer(device_path, tmp_path):
    # batched decode rows in pages that do not follow one another run on staging copies of their rows, written back
    # to the pages layer by layer; each layer's write-back made its source and destination rows on the host and
    # copied them to the device (2 waits a layer on a GPU), though every layer writes back the same entries
    from waferline.model.attention import TokenCache

    build("llama", tmp_path)
    layers = configs()["llama"]["num_hidden_layers"]
    llm = LLM(tmp_path)
    prompts = [[1, 17, 42, 99, 5, 23, 64, 11, 87, 3][: 10 - i] for i in range(3)]
    stream = llm.stream(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    for _ in range(3 * 4):  # (four steps in: each row's new entries wait in its staging copy)
        next(stream)
    try:
        table = llm._scheduler.runner._table
        writes = []
        real = TokenCache._write_back
        TokenCache._write_back = lambda self, st: writes.append(st) or real(self, st)
        try:
            with _DeviceTensors() as n:
                table.flush()
        finally:
            TokenCache._write_back = real
        assert len(writes) == layers and n.moved == 1, (len(writes), n.moved)
    finally:
        stream.close()
