"""Speculative decoding: greedy output identical to plain decoding for every drafter and cache kind, the verifier's
output distribution (chi-square), cache rollback, adaptive K, and the errors a user can cause."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tiny_models import VOCAB, build
from waferline import LLM, SamplingParams
from waferline.engine.sampling import target_probs
from waferline.engine.speculative import (
    AdaptiveK,
    NgramDrafter,
    Proposal,
    expected_tokens,
    residual,
    verify,
    verify_greedy,
    verify_rows,
    verify_sampled,
)
from waferline.errors import ConfigError, WaferlineError
from waferline.model.context import StepBatch
from waferline.model.init import write_random_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

TYPES = ("llama", "deepseek_v3", "bamba", "gpt_oss")


def _perturbed_copy(src: Path, dst: Path, noise: float, seed: int = 1) -> Path:
    """A draft model: the target's checkpoint with every weight perturbed (shares the vocab, disagrees sometimes)."""
    dst.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    w = load_file(src / "model.safetensors")
    out = {k: (v + noise * v.float().std().nan_to_num(0.0) * torch.randn(v.shape, generator=g)).to(v.dtype)
           if v.is_floating_point() and v.dim() == 2 else v for k, v in w.items()}
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    (dst / "config.json").write_text((src / "config.json").read_text())
    return dst


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    out = {}
    for mt in TYPES:
        d = tmp_path_factory.mktemp(mt)
        build(mt, d)
        out[mt] = d
        out[mt + ":draft"] = _perturbed_copy(d, tmp_path_factory.mktemp(mt + "_draft"), 0.05)
    # DeepSeek-V3 with its MTP module (transformers drops MTP weights, so write the same config with random ones)
    cfg = json.loads((out["deepseek_v3"] / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    out["deepseek_v3:mtp"] = write_random_checkpoint(cfg, tmp_path_factory.mktemp("dsv3_mtp"), seed=3)
    # our sol hybrid (Mamba-2 + MLA + MoE) with an MTP head
    out["sol:mtp"] = write_random_checkpoint(SOL, tmp_path_factory.mktemp("sol_mtp"), seed=4)
    return out


SOL = {"model_type": "sol", "vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": 3,
           "mixer_types": ["mamba2", "mla", "gqa"], "ffn_types": ["dense", "moe", "moe"], "num_attention_heads": 4,
           "num_key_value_heads": 2, "q_lora_rank": None, "kv_lora_rank": 16, "qk_nope_head_dim": 16,
           "qk_rope_head_dim": 8, "v_head_dim": 16, "intermediate_size": 96, "moe_intermediate_size": 32,
           "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2, "mamba_n_heads": 4,
           "mamba_d_head": 16, "mamba_d_state": 8, "mamba_n_groups": 1, "mamba_d_conv": 4, "mamba_chunk_size": 8,
           "num_nextn_predict_layers": 1, "max_position_embeddings": 256, "bos_token_id": 1, "eos_token_id": 2}


def _prompts(n: int = 5, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = [3, 11, 6, 19, 8, 14][:n]
    ps = [torch.randint(3, VOCAB, (k,), generator=g).tolist() for k in lens]
    ps[1] = [7, 8, 9, 10] * 3  # repetitive: the n-gram drafter finds matches
    return ps


GREEDY = SamplingParams(max_tokens=14, ignore_eos=True)


class Scripted:
    """A test drafter that knows the reference continuation and corrupts one draft per step at a position that
    cycles over 0..k (k: no corruption), so every row sees every accepted length and every rollback depth."""

    name = "scripted"
    uses_hidden = False

    def __init__(self, ref: list[list[int]]):
        self.ref, self.step = ref, 0

    def begin(self, seqs, hidden):
        pass

    def propose(self, rows, seqs, ks, params, gens):
        self.step += 1
        props = []
        for b, k in zip(rows, ks):
            n = len(seqs[b])
            assert seqs[b] == self.ref[b][:n], "speculative output left the reference"
            d = self.ref[b][n:n + k]
            bad = (self.step + b) % (k + 1)
            if bad < len(d):
                d[bad] = (d[bad] + 1) % VOCAB
            props.append(Proposal(d))
        return props

    def accepted(self, rows, seqs, n_accepted, n_drafted, hidden):
        pass


@pytest.mark.parametrize("mt", TYPES)
def test_greedy_identical_every_drafter(ckpts, mt):
    prompts = _prompts()
    ref = [o.token_ids for o in LLM(ckpts[mt]).generate(prompts, GREEDY)]
    # every rollback depth, non-adaptive K (gpt_oss: window 8 caps K at 7)
    llm = LLM(ckpts[mt], speculative="ngram", num_speculative_tokens=5, speculative_adaptive=False)
    llm._spec.drafter = Scripted([p + r for p, r in zip(prompts, ref)])
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == ref
    m = outs[0].metrics
    assert 0 < m["spec_acceptance_rate"] < 1 and m["spec_mean_accepted_length"] > 1.5
    # the n-gram drafter with adaptive K; the draft model (as large as the target here, so adaptive K would
    # rightly never draft with it) at a fixed K
    for method, adaptive in (("ngram", True), (f"draft:{ckpts[mt + ':draft']}", False)):
        outs = LLM(ckpts[mt], speculative=method, num_speculative_tokens=4,
                   speculative_adaptive=adaptive).generate(prompts, GREEDY)
        assert [o.token_ids for o in outs] == ref, method
        assert outs[0].metrics["spec_drafted"] > 0
    if mt == "deepseek_v3":
        ref = [o.token_ids for o in LLM(ckpts["deepseek_v3:mtp"]).generate(prompts, GREEDY)]
        outs = LLM(ckpts["deepseek_v3:mtp"], speculative="mtp", num_speculative_tokens=3,
                   speculative_adaptive=False).generate(prompts, GREEDY)
        assert [o.token_ids for o in outs] == ref


def test_draft_model_partial_acceptance(ckpts):
    """The perturbed draft model agrees often but not always: rejections in the draft model's own caches (Mamba-2
    state, attention) are rolled back too."""
    prompts = _prompts()
    ref = [o.token_ids for o in LLM(ckpts["bamba"]).generate(prompts, GREEDY)]
    outs = LLM(ckpts["bamba"], speculative=f"draft:{ckpts['bamba:draft']}", num_speculative_tokens=3,
               speculative_adaptive=False).generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == ref
    assert 0.1 < outs[0].metrics["spec_acceptance_rate"] < 1.0


def test_mtp_sol_hybrid_and_drafts_match_full_forward(ckpts):
    """sol (Mamba-2 + MLA + GQA, MoE) with an MTP head: greedy output identical, and every first draft the MTP
    drafter proposed equals the MTP head's prediction from a single full-sequence forward (t, token t+1 -> t+2)."""
    d = ckpts["sol:mtp"]
    prompts = _prompts()
    ref = [o.token_ids for o in LLM(d).generate(prompts, GREEDY)]
    llm = LLM(d, speculative="mtp", num_speculative_tokens=2, speculative_adaptive=False)
    drafter = llm._spec.drafter
    seen: list[tuple[int, list[int], int]] = []
    orig = drafter.propose

    def spy(rows, seqs, ks, params, gens):
        props = orig(rows, seqs, ks, params, gens)
        seen.extend((b, list(seqs[b]), p.tokens[0]) for b, p in zip(rows, props) if p.tokens)
        return props

    drafter.propose = spy
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == ref
    assert len(seen) > 10
    model = llm.model
    with torch.inference_mode():
        for _b, seq, first in seen[::3]:
            n = len(seq)
            toks = torch.tensor([seq])
            h = model(toks, model.new_caches(1), StepBatch.make([0], [0], n))
            head = model.mtp[0]
            h2 = head(
                h[:, :-1], model.embed_tokens(toks[:, 1:]), head.layer.new_cache(1), StepBatch.make([0], [0], n - 1)
            )
            pred = int(torch.nn.functional.linear(head.norm(h2[0, -1]), model.lm_head).argmax())
            assert pred == first


class _Every(AdaptiveK):
    """A scripted adaptive K: k drafts per row at every ``every``-th step, none at the others (0: never)."""

    def __init__(self, k: int, every: int):
        super().__init__(k)
        self.every, self.calls = every, 0

    def choose(self, rows, batch=None):
        self.calls += 1
        return [self.k_max if self.every and self.calls % self.every == 0 else 0] * len(rows)


@pytest.mark.parametrize("method,every", [("mtp", 0), ("mtp", 3), ("ngram:3:3", 1)],
                         ids=["mtp-never", "mtp-every-3rd", "ngram-no-match"])
def test_plain_steps_in_bursts_when_nothing_is_drafted(ckpts, monkeypatch, method, every):
    """A greedy step in which no row drafts (adaptive K chose k = 0, or the n-gram lookup found no match) runs as plain
    steps in a burst (DecoderModel.greedy_steps; burst_len: 1, 2, 4, then LLM's GREEDY_BURST after such steps in a
    row): the same tokens as plain decoding and as step by step, with drafting steps in between (MTP every 3rd step:
    its next draft commits the burst's hidden states) or none; with MTP never drafting, the hidden states the drafter
    holds for its next draft are bitwise the ones step by step gives it. Where the fused operators are built (sol
    int4: whole-step programs), bursts ran."""
    import waferline.engine.speculative.serving as spm  # the module whose ServeSpeculation looks up burst_len
    from waferline import kernels

    d, opts = ckpts["sol:mtp"], dict(dtype="bfloat16", weight_bits=4, group_size=32)
    prompts, sp = _prompts(3, seed=7), SamplingParams(max_tokens=21, ignore_eos=True)
    prompts[1] = prompts[1][:5]  # (no repeated 3-gram in any prompt)
    ref = [o.token_ids for o in LLM(d, **opts).generate(prompts, sp)]
    llm = LLM(d, speculative=method, num_speculative_tokens=2, **opts)
    if method == "mtp":
        monkeypatch.setattr(llm._spec, "ctl", _Every(2, every))
    ran, orig = [], type(llm.model).greedy_steps
    monkeypatch.setattr(type(llm.model), "greedy_steps", lambda self, *a: ran.append(orig(self, *a)) or ran[-1])
    held, kept, release = {}, {}, llm._spec.reset

    def keep(slot):  # (a sequence's drafter state is released when it ends: what it held then)
        if llm._spec.drafter.pending[slot].shape[0]:
            kept[slot] = llm._spec.drafter.pending[slot].clone()
        release(slot)

    if method == "mtp":
        monkeypatch.setattr(llm._spec, "reset", keep)
    for name, burst in (("steps", lambda idle: 1), ("bursts", spm.burst_len)):
        monkeypatch.setattr(spm, "burst_len", burst)
        ran.clear()
        kept.clear()
        outs = llm.generate(prompts, sp)
        assert [o.token_ids for o in outs] == ref, name
        if method == "mtp":
            held[name] = [kept[s] for s in sorted(kept)]
            assert all(p.shape[0] == 0 for p in llm._spec.drafter.pending)  # (released)
            assert (outs[0].metrics["spec_drafted"] > 0) == (every > 0)
        if name == "steps":
            assert not ran
    if kernels.available():
        assert sum(r is not None for r in ran) >= 2
    if every == 0:
        # (the prompt's last position's, then one a step: the drafter commits the rest of the prompt at the start)
        assert [p.shape[0] for p in held["bursts"]] == [1 + sp.max_tokens - 1] * len(prompts)
        assert all(torch.equal(a, b) for a, b in zip(held["steps"], held["bursts"]))


def test_sampled_generation_runs_and_is_seeded(ckpts):
    prompts = _prompts(3)
    sp = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, top_k=40, seed=5, ignore_eos=True)
    for method in ("ngram", f"draft:{ckpts['llama:draft']}"):
        # adaptive K (n-gram) must not make a seeded run depend on wall-clock timings
        llm = LLM(ckpts["llama"], speculative=method, num_speculative_tokens=3, speculative_adaptive=method == "ngram")
        a = [o.token_ids for o in llm.generate(prompts, sp)]
        b = [o.token_ids for o in llm.generate(prompts, sp)]
        assert a == b and all(len(x) == 12 for x in a)


def _joint(llm: LLM, prompt: list[int], params: SamplingParams, n: int) -> dict[tuple[int, ...], float]:
    """The exact distribution of the first ``n`` sampled tokens: target_probs of the plain model's logits after each
    prefix (a small top_k keeps the support small)."""
    out: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(n):
        nxt = {}
        for pre, pr in out.items():
            p = target_probs(llm.prompt_logprobs(prompt + list(pre))[-1], params).double()
            nxt.update({pre + (t,): pr * float(p[t]) for t in torch.nonzero(p).flatten().tolist()})
        out = nxt
    return out


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_sampled_speculation_keeps_the_joint_distribution_of_the_first_tokens(ckpts, method):
    """End to end through the scheduler (drafts, verify, residual, bonus token, rollback, a drafter's q): the first 4
    tokens of 2000 requests (seeded apart) follow the target's joint distribution (chi-square, the cells expected
    fewer than 5 times pooled), with some drafts accepted and some rejected. A rejection resampled from p instead of the
    residual, or a bonus token drawn from the wrong row, fails it (p < 1e-40 or a zero-probability sequence)."""
    d = ckpts["llama"]
    plain = LLM(d, max_model_len=96)
    # a prompt of the model's own likely text, repeated in part: the n-gram drafter finds continuations it may accept
    text = plain.generate([[5, 6, 7]], SamplingParams(max_tokens=40, temperature=1.0, top_k=3, seed=1,
                                                      ignore_eos=True))[0].token_ids
    prompt = [5, 6, 7] + text + text[:6]
    params = SamplingParams(max_tokens=4, temperature=1.0, top_k=3, ignore_eos=True)
    joint = _joint(plain, prompt, params, 4)
    spec = "ngram" if method == "ngram" else f"draft:{ckpts['llama:draft']}"
    llm = LLM(d, max_model_len=96, speculative=spec, num_speculative_tokens=2, speculative_adaptive=False)
    n = 2000  # (each request seeded apart: independent draws, and the same ones every run)
    outs = llm.generate([prompt] * n, [SamplingParams(max_tokens=4, temperature=1.0, top_k=3, ignore_eos=True, seed=i)
                                       for i in range(n)])
    m = outs[0].metrics
    assert 0 < m["spec_accepted"] < m["spec_drafted"], m
    counts: dict[tuple[int, ...], int] = {}
    for o in outs:
        counts[tuple(o.token_ids)] = counts.get(tuple(o.token_ids), 0) + 1
    assert all(joint.get(k, 0.0) > 0 for k in counts), "a sequence of probability 0 was sampled"
    big = [k for k, p in joint.items() if p * n >= 5]
    small = [k for k in joint if k not in big]
    got = torch.tensor([counts.get(k, 0) for k in big] + [sum(counts.get(k, 0) for k in small)], dtype=torch.float64)
    want = torch.tensor([joint[k] for k in big] + [sum(joint[k] for k in small)], dtype=torch.float64)
    assert _chi2_pvalue(got, want) > 1e-4


def test_stop_token_inside_accepted_drafts(ckpts):
    prompts = _prompts(3)
    ref_full = [o.token_ids for o in LLM(ckpts["llama"]).generate(prompts, GREEDY)]
    stop = ref_full[0][5]  # a token row 0 emits mid-sequence
    sp = SamplingParams(max_tokens=14, stop_token_ids=[stop], ignore_eos=True)
    ref = LLM(ckpts["llama"]).generate(prompts, sp)
    llm = LLM(ckpts["llama"], speculative="ngram", num_speculative_tokens=4, speculative_adaptive=False)
    llm._spec.drafter = Scripted([p + r for p, r in zip(prompts, ref_full)])
    outs = llm.generate(prompts, sp)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert [o.finish_reason for o in outs] == [o.finish_reason for o in ref]
    assert outs[0].finish_reason == "stop" and outs[0].token_ids[-1] == stop


# ----------------------------------------------------------------------------------------------- the verifier


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    exp = probs.double() * counts.sum()
    keep = exp > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was emitted"
    stat = float(((counts[keep].double() - exp[keep]) ** 2 / exp[keep]).sum())
    df = int(keep.sum()) - 1
    return float(
        torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64))
    )


