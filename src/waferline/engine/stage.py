"""One pipeline stage: its slice of layers and caches and the worker process loop (the messages between stages are
engine/messages.py, the transport underneath engine/transport.py)."""

from __future__ import annotations

import datetime
import os
import signal
import sys
import threading
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist

from waferline.engine.messages import (
    BEGIN,
    EMIT_LOGITS,
    EMIT_LOGPROBS,
    EMIT_NONE,
    EMIT_TOKEN,
    EMIT_VERIFY,
    FEEDBACK,
    RESET,
    SHUTDOWN,
    STEP,
    Emit,
    Group,
    Kind,
    MicroBatch,
    decode_feedback,
)
from waferline.engine.sampling import SamplingParams, greedy, make_generator, sample, seeded_generator
from waferline.engine.transport import (
    LOOPBACK,
    MAX_PENDING_SENDS,
    SLOT_BYTES,
    Control,
    Link,
    PeerLost,
    _client_of,
    json_meta,
    loopback_host,
    loopback_store,
    make_group,
    meta_json,
)
from waferline.model.arena import move_to_huge_pages

# (the transport's names are re-exported: the pipeline, AFD and their tests import them from here)
__all__ = ["Kind", "Emit", "BEGIN", "STEP", "SHUTDOWN", "FEEDBACK", "RESET", "EMIT_NONE", "EMIT_TOKEN", "EMIT_LOGPROBS",
           "EMIT_VERIFY", "EMIT_LOGITS", "EXIT_ERROR", "EXIT_PEER_LOST", "EXIT_ABORTED", "PUBLISH_INTERVAL_S",
           "LOOPBACK", "MAX_PENDING_SENDS", "SLOT_BYTES", "Control", "Link",
           "PeerLost", "json_meta", "loopback_host", "loopback_store", "make_group", "meta_json", "Group",
           "MicroBatch", "StageRunner", "decode_feedback", "serve", "worker_main", "worker_ready", "worker_failed",
           "worker_load_failed", "check_mtp", "ctl_safe_set"]

# worker exit codes the driver interprets
EXIT_ERROR, EXIT_PEER_LOST, EXIT_ABORTED = 3, 4, 5
PUBLISH_INTERVAL_S = 0.1


