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

from waferline import kernels
from waferline.engine.messages import (
    BEGIN,
    EMIT_LOGITS,
    EMIT_LOGPROBS,
    EMIT_NONE,
    EMIT_TOKEN,
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
from waferline.engine.padding import padded_calls, pads_safely
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
           "EMIT_LOGITS", "EXIT_ERROR", "EXIT_PEER_LOST", "EXIT_ABORTED", "PUBLISH_INTERVAL_S",
           "LOOPBACK", "MAX_PENDING_SENDS", "SLOT_BYTES", "Control", "Link",
           "PeerLost", "json_meta", "loopback_host", "loopback_store", "make_group", "meta_json", "Group",
           "MicroBatch", "StageRunner", "decode_feedback", "serve", "worker_main", "worker_ready", "worker_failed",
           "worker_load_failed", "ctl_safe_set"]

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
        self.send_hidden = False  # the last stage returns every row's final hidden states (the server's MTP drafter)
        self.table: Any = None  # the page table its paged caches share, following the scheduler's (begin())
        self._pad_ok: bool | None = None  # plain groups of different T may share a padded call (_merged)

    def begin(self, cfg: dict[str, Any]) -> None:
        """Fresh caches for ``num_slots`` rows; the last stage sets up sampling (``cfg["hidden"]``: its feedback carries
        every row's final hidden states). With ``cfg["page_tokens"]`` paged caches follow the scheduler's page table
        (``MicroBatch.pages``): a page id names the same tokens in every stage, a shared prefix is shared here too."""
        self.caches = self.model.new_caches(int(cfg["num_slots"]), self.device)
        self._pad_ok = None
        self.rollback.reset()
        if cfg.get("page_tokens"):
            from waferline.model.attention import TokenCache
            from waferline.model.block_table import BlockTable

            table = BlockTable(int(cfg["num_slots"]), int(cfg["page_tokens"]), managed=True,  # (pools made once,
                               max_pages=int(cfg["max_pages"]) if cfg.get("max_pages") else None)  # at the bound)
            for c in self.caches:
                if isinstance(c, TokenCache) and c.paged:
                    c.bind(table)
            self.table = table
        else:
            self.table = None
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

        if mb.pages:
            for slot, pages in mb.pages:
                self.table.mirror(slot, pages)
        if mb.rewinds:
            self.rollback.apply(self.caches, mb.rewinds, self.device)
        merged = self._merged(mb, inputs)
        if merged is not None:
            return merged
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
    def feedback(self, mb: MicroBatch, hs: list[torch.Tensor]) -> tuple[list[int], list[torch.Tensor]]:
        """The last stage's answer for a micro-batch: emitted tokens (a variable number per row: a verify group's
        greedy rows get one per position) and fp32 logits (EMIT_LOGPROBS rows: every position's).

        meta = [mb_id, R, n_tok, n_lp] + seq[R] + count[R] + tokens[n_tok] + lp_seq[n_lp] + lp_T[n_lp];
        tensors = [fp32 logits, [sum lp_T, V]] when n_lp > 0. With ``send_hidden`` one byte tensor instead: the
        logits, then every group's final hidden states [B, T, ...] in the model's dtype, group after group.

        A verify group's rows (the scheduler verifies them itself) get every position's answer up to their last draft:
        the greedy tokens (len(draft) + 1 of them) of EMIT_TOKEN rows, the fp32 logits [len(draft) + 1, V] of
        EMIT_LOGITS rows.
        """
        seqs, counts, toks, lp_seqs, lp_T, lps = [], [], [], [], [], []
        for g, h in zip(mb.groups, hs):
            if g.verify:
                self._positions(g, h, seqs, counts, toks, lp_seqs, lp_T, lps)
                continue
            rows = [r for r in range(g.B) if g.emits[r] == EMIT_TOKEN]
            if rows:
                logits = self.model.logits(h[rows, -1]).float().cpu()
                for k, r in enumerate(rows):
                    seqs.append(g.seqs[r])
                    counts.append(1)
                    toks.append(sample(logits[k], self.params, self.gens[g.seqs[r]]))
            for r in range(g.B):
                if g.emits[r] == EMIT_LOGPROBS:
                    lp_seqs.append(g.seqs[r])
                    lp_T.append(g.T)
                    lps.append(self.model.logits(h[r]).float())  # (raw: the consumer takes the log-softmax)
            rows = [r for r in range(g.B) if g.emits[r] == EMIT_LOGITS]
            if rows:  # (each travels as a one-position "log-prob" row: raw logits; the head once for all of them)
                logits = self.model.logits(h[rows, -1]).float()
                for k, r in enumerate(rows):
                    lp_seqs.append(g.seqs[r])
                    lp_T.append(1)
                    lps.append(logits[k:k + 1])
        meta = [mb.mb_id, len(seqs), len(toks), len(lp_seqs)] + seqs + counts + toks + lp_seqs + lp_T
        tail = [torch.cat(lps)] if lps else []
        if self.send_hidden:
            parts = [t.detach().contiguous().reshape(-1).view(torch.uint8).cpu() for t in tail + list(hs)]
            tail = [torch.cat(parts)] if parts else []
        return meta, tail

    def _merged(self, mb: MicroBatch, inputs: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Plain groups of different T as fewer padded calls where this stage's caches allow it
        (engine/padding.py): each group's output cut back to its own [B, T, ...], so the next stage and the answers
        see the groups as sent. None where no groups merge (run them one by one)."""
        if self._pad_ok is None:
            self._pad_ok = pads_safely(self.caches) and not self.model.hc_mult
        if not self._pad_ok or len(mb.groups) < 2 or any(g.verify for g in mb.groups):
            return None
        calls = padded_calls([(g.B, g.T) for g in mb.groups], True)
        if len(calls) == len(mb.groups):
            return None
        from waferline.model.context import StepBatch

        out: list[torch.Tensor | None] = [None] * len(mb.groups)
        for idx, T in calls:
            gs = [mb.groups[i] for i in idx]
            xs = []
            for i in idx:
                x = inputs[i].to(self.device)
                if x.shape[1] < T:  # (token ids, or hidden states, padded at the end)
                    x = torch.nn.functional.pad(x, (0, 0) * (x.dim() - 2) + (0, T - x.shape[1]))
                xs.append(x)
            x = torch.cat(xs) if len(xs) > 1 else xs[0]
            batch = StepBatch.make([s for g in gs for s in g.slots], [s for g in gs for s in g.starts], T, self.device)
            if self.is_first:
                x = self.model.embed_tokens(x)
            h = self.model.forward_layers(x, self.caches, batch)
            r = 0
            for i, g in zip(idx, gs):
                out[i] = h[r:r + g.B, :g.T]
                r += g.B
        return out  # type: ignore[return-value]

    def _positions(self, g: Group, h: torch.Tensor, seqs: list[int], counts: list[int], toks: list[int],
                   lp_seqs: list[int], lp_T: list[int], lps: list[torch.Tensor]) -> None:
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
            else:
                lp_seqs.append(g.seqs[r])
                lp_T.append(n)
                lps.append(logits[k, :n])

    def split(self, mb: MicroBatch, tail: torch.Tensor) -> list[torch.Tensor]:
        """Hidden states per group ([B, T, D], DeepSeek-V4's streams [B, T, hc_mult, D]) from the raw bytes of a STEP
        message."""
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
        return out


# ---------------------------------------------------------------- worker process

_said = threading.Lock()  # (held once a worker has said why it stops)


def _say_why(rank: int, why: str, driver_pid: int | None) -> None:
    """env:// (``driver_pid`` None): say once why this worker stops (its output is all its user sees; not local)."""
    if driver_pid is None and _said.acquire(blocking=False):
        print(f"error: stage {rank} stopped: {why}", file=sys.stderr, flush=True)


def first_line(e: BaseException | str) -> str:
    """An error (an exception, or a worker's status text) as one line: its first (torch's go on with C++ frames)."""
    text = e if isinstance(e, str) else str(e)
    return next((line.strip() for line in text.splitlines() if line.strip()), text or type(e).__name__)[:500]


def _publisher(ctl: Control, rank: int, state: dict[str, Any], driver_pid: int | None) -> None:
    """Publish this stage's progress counter (env://: and a heartbeat every tick); exit the process if the driver is
    gone or asked for an abort."""
    last = None
    while True:
        if state.get("stopping"):  # a SHUTDOWN arrived: the process exits on its own (exit code 0), whatever follows
            return
        # first: a store call to a driver that is gone logs a C++ trace before it fails
        if driver_pid is not None and _gone(driver_pid):
            os._exit(EXIT_PEER_LOST)
        n = state["processed"]
        if n != last:
            try:
                ctl.set("progress", rank, str(n))
            except Exception as e:
                if state.get("stopping"):
                    return
                _say_why(rank, f"lost the rendezvous store: rank 0 is gone ({first_line(e)})", driver_pid)
                os._exit(EXIT_PEER_LOST)
            last = n
        try:
            if driver_pid is None:  # env://: a heartbeat, the driver's only sign that a process on another host lives
                ctl.store.add(ctl.key("beat", rank), 1)
            if ctl.get("abort") is not None and not state.get("stopping"):
                _say_why(rank, "rank 0 stopped the pipeline after a fault (its error names it)", driver_pid)
                os._exit(EXIT_ABORTED)
        except Exception as e:
            if state.get("stopping"):
                return
            _say_why(rank, f"lost the rendezvous store: rank 0 is gone ({first_line(e)})", driver_pid)
            os._exit(EXIT_PEER_LOST)
        time.sleep(PUBLISH_INTERVAL_S)


def serve(store: Any, run_id: str, rank: int, num_stages: int, load: dict[str, Any], device: torch.device,
          local: bool, driver_pid: int | None = None) -> int:
    """Run stage ``rank`` (>= 1) until SHUTDOWN: receive from rank-1, compute, send on (or feed back to rank 0)."""
    ctl = Control(store, run_id)
    state = {"processed": 0}
    try:  # (the store is the driver's: a driver gone while this worker starts fails the store calls here)
        # the publisher's connection, made while the store surely answers: one made once the driver is gone would be
        # retried for up to a minute
        publish = Control(_client_of(store, load), run_id)
        ctl.set("alive", rank, str(os.getpid()))
        try:
            act = Link(make_group(store, f"waferline/{run_id}/act", rank, num_stages, device, local), device)
            fb = Link(make_group(store, f"waferline/{run_id}/fb", rank, num_stages, device, local), device)
            from waferline.model.load import load_model
            from waferline.model.quant import convert_loaded, loading_for, move_model

            a, b = load["layer_range"]
            with loading_for(device):
                model = load_model(load["path"], load["dtype"], range(a, b), has_embed=False,
                                   has_head=rank == num_stages - 1, **load.get("extra", {}))
            if device.type != "cpu":  # (int4 weights repacked for the device's kernel)
                move_model(model, device)
            convert_loaded(model, **load.get("convert", {}))  # (int4 on load, int8 head: as the driver's stage)
        except Exception as e:  # a load error (bad checkpoint, ...) goes to the driver, which raises it
            _say_why(rank, f"could not start: {type(e).__name__}: {first_line(e)}", driver_pid)
            return worker_load_failed(ctl, rank, e)
        worker_ready(ctl, store, load, run_id, rank, state, driver_pid, f"waferline-stage{rank}-publisher", publish)
    except (dist.DistError, OSError) as e:
        _say_why(rank, f"lost the rendezvous store while starting: rank 0 is gone ({first_line(e)})", driver_pid)
        return EXIT_PEER_LOST
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
                state["stopping"] = True  # the publisher neither obeys the abort key nor minds a gone store now
                ctl_safe_set(ctl, "stopped", rank, "1")  # (the driver under torchrun waits for it before the abort)
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
                hs = runner.forward(mb, runner.split(mb, tail))
                if last:
                    fmeta, ft = runner.feedback(mb, hs)
                    fb.send(0, FEEDBACK, fmeta, ft)
                else:
                    act.send(rank + 1, STEP, meta, hs)
            state["processed"] += 1
    except Exception as e:
        if isinstance(e, PeerLost):
            _say_why(rank, f"lost a neighbouring stage ({first_line(e)})", driver_pid)
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
                 driver_pid: int | None, thread_name: str, publish: Control | None = None) -> None:
    """A worker has loaded: announce it and start the thread that publishes its progress for the driver's watchdog
    (through ``publish``, or a connection of its own to the store made now)."""
    ctl.set("progress", rank, "0")
    if driver_pid is None:  # (env://: the heartbeat the publisher counts up)
        ctl.set("beat", rank, "0")
    ctl.set("ready", rank, "1")
    publish = publish or Control(_client_of(store, load), run_id)
    threading.Thread(target=_publisher, args=(publish, rank, state, driver_pid), daemon=True, name=thread_name).start()


def worker_failed(ctl: Control, rank: int, e: Exception) -> int:
    """Publish why a worker's serve loop ended (a lost neighbour is not the cause of a fault) and pick its exit code."""
    if isinstance(e, PeerLost):
        ctl_safe_set(ctl, "status", rank, f"lost a neighbour: {str(e)[:300]}")
        return EXIT_PEER_LOST
    ctl_safe_set(ctl, "status", rank, f"{type(e).__name__}: {e}")
    _print_unexpected(e)
    return EXIT_ERROR


def ctl_safe_set(ctl: Control, what: str, rank: int, value: str) -> None:
    try:
        ctl.set(what, rank, value)
    except Exception:
        pass


def worker_start(driver_pid: int, kernels_on: bool | None = None) -> None:
    """The first thing a locally spawned worker does. Ctrl-C goes to the driver, which shuts the workers down; so
    does a SIGTERM sent to the whole process group (e.g. by `timeout`): the driver stops the workers in order. A
    worker whose driver is gone exits by itself, from its first moment (a Ctrl-C that ends the driver while this
    worker still connects or loads leaves nothing behind): a thread watches the driver's pid. ``kernels_on``: what
    the driver's ``kernels.prepare()`` returned; False keeps the fused operators off here too (their build failed
    there, or they are turned off), so the worker neither builds them again inside a step nor warns again."""
    if kernels_on is False:
        kernels.use(False)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Thread(target=_exit_without, args=(driver_pid,), daemon=True, name="waferline-driver-watch").start()


def _gone(pid: int) -> bool:
    """Whether process ``pid`` has exited: no such process, or a zombie its parent has not waited for yet (a driver
    run under a caller that reads its output to the end before it waits, as subprocess.run and `$(...)` do)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def _exit_without(driver_pid: int) -> None:
    while True:
        if _gone(driver_pid):
            os._exit(EXIT_PEER_LOST)
        time.sleep(PUBLISH_INTERVAL_S)


def stage_device(device: str, rank: int) -> torch.device:
    """Where stage ``rank`` of a pipeline on ``device`` (stage 0's) runs: on CUDA the rank-th GPU counted from stage
    0's (``cuda:1`` with 2 stages on 3 GPUs: cuda:1, cuda:2; never two stages on one GPU while there are enough)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return dev
    return torch.device("cuda", ((dev.index or 0) + rank) % max(1, torch.cuda.device_count()))


def worker_main(rank: int, num_stages: int, load: dict[str, Any], run_id: str, threads: int, device: str,
                driver_pid: int) -> None:
    """Entry point of a locally spawned stage process."""
    worker_start(driver_pid, load.get("kernels"))
    torch.set_num_threads(max(1, threads))
    dev = stage_device(device, rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    host, port = load["store_addr"]
    store = dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=30))
    code = serve(store, run_id, rank, num_stages, load, dev, local=True, driver_pid=driver_pid)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
