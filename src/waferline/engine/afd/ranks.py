"""AFD's ranks: an attention rank's compute (``AttentionRunner``: mixers, routing, dispatch / combine, sampling),
an FFN rank's (``FFNRunner``: each local expert once per round), the step messages, and the worker processes'
entry point (``worker_main``) and loop."""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from waferline.engine.afd.layout import DISPATCH, STATS, Layout
from waferline.engine.afd.link import AFLink, Clock, _split_tail
from waferline.engine.afd.sides import FFNFront, convert_ffn, load_attention_side, load_ffn_side
from waferline.engine.sampling import make_generator, seeded_generator
from waferline.engine.stage import (
    BEGIN,
    FEEDBACK,
    RESET,
    SHUTDOWN,
    STEP,
    Control,
    MicroBatch,
    StageRunner,
    make_group,
    meta_json,
    worker_failed,
    worker_load_failed,
    worker_ready,
    worker_start,
)
from waferline.model.quant import convert_loaded
from waferline.plan.place import ffn_owner

# ---------------------------------------------------------------- attention side


@dataclass
class _Pending:
    """A micro-batch's FFN round trip in flight: what the combine needs."""

    layer: int
    x: torch.Tensor  # residual input [Ntot, D]
    shapes: list[tuple[int, int]]  # (B, T) per group
    weights: torch.Tensor | None = None
    order: torch.Tensor | None = None
    token: torch.Tensor | None = None
    replies: list[tuple[int, int, Any]] = field(default_factory=list)  # (FFN rank, routed rows, posted recv)
    shared_rows: int = 0


