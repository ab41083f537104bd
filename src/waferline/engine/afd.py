"""Attention/FFN disaggregation (AFD): M attention ranks and N FFN (expert) ranks as processes, hidden states going
attention -> FFN -> attention once per layer over torch.distributed point-to-point, K micro-batches ping-ponging.

Layout (ranks of one gloo process group; rank 0 is the calling process and the scheduler):

* **attention ranks 0..M-1** are data parallel over the *sequences*: each holds the embedding, every mixer layer
  (attention, MLA or Mamba-2) with its norm, the FFN norms, the MoE routers, the final norm and the LM head, and the
  caches of the sequences it owns (sequence i lives on attention rank i mod M). Sampling happens there, with the
  single-process engine's sampling code and per-row seeds.
* **FFN ranks M..M+N-1** hold no per-sequence state: routed experts sharded by expert (contiguous ranges, the first
  E mod N ranks one expert more), and per layer one *owner* rank (layer mod N) that also holds that layer's shared
  experts or dense FFN. A rank loads only its own experts' tensors (per-expert checkpoint keys are never read by other
  ranks; fused ``[E, ...]`` tensors are read and sliced).

Per layer with an FFN, an attention rank normalises and *routes* its tokens itself (the router is E x D, tiny), sorts
the (token, expert) pairs by expert exactly as ``MoE.experts_forward`` does, and **dispatches** to every FFN rank the
rows routed to its experts (and to the owner the whole normalised batch for shared experts / dense FFN). Every FFN rank
gathers one message from each of the M attention ranks (they run in lock step, so the expert batch is the union of
all M ranks' tokens), runs each expert once on its rows, and sends the per-(token, expert) outputs back. The attention
rank **combines** them (weights, ``index_add_`` in expert order, shared output, residual) with the same ops as the
single-process engine, so fp32 results differ only by GEMM row blocking.

Ping-pong: a decode step is split into K (default 2) micro-batches; per layer each micro-batch is dispatched as soon
as its mixer is done, and the attention rank computes the next micro-batch's mixer while the FFN ranks work on the
previous one (and vice versa). Faults: a watchdog thread names a dead or failed rank (``AFDError``) and stops all.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import re
import signal
import sys
import threading
import time
import uuid
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn

from waferline.engine.pipeline import (DECODE, DEFAULT_HANG_TIMEOUT_S, DEFAULT_PREFILL_CHUNK, DONE, PREFILL,
                                       WATCH_INTERVAL_S, Pipeline, StageError, _main_hidden, _reap, _Seq)
from waferline.engine.sampling import SamplingParams, make_generator
from waferline.engine.stage import (BEGIN, EMIT_LOGPROBS, EMIT_NONE, EMIT_TOKEN, FEEDBACK, SHUTDOWN, SLOT_BYTES, STEP,
                                    Control, Group, Link, MicroBatch, StageRunner, decode_feedback, json_meta,
                                    make_group, meta_json, worker_failed, worker_load_failed, worker_ready)
from waferline.errors import ConfigError
from waferline.model.moe import MoE
from waferline.plan.place import expert_split, ffn_owner

DISPATCH, STATS = 6, 8  # (message kinds 1-4 are the pipeline's: BEGIN, STEP, SHUTDOWN, FEEDBACK)
DEFAULT_MICRO_BATCHES = 2


class AFDError(StageError):
    """An attention or FFN rank died, hung or failed; the message names it. The engine is unusable afterwards."""


# ---------------------------------------------------------------- the split

@dataclass
class Layout:
    """Who holds what: M attention ranks, N FFN ranks, per FFN layer its kind and expert split."""

    attention_ranks: int
    ffn_ranks: int
    kinds: dict[int, str]  # layer -> "moe" | "dense" (layers with an FFN only)
    splits: dict[int, list[tuple[int, int]]]  # MoE layer -> expert range per FFN rank
    shared: dict[int, bool]  # MoE layer -> has shared experts

    @property
    def world(self) -> int:
        return self.attention_ranks + self.ffn_ranks

    def describe(self, rank: int) -> str:
        M = self.attention_ranks
        if rank < M:
            return f"attention rank {rank}" + (" (the driver)" if rank == 0 else "")
        n = rank - M
        rng = sorted({r[n] for r in self.splits.values()})
        ex = ", ".join(f"experts {a}-{b - 1}" if b - a > 1 else f"expert {a}" for a, b in rng if b > a)
        return f"FFN rank {n}" + (f" ({ex})" if ex else "")


def make_layout(spec: Any, attention_ranks: int, ffn_ranks: int) -> Layout:
    """Check M and N against the model and fix the expert split; clear errors for what AFD cannot run."""
    from waferline.spec.model import DenseFFNSpec, MoESpec

    M, N = int(attention_ranks), int(ffn_ranks)
    if M < 1 or N < 1:
        raise ConfigError(f"AFD needs at least one attention rank and one FFN rank (got attention_ranks={M}, ffn_ranks={N})")
    kinds, splits, shared = {}, {}, {}
    for i, layer in enumerate(spec.layers):
        f = layer.ffn
        if f is None:
            continue
        if isinstance(f, MoESpec):
            if f.num_experts < N:
                raise ConfigError(f"layer {i} has {f.num_experts} experts but {N} FFN ranks were asked for: every FFN rank "
                                  f"needs at least one expert; use ffn_ranks <= {f.num_experts}")
            kinds[i], splits[i], shared[i] = "moe", expert_split(f.num_experts, N), bool(f.shared_intermediate)
        elif isinstance(f, DenseFFNSpec):
            kinds[i] = "dense"
        else:
            raise ConfigError(f"layer {i}: AFD cannot run FFN kind {f.kind!r}")
    if not kinds:
        raise ConfigError(f"{spec.name}: no layer has an FFN, so there is nothing to disaggregate; run it without AFD")
    if not splits and N > len(kinds):
        raise ConfigError(f"{spec.name} is dense (no MoE layers): its {len(kinds)} FFN layers go to FFN ranks whole, so "
                          f"at most {len(kinds)} FFN ranks can hold something; got {N}")
    return Layout(M, N, kinds, splits, shared)


def is_afd_plan(plan: Any) -> bool:
    """Whether a Plan (or a plan JSON path) has attention and FFN stages."""
    if isinstance(plan, (str, Path)):
        from waferline.plan.plan import Plan

        plan = Plan.load(plan)
    return bool(plan.afd) or any(s.role in ("attention", "ffn") for s in plan.stages)


def plan_ranks(plan: Any, spec: Any) -> tuple[int, int, int | None]:
    """(attention ranks, FFN ranks, micro-batches) of an AFD Plan the engine can run: every attention stage holds every
    layer (a data-parallel replica) and every FFN stage the FFN of every layer (an expert shard)."""
    if isinstance(plan, (str, Path)):
        from waferline.plan.plan import Plan

        plan = Plan.load(plan)
    att = [s for s in plan.stages if s.role == "attention"]
    ffn = [s for s in plan.stages if s.role == "ffn"]
    full = [s for s in plan.stages if s.role == "full"]
    if full or not att or not ffn:
        raise ConfigError("the AFD engine runs plans with 'attention' and 'ffn' stages only; plan with --afd")
    every = list(range(spec.num_layers))
    with_ffn = [i for i, layer in enumerate(spec.layers) if layer.ffn is not None]
    for s in att:
        if sorted(s.layers) != every:
            raise ConfigError(f"plan stage {s.index} (attention) holds layers {s.layers[:4]}...: the AFD engine runs "
                              "data-parallel attention ranks that each hold every layer; plan with "
                              "--afd --attention-ranks M --ffn-ranks N")
    for s in ffn:
        if sorted(s.layers) not in (every, with_ffn):
            raise ConfigError(f"plan stage {s.index} (ffn) holds layers {s.layers[:4]}...: the AFD engine shards experts "
                              "(every FFN rank serves every layer); plan with --afd --attention-ranks M --ffn-ranks N")
    return len(att), len(ffn), plan.micro_batches


# ---------------------------------------------------------------- modules on each side

class Router(nn.Module):
    """The routing half of an MoE block (router weight, bias, correction bias), kept on the attention side."""

    route = MoE.route  # the single-process engine's routing and router loading, not copies of them
    _load_router = MoE._load_router

    def __init__(self, spec: Any):
        super().__init__()
        E, D = spec.num_experts, spec.hidden_size
        self.spec, self.num_experts, self.hidden_size, self.top_k = spec, E, D, spec.top_k
        self.group_top2 = spec.correction_bias or spec.scoring == "sigmoid"  # as MoE.__init__
        self.gate_weight = nn.Parameter(torch.zeros(E, D), requires_grad=False)
        self.gate_bias = nn.Parameter(torch.zeros(E), requires_grad=False) if spec.router_bias else None
        if spec.correction_bias:
            self.register_buffer("e_score_correction_bias", torch.zeros(E))
        else:
            self.e_score_correction_bias = None

    def load_hf(self, src: Any, prefix: str, flavor: str) -> None:
        from waferline.model.weights import copy_into

        if flavor == "granitemoehybrid":
            self._load_router(src, prefix + "block_sparse_moe.", ["router.layer.weight", "router.weight"])
            return
        self._load_router(src, prefix, ["router.weight"] if flavor == "gpt_oss" else ["gate.weight"])
        if self.e_score_correction_bias is not None:
            name = prefix + "gate.e_score_correction_bias"
            if not src.has(name) and src.has(prefix + "e_score_correction_bias"):
                name = prefix + "e_score_correction_bias"
            copy_into(self.e_score_correction_bias, src.get(name, (self.num_experts,)))



class FFNFront(nn.Module):
    """What the attention side keeps of a layer's FFN: its pre-norm, and the router for an MoE layer."""

    def __init__(self, norm: nn.Module, router: Router | None):
        super().__init__()
        self.norm = norm
        self.router = router


