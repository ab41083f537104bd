"""The server's scheduler over a pipeline: ``PipelineRunner`` runs each scheduler step (engine/runner.py) through the
stage processes of a ``Pipeline``.

The scheduler stays in this process (stage 0); the stages keep their slices of layers and per-slot caches, one slot
per scheduler slot (one BEGIN at start-up sizes them; a RESET message clears the slots of newly admitted sequences).
A step's rows are split into up to M micro-batches that are all launched before the first answer is read, so stage
r works on micro-batch k while stage r-1 works on k+1. The last stage answers greedy rows with their argmax
(EMIT_TOKEN, sampled at temperature 0) and sampled rows with their fp32 logits (EMIT_LOGITS): the scheduler samples
those with each request's own generator, so per-request parameters and seeds hold as in the single-process engine.
The server's engine loop keeps up to M steps in flight over disjoint sequences (``submit`` launches a step,
``collect`` reads its answers: engine/overlap.py), so the stages stay busy while a step is postprocessed; a step
submitted while others are in flight goes as fewer micro-batches (about M in flight in all); so does a speculative
step, whose verify rows ``submit`` launches first (``verify`` is submit + collect).

Speculation (the scheduler's, engine/speculative/serving.py): ``verify`` sends each row's [last token] + drafts as
a verify group (every stage snapshots what the group overwrites, ``SlotRollback``) and the
last stage answers every position: the greedy tokens of greedy rows, the fp32 logits of sampled ones. ``keep`` queues
each row's accepted length; the (slot, keep) pairs ride on the next micro-batch launched, and every stage rolls those
rows back before that micro-batch's forward (stages process micro-batches in order, so before the rows' next forward);
a slot given to a new sequence first drops its pair. An MTP drafter runs here in the scheduler's process, on the
checkpoint's embedding, MTP head, final norm and LM head (``prepare_speculation`` loads them): with ``keep_hidden`` the
last stage sends every row's final hidden states back with its answers. The drafter thus samples with each request's
own generator, as in the single-process engine.

Faults are the pipeline's own (supervise.py): a stage that dies or hangs makes the step raise ``StageError``; the
runner then reports the fault and ``recover`` builds a new pipeline (new stage processes) when it was given a way to.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Container, Iterator
from typing import TYPE_CHECKING, Any

import torch

from waferline.engine.pipeline.supervise import StageError
from waferline.engine.runner import (
    WANT_ARGMAX,
    WANT_LOGITS,
    WANT_LOGPROBS,
    WANT_NONE,
    DecodeRow,
    PrefillChunk,
    RowOutput,
    VerifyRow,
)
from waferline.engine.sampling import SamplingParams
from waferline.engine.stage import (
    EMIT_LOGITS,
    EMIT_LOGPROBS,
    EMIT_NONE,
    EMIT_TOKEN,
    RESET,
    Group,
    MicroBatch,
    decode_feedback,
)
from waferline.model.block_table import BlockTable

if TYPE_CHECKING:
    from waferline.engine.pipeline.driver import Pipeline

_GREEDY = SamplingParams(max_tokens=1, temperature=0.0)  # how the last stage samples EMIT_TOKEN rows
_EMITS = {WANT_NONE: EMIT_NONE, WANT_ARGMAX: EMIT_TOKEN, WANT_LOGITS: EMIT_LOGITS, WANT_LOGPROBS: EMIT_LOGPROBS}

# a row of a step as it travels: (slot, start, tokens, want, index into the step's outputs)
_Row = tuple[int, int, list[int], int, int]
# where a launched micro-batch's answers go: mb id -> (slot -> output index, its groups, whether it is a verify's)
_Where = dict[int, tuple[dict[int, int], list[Group], bool]]
# a submitted step: (where its answers go, its outputs, how many of them are decode rows', its verify rows)
_Submitted = tuple[_Where, list[RowOutput | None], int, list[VerifyRow]]


def _once(fn: Callable[[], Any]) -> Iterator[Any]:
    """``fn`` as a one-item iterator, for ``Pipeline._guarded`` (which turns transport failures into StageError)."""
    yield fn()


class PipelineRunner:
    """A ``Runner`` over the stage processes of ``pipe``; ``rebuild`` returns a new Pipeline after a fault."""

    overlap = True  # the engine loop may keep several steps in flight (submit / collect: engine/overlap.py),
    verify_in_flight = True  # speculative ones too (a step's verify rows go with ``submit``)
    verify_with_step = True  # ``verify`` also takes the step's decode rows and prefill chunks: one trip for all

    def __init__(self, pipe: Pipeline, num_slots: int, rebuild: Callable[[], Pipeline] | None = None):
        self.rebuild = rebuild
        self.num_slots = num_slots
        self._keep_hidden = False
        self._rewinds: list[tuple[int, int]] = []  # (slot, keep) of verified rows, sent with the next micro-batch
        self._verified: list[int] = []  # slots of the verify whose keep() has not come yet
        self._mtp_model: Any = None  # the MTP drafter's modules (embedding, MTP head, norm, LM head), once loaded
        self.max_in_flight = 0  # the most steps submitted and not collected at once so far
        self._submitted: list[_Submitted] = []
        self._early: dict[int, tuple[list[int], torch.Tensor]] = {}  # answers read before their step's collect
        self._in_chain: set[int] = set()  # micro-batches launched and not answered yet
        self._table: BlockTable | None = None  # the scheduler's page table, which the stages' paged caches follow
        self._sent: dict[int, list[int]] = {}  # slot -> its pages as the stages last heard them
        self._bound: int | None = None  # the pages the stages' paged pools were sized for at the last BEGIN
        self._attach(pipe)

    def _attach(self, pipe: Pipeline) -> None:
        self.pipe = pipe
        self.spec = pipe.spec
        self.cache_bits = torch.finfo(pipe.dtype).bits
        self._begin()

    def _begin(self) -> None:
        """Fresh caches of ``num_slots`` rows on every stage; the last stage samples EMIT_TOKEN rows greedily."""
        self._rewinds, self._verified, self._submitted, self._early, self._in_chain = [], [], [], {}, set()
        self._sent = {}
        pt = self._table.page_tokens if self._table is not None else None
        self._bound = bound = self._stage_pages()
        self._guard(lambda: self.pipe._begin(self.num_slots, _GREEDY, self._keep_hidden, pt, bound))

    def _stage_pages(self) -> int | None:
        """The most pages (the sink included) a stage's paged pools hold: the scheduler's bound on its table (None
        until its CacheManager sets one). A stage makes its pools that size once, as the single-process engine does;
        without a bound they grow by doubling, to up to twice the pages the cache budget pays for."""
        return self._table.max_pages if self._table is not None else None

    def _check_bound(self) -> None:
        """The scheduler bounds its table's pages after ``block_table`` (whose BEGIN could not say it), before it
        admits a sequence: the stages start again with pools of that size before the first sequence's reset."""
        if self._stage_pages() != self._bound:
            self._begin()

    @property
    def keep_hidden(self) -> bool:
        """Give every row's final hidden states back (``RowOutput.hidden``: an MTP drafter consumes them)."""
        return self._keep_hidden

    @keep_hidden.setter
    def keep_hidden(self, on: bool) -> None:
        if bool(on) != self._keep_hidden:
            self._keep_hidden = bool(on)
            self._begin()  # (the last stage learns it at BEGIN; the scheduler sets it before its first step)

    def _guard(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` under the pipeline's guard; a fault raises StageError with the fault's own words."""
        try:
            return list(self.pipe._guarded(_once(fn)))[0]  # (run to the end: the guard holds the pipeline's lock)
        except StageError as e:
            raise type(e)(self.fault() or str(e)) from None

    # -- the Runner interface
    def step(self, decodes: list[DecodeRow], prefills: list[PrefillChunk]
             ) -> tuple[list[RowOutput | None], list[RowOutput | None]]:
        if not (decodes or prefills):
            return [], []
        return self.collect(self.submit(decodes, prefills, parts=self.pipe.micro_batches))

    def verify(self, rows: list[VerifyRow], decodes: list[DecodeRow] = (), prefills: list[PrefillChunk] = ()
               ) -> Any:
        """One pass of every row's tokens (its last token, then its drafts) through the stages, each stage ready to
        roll its layers' caches back; ``keep`` must follow before the next step. A greedy row's answer is every
        position's argmax (``argmaxes``), a sampled row's the fp32 logits [len(tokens), V]; with ``keep_hidden`` each
        has its hidden states [W, ...] (W: the longest row's length, shorter rows zero-padded).

        With ``decodes`` / ``prefills`` (the rest of the scheduler's step) those travel in the same trip through the
        stages, launched behind the verify's micro-batches: returns (verify outputs, decode outputs, prefill
        outputs)."""
        got = self.collect(self.submit(decodes, prefills, rows, parts=self.pipe.micro_batches))
        return got if decodes or prefills else got[0]

    def keep(self, counts: list[int]) -> None:
        """After ``verify``: row b keeps its first ``counts[b]`` tokens on every stage (with the next micro-batch)."""
        self._rewinds += list(zip(self._verified, counts))
        self._verified = []

    def prepare_speculation(self, method: str) -> tuple[Any, list[Any]]:
        """What the scheduler's speculation needs: a model for its drafter (stage 0's slice for n-grams, which need
        only the ModelSpec; for 'mtp' the checkpoint's embedding, MTP head, final norm and LM head, loaded here once)
        and caches that carry the model's sliding windows (zero-slot stand-ins: a verify must not wrap a ring)."""
        from waferline.model.attention import TokenCache

        windows = {w for w in (getattr(layer.mixer, "sliding_window", None) for layer in self.spec.layers) if w}
        standins = [TokenCache(0, 1, self.pipe.dtype, window=w) for w in sorted(windows)]
        if method != "mtp":
            return self.pipe.runner.model, standins
        if self._mtp_model is None:
            self._mtp_model = load_mtp_drafter(self.pipe.path, self.pipe.dtype, self.pipe.convert)
        return self._mtp_model, standins

    def prompt_logprobs(self, token_ids: list[int], slot: int = 0) -> torch.Tensor:
        """The fp32 log-softmax at every position of ``token_ids``, [len, V], prefilled into the free cache ``slot``
        (in pieces of the pipeline's prefill chunk, streamed through the stages)."""
        self.reset_slots([slot])
        _, outs = self.step([], [PrefillChunk(slot, 0, list(token_ids), WANT_LOGPROBS)])
        assert outs[0] is not None and outs[0].logits is not None
        return torch.log_softmax(outs[0].logits.float(), dim=-1)

    def reset_slots(self, slots: list[int]) -> None:
        self._check_bound()
        fresh = set(slots)
        self._rewinds = [(s, k) for s, k in self._rewinds if s not in fresh]  # (a new sequence: nothing to roll back)

        def reset() -> None:
            self.pipe.runner.reset_slots(slots)
            if self.pipe.num_stages > 1:
                self.pipe._send_chain(RESET, list(slots))

        self._guard(reset)

    def block_table(self, page_tokens: int) -> BlockTable | None:
        """The page table the scheduler's CacheManager allocates from; every stage's paged caches (full attention,
        MLA latents) follow it, the changes riding on the micro-batches (``MicroBatch.pages``)."""
        layers = frozenset(i for i, layer in enumerate(self.spec.layers) if _paged_mixer(layer.mixer))
        if not layers:
            return None
        self._table = BlockTable(self.num_slots, page_tokens, managed=True, parts=self._page_parts())
        self._table.layers = layers
        self._begin()  # (the stages learn the page size at BEGIN)
        return self._table

    def _page_parts(self) -> int:
        return 1  # (the stages hold every slot)

    def prefix_caches(self) -> list[Any] | None:
        """Every layer's cache is a paged token cache following the scheduler's pages: prefixes are shared by page
        (an empty list: the stages hold the caches); else None."""
        if self._table is None or len(self._table.layers) != len(self.spec.layers) or \
                getattr(self.pipe, "ids_downstream", False):  # (AFD has no stages after the first)
            return None
        return []

    def fault(self) -> str | None:
        """Why the pipeline cannot run a step (a stage died, hung or failed), or None."""
        p = self.pipe
        if p._fault is not None:  # (the watchdog's diagnosis names the process)
            return f"{p._engine_name} failed: {p._fault}"
        if p._broken is not None:
            return str(p._broken)
        if p._closed:
            return f"the {p._engine_name} is closed"
        return None

    def recover(self) -> None:
        """A healthy pipeline gets fresh caches (a BEGIN); a broken one is replaced by a new one (new processes).
        The answers of steps still in flight are read (and dropped) first."""
        try:
            for h in list(self._submitted):
                self.collect(h)
            if self.fault() is None:  # (a step that failed while launching: its answers still come)
                self._guard(lambda: [self._recv() for _ in list(self._in_chain)])
        except StageError:
            pass
        if self.fault() is None:
            self._begin()
            return
        self.pipe.close()
        if self.rebuild is None:
            raise StageError(f"{self.fault()}; no way to start new processes was given")
        self._attach(self.rebuild())

    def close(self) -> None:
        self.pipe.close()

    # -- micro-batches
    def _split(self, rows: list[_Row], n_decodes: int, parts: int | None = None) -> list[list[_Row]]:
        """Micro-batches: the decode rows in up to M (or ``parts``) contiguous runs of near-equal size, then the prefill
        chunks in order, each micro-batch taking up to the pipeline's ``prefill_chunk`` tokens (beside its decode rows:
        what is left of it, at least one) and a chunk split where that room ends (``pack_prefills``), so a long prompt
        streams through the stages piece after piece."""
        M = max(1, min(parts or self.pipe.micro_batches, n_decodes))
        mbs: list[list[_Row]] = [[] for _ in range(M if n_decodes else 0)]
        for k, row in enumerate(rows[:n_decodes]):
            mbs[k * M // n_decodes].append(row)
        chunk = self.pipe.prefill_chunk
        bins = pack_prefills(rows[n_decodes:], [max(chunk - len(mb), 1) for mb in mbs], chunk)
        return [mb + b for mb, b in itertools.zip_longest(mbs, bins, fillvalue=[]) if mb or b]

    def _launch_all(self, mbs: list[list[_Row]], verify: bool = False) -> _Where:
        """Launch the micro-batches ``mbs`` (``verify``: each one verify group); returns where their answers go."""
        pipe = self.pipe
        where: _Where = {}
        for rows in mbs:
            by_T: dict[int, list[_Row]] = {}
            for row in rows:
                by_T.setdefault(max(len(r[2]) for r in rows) if verify else len(row[2]), []).append(row)
            groups, toks = [], []
            for T in sorted(by_T):
                g = Group(T, drafts=[] if verify else None)
                for slot, start, tokens, want, _ in by_T[T]:
                    g.seqs.append(slot)
                    g.slots.append(slot)
                    g.starts.append(start)
                    g.emits.append(_EMITS[want])
                    if g.drafts is not None:
                        g.drafts.append(tokens[1:])
                groups.append(g)
                toks.append(torch.tensor([r[2] + [0] * (T - len(r[2])) for r in by_T[T]], dtype=torch.long))
            pipe._carry_ids(groups, toks)
            pipe._mb_ids += 1
            mb = MicroBatch(pipe._mb_ids, groups, self._rewinds, self._page_changes(rows))
            self._rewinds = []
            where[mb.mb_id] = ({r[0]: r[4] for r in rows if r[3] != WANT_NONE or self._keep_hidden}, groups, verify)
            while len(self._in_chain) >= max(1, pipe.micro_batches):  # (at most M micro-batches in the chain)
                meta, tail = self._recv()
                self._early[meta[0]] = (meta, tail)
            pipe._launch(mb, toks)
            self._in_chain.add(mb.mb_id)
        return where

    def _page_changes(self, rows: list[_Row]) -> list[tuple[int, list[int]]]:
        """The pages the stages must follow before running ``rows``: slots released or given other pages since they
        last heard (first: their rows' pending entries go to the old pages before another slot gets one), then the
        rows' slots whose pages changed."""
        t = self._table
        if t is None:
            return []
        out: list[tuple[int, list[int]]] = [(s, []) for s, was in self._sent.items() if t.slots[s][:len(was)] != was]
        for s, _ in out:
            del self._sent[s]
        for row in rows:
            pages = t.slots[row[0]]
            if pages and self._sent.get(row[0]) != pages:
                self._sent[row[0]] = list(pages)
                out.append((row[0], list(pages)))
        return out

    def _recv(self) -> tuple[list[int], torch.Tensor]:
        meta, tail = self.pipe._recv_feedback()
        self._in_chain.discard(meta[0])
        return meta, tail

    def _gather(self, where: _Where, outs: list[RowOutput | None]) -> None:
        """Read the answers of the micro-batches in ``where`` into ``outs``; answers of other submitted steps that
        come first are kept for their ``collect``."""
        pipe = self.pipe
        while where:
            mine = next((i for i in where if i in self._early), None)
            meta, tail = self._early.pop(mine) if mine is not None else self._recv()
            got = where.pop(meta[0], None)
            if got is None:
                if not any(meta[0] in h[0] for h in self._submitted):
                    raise StageError(f"protocol error: an answer for micro-batch {meta[0]}, which is not in flight")
                self._early[meta[0]] = (meta, tail)
                continue
            self._answers(meta, tail, got[1], got[0], outs, got[0] if got[2] else ())
        if pipe.num_stages > 1 and not self._submitted:
            pipe.act.flush()

    # -- steps in flight (engine/overlap.py): launched now, their answers read later
    def submit(self, decodes: list[DecodeRow], prefills: list[PrefillChunk], verifies: list[VerifyRow] = (),
               parts: int | None = None) -> _Submitted:
        """Launch a step's micro-batches (its verify rows' first, as verify groups) without waiting for their answers;
        ``collect`` reads them."""
        n = len(verifies)
        items: list[_Row] = [(r.slot, r.position, list(r.tokens), r.want, i) for i, r in enumerate(verifies)]
        rows = _plain_rows(decodes, prefills, n)
        parts = parts or max(1, self.pipe.micro_batches - len(self._submitted))  # (about M micro-batches in flight)

        def launch() -> _Where:
            where = self._launch_all(self._split(items, n, parts), verify=True) if items else {}
            return where | (self._launch_all(self._split(rows, len(decodes), parts)) if rows else {})

        h: _Submitted = (self._guard(launch) if items or rows else {}, [None] * (n + len(rows)), len(decodes),
                         list(verifies))
        self._submitted.append(h)
        self.max_in_flight = max(self.max_in_flight, len(self._submitted))
        return h

    def collect(self, h: _Submitted) -> Any:
        """The outputs of a submitted step: (decode rows', prefill chunks'); of one with verify rows, (verify rows',
        decode rows', prefill chunks'), and ``keep`` then names its verify rows' accepted lengths."""
        where, outs, nd, verifies = h
        self._submitted.remove(h)
        self._guard(lambda: self._gather(where, outs))
        if not verifies:
            return outs[:nd], outs[nd:]
        n, self._verified = len(verifies), [r.slot for r in verifies]
        mine = _padded(outs[:n], max(len(r.tokens) for r in verifies)) if self._keep_hidden else outs[:n]
        return mine, outs[n:n + nd], outs[n + nd:]

    def _answers(self, meta: list[int], tail: torch.Tensor, groups: list[Group], slots: dict[int, int],
                 outs: list[RowOutput | None], verify: Container[int]) -> None:
        """One micro-batch's feedback into the outputs of its rows (``slots``: row -> output index; a group's rows
        are named by ``Group.seqs``; the rows in ``verify`` were verify rows: every position's answer)."""
        _, tokens, logits = decode_feedback(meta, tail, self.spec.vocab_size)
        hidden = self._hidden(tail, logits, groups) if self._keep_hidden else {}
        whole = {s for g in groups for s, e in zip(g.seqs, g.emits) if e == EMIT_LOGPROBS}
        for slot, i in slots.items():
            out = None
            v = slot in verify
            if slot in logits:
                out = RowOutput(logits=(logits[slot] if v or slot in whole else logits[slot][0]).clone())
            elif tokens.get(slot):
                out = RowOutput(argmaxes=tokens[slot]) if v else RowOutput(argmax=tokens[slot][0])
            if slot in hidden:
                out = out or RowOutput()
                out.hidden = hidden[slot]
            outs[i] = _joined(outs[i], out)

    def _hidden(self, tail: torch.Tensor, logits: dict[int, torch.Tensor], groups: list[Group]
                ) -> dict[int, torch.Tensor]:
        """Every row's final hidden states [T, ...] from the bytes behind the fp32 logits of a feedback message."""
        model = self.pipe.runner.model
        row = (model.hc_mult, self.spec.hidden_size) if model.hc_mult else (self.spec.hidden_size,)
        dt = self.pipe.dtype
        esz = torch.empty(0, dtype=dt).element_size()
        off = sum(x.shape[0] for x in logits.values()) * self.spec.vocab_size * 4
        out: dict[int, torch.Tensor] = {}
        for g in groups:
            n = g.B * g.T * math.prod(row) * esz
            h = tail[off:off + n].clone().view(dt).view(g.B, g.T, *row)
            off += n
            for b, s in enumerate(g.seqs):
                out[s] = h[b]
        return out


def _plain_rows(decodes: list[DecodeRow], prefills: list[PrefillChunk], first: int = 0) -> list[_Row]:
    """A step's decode rows, then its prefill chunks, as rows whose outputs go to indices ``first``, ``first + 1``..."""
    rows: list[_Row] = [(r.slot, r.position, [r.token], r.want, first + i) for i, r in enumerate(decodes)]
    return rows + [(c.slot, c.start, c.tokens, c.want, first + len(decodes) + i) for i, c in enumerate(prefills)]


def _paged_mixer(mixer: Any) -> bool:
    """A layer whose cache is a paged token cache (full attention without a window, or MLA latents)."""
    from waferline.spec.model import AttentionSpec, MLASpec

    return type(mixer) is MLASpec or (type(mixer) is AttentionSpec and mixer.sliding_window is None)


def _joined(before: RowOutput | None, out: RowOutput | None) -> RowOutput | None:
    """The answer of a prefill chunk that ran as pieces (``pack_prefills``), one piece's answer after another's: hidden
    states and prompt log-probs are concatenated; the next token is the last piece's."""
    if before is None or out is None:
        return out or before
    if before.hidden is not None and out.hidden is not None:
        out.hidden = torch.cat([before.hidden, out.hidden])
    if before.logits is not None and out.logits is not None and before.logits.dim() == 2:
        out.logits = torch.cat([before.logits, out.logits])
    return out


def pack_prefills(chunks: list[_Row], room: list[int], chunk: int) -> list[list[_Row]]:
    """Prefill chunks packed in order into bins: bin i takes up to ``room[i]`` tokens (bins after those: ``chunk``), a
    chunk is split where a bin's room ends. A piece before a chunk's last wants nothing, except log-prob rows (every
    piece answers its positions) and the hidden states a runner keeps (``_joined`` puts the pieces back together)."""
    bins: list[list[_Row]] = [[] for _ in room]
    room = list(room)
    i = 0
    for slot, start, tokens, want, idx in chunks:
        pos = 0
        while pos < len(tokens):
            if i == len(bins):
                bins.append([])
                room.append(chunk)
            n = min(len(tokens) - pos, room[i])
            if n <= 0:
                i += 1
                continue
            end = pos + n == len(tokens)
            bins[i].append((slot, start + pos, tokens[pos:pos + n], want if end or want == WANT_LOGPROBS else WANT_NONE,
                            idx))
            room[i] -= n
            pos += n
            if room[i] <= 0:
                i += 1
    return bins


def _padded(outs: list[RowOutput | None], width: int) -> list[RowOutput | None]:
    """Verify outputs whose hidden states are zero-padded (or cut) to ``width`` positions, so they stack."""
    for o in outs:
        if o is not None and o.hidden is not None and o.hidden.shape[0] != width:
            h = o.hidden[:width]
            o.hidden = torch.cat([h, h.new_zeros(width - h.shape[0], *h.shape[1:])])
    return outs


def load_mtp_drafter(path: Any, dtype: torch.dtype, convert: dict[str, int] | None = None) -> Any:
    """The parts of a checkpoint an MTP drafter runs on, for a process that holds no layer's weights: the embedding,
    the MTP head(s), the final norm and the LM head (a DecoderModel without decoder layers); its MTP head in int4
    where the stages' layers are and its LM head in int8 with head_bits 8 (``convert``), as LLM's drafter."""
    from pathlib import Path

    from waferline.engine.inputs import is_int4_checkpoint
    from waferline.engine.speculative.drafters import check_mtp
    from waferline.model.load import load_model
    from waferline.model.quant import quantize_mtp

    convert = convert or {}
    model = load_model(path, dtype, range(0), has_embed=True, has_head=True)
    check_mtp(len(model.mtp), path, model.spec.model_type)
    ckpt = is_int4_checkpoint(Path(path))
    quantize_mtp(model, ckpt or convert.get("weight_bits") == 4, None if ckpt else convert.get("group_size"))
    model.quantize_head(convert.get("head_bits", 16))
    return model