class AttentionRunner:
    """An attention rank's compute: embed, mixers, FFN norms + routing + dispatch/combine, logits and sampling."""

    def __init__(self, model: Any, fronts: dict[int, FFNFront], layout: Layout, link: AFLink):
        self.model, self.fronts, self.layout, self.link = model, fronts, layout, link
        self.rt = StageRunner(model, 0, 1, torch.device("cpu"))  # begin() / feedback(): the pipeline's last stage
        self.D = model.spec.hidden_size
        self.clock = link.clock
        self.progress: dict[str, int] | None = None

    def begin(self, cfg: dict[str, Any]) -> None:
        """Caches for this rank's ``local_slots`` sequences; per-row generators indexed by the global row."""

        self.rt.begin(dict(cfg, num_slots=int(cfg["local_slots"])))
        p, n = self.rt.params, int(cfg["num_slots"])
        self.rt.gens = [make_generator(p) if p.seed is None else seeded_generator(p, i) for i in range(n)]

    def _tick(self) -> None:
        if self.progress is not None:
            self.progress["processed"] += 1

    @staticmethod
    def _mixer(layer: Any, xs: list[torch.Tensor], cache: Any, batches: list[Any], trails: list[bool]
               ) -> list[torch.Tensor]:
        m = layer.residual_multiplier
        out = []
        for x, b, v in zip(xs, batches, trails):  # DecoderLayer.forward's mixer half
            if hasattr(cache, "keep_trail"):  # (a verify group records its trail for a rollback; a plain one does not)
                cache.keep_trail = v
            h = layer.mixer(layer.mixer_norm(x), cache, b)
            out.append(x + h * m if m != 1.0 else x + h)
        return out

    def _dispatch(self, li: int, xs: list[torch.Tensor]) -> _Pending:
        L, M = self.layout, self.layout.attention_ranks
        D = self.D
        if not xs:  # an empty micro-batch still takes part (the FFN ranks gather one message per attention rank)
            x = torch.empty(0, D, dtype=self.model.dtype)
        else:
            x = torch.cat([t.reshape(-1, D) for t in xs]) if len(xs) > 1 else xs[0].reshape(-1, D)
        pend = _Pending(li, x, [(t.shape[0], t.shape[1]) for t in xs])
        front = self.fronts[li]
        h = front.norm(x)
        Ntot = h.shape[0]
        esz = h.element_size()
        if L.kinds[li] == "dense":
            o = ffn_owner(li, L.ffn_ranks)
            self.clock.compute += time.perf_counter() - self._t
            pend.replies.append((o, 0, self.link.post_reply(M + o, Ntot * D * esz)))
            pend.shared_rows = Ntot
            self.link.send(M + o, DISPATCH, [li, 0, Ntot], [h])
            self._t = time.perf_counter()
            return pend
        E = front.router.num_experts
        if Ntot:
            w, idx = front.router.route(h)
            k = idx.shape[1]
            flat = idx.reshape(-1)
            order = flat.argsort(stable=True)  # as MoE.experts_forward: (token, expert) pairs sorted by expert
            pend.weights, pend.order, pend.token = w, order, order // k
            counts = torch.bincount(flat, minlength=E).tolist()
            rows = h.index_select(0, pend.token)
        else:
            counts, rows = [0] * E, h
        self.clock.compute += time.perf_counter() - self._t
        start, o = 0, ffn_owner(li, L.ffn_ranks)
        for n, (e0, e1) in enumerate(L.splits[li]):
            c = counts[e0:e1]
            R = sum(c)
            S = Ntot if (n == o and L.shared[li]) else 0
            pend.replies.append((n, R, self.link.post_reply(M + n, R * D * 4 + S * D * esz)))
            pend.shared_rows += S
            self.link.send(M + n, DISPATCH, [li, R, S] + c, [rows[start:start + R]] + ([h] if S else []))
            start += R
        self._t = time.perf_counter()
        return pend

    def _combine(self, p: _Pending) -> list[torch.Tensor]:
        D, dt = self.D, self.model.dtype
        self.clock.compute += time.perf_counter() - self._t
        routed, shared = [], None
        for n, R, handle in p.replies:
            tail = self.link.wait_reply(handle)
            S = p.shared_rows if n == ffn_owner(p.layer, self.layout.ffn_ranks) else 0
            out, s = _split_tail(tail, [(R, torch.float32), (S, dt)], D)
            routed.append(out)
            if S:
                shared = s
        self._tick()
        self._t = time.perf_counter()
        x = p.x
        if self.layout.kinds[p.layer] == "dense":
            y = shared if shared is not None else torch.zeros_like(x)
        else:  # MoE.experts_forward's combine, then MoE.forward's shared add
            N = x.shape[0]
            y = torch.zeros(N, D, dtype=torch.float32)
            if N:
                out = torch.cat(routed) if len(routed) > 1 else routed[0]
                out.mul_(p.weights.reshape(-1)[p.order].unsqueeze(-1))
                y.index_add_(0, p.token, out)
            y = y.to(dt)
            if shared is not None:
                y = y + shared
        m = self.model.layers[p.layer].residual_multiplier
        x = x + y * m if m != 1.0 else x + y
        out, i = [], 0
        for B, T in p.shapes:
            out.append(x[i:i + B * T].view(B, T, D))
            i += B * T
        return out

    @torch.inference_mode()
    def step(
        self, mbs: list[MicroBatch], tokens: list[list[torch.Tensor]]
    ) -> list[tuple[list[int], list[torch.Tensor]]]:
        """Run K micro-batches through every layer, ping-ponging them with the FFN ranks; the feedback of each. Rows
        named in a micro-batch's ``rewinds`` are rolled back first (earlier verifies: the caches live on this side);
        verify groups record what a later rollback needs (the pipeline stages' ``SlotRollback``)."""
        from waferline.model.context import StepBatch

        self._t = time.perf_counter()
        model, rt = self.model, self.rt
        for mb in mbs:
            for slot, pages in mb.pages:  # (this rank's slots and its part's pages: AFD._step_raw)
                rt.table.mirror(slot, pages)
            if mb.rewinds:
                rt.rollback.apply(rt.caches, mb.rewinds)
        xs = [[model.embed_tokens(t) for t in toks] for toks in tokens]
        batches = [[StepBatch.make(g.slots, g.starts, g.T) for g in mb.groups] for mb in mbs]
        verifies = [b for mb, bs in zip(mbs, batches) for g, b in zip(mb.groups, bs) if g.verify and g.T > 1]
        for b in verifies:
            rt.rollback.before(rt.caches, b)
        trails = [[g.verify and g.T > 1 for g in mb.groups] for mb in mbs]  # (per group: _mixer)
        K = len(mbs)
        pending: list[_Pending | None] = [None] * K
        try:
            for li, layer in enumerate(model.layers):
                cache = rt.caches[li]
                for k in range(K):
                    if pending[k] is not None:
                        xs[k] = self._combine(pending[k])
                        pending[k] = None
                    if layer.mixer is not None and xs[k]:
                        xs[k] = self._mixer(layer, xs[k], cache, batches[k], trails[k])
                    if li in self.fronts:
                        pending[k] = self._dispatch(li, xs[k])
            for k in range(K):
                if pending[k] is not None:
                    xs[k] = self._combine(pending[k])
        finally:
            if verifies:
                rt.rollback.after(rt.caches)
        out = [rt.feedback(mb, x) for mb, x in zip(mbs, xs)]
        self.clock.compute += time.perf_counter() - self._t
        return out