class ExpertSlice:
    """A view of a WeightSource in which MoE layer ``prefix`` has only experts [e0, e1), renumbered from 0:
    per-expert keys are renamed, [E, ...] tensors under the prefix (fused experts, router rows) are sliced."""

    _EXPERT = re.compile(r"^(.*experts\.)(\d+)\.(.*)$")

    def __init__(self, src: Any, prefix: str, e0: int, e1: int, num_experts: int):
        self.src, self.prefix, self.e0, self.e1, self.E = src, prefix, e0, e1, num_experts

    def _map(self, name: str) -> tuple[str | None, bool]:
        if not name.startswith(self.prefix) or "shared" in name[len(self.prefix):]:
            return name, False
        m = self._EXPERT.match(name)
        if m:
            j = int(m.group(2))
            return (f"{m.group(1)}{self.e0 + j}.{m.group(3)}" if j < self.e1 - self.e0 else None), False
        return name, True

    def has(self, name: str) -> bool:
        base, _ = self._map(name)
        return base is not None and self.src.has(base)

    def names_with_prefix(self, prefix: str) -> list[str]:
        return self.src.names_with_prefix(prefix)

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        from waferline.errors import CheckpointError

        base, sliced = self._map(name)
        if base is None:
            raise CheckpointError(f"checkpoint is missing tensor {name!r}")
        if sliced and self.src.shape(base)[:1] == (self.E,):
            t = self.src.get(base)[self.e0:self.e1].clone()
        else:
            t = self.src.get(base)
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise CheckpointError(f"tensor {base!r} gives shape {list(t.shape)} for experts {self.e0}-{self.e1 - 1} but "
                                  f"the config implies {list(shape)}")
        return t