def _run_verifier(fn, p, q, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n draws of: draft 2 tokens from q (or a fixed draft with one-hot q), verify; count the first emitted token,
    and the second one when the first draft was accepted."""
    g = torch.Generator().manual_seed(seed)
    V = p.shape[1]
    first, second = torch.zeros(V), torch.zeros(V)
    for _ in range(n):
        if q is None:
            draft = [0, 4]
        else:
            draft = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(2)]
        out = fn(p, q, draft, g)
        first[out[0]] += 1
        if len(out) >= 2:
            second[out[1]] += 1
    return first, second


P = torch.tensor([[0.30, 0.05, 0.25, 0.10, 0.20, 0.10], [0.10, 0.40, 0.05, 0.05, 0.30, 0.10],
                  [0.20, 0.20, 0.20, 0.20, 0.10, 0.10]])
Q = torch.tensor([[0.05, 0.40, 0.05, 0.30, 0.10, 0.10], [0.30, 0.10, 0.30, 0.10, 0.10, 0.10]])


@pytest.mark.parametrize("q", [Q, None], ids=["draft-distribution", "one-hot-ngram"])
def test_verifier_output_follows_target_distribution(q):
    first, second = _run_verifier(verify_sampled, P, q, 20_000, seed=0)
    assert _chi2_pvalue(first, P[0]) > 1e-3
    assert second.sum() > 2000 and _chi2_pvalue(second, P[1]) > 1e-3


def test_broken_verifier_fails_the_test():
    """Resampling a rejected draft from p instead of the residual max(0, p − q) (a classic bug) is caught."""

    def broken(p, q, draft, g):
        out = []
        for i, x in enumerate(draft):
            qx = 1.0 if q is None else float(q[i, x])
            if float(torch.rand(1, generator=g)) * qx < float(p[i, x]):
                out.append(x)
                continue
            out.append(int(torch.multinomial(p[i], 1, generator=g)))
            return out
        return out + [int(torch.multinomial(p[len(draft)], 1, generator=g))]

    for q in (Q, None):
        first, _ = _run_verifier(broken, P, q, 20_000, seed=0)
        assert _chi2_pvalue(first, P[0]) < 1e-6


def test_verify_respects_temperature_top_k_top_p():
    """verify() builds p with target_probs: tokens outside top-k / top-p are never emitted, and the emitted
    distribution is the truncated, tempered one."""
    torch.manual_seed(0)
    logits = torch.randn(2, 8) * 2
    params = SamplingParams(temperature=0.7, top_k=5, top_p=0.9)
    p = target_probs(logits, params)
    q = torch.softmax(torch.randn(1, 8), -1)
    g = torch.Generator().manual_seed(1)
    counts = torch.zeros(8)
    for _ in range(20_000):
        d = [int(torch.multinomial(q[0], 1, generator=g))]
        counts[verify(logits, d, q, params, g)[0]] += 1
    assert _chi2_pvalue(counts, p[0]) > 1e-3


def test_sample_draws_from_the_tempered_truncated_distribution():
    """sample() (one uniform per token, inverse CDF in fp64) follows target_probs: temperature, top-k and top-p
    applied; the same counts are far from the untempered softmax (the check can fail)."""
    from waferline.engine.sampling import sample

    logits = torch.tensor([2.0, 1.5, 0.3, -1.0, 0.9, 1.1, -0.2, 0.0])
    params = SamplingParams(temperature=0.7, top_k=6, top_p=0.95)
    g = torch.Generator().manual_seed(3)
    counts = torch.zeros(8)
    for _ in range(20_000):
        counts[sample(logits, params, g)] += 1
    p = target_probs(logits[None], params)[0]
    assert counts[p == 0].sum() == 0
    keep = p > 0
    assert _chi2_pvalue(counts[keep], p[keep]) > 1e-3
    plain = torch.softmax(logits, -1)[keep]
    assert _chi2_pvalue(counts[keep], plain / plain.sum()) < 1e-6


def test_greedy_verify_and_residual():
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0], [0.0, 0.0, 9.0]])
    assert verify_greedy(logits, [1, 0]) == [1, 0, 2]  # all accepted + bonus
    assert verify_greedy(logits, [1, 2]) == [1, 0]  # second rejected, replaced by the argmax
    assert verify_greedy(logits, [2, 0]) == [1]
    assert verify_greedy(logits, []) == [1]
    p = torch.tensor([0.5, 0.3, 0.2])
    assert torch.allclose(residual(p, None, 0), torch.tensor([0.0, 0.6, 0.4]))
    # a whole greedy verify: with the forward's argmaxes (what step_logits returns) the same tokens as from the logits
    batch = torch.stack([logits, logits.flip(0)])  # [2, 3, V]
    greedy_p = SamplingParams(temperature=0)
    for drafts in ([[1, 0], [2]], [[], []], [[1, 2], []]):
        want = verify_rows(batch, drafts, [None, None], greedy_p, [None, None])
        assert verify_rows(batch, drafts, [None, None], greedy_p, [None, None], batch.argmax(-1)) == want, drafts
    assert verify_rows(batch, [[1, 0], [2]], [None, None], greedy_p, [None, None]) == [[1, 0, 2], [2, 0]]
    assert torch.allclose(residual(p, torch.tensor([0.2, 0.6, 0.2]), 1), torch.tensor([1.0, 0.0, 0.0]))


# ----------------------------------------------------------------------------------------------- drafters, K, errors


def test_ngram_lookup_prefers_longest_latest_match():
    d = NgramDrafter(1, 3)
    d.begin([[]], [])
    seq = [1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3]
    assert d.lookup(0, seq, 3) == [7, 5, 1]  # "1 2 3" last seen before position 7
    seq += [7, 5]
    assert d.lookup(0, seq, 2) == [1, 2]  # "3 7 5" -> 1 2
    d.begin([[]], [])
    assert d.lookup(0, [4, 4], 2) == [4]
    assert d.lookup(0, [4, 4, 5], 2) == []


def test_adaptive_k_grows_with_acceptance_and_backs_off_with_batch():
    ctl = AdaptiveK(k_max=6, overhead=24.0)
    for _ in range(10):
        ctl.observe(0, 4, 4)
        ctl.observe(1, 4, 0)
    k_hi, k_lo = ctl.choose([0, 1])[0], AdaptiveK(6, overhead=24.0, alpha={1: ctl.alpha[1]}).choose([1])[0]
    assert k_hi >= 5 and k_lo <= 1
    # a larger batch pays for every verified token, accepted or not: K shrinks, then speculation stops
    mid = AdaptiveK(k_max=6, overhead=24.0, alpha={b: 0.7 for b in range(64)})
    k1, k8, k64 = mid.choose([0])[0], mid.choose(list(range(8)))[0], mid.choose(list(range(64)))[0]
    assert k1 >= 5 and 1 <= k8 <= 3 and k64 == 0
    assert expected_tokens(0.5, 3) == pytest.approx(1.875) and expected_tokens(1.0, 3) == 4.0
    assert AdaptiveK(k_max=3, enabled=False).choose([0, 1]) == [3, 3]
    # a measured cost table where 2..8 tokens cost twice one token (a CPU's gemv -> gemm step): only a high
    # acceptance pays
    table = [(1, 1.0), (2, 2.0), (8, 2.0), (64, 10.0)]
    assert AdaptiveK(k_max=6, cost_table=table, alpha={0: 0.5}).choose([0]) == [0]
    assert AdaptiveK(k_max=6, cost_table=table, alpha={0: 0.9}).choose([0])[0] >= 4
    assert AdaptiveK(k_max=6, cost_table=table).cost(5) == 2.0 and AdaptiveK(6, cost_table=table).cost(
        120
    ) == pytest.approx(18.0)


def test_adaptive_k_follows_measured_step_costs():
    """With ``measure``, what steps really cost replaces the prior: a verify that costs 3x a plain step stops
    speculation at a middling acceptance; one that costs hardly more (a pipeline's hops) makes it draft the most;
    a plain step is taken every ``explore_every`` steps so its cost stays measured; the estimate skips a shape's first
    step and follows faster steps at once, slower ones by a quarter."""
    ctl = AdaptiveK(k_max=4, measure=True, explore_every=4, alpha={0: 0.5})
    first = [ctl.choose([0])[0] for _ in range(8)]
    assert first.count(0) >= 1  # a new batch size: one plain step early on, to measure it
    for _ in range(3):  # (a shape's first step is not kept: it pays one-time costs; the next waits for a third)
        ctl.record(1, 1, 0.010)
        for T in range(2, 6):
            ctl.record(1, T, 0.030)
    assert ctl.step_cost(1, 3) == pytest.approx(0.030) and ctl.choose([0]) == [0]
    fast = AdaptiveK(k_max=4, measure=True, explore_every=4, alpha={0: 0.5})
    for T, sec in ((1, 0.050), (1, 0.010), (1, 0.010), (5, 0.011), (5, 0.011), (5, 0.011)):
        fast.record(1, T, sec)  # unmeasured T: the prior line scaled to the measurements
    assert fast.step_cost(1, 1) == pytest.approx(0.010)
    ks = [fast.choose([0])[0] for _ in range(12)]
    assert max(ks) >= 3 and ks.count(0) in (2, 3, 4)  # plain exactly when due, K >= 3 otherwise
    # a pipeline explores with one plain step per micro-batch in a row, so its measurement is not mixed with verifies
    run = AdaptiveK(k_max=4, measure=True, explore_every=4, explore_run=2, alpha={0: 0.9})
    for _ in range(3):  # (a plain step measured: explorations take explore_run steps)
        run.record(1, 1, 0.010)
    ks = [run.choose([0])[0] for _ in range(10)]
    assert ks[4:6] == [0, 0] and min(ks[:4] + ks[6:]) > 0
    # never measured: the first exploration takes the 3 plain steps a measurement needs (the first is not kept, the
    # next waits for a third), so a short run does not draft on the prior alone until a later one
    new = AdaptiveK(k_max=4, measure=True, explore_every=16, alpha={0: 0.9})
    ks = [new.choose([0])[0] for _ in range(10)]
    assert ks[4:7] == [0, 0, 0] and min(ks[:4] + ks[7:]) > 0
    # measured drafting time counts against drafting
    slow_draft = AdaptiveK(k_max=4, measure=True, alpha={0: 0.5})
    for _ in range(3):
        slow_draft.record(1, 1, 0.010)
        slow_draft.record_draft(1, 2, 0.040)  # 20 ms per drafted token
    assert slow_draft.gain(0.5, 2, 1) < 1.0
    # noise only slows steps down: a faster step replaces the estimate, slower ones move it a quarter of the way
    # (a lone slow step not at all: the next one must be slow too)
    fast.record(1, 1, 0.030)
    assert fast.step_cost(1, 1) == pytest.approx(0.010)
    fast.record(1, 1, 0.030)
    assert fast.step_cost(1, 1) == pytest.approx(0.015)
    fast.record(1, 1, 0.012)
    assert fast.step_cost(1, 1) == pytest.approx(0.012)


def test_adaptive_k_prices_the_steps_it_measured_for_the_rows_they_take():
    """An unmeasured width of B rows is priced linearly from the widths of B rows measured, not by the prior line scaled
    by every measurement (which put a 2-token verify of 4 rows at ~1.2x a plain step on a CPU where 1 and 3 tokens
    measured 4 and 14 ms); and ``batch`` (steps in flight split the rows between them: engine/overlap.py) makes K
    weigh the steps of that many rows, the ones measured: 8 rows in steps of 4 at acceptance 0.5 do not draft."""
    ctl = AdaptiveK(k_max=3, measure=True, alpha={b: 0.5 for b in range(8)})
    for _ in range(3):
        ctl.record(4, 1, 0.004)
        ctl.record(4, 3, 0.014)
    assert ctl.step_cost(4, 2) == pytest.approx(0.009) and ctl.step_cost(4, 4) == pytest.approx(0.019)
    assert ctl.step_cost(4, 3) == pytest.approx(0.014)  # (measured: as measured)
    assert ctl.choose(list(range(8)), batch=4) == [0] * 8
    cheap = AdaptiveK(k_max=3, measure=True, alpha={b: 0.5 for b in range(8)})  # (a pipeline's hop-bound verify)
    for _ in range(3):
        cheap.record(4, 1, 0.004)
        cheap.record(4, 3, 0.0045)
    assert min(cheap.choose(list(range(8)), batch=4)) >= 2


def test_one_slow_step_does_not_stop_speculation():
    """A GC pause in one verify step must not price its width out: the controller would never choose (and so never
    measure) it again, and with it priced out every unmeasured width too (the prior is scaled by the measurements)."""
    ctl = AdaptiveK(k_max=4, measure=True, alpha={0: 0.95})
    for _ in range(3):
        ctl.record(1, 1, 0.00105)
        ctl.record(1, 5, 0.00125)
    assert ctl.choose([0]) == [4]
    ctl.record(1, 5, 0.5)  # one 0.5 s pause
    assert ctl.step_cost(1, 5) == pytest.approx(0.00125) and ctl.choose([0]) == [4]
    ctl.record(1, 5, 0.00125)
    ctl.record(1, 5, 0.004)  # steps that really got slower move the estimate
    ctl.record(1, 5, 0.004)
    assert 0.00125 < ctl.step_cost(1, 5) < 0.004


def test_a_pause_in_the_first_kept_step_of_a_width_does_not_price_it_out():
    """The first step of a width whose time is kept (its first is not: one-time costs) may be a GC pause too: it must
    not become the width's cost (nor scale every unmeasured width's prior), or speculation stops until a probe and
    that width is never chosen, so never measured, again."""
    ctl = AdaptiveK(k_max=4, measure=True, alpha={0: 0.95})
    for _ in range(3):
        ctl.record(1, 1, 0.00105)
    ctl.record(1, 5, 0.00125)  # (not kept: the width's first step)
    ctl.record(1, 5, 0.5)  # a 0.5 s pause
    assert ctl.choose([0]) == [4]
    ctl.record(1, 5, 0.00125)
    assert ctl.step_cost(1, 5) == pytest.approx(0.00125) and ctl.choose([0]) == [4]


def test_a_row_that_backed_off_drafts_again_when_its_drafts_pay():
    """A row whose drafts failed stops drafting (k = 0), so its acceptance is not observed again; it drafts one token
    after ``probe_every`` steps without drafts, and K climbs back when those are accepted. In a step where other rows
    draft only the due row probes; in one where none does, every row does."""
    ctl = AdaptiveK(k_max=4, alpha={0: 0.01, 1: 0.01}, probe_every=8)
    ks = [ctl.choose([0, 1]) for _ in range(9)]
    assert ks[:8] == [[0, 0]] * 8 and ks[8] == [1, 1]
    for _ in range(20):
        k = ctl.choose([0])[0]
        ctl.observe(0, k, k)
    assert ctl.choose([0]) == [4]
    ctl.alpha.update({0: 0.99, 1: 0.01})
    ctl.since_draft.update({0: 0, 1: 8})
    assert ctl.choose([0, 1]) == [4, 1] and ctl.choose([0, 1]) == [4, 0]
    assert AdaptiveK(k_max=0, alpha={0: 0.0}, probe_every=1, since_draft={0: 5}).choose([0]) == [0]


def test_user_errors(ckpts, tmp_path):
    with pytest.raises(ConfigError, match="MTP"):
        LLM(ckpts["llama"], speculative="mtp")
    with pytest.raises(ConfigError, match="unknown speculative"):
        LLM(ckpts["llama"], speculative="medusa")
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        LLM(ckpts["llama"], speculative="ngram", num_speculative_tokens=0)
    with pytest.raises(ConfigError, match="vocab_size"):
        LLM(ckpts["llama"], speculative=f"draft:{write_random_checkpoint(dict(SOL, vocab_size=256), tmp_path / 'v')}")
    with pytest.raises(WaferlineError):
        LLM(ckpts["llama"], speculative=f"draft:{tmp_path / 'missing'}")


def test_cli_generate_speculative(ckpts):
    base = [sys.executable, "-m", "waferline.cli", "generate", "--model", str(ckpts["llama"]),
            "--prompt-ids", "7 8 9 10 7 8 9 10 7 8", "--max-tokens", "10", "--json"]
    plain = json.loads(subprocess.run(base, capture_output=True, text=True, check=True).stdout)
    spec = json.loads(subprocess.run(base + ["--speculative", "ngram", "--num-speculative-tokens", "3"],
                                     capture_output=True, text=True, check=True).stdout)
    assert spec["token_ids"] == plain["token_ids"] and "spec_acceptance_rate" in spec
    bad = subprocess.run(base + ["--speculative", "nope"], capture_output=True, text=True)
    assert bad.returncode != 0 and "--speculative nope: unknown method" in bad.stderr and "Traceback" not in bad.stderr
    # nothing to draft from (no earlier n-gram): said so, not "acceptance 0.00" as if every draft had been rejected
    none = [sys.executable, "-m", "waferline.cli", "generate", "--model", str(ckpts["llama"]), "--prompt-ids",
            "40 41 42 43", "--max-tokens", "2", "--speculative", "ngram"]
    got = json.loads(subprocess.run(none + ["--json"], capture_output=True, text=True, check=True).stdout)
    assert got["spec_drafted"] == 0
    err = subprocess.run(none, capture_output=True, text=True, check=True).stderr
    assert "[speculative ngram: nothing drafted" in err and "acceptance" not in err


def test_ngram_bounds_are_two_numbers_or_none():
    """'ngram:5' or 'ngram:a' ran as ngram:1:3 without a word; now refused like 'ngram:x:y'."""
    from waferline.engine.speculative.drafters import NgramDrafter, make_drafter
    from waferline.errors import ConfigError

    for spec in ("ngram:5", "ngram:a", "ngram:", "ngram:1:2:3", "ngram:x:y"):
        with pytest.raises(ConfigError, match="use 'ngram' or 'ngram:MIN_N:MAX_N'"):
            make_drafter(spec, None, torch.float32)
    d = make_drafter("ngram:2:4", None, torch.float32)
    assert isinstance(d, NgramDrafter) and (d.min_n, d.max_n) == (2, 4)
    d = make_drafter("ngram", None, torch.float32)
    assert (d.min_n, d.max_n) == (1, 3)


@pytest.mark.parametrize("mt", ["bamba", "gpt_oss"])
def test_verify_rollback_equals_running_only_the_accepted_prefix(ckpts, mt):
    """After a 6-token verify and a rollback to the first k tokens, the caches give the same next-token logits as
    caches that only ever saw those k tokens (Mamba-2 state from the trail; the sliding-window ring restored)."""
    from waferline.engine.speculative import VerifyRollback

    m = LLM(ckpts[mt]).model
    prompt = torch.arange(3, 3 + 13)[None] % VOCAB  # longer than gpt_oss's window of 8: the ring has wrapped
    new = torch.tensor([[17, 40, 9, 88, 5, 61]])
    with torch.inference_mode():
        for keep in (1, 3, 6):
            a, b = m.new_caches(1), m.new_caches(1)
            for c in (a, b):
                m(prompt, c, StepBatch.make([0], [0], 13))
            batch = StepBatch.make([0], [13], 6)
            rb = VerifyRollback(a, batch)
            m(new, a, batch)
            rb.done([keep])
            m(new[:, :keep], b, StepBatch.make([0], [13], keep))
            nxt = torch.tensor([[33]])
            la = m.logits(m(nxt, a, StepBatch.make([0], [13 + keep], 1)))
            lb = m.logits(m(nxt, b, StepBatch.make([0], [13 + keep], 1)))
            assert torch.allclose(la, lb, atol=1e-4), (keep, float((la - lb).abs().max()))