def encode_step(mbs: list[MicroBatch], tokens: list[list[torch.Tensor]]) -> tuple[list[int], list[torch.Tensor]]:
    meta = [len(mbs)]
    for mb in mbs:
        e = mb.encode()
        meta += [len(e)] + e
    flat = [t.reshape(-1) for toks in tokens for t in toks]
    return meta, ([torch.cat(flat)] if flat else [])


def decode_step(meta: list[int], tail: torch.Tensor) -> tuple[list[MicroBatch], list[list[torch.Tensor]]]:
    K, i = meta[0], 1
    mbs = []
    for _ in range(K):
        n = meta[i]
        mbs.append(MicroBatch.decode(meta[i + 1:i + 1 + n]))
        i += 1 + n
    flat = tail.view(torch.int64) if tail.numel() else torch.empty(0, dtype=torch.int64)
    tokens, j = [], 0
    for mb in mbs:
        toks = []
        for g in mb.groups:
            toks.append(flat[j:j + g.B * g.T].view(g.B, g.T))
            j += g.B * g.T
        tokens.append(toks)
    return mbs, tokens


# ---------------------------------------------------------------- FFN side

class FFNRunner:
    """An FFN rank: per round, one DISPATCH from each attention rank for the same layer; each local expert runs once
    on the union of their rows; per-(token, expert) outputs (fp32) and shared/dense outputs go back."""

    def __init__(self, mods: dict[int, nn.Module], layout: Layout, rank: int, link: AFLink, D: int, dtype: torch.dtype):
        self.mods, self.layout, self.rank, self.link, self.D, self.dtype = mods, layout, rank, link, D, dtype

    @torch.inference_mode()
    def round(self, first: tuple[int, list[int], torch.Tensor]) -> None:
        L, M, D, dt = self.layout, self.layout.attention_ranks, self.D, self.dtype
        msgs = [first] + [self.link.recv(m) for m in range(1, M)]
        t0 = time.perf_counter()
        li = first[1][0]
        if any(kind != DISPATCH or meta[0] != li for kind, meta, _ in msgs):
            raise RuntimeError(f"protocol error on FFN rank {self.rank}: attention ranks out of step "
                               f"({[(k, m[:1]) for k, m, _ in msgs]})")
        mod = self.mods.get(li)
        routed_out: list[torch.Tensor] = []
        shared_out: list[torch.Tensor] = []
        parsed = []
        for _, meta, tail in msgs:
            R, S = meta[1], meta[2]
            rows, sh = _split_tail(tail, [(R, dt), (S, dt)], D)
            parsed.append((meta[3:], rows, sh))
        if L.kinds[li] == "moe":
            nloc = len(parsed[0][0])
            outs = [torch.empty(rows.shape[0], D, dtype=torch.float32) for _, rows, _ in parsed]
            offs = [0] * M
            for j in range(nloc):
                chunks = [rows[offs[m]:offs[m] + c[j]] for m, (c, rows, _) in enumerate(parsed)]
                total = sum(ch.shape[0] for ch in chunks)
                if total:
                    y = mod._expert_ffn(torch.cat(chunks) if M > 1 else chunks[0], j).float()
                    a = 0
                    for m, ch in enumerate(chunks):
                        n = ch.shape[0]
                        outs[m][offs[m]:offs[m] + n] = y[a:a + n]
                        a += n
                for m, (c, _, _) in enumerate(parsed):
                    offs[m] += c[j]
            routed_out = outs
            if any(sh.shape[0] for _, _, sh in parsed):
                x = torch.cat([sh for _, _, sh in parsed])
                s = mod.shared(x)
                if mod.shared_gate_weight is not None:
                    s = torch.sigmoid(torch.nn.functional.linear(x, mod.shared_gate_weight)) * s
                shared_out = list(s.split([sh.shape[0] for _, _, sh in parsed]))
        else:
            x = torch.cat([sh for _, _, sh in parsed])
            shared_out = list(mod(x).split([sh.shape[0] for _, _, sh in parsed]))
            routed_out = [torch.empty(0, D, dtype=torch.float32) for _ in range(M)]
        self.link.clock.compute += time.perf_counter() - t0
        for m in range(M):
            r = routed_out[m]
            s = shared_out[m] if shared_out else torch.empty(0, D, dtype=dt)
            self.link.send_reply(m, [r, s])