def _check_checkpoint(path: Path, device: str) -> None:
    from waferline.model.quant import quant_method

    cfg = json.loads((path / "config.json").read_text())
    if quant_method(cfg) is not None:
        raise ConfigError(f"{path} is an int4 checkpoint; the AFD engine runs 16-bit checkpoints so far (load the "
                          "16-bit original, or run the int4 checkpoint with the pipeline engine)")
    if device != "cpu":
        raise ConfigError(f"the AFD engine runs on CPU processes (gloo) so far; got device={device!r}")


def load_attention_side(path: str | Path, dtype: torch.dtype, src: Any = None) -> tuple[Any, dict[int, FFNFront]]:
    """The attention side of a checkpoint: a DecoderModel without FFNs (embedding, mixers, head) and, per FFN layer,
    its FFNFront. Expert, shared-expert and dense-FFN tensors are never read."""
    from waferline.model.decoder import NAMING, DecoderModel, Naming, _norm_eps
    from waferline.model.layers import RMSNorm
    from waferline.model.load import open_weights
    from waferline.spec.model import MoESpec, ModelSpec

    path = Path(path)
    spec = ModelSpec.from_pretrained(path)
    bare = dataclasses.replace(spec, layers=[dataclasses.replace(layer, ffn=None) for layer in spec.layers])
    src = src if src is not None else open_weights(path)
    model = DecoderModel(bare, dtype, with_mtp=False)
    model.load_hf(src)
    model.spec = spec  # the full accounting (the engine reads vocab/hidden/layers from it)
    n: Naming = NAMING.get(spec.model_type, Naming())
    eps = _norm_eps(spec.hf_config)
    fronts: dict[int, FFNFront] = {}
    for i, layer in enumerate(spec.layers):
        if layer.ffn is None:
            continue
        p = f"{n.root}layers.{i}."
        norm = RMSNorm(spec.hidden_size, eps, dtype)
        norm.load_hf(src, p + n.norm_ffn + ".weight")
        router = None
        if isinstance(layer.ffn, MoESpec):
            router = Router(layer.ffn)
            router.load_hf(src, p + n.ffn + "." if n.ffn else p, spec.model_type)
        fronts[i] = FFNFront(norm, router).eval()
    model.eval()
    return model, fronts


