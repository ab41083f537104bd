"""DeepSeek-V4 under speculative decoding: a verify's rejected tokens are taken back out of the V4 caches (window rows,
compressed entries and indexer keys of the windows they closed, the open window, CSA's overlap), so rolled-back
caches equal caches that only saw the accepted tokens, and greedy output with every drafter equals plain greedy
decoding. The tiny config compresses every 4 (CSA) and 8 (HCA) tokens: verifies of 5 to 7 tokens close windows
that a rejection then reopens."""

from dataclasses import fields

import pytest
import torch

from test_speculative import Scripted, _perturbed_copy
from tiny_models import build
from waferline import LLM, SamplingParams
from waferline.engine.speculative import SlotRollback, VerifyRollback
from waferline.engine.speculative.rollback import _load, _save
from waferline.model.context import StepBatch
from waferline.model.v4_attention import V4Cache

pytestmark = pytest.mark.usefixtures("one_thread")

LONG = [1] + [(7 * i * i + 3 * i + 5) % 125 + 3 for i in range(69)]
VERIFY = [17, 40, 9, 88, 5, 61, 30]  # T = 7
NEXT = [33, 12, 70, 4, 101]  # decoded after the rollback (not the rejected tokens)
ROWS = ((0, 38), (1, 45))  # (slot, prefix length): CSA windows close after 2 / 6 and 3 / 7 verify tokens, HCA 2 / 3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("deepseek_v4")
    build("deepseek_v4", d)
    return d


@pytest.fixture(scope="module")
def model(checkpoint):
    return LLM(checkpoint).model


def _prefilled(model, num_slots: int = 2) -> list:
    caches = model.new_caches(num_slots)
    for slot, n in ROWS:
        model(torch.tensor([LONG[:n]]), caches, StepBatch.make([slot], [0], n))
    return caches


def _accepted_only(model, keep: list[int]) -> list:
    """Caches that saw each row's prefix and then only its first keep[b] verify tokens."""
    caches = _prefilled(model)
    for (slot, n), k in zip(ROWS, keep):
        if k:
            model(torch.tensor([VERIFY[:k]]), caches, StepBatch.make([slot], [n], k))
    return caches


def _decode(model, caches, keep: list[int]) -> torch.Tensor:
    """Logits [len(NEXT), 2, V] of NEXT decoded by both rows together after their accepted tokens."""
    out = []
    for i, tok in enumerate(NEXT):
        batch = StepBatch.make([s for s, _ in ROWS], [n + k + i for (_, n), k in zip(ROWS, keep)], 1)
        out.append(model.logits(model(torch.tensor([[tok], [tok]]), caches, batch)[:, 0]))
    return torch.stack(out)


def _assert_same_state(a: list, b: list) -> None:
    for layer, (ca, cb) in enumerate(zip(a, b)):
        for slot, _ in ROWS:
            torch.testing.assert_close(ca.window[slot], cb.window[slot], atol=1e-5, rtol=1e-5)
            for sa, sb in ((ca.kv[slot], cb.kv[slot]), (ca.index[slot], cb.index[slot])):
                assert (sa is None) == (sb is None), layer
                if sa is None:
                    continue
                for f in fields(sa):
                    name = f.name
                    ta, tb = getattr(sa, name), getattr(sb, name)
                    assert (ta is None) == (tb is None), (layer, slot, name)
                    if ta is not None:
                        torch.testing.assert_close(ta, tb, atol=1e-5, rtol=1e-5, msg=f"{layer} {slot} {name}")


def _crossed(keep: list[int]) -> bool:
    """Whether some row's rejected verify tokens closed a CSA window (ratio 4) that the rollback must reopen."""
    return any((n + j + 1) % 4 == 0 for (_, n), k in zip(ROWS, keep) for j in range(k, len(VERIFY)))


@pytest.mark.parametrize("keep0", range(1, len(VERIFY) + 1))
def test_verify_rollback_equals_caches_that_saw_only_the_accepted_tokens(model, keep0):
    """A 7-token verify of two rows, rolled back to keep0 and 8 - keep0 tokens (windows closed by rejected tokens
    reopened, CSA's overlap and the open window put back), then 5 decode steps: the same state and logits (1e-5,
    fp32) as caches that never saw the rejected tokens."""
    keep = [keep0, len(VERIFY) + 1 - keep0]
    with torch.inference_mode():
        caches = _prefilled(model)
        batch = StepBatch.make([s for s, _ in ROWS], [n for _, n in ROWS], len(VERIFY))
        rb = VerifyRollback(caches, batch)
        model(torch.tensor([VERIFY, VERIFY]), caches, batch)
        rb.done(keep)
        assert not any(c.trail or c.keep_trail for c in caches)
        want = _accepted_only(model, keep)
        _assert_same_state(caches, want)
        got, ref = _decode(model, caches, keep), _decode(model, want, keep)
    assert (got - ref).abs().max().item() < 1e-5, keep


def test_the_compressor_state_must_be_rolled_back(model):
    """Rolling back only the window rows (leaving the compressed entries, open window and overlap as the whole
    verify left them) gives other logits than the accepted-only caches: the test above checks the compressors."""
    keep = [1, 2]
    assert _crossed(keep)
    with torch.inference_mode():
        caches = _prefilled(model)
        for c in caches:
            c.keep_trail = True
        batch = StepBatch.make([s for s, _ in ROWS], [n for _, n in ROWS], len(VERIFY))
        model(torch.tensor([VERIFY, VERIFY]), caches, batch)
        for c in caches:
            c.keep_trail = False
            for (slot, _), k in zip(ROWS, keep):
                (window, _, _), kv, _, _ = c.trail.pop(slot)
                c.window[slot] = torch.cat([window, kv[:k]])[-(c.attn.window - 1):]
        got, ref = _decode(model, caches, keep), _decode(model, _accepted_only(model, keep), keep)
    assert (got - ref).abs().max().item() > 1e-3


