"""The static decode step a GPU captures as a CUDA graph (engine/graphs.py), checked on CPU: run uncaptured it
decodes the engine's tokens, and it is capturable — no value read back to the host, no host data entering it, the
same ops on the same shapes at every position."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import tiny_checkpoints
from waferline import LLM, SamplingParams, kernels
from waferline.engine.graphs import StaticDecode, graphable
from waferline.model.context import StepBatch
from waferline.model.moe import MoE


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return tiny_checkpoints(tmp_path_factory, ("deepseek_v3", "llama", "qwen3_moe", "bamba"))


@pytest.fixture
def gpu_like():
    """The ops a GPU runs: no fused CPU operators; MoE experts as grouped products (what an accelerator takes)."""
    prev = kernels.use(False)
    yield
    kernels.use(prev)


def _as_gpu(llm):
    for m in llm.model.modules():
        if isinstance(m, MoE):
            m.grouped_on_cpu = True
    return llm


@pytest.mark.parametrize("mt", ["deepseek_v3", "llama", "qwen3_moe"])
def test_static_steps_decode_the_engines_tokens(ckpts, gpu_like, mt, monkeypatch):
    prompts = [[5, 6, 7, 8, 9], [11, 12], [3, 4, 5, 6, 7, 8, 9, 10]]
    p = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in _as_gpu(LLM(ckpts[mt], dtype="bfloat16")).generate(prompts, p)]
    llm = _as_gpu(LLM(ckpts[mt], dtype="bfloat16"))
    llm._graphs_on_cpu = True
    runs = []
    real = StaticDecode._once
    monkeypatch.setattr(StaticDecode, "_once", lambda self: runs.append(1) or real(self))
    got = [o.token_ids for o in llm.generate(prompts, p)]
    assert got == want
    assert len(runs) == 8 and llm.graph_note is None  # every step after the prefill's token ran static
    # a single row too, and sampling keeps the ordinary steps
    assert [o.token_ids for o in llm.generate([prompts[2]], p)] == [want[2]]
    runs.clear()
    llm.generate([prompts[0]], SamplingParams(max_tokens=4, temperature=0.7, seed=1))
    llm.generate([prompts[0]], SamplingParams(max_tokens=1, temperature=0.0))  # (the prefill's token alone)
    assert not runs and llm.graph_note is None


@pytest.mark.parametrize("mt", ["deepseek_v3", "llama"])
def test_static_steps_run_greedy_bursts_fed_on_the_device(ckpts, gpu_like, mt, monkeypatch):
    """A greedy burst (LLM.generate: 8 steps back to back) ran the static step one step at a time, each step's
    tokens read back to the host before the next (a GPU waited at every replay); the burst now feeds each step's
    argmax to the next on the device and reads the burst's tokens once."""
    prompts = [[5, 6, 7, 8, 9], [11, 12], [3, 4, 5, 6, 7, 8, 9, 10]]
    p = SamplingParams(max_tokens=17, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in _as_gpu(LLM(ckpts[mt], dtype="bfloat16")).generate(prompts, p)]
    llm = _as_gpu(LLM(ckpts[mt], dtype="bfloat16"))
    llm._graphs_on_cpu = True
    calls = {"run": 0, "burst": 0, "_once": 0}
    for name in calls:
        real = getattr(StaticDecode, name)
        monkeypatch.setattr(StaticDecode, name, lambda self, *a, _n=name, _r=real: calls.__setitem__(
            _n, calls[_n] + 1) or _r(self, *a))
    assert [o.token_ids for o in llm.generate(prompts, p)] == want
    assert calls == {"run": 0, "burst": 2, "_once": 16}  # two bursts of 8 steps, no step read back alone
    # a stop in the middle of a burst: the tokens after it are dropped, as for the CPU's bursts
    stop = want[0][6]
    got = llm.generate([prompts[0]], SamplingParams(max_tokens=17, temperature=0.0, stop_token_ids=[stop]))
    assert got[0].token_ids == want[0][:want[0].index(stop) + 1]