def load_ffn_side(path: str | Path, dtype: torch.dtype, rank: int, layout: Layout, src: Any = None) -> dict[int, nn.Module]:
    """FFN rank ``rank``'s modules per layer: an MoE holding only its experts (renumbered from 0; plus the shared
    experts where it is the owner), or the dense FFN of the layers it owns."""
    from waferline.model.decoder import NAMING, Naming, _build_ffn
    from waferline.model.load import open_weights
    from waferline.spec.model import ModelSpec

    path = Path(path)
    spec = ModelSpec.from_pretrained(path)
    src = src if src is not None else open_weights(path)
    n: Naming = NAMING.get(spec.model_type, Naming())
    N = layout.ffn_ranks
    mods: dict[int, nn.Module] = {}
    for i, kind in layout.kinds.items():
        layer = spec.layers[i]
        prefix = f"{n.root}layers.{i}." + (n.ffn + "." if n.ffn else "")
        owner = ffn_owner(i, N) == rank
        if kind == "dense":
            if owner:
                mod = _build_ffn(layer, spec.model_type, spec.hf_config, dtype)
                mod.load_hf(src, prefix)
                mods[i] = mod.eval()
            continue
        f = layer.ffn
        e0, e1 = layout.splits[i][rank]
        local = dataclasses.replace(f, num_experts=e1 - e0, top_k=1, n_group=1, topk_group=1,
                                    num_shared=f.num_shared if owner else 0,
                                    shared_intermediate=f.shared_intermediate if owner else 0,
                                    shared_gate=f.shared_gate and owner)
        mod = _build_ffn(dataclasses.replace(layer, ffn=local), spec.model_type, spec.hf_config, dtype)
        mod.load_hf(ExpertSlice(src, prefix, e0, e1, f.num_experts), prefix)
        mods[i] = mod.eval()
    return mods


# ---------------------------------------------------------------- transport with a time split

@dataclass
class Clock:
    """Seconds spent per activity on one rank: compute; transfer (issuing sends, and the part of a wait after the
    peer had sent); idle (the part of a wait before the peer had sent)."""

    compute: float = 0.0
    transfer: float = 0.0
    idle: float = 0.0
    messages: int = 0
    bytes: int = 0

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


class TimedLink(Link):
    """A Link that charges its time to a Clock: issuing sends = transfer; a wait splits into idle (the peer had not
    sent yet) and transfer (sent, not yet here) by the send time the message carries; both ends are on one host,
    where the clocks agree."""

    def __init__(self, pg: Any, device: torch.device, clock: Clock, slot_bytes: int = SLOT_BYTES):
        super().__init__(pg, device, slot_bytes)
        self.clock = clock

    def send(self, dst: int, kind: int, meta: list[int], tensors: list[torch.Tensor] = ()) -> None:
        t = time.perf_counter()
        super().send(dst, kind, meta, tensors)
        self.clock.transfer += time.perf_counter() - t
        self.clock.messages += 1
        self.clock.bytes += sum(x.numel() * x.element_size() for x in tensors) + 8 * len(meta)

    def _wait(self, work: Any, sent_ns: Any) -> None:
        w0 = time.time_ns()
        super()._wait(work, sent_ns)
        a = time.time_ns()
        sent = int(sent_ns()) or w0
        self.clock.transfer += max(0, a - max(sent, w0)) / 1e9
        self.clock.idle += max(0, min(sent, a) - w0) / 1e9


AFD_SLOT_BYTES = 64 * 1024  # attention -> FFN messages travel in slots of this size that the FFN rank posts ahead


class AFLink(TimedLink):
    """The attention <-> FFN channel, built so that gloo moves each message in one hop: an FFN rank keeps a slot of
    ``AFD_SLOT_BYTES`` posted for the next message from every attention rank (Link's slotted messages), and an
    attention rank posts the recv of an FFN rank's reply, whose size it knows, before it dispatches."""

    def __init__(self, pg: Any, clock: Clock, slot_bytes: int = AFD_SLOT_BYTES):
        super().__init__(pg, torch.device("cpu"), clock, slot_bytes)

    # -- FFN -> attention: replies of a size the attention rank knows
    def post_reply(self, src: int, nbytes: int) -> tuple[torch.Tensor, Any]:
        buf = torch.empty(8 + nbytes, dtype=torch.uint8)
        return buf, self._post(src, buf)

    def wait_reply(self, handle: tuple[torch.Tensor, Any]) -> torch.Tensor:
        buf, work = handle
        self._wait(work, lambda: buf[:8].view(torch.int64)[0])
        return buf[8:]

    def send_reply(self, dst: int, tensors: list[torch.Tensor]) -> None:
        t = time.perf_counter()
        parts = [torch.tensor([time.time_ns()], dtype=torch.int64).view(torch.uint8)]
        parts += [x.detach().contiguous().reshape(-1).view(torch.uint8) for x in tensors]
        self._put(dst, torch.cat(parts))
        self.clock.transfer += time.perf_counter() - t
        self.clock.messages += 1
        self.clock.bytes += sum(x.numel() * x.element_size() for x in tensors)