def test_slot_rollback_with_other_rows_in_between(model):
    """The pipeline stages' rollback: the verify's keep arrives later, per row, after a forward of another row; each
    row's state is rebuilt from its own trail."""
    keep = [2, 5]
    with torch.inference_mode():
        caches = _prefilled(model, num_slots=3)
        sr = SlotRollback()
        batch = StepBatch.make([s for s, _ in ROWS], [n for _, n in ROWS], len(VERIFY))
        sr.before(caches, batch)
        model(torch.tensor([VERIFY, VERIFY]), caches, batch)
        sr.after(caches)
        model(torch.tensor([LONG[:11]]), caches, StepBatch.make([2], [0], 11))  # another row's prefill meanwhile
        sr.apply(caches, [(1, keep[1])])
        sr.apply(caches, [(0, keep[0])])
        assert not any(c.trail or c.keep_trail for c in caches) and not sr.rows
        want = _accepted_only(model, keep)
        _assert_same_state(caches, want)
        got, ref = _decode(model, caches, keep), _decode(model, want, keep)
    assert (got - ref).abs().max().item() < 1e-5


def test_drafter_save_and_load_restore_a_slot(model):
    """A drafter's per-token snapshots (_save / _load): after drafting on past a window's close, loading the state
    saved after k drafted tokens gives the caches that saw only those k."""
    with torch.inference_mode():
        caches = _prefilled(model)
        saved, other = [_save(caches, 0)], _save(caches, 1)
        for j, tok in enumerate(VERIFY[:5]):
            model(torch.tensor([[tok]]), caches, StepBatch.make([0], [38 + j], 1))
            saved.append(_save(caches, 0))
        for k in (4, 1):  # (decoding after a load moves both rows on; the saved states stay as they were)
            _load(caches, 0, saved[k])
            _load(caches, 1, other)
            want = _accepted_only(model, [k, 0])
            _assert_same_state(caches, want)
            got, ref = _decode(model, caches, [k, 0]), _decode(model, want, [k, 0])
            assert (got - ref).abs().max().item() < 1e-5, k


GREEDY = SamplingParams(max_tokens=40, ignore_eos=True)
PROMPTS = [LONG[:13], LONG[20:29] * 2, LONG[40:46]]


@pytest.fixture(scope="module")
def plain(checkpoint):
    return [o.token_ids for o in LLM(checkpoint).generate(PROMPTS, GREEDY)]


def _reopens(monkeypatch) -> list[tuple[int, int, int]]:
    """Record, for every rewind of a CSA layer's cache, (tokens of the open window before the verify, tokens
    kept, tokens verified)."""
    seen: list[tuple[int, int, int]] = []
    orig = V4Cache.rewind

    def spy(self, slots, keep):
        if self.attn.indexer is not None:
            for s, k in zip(torch.as_tensor(slots).reshape(-1).tolist(), keep):
                (_, series, _), kv, _, _ = self.trail[s]
                seen.append((series.pending_kv.shape[0], k, kv.shape[0]))
        return orig(self, slots, keep)

    monkeypatch.setattr(V4Cache, "rewind", spy)
    return seen


def _reopened(seen: list[tuple[int, int, int]], ratio: int = 4) -> int:
    """Rewinds (in a CSA layer) whose rejected tokens had closed a window."""
    return sum((p + T) // ratio > (p + k) // ratio for p, k, T in seen)


def test_greedy_scripted_drafts_equal_plain_greedy(checkpoint, plain, monkeypatch):
    """Drafts right up to a position cycling over every depth, 40 tokens per row: every accepted length occurs, and
    many verifies reopen a CSA window that their rejected tokens had closed."""
    seen = _reopens(monkeypatch)
    llm = LLM(checkpoint, speculative="ngram", num_speculative_tokens=5, speculative_adaptive=False)
    llm._spec.drafter = Scripted([p + r for p, r in zip(PROMPTS, plain)])
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == plain
    m = outs[0].metrics
    assert 0 < m["spec_acceptance_rate"] < 1 and m["spec_mean_accepted_length"] > 1.5
    assert _reopened(seen) >= 10


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_drafters_equal_plain_greedy(checkpoint, plain, tmp_path, monkeypatch, method):
    """The n-gram drafter and a perturbed deepseek_v4 draft model (whose own V4 caches roll back per drafted token)."""
    seen = _reopens(monkeypatch)
    spec = "ngram" if method == "ngram" else f"draft:{_perturbed_copy(checkpoint, tmp_path / 'draft', 0.05)}"
    outs = LLM(checkpoint, speculative=spec, num_speculative_tokens=4,
               speculative_adaptive=False).generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == plain
    m = outs[0].metrics
    assert 0 < m["spec_accepted"] < m["spec_drafted"]
    assert _reopened(seen) > 0


def test_mtp_on_deepseek_v4_is_refused_as_not_run(checkpoint):
    """DeepSeek-V4's config declares an MTP module (the planner models it) that the engine does not run: asking for
    'mtp' is one ConfigError that says so, in one process and over a pipeline (it said the checkpoint had no MTP
    weights)."""
    from waferline.errors import ConfigError
    from waferline.spec.configs import spec_from_pretrained

    assert spec_from_pretrained(checkpoint).mtp_layers  # (num_nextn_predict_layers: 1, transformers' default)
    for kw in ({}, {"stages": 2}):
        with pytest.raises(ConfigError, match="does not run DeepSeek-V4's MTP module"):
            LLM(checkpoint, speculative="mtp", **kw)