# ---------------------------------------------------------------- worker processes

def _serve(store: Any, run_id: str, rank: int, load: dict[str, Any], driver_pid: int) -> int:
    """A worker rank (attention rank >= 1 or FFN rank) until SHUTDOWN from the driver."""
    ctl = Control(store, run_id)
    ctl.set("alive", rank, str(os.getpid()))
    layout: Layout = load["layout"]
    M = layout.attention_ranks
    state = {"processed": 0}
    clock = Clock()
    try:
        link = AFLink(
            make_group(store, f"waferline/{run_id}/afd", rank, layout.world, torch.device("cpu"), True), clock
        )
        if rank < M:
            model, fronts = load_attention_side(load["path"], load["dtype"])
            convert_loaded(model, **load.get("convert", {}))  # (the mixers in int4, the head in int8: as rank 0's)
            runner: Any = AttentionRunner(model, fronts, layout, link)
            runner.progress = state
        else:
            mods = load_ffn_side(load["path"], load["dtype"], rank - M, layout)
            convert_ffn(mods, **load.get("convert", {}), int4_checkpoint=load.get("int4", False), dtype=load["dtype"])
            runner = FFNRunner(mods, layout, rank - M, link, load["hidden"], load["dtype"])
            for m in range(M):
                link.post(m)
    except Exception as e:  # a load error goes to the driver, which raises it
        return worker_load_failed(ctl, rank, e)
    worker_ready(ctl, store, load, run_id, rank, state, driver_pid, f"waferline-afd{rank}-publisher")
    try:
        while True:
            kind, meta, tail = link.recv(0)
            if kind == SHUTDOWN:
                link.flush()
                return 0
            if kind == STATS:
                ctl.set("stats", rank, json.dumps(clock.as_dict()))
                if meta and meta[0]:
                    clock.__init__()
            elif rank >= M:
                runner.round((kind, meta, tail))
            elif kind == BEGIN:
                runner.begin(meta_json(meta))
            elif kind == RESET:
                runner.rt.reset_slots(meta)
            elif kind == STEP:
                mbs, toks = decode_step(meta, tail)
                for fmeta, ft in runner.step(mbs, toks):
                    link.send(0, FEEDBACK, fmeta, ft)
            else:
                raise RuntimeError(f"protocol error: unexpected message kind {kind}")
            state["processed"] += 1
    except Exception as e:
        return worker_failed(ctl, rank, e)


def worker_main(rank: int, load: dict[str, Any], run_id: str, threads: int, driver_pid: int) -> None:
    """Entry point of a locally spawned AFD rank."""
    worker_start(driver_pid, load.get("kernels"))  # (Ctrl-C and SIGTERM go to the driver, which stops every rank)
    torch.set_num_threads(max(1, threads))
    host, port = load["store_addr"]
    store = dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=30))
    code = _serve(store, run_id, rank, load, driver_pid)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