def _split_tail(tail: torch.Tensor, parts: list[tuple[int, torch.dtype]], D: int) -> list[torch.Tensor]:
    """Consecutive [rows, D] tensors of the given dtypes from a message's raw bytes."""
    out, i = [], 0
    for rows, dt in parts:
        nb = rows * D * torch.empty(0, dtype=dt).element_size()
        out.append(tail[i:i + nb].view(dt).view(rows, D) if rows else torch.empty(0, D, dtype=dt))
        i += nb
    return out


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
        from waferline.engine.llm import _seeded

        self.rt.begin(dict(cfg, num_slots=int(cfg["local_slots"])))
        p, n = self.rt.params, int(cfg["num_slots"])
        self.rt.gens = [make_generator(p) if p.seed is None else _seeded(p, i) for i in range(n)]

    def _tick(self) -> None:
        if self.progress is not None:
            self.progress["processed"] += 1

    @staticmethod
    def _mixer(layer: Any, xs: list[torch.Tensor], cache: Any, batches: list[Any]) -> list[torch.Tensor]:
        m = layer.residual_multiplier
        out = []
        for x, b in zip(xs, batches):  # DecoderLayer.forward's mixer half
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
    def step(self, mbs: list[MicroBatch], tokens: list[list[torch.Tensor]]) -> list[tuple[list[int], list[torch.Tensor]]]:
        """Run K micro-batches through every layer, ping-ponging them with the FFN ranks; the feedback of each."""
        from waferline.model.context import StepBatch

        self._t = time.perf_counter()
        model = self.model
        xs = [[model.embed_tokens(t) for t in toks] for toks in tokens]
        batches = [[StepBatch.make(g.slots, g.starts, g.T) for g in mb.groups] for mb in mbs]
        K = len(mbs)
        pending: list[_Pending | None] = [None] * K
        for li, layer in enumerate(model.layers):
            cache = self.rt.caches[li]
            for k in range(K):
                if pending[k] is not None:
                    xs[k] = self._combine(pending[k])
                    pending[k] = None
                if layer.mixer is not None and xs[k]:
                    xs[k] = self._mixer(layer, xs[k], cache, batches[k])
                if li in self.fronts:
                    pending[k] = self._dispatch(li, xs[k])
        for k in range(K):
            if pending[k] is not None:
                xs[k] = self._combine(pending[k])
        out = [self.rt.feedback(mb, x) for mb, x in zip(mbs, xs)]
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
        link = AFLink(make_group(store, f"waferline/{run_id}/afd", rank, layout.world, torch.device("cpu"), True), clock)
        if rank < M:
            model, fronts = load_attention_side(load["path"], load["dtype"])
            runner: Any = AttentionRunner(model, fronts, layout, link)
            runner.progress = state
        else:
            mods = load_ffn_side(load["path"], load["dtype"], rank - M, layout)
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
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the driver, which stops every rank
    torch.set_num_threads(max(1, threads))
    host, port = load["store_addr"]
    store = dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=30))
    code = _serve(store, run_id, rank, load, driver_pid)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _proc_state(pid: int) -> str:
    """The one-letter state of a local process (R, S, T for stopped, Z, ...); '' when unknown."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


# ---------------------------------------------------------------- the driver (attention rank 0 + scheduler)

class AFD(Pipeline):
    """Attention/FFN disaggregation over M attention ranks and N FFN ranks; this process is attention rank 0 and
    the scheduler. Same API as ``Pipeline`` (run_generate, run_stream, prompt_logprobs, stream, close).

    >>> with AFD("ckpt", attention_ranks=2, ffn_ranks=2) as afd:
    ...     toks, reasons, metrics = afd.run_generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=8))
    """

    def __init__(self, path: str | Path, dtype: str | torch.dtype = "float32", *, attention_ranks: int | None = None,
                 ffn_ranks: int | None = None, micro_batches: int | None = None, plan: Any = None,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK, threads_per_rank: int | None = None,
                 threads_per_stage: int | None = None, hang_timeout_s: float = DEFAULT_HANG_TIMEOUT_S,
                 device: str = "cpu", start_method: str = "forkserver"):
        from waferline.engine.llm import DTYPES
        from waferline.spec.model import ModelSpec

        if isinstance(dtype, str):
            if dtype not in DTYPES:
                raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
            dtype = DTYPES[dtype]
        self.path = Path(path)
        if not self.path.is_dir():
            raise ConfigError(f"model directory {self.path} does not exist")
        _check_checkpoint(self.path, device)
        self.spec = ModelSpec.from_pretrained(self.path)
        if plan is not None:
            if attention_ranks is not None or ffn_ranks is not None:
                raise ConfigError("give a plan or attention_ranks/ffn_ranks, not both")
            attention_ranks, ffn_ranks, plan_mb = plan_ranks(plan, self.spec)
            micro_batches = micro_batches if micro_batches is not None else plan_mb
        self.layout = make_layout(self.spec, 1 if attention_ranks is None else attention_ranks,
                                  1 if ffn_ranks is None else ffn_ranks)
        self.M, self.N = self.layout.attention_ranks, self.layout.ffn_ranks
        self.num_stages = self.layout.world  # processes (the Pipeline base reports it as "stages")
        self.micro_batches = int(micro_batches) if micro_batches is not None else DEFAULT_MICRO_BATCHES
        if self.micro_batches < 1:
            raise ConfigError(f"micro_batches must be >= 1, got {self.micro_batches}")
        if prefill_chunk < 1:
            raise ConfigError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.prefill_chunk = int(prefill_chunk)
        self.hang_timeout_s = float(hang_timeout_s)
        threads = threads_per_rank or threads_per_stage
        self.threads = int(threads) if threads else max(1, (os.cpu_count() or 1) // self.layout.world)
        self.device = torch.device("cpu")
        self.dtype = dtype
        self.ranges = [(0, self.spec.num_layers)]
        self._procs: list[Any] = []
        self._closed = False
        self._broken: StageError | None = None
        self._fault: str | None = None
        self._lock = threading.Lock()
        self._env = False
        self.speculative, self._sr = None, None  # the Pipeline base's speculative path: not under AFD
        self._busy_since: float | None = None
        self._stop_watch = threading.Event()
        self._watcher: threading.Thread | None = None
        self._finalizer = weakref.finalize(self, _reap, self._procs)
        try:
            self._start_afd(start_method)
        except BaseException:
            self._kill_all()
            self._closed = True
            raise

    # ------------------------------------------------------------ start-up
    def _start_afd(self, start_method: str) -> None:
        import torch.multiprocessing as mp

        W = self.layout.world
        self.run_id = uuid.uuid4().hex[:12]
        self.store = dist.TCPStore("127.0.0.1", 0, W, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=60))
        self.ctl = Control(self.store, self.run_id)
        load = {"path": str(self.path), "dtype": self.dtype, "layout": self.layout, "hidden": self.spec.hidden_size,
                "store_addr": ("127.0.0.1", self.store.port)}
        ctx = mp.get_context(start_method)
        if start_method == "forkserver":
            ctx.set_forkserver_preload(["waferline.engine.afd", "waferline.model.load"])
        for r in range(1, W):
            p = ctx.Process(target=worker_main, args=(r, load, self.run_id, self.threads, os.getpid()),
                            name=f"waferline-afd{r}", daemon=True)
            with _main_hidden():
                p.start()
            self._procs.append(p)
        self._wait_for("alive", "start")
        self._connect_afd()
        model, fronts = load_attention_side(self.path, self.dtype)
        self.runner = AttentionRunner(model, fronts, self.layout, self.link)
        self._wait_for("ready", "load its part of the model")
        self._watcher = threading.Thread(target=self._watch, daemon=True, name="waferline-afd-watchdog")
        self._watcher.start()

    def _connect_afd(self) -> None:
        box: dict[str, Any] = {}

        def build() -> None:
            try:
                box["pg"] = make_group(self.store, f"waferline/{self.run_id}/afd", 0, self.layout.world,
                                       torch.device("cpu"), True)
            except BaseException as e:  # noqa: BLE001 - re-raised by _connect_watching
                box["error"] = e

        self._connect_watching(build, box)
        self.link = AFLink(box["pg"], Clock())

    # fault messages name ranks the AFD way (the Pipeline's start-up checks and diagnosis use these)
    _error_cls = AFDError
    _peers_name = "ranks"
    _engine_name = "AFD"

    def _rank_name(self, r: int) -> str:
        return self.layout.describe(r)

    # ------------------------------------------------------------ watchdog
    def _watch(self) -> None:
        """Every WATCH_INTERVAL_S: a dead rank or one that reported an error is a fault; so is a step during which no
        rank progressed for ``hang_timeout_s``. On a fault every rank is stopped, which unblocks the driver."""
        ctl = Control(dist.TCPStore("127.0.0.1", self.store.port, is_master=False, timeout=datetime.timedelta(seconds=30)),
                      self.run_id)
        W = self.layout.world
        keys = [ctl.key("progress", r) for r in range(1, W)]
        last = {r: (-1, time.monotonic()) for r in range(1, W)}
        while not self._stop_watch.wait(WATCH_INTERVAL_S):
            try:
                fault = self._diagnose(ctl)
                if fault is None and self.hang_timeout_s > 0:
                    now = time.monotonic()
                    prog = [int(v) for v in ctl.store.multi_get(keys)]
                    for r in range(1, W):
                        if prog[r - 1] != last[r][0]:
                            last[r] = (prog[r - 1], now)
                    busy = self._busy_since
                    if busy is not None and now - busy > self.hang_timeout_s:
                        stalled = [r for r in range(1, W) if now - last[r][1] > self.hang_timeout_s]
                        if len(stalled) == W - 1:
                            # a stopped process is the cause; otherwise blame the rank that stalled first
                            stopped = [q for q in stalled if _proc_state(self._procs[q - 1].pid) in ("T", "t")]
                            r = stopped[0] if stopped else min(stalled, key=lambda q: last[q][1])
                            why = "is stopped (state T)" if stopped else "stalled first"
                            fault = (f"{self.layout.describe(r)} hung: no rank made progress for "
                                     f"{now - last[r][1]:.1f} s of a step (hang timeout {self.hang_timeout_s:g} s); "
                                     f"{self.layout.describe(r)} {why}")
            except Exception as e:  # the store itself went away
                if self._closed:
                    return
                fault = f"lost contact with the AFD ranks ({e})"
            if fault is not None and not self._closed:
                self._fault = fault
                self._kill_all()
                return

    def _guarded(self, it: Iterator[Any]) -> Iterator[Any]:
        """The Pipeline's guard (lock, fault naming, Ctrl-C shutdown), raising AFDError for every rank failure."""
        try:
            yield from super()._guarded(it)
        except StageError as e:
            if isinstance(e, AFDError):
                raise
            raise AFDError(str(e)) from None

    # ------------------------------------------------------------ scheduling
    def _rank_of(self, i: int) -> int:
        return i % self.M

    def _plan_step(self, seqs: list[_Seq], logprobs: bool) -> list[list[tuple[_Seq, list[int], int, int]]] | None:
        """Per attention rank, the rows of this step: (seq, tokens, start, emit); None when nothing is left."""
        per: list[list[tuple[_Seq, list[int], int, int]]] = [[] for _ in range(self.M)]
        for s in seqs:
            if s.phase == DECODE:
                per[self._rank_of(s.idx)].append((s, [s.out[-1]], len(s.prompt) + len(s.out) - 1, EMIT_TOKEN))
        budget = [max(self.prefill_chunk - len(rows), 1) for rows in per]  # prompts always advance
        for s in seqs:
            m = self._rank_of(s.idx)
            if s.phase != PREFILL or s.next_pos >= len(s.prompt) or budget[m] <= 0:
                continue
            n = min(len(s.prompt) - s.next_pos, budget[m])
            last = s.next_pos + n == len(s.prompt)
            emit = EMIT_LOGPROBS if logprobs else (EMIT_TOKEN if last else EMIT_NONE)
            per[m].append((s, s.prompt[s.next_pos:s.next_pos + n], s.next_pos, emit))
            s.next_pos += n
            budget[m] -= n
        return per if any(per) else None

    def _micro_batches(self, rows: list[tuple[_Seq, list[int], int, int]]) -> tuple[list[MicroBatch], list[list[torch.Tensor]]]:
        """K micro-batches balanced by tokens (largest rows first), each split into groups of equal T."""
        K = self.micro_batches
        bins: list[list[tuple[_Seq, list[int], int, int]]] = [[] for _ in range(K)]
        load = [0] * K
        for row in sorted(rows, key=lambda r: -len(r[1])):
            k = min(range(K), key=lambda j: (load[j], j))
            bins[k].append(row)
            load[k] += len(row[1])
        mbs, toks = [], []
        for rows_k in bins:
            groups: dict[int, tuple[Group, list[list[int]]]] = {}
            for s, t, start, emit in sorted(rows_k, key=lambda r: r[0].idx):
                g, tl = groups.setdefault(len(t), (Group(len(t)), []))
                g.seqs.append(s.idx)
                g.slots.append(s.idx // self.M)
                g.starts.append(start)
                g.emits.append(emit)
                tl.append(t)
            self._mb_ids += 1
            mbs.append(MicroBatch(self._mb_ids, [groups[T][0] for T in sorted(groups)]))
            toks.append([torch.tensor(groups[T][1], dtype=torch.long) for T in sorted(groups)])
        return mbs, toks

    def _run(self, seqs: list[_Seq], params: SamplingParams, logprobs: bool, on_tokens: Any) -> Iterator[list[tuple[int, int]]]:
        n = len(seqs)
        cfg = {"num_slots": n, "params": {"temperature": params.temperature, "top_p": params.top_p,
                                          "top_k": params.top_k, "seed": params.seed}}
        self._mb_ids = 0
        self.runner.begin(dict(cfg, local_slots=len(range(0, n, self.M))))
        for m in range(1, self.M):
            self.link.send(m, BEGIN, json_meta(dict(cfg, local_slots=len(range(m, n, self.M)))))
        while True:
            per = self._plan_step(seqs, logprobs)
            if per is None:
                break
            self._busy_since = time.monotonic()
            mine = None
            for m in range(self.M):
                mbs, toks = self._micro_batches(per[m])
                if m == 0:
                    mine = (mbs, toks)
                else:
                    meta, ts = encode_step(mbs, toks)
                    self.link.send(m, STEP, meta, ts)
            feedback = self.runner.step(*mine)
            for m in range(1, self.M):
                for _ in range(self.micro_batches):
                    kind, meta, tail = self.link.recv(m)
                    if kind != FEEDBACK:
                        raise AFDError(f"protocol error: expected feedback from attention rank {m}, got kind {kind}")
                    feedback.append((meta, [tail]))
            self._busy_since = None
            now = time.perf_counter()
            events: list[tuple[int, int]] = []
            for meta, ts in feedback:
                tail = ts[0].reshape(-1).view(torch.uint8) if ts else torch.empty(0, dtype=torch.uint8)
                fb = decode_feedback(meta, tail, self.spec.vocab_size)  # (mb_id, tokens, log-probs, ...)
                tokens, lps = fb[1], fb[2]
                for i, lp in lps.items():
                    s = seqs[i]
                    s.logprobs.append(lp.clone())
                    if s.next_pos >= len(s.prompt) and sum(x.shape[0] for x in s.logprobs) == len(s.prompt):
                        s.phase = DONE
                for i, toks in tokens.items():
                    events += [(i, t) for t in on_tokens(seqs[i], toks, now)]
            if events:
                yield events
        self.link.flush()

    # ------------------------------------------------------------ measurement
    def time_split(self, reset: bool = True) -> dict[str, Any]:
        """Seconds of compute / transfer / idle per rank since the last reset, and the sums per side."""
        if self._broken is not None or self._closed:
            raise AFDError(str(self._broken or "this AFD engine is closed"))
        with self._lock:
            for r in range(1, self.layout.world):
                self.ctl.store.delete_key(self.ctl.key("stats", r))
                self.link.send(r, STATS, [1 if reset else 0])
            self.link.flush()
            ranks = {0: self.link.clock.as_dict()}
            if reset:
                self.link.clock.__init__()
            deadline = time.monotonic() + 10
            for r in range(1, self.layout.world):
                while (v := self.ctl.get("stats", r)) is None:
                    if time.monotonic() > deadline:
                        raise AFDError(f"{self.layout.describe(r)} did not report its time split")
                    time.sleep(0.005)
                ranks[r] = json.loads(v)
        sides: dict[str, dict[str, float]] = {}
        for r, c in ranks.items():
            side = sides.setdefault("attention" if r < self.M else "ffn", {"compute": 0.0, "transfer": 0.0, "idle": 0.0})
            for k in side:
                side[k] += c[k]
        return {"ranks": {self.layout.describe(r): c for r, c in ranks.items()}, "sides": sides}

    # ------------------------------------------------------------ shutdown
    def _send_shutdown(self) -> None:
        """SHUTDOWN to every rank (the Pipeline's close() calls this)."""
        for r in range(1, self.layout.world):
            self.link.send(r, SHUTDOWN, [])
        self.link.flush()