class StageRunner:
    """The compute of one stage: embed (first), its layers, and logits + sampling (last)."""

    def __init__(self, model: Any, rank: int, num_stages: int, device: torch.device):
        self.model = model
        # this stage's weights in transparent huge pages (model/arena.py: a decode step streams them)
        self.arena = move_to_huge_pages(model) if device.type == "cpu" else None
        self.rank = rank
        self.is_first = rank == 0
        self.is_last = rank == num_stages - 1
        self.device = device
        self.caches: list[Any] = []
        self.params: SamplingParams | None = None
        self.gens: list[torch.Generator | None] = []
        from waferline.engine.speculative import SlotRollback

        self.rollback = SlotRollback()  # speculative verifies of this stage's layers, until their keep arrives
        self.spec: Any = None  # the last stage's LastStageSpec when the run speculates
        self.send_hidden = False  # the last stage returns every row's final hidden states (the server's MTP drafter)

    def begin(self, cfg: dict[str, Any]) -> None:
        """A new set of sequences: fresh caches for ``num_slots`` rows; the last stage sets up sampling (and, when
        ``cfg["spec"]`` is set, speculative verification / MTP drafting; with ``cfg["hidden"]`` its feedback carries
        the final hidden states of every row)."""
        self.caches = self.model.new_caches(int(cfg["num_slots"]), self.device)
        self.rollback.reset()
        self.spec = None
        self.send_hidden = bool(cfg.get("hidden")) and self.is_last
        if self.is_last:

            p = cfg.get("params") or {}
            self.params = SamplingParams(
                max_tokens=1,
                temperature=float(p.get("temperature", 0.0)),
                top_p=float(p.get("top_p", 1.0)),
                top_k=int(p.get("top_k", 0)),
                seed=p.get("seed"),
            )
            n = int(cfg["num_slots"])
            p = self.params
            self.gens = [make_generator(p) if p.seed is None else seeded_generator(p, i) for i in range(n)]
            if cfg.get("spec"):
                from waferline.engine.speculative import LastStageSpec

                self.spec = LastStageSpec(self.model, cfg, self.params, self.gens)

    @torch.inference_mode()  # (a rollback may have left inference tensors in the caches)
    def reset_slots(self, slots: list[int]) -> None:
        """New sequences start in ``slots``: clear their ring positions and recurrent state in this stage's caches
        (and forget a verify of the slots' previous sequences whose rollback had not arrived)."""
        for s in slots:
            self.rollback.rows.pop(s, None)
        index = torch.tensor(slots, dtype=torch.long, device=self.device)
        for c in self.caches:
            if c is not None:
                c.reset(index)

    @torch.inference_mode()
    def forward(self, mb: MicroBatch, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """inputs per group: token ids [B, T] on the first stage, hidden states [B, T, D] elsewhere (DeepSeek-V4: its
        streams [B, T, hc_mult, D]). Rows named in ``mb.rewinds`` are rolled back first; verify groups record what a
        later rollback needs. DeepSeek-V4's hash-routed layers read the step's token ids from ``batch.memo`` (the
        first stage's inputs, or the ids the group carries)."""
        from waferline.model.context import StepBatch

        if mb.rewinds:
            self.rollback.apply(self.caches, mb.rewinds, self.device)
        out = []
        for g, x in zip(mb.groups, inputs):
            batch = StepBatch.make(g.slots, g.starts, g.T, self.device)
            if self.model.hc_mult:
                ids = x if self.is_first else g.tokens
                if ids is not None:
                    batch.memo["tokens"] = torch.as_tensor(ids, dtype=torch.long, device=self.device).view(g.B, g.T)
            if self.is_first:
                x = self.model.embed_tokens(x.to(self.device))
            if g.verify and g.T > 1:
                self.rollback.before(self.caches, batch)
                try:
                    out.append(self.model.forward_layers(x, self.caches, batch))
                finally:
                    self.rollback.after(self.caches)
            else:
                out.append(self.model.forward_layers(x, self.caches, batch))
        return out

    @torch.inference_mode()
    def feedback(self, mb: MicroBatch, hs: list[torch.Tensor], extra: torch.Tensor | None = None
                 ) -> tuple[list[int], list[torch.Tensor]]:
        """The last stage's answer for a micro-batch: emitted tokens (a variable number per row: speculative verifies
        emit 1..K+1), the next drafts per row (MTP drafting here), and log-probs.

        meta = [mb_id, R, n_tok, n_lp, n_dr] + seq[R] + count[R] + dcount[R] + tokens[n_tok] + drafts[n_dr]
               + lp_seq[n_lp] + lp_T[n_lp];
        tensors = [fp32 log-probs, [sum lp_T, V]] when n_lp > 0. With ``send_hidden`` one byte tensor instead: the
        log-probs, then every group's final hidden states [B, T, ...] in the model's dtype, group after group.

        A verify group's rows that ask for EMIT_TOKEN or EMIT_LOGITS (the server's scheduler verifies them itself)
        get every position's answer up to their last draft: the greedy tokens (len(draft) + 1 of them) or the fp32
        logits [len(draft) + 1, V].
        """
        seqs, counts, toks, lp_seqs, lp_T, lps, ks = [], [], [], [], [], [], []
        qs = self.split_probs(mb, extra)
        for g, h, gq in zip(mb.groups, hs, qs):
            if g.verify:
                rows = [r for r in range(g.B) if g.emits[r] == EMIT_VERIFY]
                if rows:
                    if self.spec is None:
                        raise RuntimeError("a verify micro-batch arrived but this run does not speculate")
                    logits = self.model.logits(h[rows]).float().cpu()
                    em = self.spec.verify([g.seqs[r] for r in rows], [g.drafts[r] for r in rows], [gq[r] for r in rows],
                                          logits, h[rows])
                    for r, t in zip(rows, em):
                        seqs.append(g.seqs[r])
                        counts.append(len(t))
                        toks += t
                        ks.append(g.ks[r] if g.ks is not None else 0)
                self._positions(g, h, seqs, counts, toks, ks, lp_seqs, lp_T, lps)
                continue
            if self.spec is not None and g.tokens is not None:
                for r in range(g.B):
                    self.spec.prefill(g.seqs[r], g.tokens[r * g.T:(r + 1) * g.T], h[r])
            rows = [r for r in range(g.B) if g.emits[r] == EMIT_TOKEN]
            if rows:
                logits = self.model.logits(h[rows, -1]).float().cpu()
                for k, r in enumerate(rows):
                    seqs.append(g.seqs[r])
                    counts.append(1)
                    toks.append(sample(logits[k], self.params, self.gens[g.seqs[r]]))
                    ks.append(g.ks[r] if g.ks is not None else 0)
                    if self.spec is not None:
                        self.spec.first(g.seqs[r], toks[-1])
            for r in range(g.B):
                if g.emits[r] == EMIT_LOGPROBS:
                    lp_seqs.append(g.seqs[r])
                    lp_T.append(g.T)
                    lps.append(torch.log_softmax(self.model.logits(h[r]).float(), dim=-1))
                elif g.emits[r] == EMIT_LOGITS:  # (travels as a one-position "log-prob" row: raw logits)
                    lp_seqs.append(g.seqs[r])
                    lp_T.append(1)
                    lps.append(self.model.logits(h[r, -1:]).float())
        drafts = self.spec.draft(seqs, ks) if self.spec is not None else [[] for _ in seqs]
        flat = [t for d in drafts for t in d]
        meta = ([mb.mb_id, len(seqs), len(toks), len(lp_seqs), len(flat)] + seqs + counts + [len(d) for d in drafts]
                + toks + flat + lp_seqs + lp_T)
        tail = [torch.cat(lps)] if lps else []
        if self.send_hidden:
            parts = [t.detach().contiguous().reshape(-1).view(torch.uint8).cpu() for t in tail + list(hs)]
            tail = [torch.cat(parts)] if parts else []
        return meta, tail

    def _positions(self, g: Group, h: torch.Tensor, seqs: list[int], counts: list[int], toks: list[int],
                   ks: list[int], lp_seqs: list[int], lp_T: list[int], lps: list[torch.Tensor]) -> None:
        """A verify group's EMIT_TOKEN / EMIT_LOGITS rows: every position's greedy token or fp32 logits, up to the
        row's last draft (padding excluded)."""
        want = [r for r in range(g.B) if g.emits[r] in (EMIT_TOKEN, EMIT_LOGITS)]
        if not want:
            return
        logits = self.model.logits(h[want]).float().cpu()
        for k, r in enumerate(want):
            n = len(g.drafts[r]) + 1
            if g.emits[r] == EMIT_TOKEN:
                seqs.append(g.seqs[r])
                counts.append(n)
                toks += greedy(logits[k, :n])
                ks.append(0)
            else:
                lp_seqs.append(g.seqs[r])
                lp_T.append(n)
                lps.append(logits[k, :n])

    def split_probs(self, mb: MicroBatch, extra: torch.Tensor | None) -> list[list[torch.Tensor | None]]:
        """Per group and row, the drafter's probabilities [len(draft), V] that ride behind the hidden states."""
        V = self.model.spec.vocab_size
        flat = extra.clone().view(torch.float32) if extra is not None and extra.numel() else None
        out, off = [], 0
        for g in mb.groups:
            row: list[torch.Tensor | None] = [None] * g.B
            if g.has_q and g.drafts is not None and flat is not None:
                for r, d in enumerate(g.drafts):
                    if d:
                        row[r] = flat[off: off + len(d) * V].view(len(d), V)
                        off += len(d) * V
            out.append(row)
        return out

    def split(self, mb: MicroBatch, tail: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Hidden states per group ([B, T, D], DeepSeek-V4's streams [B, T, hc_mult, D]) from the raw bytes of a STEP
        message, and the bytes after them (draft probabilities, passed on unchanged to the last stage)."""
        d, n_hc = self.model.spec.hidden_size, self.model.hc_mult
        row = (n_hc, d) if n_hc else (d,)
        D, dt = d * max(n_hc, 1), self.model.dtype
        n_h = sum(g.B * g.T for g in mb.groups) * D
        nbytes = n_h * torch.empty(0, dtype=dt).element_size()
        flat = tail[:nbytes].view(dt)
        out, i = [], 0
        for g in mb.groups:
            n = g.B * g.T * D
            out.append(flat[i:i + n].view(g.B, g.T, *row))
            i += n
        return out, tail[nbytes:]

    def split_hidden(self, mb: MicroBatch, tail: torch.Tensor) -> list[torch.Tensor]:
        """Hidden states per group from the raw bytes of a STEP message."""
        return self.split(mb, tail)[0]


# ---------------------------------------------------------------- worker process

def _publisher(ctl: Control, rank: int, state: dict[str, Any], driver_pid: int | None) -> None:
    """Publish this stage's progress counter; exit the process if the driver is gone or asked for an abort."""
    last = None
    while True:
        if driver_pid is not None:  # first: a store call to a driver that is gone logs a C++ trace before it fails
            try:
                os.kill(driver_pid, 0)
            except ProcessLookupError:
                os._exit(EXIT_PEER_LOST)
        n = state["processed"]
        if n != last:
            try:
                ctl.set("progress", rank, str(n))
            except Exception:
                os._exit(EXIT_PEER_LOST)
            last = n
        try:
            if ctl.get("abort") is not None:
                os._exit(EXIT_ABORTED)
        except Exception:
            os._exit(EXIT_PEER_LOST)
        time.sleep(PUBLISH_INTERVAL_S)


def serve(store: Any, run_id: str, rank: int, num_stages: int, load: dict[str, Any], device: torch.device,
          local: bool, driver_pid: int | None = None) -> int:
    """Run stage ``rank`` (>= 1) until SHUTDOWN: receive from rank-1, compute, send on (or feed back to rank 0)."""
    ctl = Control(store, run_id)
    ctl.set("alive", rank, str(os.getpid()))
    state = {"processed": 0}
    try:
        act = Link(make_group(store, f"waferline/{run_id}/act", rank, num_stages, device, local), device)
        fb = Link(make_group(store, f"waferline/{run_id}/fb", rank, num_stages, device, local), device)
        from waferline.model.load import load_model
        from waferline.model.quant import loading_for, move_model

        a, b = load["layer_range"]
        last = rank == num_stages - 1
        mtp = bool(load.get("mtp")) and last  # MTP drafts on the last stage: it needs the embeddings and the head
        with loading_for(device):
            model = load_model(load["path"], load["dtype"], range(a, b), has_embed=mtp, has_head=last,
                               **load.get("extra", {}))
        if mtp:
            check_mtp(model, load["path"])
        if device.type != "cpu":  # (int4 weights repacked for the device's kernel)
            move_model(model, device)
    except Exception as e:  # a load error (bad checkpoint, ...) goes to the driver, which raises it
        return worker_load_failed(ctl, rank, e)
    worker_ready(ctl, store, load, run_id, rank, state, driver_pid, f"waferline-stage{rank}-publisher")
    runner = StageRunner(model, rank, num_stages, device)
    last = runner.is_last
    try:
        while True:
            kind, meta, tail = act.recv(rank - 1)
            if kind == SHUTDOWN:
                if not last:
                    act.send(rank + 1, SHUTDOWN, [])
                    act.flush()
                state["processed"] += 1
                return 0
            if kind == BEGIN:
                runner.begin(meta_json(meta))
                if not last:
                    act.send(rank + 1, BEGIN, meta)
            elif kind == RESET:
                runner.reset_slots(meta)
                if not last:
                    act.send(rank + 1, RESET, meta)
            elif kind == STEP:
                mb = MicroBatch.decode(meta)
                h_in, extra = runner.split(mb, tail)
                hs = runner.forward(mb, h_in)
                if last:
                    fmeta, ft = runner.feedback(mb, hs, extra)
                    fb.send(0, FEEDBACK, fmeta, ft)
                else:
                    act.send(rank + 1, STEP, meta, hs + ([extra] if extra.numel() else []))
            state["processed"] += 1
    except Exception as e:
        return worker_failed(ctl, rank, e)


def worker_load_failed(ctl: Control, rank: int, e: Exception) -> int:
    """A worker could not load its part: say why through the store (the driver raises it) and pick the exit code."""
    ctl.set("status", rank, f"{type(e).__name__}: {e}")
    _print_unexpected(e)
    return EXIT_ERROR


def _print_unexpected(e: BaseException) -> None:
    """A worker's traceback, for errors that look like a bug in waferline (a TypeError, a KeyError, ...). The rest
    (a WaferlineError, an OSError, torch's RuntimeError for memory and the like) the driver reports as one line,
    naming the worker, from the status the worker set."""
    from waferline.errors import WaferlineError

    if not isinstance(e, (WaferlineError, OSError, MemoryError, RuntimeError)):
        traceback.print_exc()


def worker_ready(ctl: Control, store: Any, load: dict[str, Any], run_id: str, rank: int, state: dict[str, Any],
                 driver_pid: int | None, thread_name: str) -> None:
    """A worker has loaded: announce it and start the thread that publishes its progress for the driver's watchdog."""
    ctl.set("progress", rank, "0")
    ctl.set("ready", rank, "1")
    threading.Thread(target=_publisher, args=(Control(_client_of(store, load), run_id), rank, state, driver_pid),
                     daemon=True, name=thread_name).start()


def worker_failed(ctl: Control, rank: int, e: Exception) -> int:
    """Publish why a worker's serve loop ended (a lost neighbour is not the cause of a fault) and pick its exit code."""
    if isinstance(e, PeerLost):
        ctl_safe_set(ctl, "status", rank, f"lost a neighbour: {str(e)[:300]}")
        return EXIT_PEER_LOST
    ctl_safe_set(ctl, "status", rank, f"{type(e).__name__}: {e}")
    _print_unexpected(e)
    return EXIT_ERROR


def check_mtp(model: Any, path: Any) -> None:
    """Speculative 'mtp' needs MTP weights in the checkpoint (they are loaded on the last stage)."""
    from waferline.errors import ConfigError

    if not len(model.mtp):
        raise ConfigError(
            f"speculative='mtp' needs a checkpoint with MTP weights (num_nextn_predict_layers >= 1 and "
            f"model.layers.{{N}}.eh_proj.weight ...); {path} has none: use 'ngram' or 'draft:PATH' instead"
        )


def ctl_safe_set(ctl: Control, what: str, rank: int, value: str) -> None:
    try:
        ctl.set(what, rank, value)
    except Exception:
        pass


def worker_main(rank: int, num_stages: int, load: dict[str, Any], run_id: str, threads: int, device: str,
                driver_pid: int) -> None:
    """Entry point of a locally spawned stage process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the driver, which shuts the stages down
    # so does a SIGTERM sent to the whole process group (e.g. by `timeout`): the driver stops the workers in order,
    # and a worker whose driver is gone exits by itself (its publisher thread watches the driver's pid)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    torch.set_num_threads(max(1, threads))
    dev = torch.device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", rank % max(1, torch.cuda.device_count()))
        torch.cuda.set_device(dev)
    host, port = load["store_addr"]
    store = dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=30))
    code = serve(store, run_id, rank, num_stages, load, dev, local=True, driver_pid=driver_pid)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