def test_models_without_token_caches_decode_as_before(ckpts, gpu_like):
    p = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    want = LLM(ckpts["bamba"]).generate([[5, 6, 7]], p)[0].token_ids
    llm = LLM(ckpts["bamba"])
    llm._graphs_on_cpu = True
    assert llm.generate([[5, 6, 7]], p)[0].token_ids == want
    assert "Mamba-2" in llm.graph_note
    assert not graphable(llm.model.new_caches(1))


class _Ops(TorchDispatchMode):
    """Every aten op called, with the shapes of its tensor arguments; and every read of a tensor's values into Python
    (``.tolist()`` and the conversions do not all pass through an aten op)."""

    READS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__")

    def __init__(self):
        super().__init__()
        self.calls, self.reads, self.saved = [], [], {}

    def __enter__(self):
        for name in self.READS:
            real = self.saved[name] = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, lambda t, *a, _n=name, _r=real, **k: self.reads.append(_n) or _r(t, *a, **k))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, real in self.saved.items():
            setattr(torch.Tensor, name, real)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        shapes = tuple(tuple(a.shape) for a in torch.utils._pytree.tree_leaves((args, kwargs or {}))
                       if isinstance(a, torch.Tensor))
        self.calls.append((str(func), shapes))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mt", ["deepseek_v3", "llama"])
def test_static_step_is_capturable(ckpts, gpu_like, mt):
    llm = _as_gpu(LLM(ckpts[mt], dtype="bfloat16"))
    caches = llm.model.new_caches(2)
    for b, n in enumerate((7, 4)):  # prefill two rows of different lengths
        llm.model(torch.arange(3, 3 + n)[None], caches, StepBatch.make([b], [0], n))
    step = StaticDecode(llm.model, caches, [0, 1], 32, torch.device("cpu"))
    step._step()  # a warm-up, as the capture does first (lazy tables and packed weights are made once)
    seen = []
    for tokens, starts in (([5, 9], [7, 4]), ([6, 2], [8, 5]), ([1, 1], [20, 30])):
        step.tokens.copy_(torch.tensor(tokens)[:, None])  # (what run() copies in from the host before a replay)
        step.start.copy_(torch.tensor(starts))
        with _Ops() as ops:
            logits, ids = step._step()
        names = {c[0] for c in ops.calls}
        assert not ops.reads, ops.reads
        # nothing read back to the host (.item() / .tolist() / a data-dependent shape), no host data made into a tensor
        assert not names & {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.lift_fresh.default",
                            "aten.unique_dim.default", "aten._unique2.default"}, names
        assert logits.shape == (2, llm.spec.vocab_size) and ids.shape == (2,)
        seen.append(ops.calls)
    # the same ops on the same shapes at every position: what a captured graph replays
    assert seen[0] == seen[1] == seen[2]
    assert len(seen[0]) > 50
    # and the step's tokens are the engine's: one ordinary step at the last positions gives the same argmax
    ref = llm.model.step_logits(torch.tensor([[1], [1]]), caches, StepBatch.make([0, 1], [20, 30], 1))[0][:, 0]
    assert torch.equal(ref.argmax(-1), ids)


def test_static_step_refuses_positions_past_its_end(ckpts, gpu_like):
    llm = LLM(ckpts["llama"], dtype="bfloat16")
    caches = llm.model.new_caches(1)
    step = StaticDecode(llm.model, caches, [0], 16, torch.device("cpu"))
    assert caches[0].capacity >= 16
    with pytest.raises(ValueError, match="past the static step's end"):
        step.run([3], [16])
    with pytest.raises(ValueError, match="full-attention"):
        StaticDecode(LLM(ckpts["bamba"]).model, LLM(ckpts["bamba"]).model.new_caches(1), [0], 8, torch.device("cpu"))
