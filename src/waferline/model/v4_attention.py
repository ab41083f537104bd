"""DeepSeek-V4 attention: shared-KV multi-query attention over a sliding window of recent tokens plus compressed
entries (CSA: one entry per ``m`` tokens over overlapping windows, a lightning indexer picking the top-k per query;
HCA: one entry per ``m'`` tokens, all attended), per-head sinks and a grouped low-rank output projection.

The per-sequence cache (:class:`V4Cache`) holds only what later tokens need: the last ``sliding_window - 1`` tokens'
K=V rows, the compressed entries (and the indexer's compressed keys), the tokens of the window still being filled
(their projected values and gates) and, for the overlapping CSA windows, the previous window's first-series half.
The indexer's compressed keys are held at the spec's ``index_bits``: 0 the model's precision (DeepSeek-V4's reference
cache), 8 fp8 with one fp32 scale per key, 16 / 32 bf16 / fp32.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn

from waferline.errors import ConfigError
from waferline.model.attention import attend
from waferline.model.context import StepBatch
from waferline.model.layers import Linear, RMSNorm, Rotary
from waferline.model.sparse_attention import FP8_MAX, INDEX_DTYPES, top_k
from waferline.model.weights import WeightSource, copy_into
from waferline.spec.model import CompressedAttentionSpec


def rope_settings(cfg: dict[str, Any], kind: str) -> dict[str, Any]:
    """Rotary settings of one of V4's two rope kinds, ``main`` (pure sliding-window layers: plain RoPE at
    ``rope_theta``) or ``compress`` (layers with a compressor, their compressors and indexer: ``compress_rope_theta``,
    with the config's YaRN scaling if any, whose attention factor V4 fixes at 1). Configs either nest both under
    ``rope_parameters`` (as transformers writes them) or give the flat hub spelling."""
    rp = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        return dict(rp[kind])
    if kind == "main":
        return {"rope_type": "default", "rope_theta": cfg.get("rope_theta", 10000.0)}
    out = {k: v for k, v in rp.items() if k not in ("main", "compress")}
    out["rope_theta"] = cfg.get("compress_rope_theta", 160000.0)
    out["rope_type"] = out.get("rope_type") or out.get("type") or "default"
    if out["rope_type"] == "yarn":
        out.setdefault("attention_factor", 1.0)
    return out


def rope_dim(cfg: dict[str, Any]) -> int:
    """Rotated channels per head: ``head_dim * partial_rotary_factor`` (legacy configs: ``qk_rope_head_dim``)."""
    hd = int(cfg.get("head_dim") or 512)
    factor = cfg.get("partial_rotary_factor")
    if factor is None:
        return int(cfg.get("qk_rope_head_dim") or 64)
    return int(hd * float(factor))


class TailRope(nn.Module):
    """RoPE on the trailing ``dim`` channels of each vector, channel pairs (2i, 2i+1) rotated in place (V4 lays a
    head out as [no-rope | rope], interleaved); the leading channels pass through."""

    def __init__(self, dim: int, settings: dict[str, Any], max_positions: int):
        super().__init__()
        inner = Rotary(dim, {"rope_parameters": settings, "max_position_embeddings": max_positions})
        self.register_buffer("inv_freq", inner.inv_freq, persistent=False)
        self.scaling = inner.attention_scaling

    def cos_sin(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Per-pair tables for integer ``positions`` [...]: (cos, sin) [..., dim / 2], fp32."""
        ang = positions.float()[..., None] * self.inv_freq
        return ang.cos() * self.scaling, ang.sin() * self.scaling

    @staticmethod
    def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """x [..., C] rotated by tables broadcastable to [..., dim / 2] (pass ``-sin`` to undo a rotation)."""
        d = 2 * cos.shape[-1]
        tail = x[..., -d:].float()
        a, b = tail[..., 0::2], tail[..., 1::2]
        out = torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2).to(x.dtype)
        return torch.cat([x[..., :-d], out], dim=-1) if x.shape[-1] != d else out


def unit_rms(x: Tensor, eps: float) -> Tensor:
    """RMS normalisation without a weight, over the last dimension (statistics in fp32)."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


@dataclass
class Series:
    """One compressor's state for one sequence: the entries emitted so far [n, dim], the projected values and
    gates of the tokens of the window still open [r < ratio, width], and (overlapping windows only) the last closed
    window's first-series values and gates [ratio, dim], which the next window's entry mixes in."""

    entries: Tensor
    pending_kv: Tensor
    pending_gate: Tensor
    overlap_kv: Tensor | None = None
    overlap_gate: Tensor | None = None
    scales: Tensor | None = None  # fp8 entries: one fp32 scale per entry [n, 1]

    def nbytes(self) -> int:
        parts = (self.entries, self.pending_kv, self.pending_gate, self.overlap_kv, self.overlap_gate, self.scales)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)

    def values(self) -> Tensor:
        """The entries' values: fp8 ones times their scales (fp32), others as stored."""
        if self.scales is not None:
            return self.entries.float() * self.scales
        return self.entries


def _copy(s: Series | None) -> Series | None:
    """A new Series holding the same tensors (a forward rebinds a Series' fields; it never writes their tensors)."""
    return None if s is None else replace(s)


class Compressor(nn.Module):
    """Gated pooling of every ``ratio`` tokens into one entry of ``dim`` channels: softmax over the window's
    positions (per channel) of ``gate + position_bias`` weighting the projected values, then an RMSNorm and RoPE at
    the window's first position. With ``overlap`` (CSA) each token projects two series of ``dim`` channels and entry
    ``w`` pools the second series of window ``w`` with the first series of window ``w - 1`` (2 x ratio slots)."""

    def __init__(self, d: int, dim: int, ratio: int, overlap: bool, eps: float, dtype: torch.dtype, rope: TailRope,
                 entry_bits: int = 0):
        super().__init__()
        width = 2 * dim if overlap else dim
        if entry_bits and entry_bits not in INDEX_DTYPES:
            raise ConfigError(f"index_bits {entry_bits}: the engine stores indexer keys at 0 (the model's precision) "
                              f"or {sorted(INDEX_DTYPES)} bits")
        self.dim, self.ratio, self.overlap = dim, ratio, overlap
        self.entry_dtype = INDEX_DTYPES.get(entry_bits)  # None: the entries stay at the model's precision
        self.kv_proj = Linear(d, width, dtype=dtype)
        self.gate_proj = Linear(d, width, dtype=dtype)
        self.position_bias = nn.Parameter(torch.zeros(ratio, width, dtype=torch.float32), requires_grad=False)
        self.kv_norm = RMSNorm(dim, eps, dtype)
        self.rope = rope

    def load_hf(self, src: WeightSource, prefix: str) -> None:
        """Weights under ``prefix`` (``...compressor.``) in the checkpoint's names: wkv, wgate, ape, norm."""
        self.kv_proj.load_hf(src, prefix + "wkv")
        self.gate_proj.load_hf(src, prefix + "wgate")
        copy_into(self.position_bias, src.get(prefix + "ape", tuple(self.position_bias.shape)))
        self.kv_norm.load_hf(src, prefix + "norm.weight")

    def empty(self, device: torch.device | str | None) -> Series:
        dt = self.kv_proj.weight.dtype
        width = self.kv_proj.out_features
        fp8 = self.entry_dtype == torch.float8_e4m3fn
        return Series(torch.zeros(0, self.dim, dtype=self.entry_dtype or dt, device=device),
                      torch.zeros(0, width, dtype=dt, device=device), torch.zeros(0, width, dtype=dt, device=device),
                      scales=torch.zeros(0, 1, dtype=torch.float32, device=device) if fp8 else None)

    def _store(self, s: Series, new: Tensor) -> None:
        """Append new entries [n, dim] to ``s`` at the storage precision: as computed, bf16 / fp32, or fp8 (e4m3)
        with one fp32 scale per entry mapping its largest element to fp8's largest (as DSACache keeps its keys)."""
        if self.entry_dtype is None:
            s.entries = torch.cat([s.entries, new])
        elif s.scales is None:
            s.entries = torch.cat([s.entries, new.to(self.entry_dtype)])
        else:
            scale = (new.float().abs().amax(-1, keepdim=True) / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
            s.entries = torch.cat([s.entries, (new.float() / scale).to(self.entry_dtype)])
            s.scales = torch.cat([s.scales, scale])

    def absorb(self, s: Series, kv: Tensor, gate: Tensor) -> None:
        """Add one sequence's new tokens' projections (kv, gate [T, width]) to ``s``: every window they close
        becomes an entry; the rest stays pending."""
        kv, gate = torch.cat([s.pending_kv, kv]), torch.cat([s.pending_gate, gate])
        m = self.ratio
        usable = kv.shape[0] // m * m
        s.pending_kv, s.pending_gate = kv[usable:].clone(), gate[usable:].clone()
        if usable == 0:
            return
        n = usable // m
        ckv = kv[:usable].view(n, m, -1)
        cg = gate[:usable].view(n, m, -1) + self.position_bias
        if self.overlap:
            h = self.dim
            prev_kv = ckv.new_zeros(n, m, h)
            prev_gate = cg.new_full((n, m, h), float("-inf"))
            prev_kv[1:], prev_gate[1:] = ckv[:-1, :, :h], cg[:-1, :, :h]
            if s.overlap_kv is not None:
                prev_kv[0], prev_gate[0] = s.overlap_kv, s.overlap_gate
            s.overlap_kv, s.overlap_gate = ckv[-1, :, :h].clone(), cg[-1, :, :h].clone()
            ckv = torch.cat([prev_kv, ckv[..., h:]], dim=1)
            cg = torch.cat([prev_gate, cg[..., h:]], dim=1)
        pooled = self.kv_norm((ckv * cg.softmax(dim=1, dtype=torch.float32).to(ckv.dtype)).sum(dim=1))
        first = s.entries.shape[0] * m
        cos, sin = self.rope.cos_sin(torch.arange(n, device=kv.device) * m + first)
        self._store(s, TailRope.rotate(pooled, cos, sin))


class Indexer(nn.Module):
    """Lightning indexer: its own overlapping compressor of ``index_head_dim`` keys, and per query
    ``sum_h w_h relu(q_h . k)`` over the entries the query may see; keeps the ``index_topk`` best."""

    def __init__(self, spec: CompressedAttentionSpec, eps: float, dtype: torch.dtype, rope: TailRope,
                 position_ties: bool = False):
        super().__init__()
        self.position_ties = position_ties
        d, hi, di = spec.hidden_size, spec.index_n_heads, spec.index_head_dim
        self.heads, self.dim, self.topk, self.ratio = hi, di, spec.index_topk, spec.compress_ratio
        self.compressor = Compressor(d, di, spec.compress_ratio, True, eps, dtype, rope, spec.index_bits)
        self.q_b_proj = Linear(spec.q_lora_rank, hi * di, dtype=dtype)
        self.weights_proj = Linear(d, hi, dtype=dtype)

    def load_hf(self, src: WeightSource, prefix: str) -> None:
        """Weights under ``prefix`` (``...attn.indexer.``): compressor.*, wq_b, weights_proj."""
        self.compressor.load_hf(src, prefix + "compressor.")
        self.q_b_proj.load_hf(src, prefix + "wq_b")
        self.weights_proj.load_hf(src, prefix + "weights_proj")

    def visible(self, q: Tensor, w: Tensor, keys: Tensor, positions: Tensor) -> Tensor:
        """Entries each query attends to: bool [T, n] for one sequence's queries (q [T, heads, dim] rotated, head
        weights w [T, heads], positions [T]) over its indexer keys [n, dim]; entry e is eligible for the query at
        position t once its window has closed (e < (t + 1) / ratio), and the top-k eligible ones by score are kept
        (scored and picked by the same tensor operations as the reference: equal scores, rare unless few heads, are
        broken as ``torch.topk`` breaks them, which can differ between a prefill's rows and a decode step's; with
        ``position_ties`` the earliest entries win, as DSA's ``top_k`` picks, the same in every row shape)."""
        n = keys.shape[0]
        scores = torch.matmul(q.float()[None], keys.t().float()[None, None])  # [1, T, heads, n]
        scores = scores.relu() * self.dim ** -0.5
        total = (scores * (w.float() * self.heads ** -0.5)[None, :, :, None]).sum(dim=2)  # [1, T, n]
        ready = (positions + 1) // self.ratio
        eligible = torch.arange(n, device=q.device)[None, :] < ready[:, None]
        if self.position_ties:
            if n == 0:
                return eligible
            return top_k(total.masked_fill(~eligible[None], float("-inf")), min(self.topk, n))[0] & eligible
        top = total.masked_fill(~eligible[None], float("-inf")).topk(min(self.topk, n), dim=-1).indices[0]
        keep = torch.zeros(q.shape[0], n + 1, dtype=torch.bool, device=q.device)
        keep.scatter_(1, torch.where(top < ready[:, None], top, n), True)
        return keep[:, :n]


SlotState = tuple[Tensor, Series | None, Series | None]  # one slot's (window rows, compressor, indexer series)


def _slot_list(slots: Tensor | list[int] | range | int) -> list[int]:
    return torch.as_tensor(list(slots) if isinstance(slots, range) else slots).reshape(-1).tolist()


class V4Cache:
    """Per-sequence state of one V4 attention layer for ``num_slots`` sequences (each slot's tensors sized to what
    it holds): the K=V rows of the last ``window - 1`` tokens, and the compressor's and indexer's :class:`Series`.

    A forward replaces a slot's tensors and never writes into them, so references capture a slot's state
    (:meth:`snapshot`, :meth:`restore`). Speculative verify: with ``keep_trail`` set, a T > 1 forward records per
    slot the state it started from and its T tokens' K=V rows and compressor / indexer projections; :meth:`rewind`
    rebuilds from those the state after the first k tokens: the window rows of the kept tokens, and the series fed
    only the kept tokens' projections, so the windows that rejected tokens closed are open again (their kept tokens
    pending) and CSA's overlap is that of the last window the kept tokens closed. A closed window's entry depends
    only on its own tokens' projections (and, overlapping, the previous window's), so the rebuilt state is the one a
    cache that saw only the kept tokens holds. The trail is keyed by slot: verifies of other slots (another
    micro-batch in a pipeline) in between do not disturb it."""

    def __init__(self, num_slots: int, attn: V4Attention, device: torch.device | str | None):
        self.attn, self.device = attn, device
        self.window: list[Tensor] = [torch.zeros(0)] * num_slots
        self.kv: list[Series | None] = [None] * num_slots
        self.index: list[Series | None] = [None] * num_slots
        self.keep_trail = False
        # slot -> (state before the verify, its tokens' K=V rows [T, hd], compressor (kv, gate), indexer (kv, gate))
        self.trail: dict[int, tuple[SlotState, Tensor, tuple | None, tuple | None]] = {}
        self.reset(range(num_slots))

    def reset(self, slots: Tensor | list[int] | range | int) -> None:
        """Empty these slots (new sequences start there)."""
        a = self.attn
        for slot in _slot_list(slots):
            self.window[slot] = torch.zeros(0, a.head_dim, dtype=a.kv_proj.weight.dtype, device=self.device)
            self.kv[slot] = a.compressor.empty(self.device) if a.compressor is not None else None
            self.index[slot] = a.indexer.compressor.empty(self.device) if a.indexer is not None else None
            self.trail.pop(slot, None)

    def snapshot(self, slots: Tensor | list[int] | int) -> list[SlotState]:
        """The state of ``slots``: (window rows, compressor series, indexer series) per slot."""
        return [(self.window[s], _copy(self.kv[s]), _copy(self.index[s])) for s in _slot_list(slots)]

    def restore(self, slots: Tensor | list[int] | int, state: list[SlotState]) -> None:
        """Put back a :meth:`snapshot` of ``slots``."""
        for s, (window, kv, index) in zip(_slot_list(slots), state):
            self.window[s], self.kv[s], self.index[s] = window, _copy(kv), _copy(index)

    def append(self, slot: int, kv: Tensor, comp: tuple[Tensor, Tensor] | None,
               idx: tuple[Tensor, Tensor] | None) -> None:
        """Add tokens to ``slot``: their K=V rows ``kv`` [T, hd], the compressor's (values, gates) ``comp`` and the
        indexer compressor's ``idx`` (None in a layer without one). With ``keep_trail`` and T > 1, records what
        :meth:`rewind` needs first."""
        if self.keep_trail and kv.shape[0] > 1:
            self.trail[slot] = (self.snapshot(slot)[0], kv, comp, idx)
        rows = torch.cat([self.window[slot], kv])
        self.window[slot] = rows[rows.shape[0] - min(rows.shape[0], self.attn.window - 1):].clone()
        if comp is not None:
            self.attn.compressor.absorb(self.kv[slot], *comp)
        if idx is not None:
            self.attn.indexer.compressor.absorb(self.index[slot], *idx)

    def rewind(self, slots: Tensor | list[int], keep: list[int]) -> None:
        """After a T-token forward with ``keep_trail``: give row b the state after its first ``keep[b]`` (>= 1)
        tokens."""
        for s, k in zip(_slot_list(slots), keep):
            if s not in self.trail:
                raise RuntimeError(f"V4Cache.rewind: no trail for slot {s} (run the verify with keep_trail=True)")
            before, kv, comp, idx = self.trail.pop(s)
            if k < kv.shape[0]:
                self.restore(s, [before])
                self.append(s, kv[:k], None if comp is None else (comp[0][:k], comp[1][:k]),
                            None if idx is None else (idx[0][:k], idx[1][:k]))

    def bytes_held(self, slot: int) -> int:
        """Bytes of tensors this slot holds (what the ModelSpec's cache accounting counts)."""
        w = self.window[slot]
        return w.numel() * w.element_size() + sum(s.nbytes() for s in (self.kv[slot], self.index[slot]) if s)


class V4Attention(nn.Module):
    """One V4 attention layer (sliding-window only, CSA or HCA, as its spec's compress ratio and top-k say): in a
    DeepSeek-V4 layer between hyper-connections (V4Layer), or the mixer of a sol ``csa`` / ``hca`` layer on a plain
    residual (DecoderLayer; ``position_ties``: its indexer's ties broken by position, see Indexer.visible)."""

    def __init__(self, spec: CompressedAttentionSpec, cfg: dict[str, Any], dtype: torch.dtype, eps: float,
                 position_ties: bool = False):
        super().__init__()
        d, h, hd = spec.hidden_size, spec.num_heads, spec.head_dim
        if not spec.o_lora_rank or (h * hd) % spec.o_groups:
            raise ConfigError(f"deepseek_v4 attention needs o_lora_rank > 0 and o_groups dividing {h * hd}")
        self.heads, self.head_dim, self.eps = h, hd, eps
        self.window = int(cfg.get("sliding_window") or 128)
        self.groups, self.o_rank = spec.o_groups, spec.o_lora_rank
        kind = "compress" if spec.compress_ratio else "main"
        maxpos = int(cfg.get("max_position_embeddings") or 4096)
        self.rope = TailRope(rope_dim(cfg), rope_settings(cfg, kind), maxpos)
        self.q_a_proj = Linear(d, spec.q_lora_rank, dtype=dtype)
        self.q_a_norm = RMSNorm(spec.q_lora_rank, eps, dtype)
        self.q_b_proj = Linear(spec.q_lora_rank, h * hd, dtype=dtype)
        self.kv_proj = Linear(d, hd, dtype=dtype)
        self.kv_norm = RMSNorm(hd, eps, dtype)
        self.o_a_proj = Linear(h * hd // spec.o_groups, spec.o_groups * spec.o_lora_rank, dtype=dtype)
        self.o_b_proj = Linear(spec.o_groups * spec.o_lora_rank, d, dtype=dtype)
        self.sinks = nn.Parameter(torch.zeros(h, dtype=torch.float32), requires_grad=False)
        self.compressor = (Compressor(d, hd, spec.compress_ratio, spec.index_topk > 0, eps, dtype, self.rope)
                           if spec.compress_ratio else None)
        self.indexer = (Indexer(spec, eps, dtype, self.rope, position_ties)
                        if spec.compress_ratio and spec.index_topk else None)

    def new_cache(self, num_slots: int, device: torch.device | str | None = None) -> V4Cache:
        return V4Cache(num_slots, self, device)

    def load_hf(self, src: WeightSource, prefix: str) -> None:
        """Weights under ``prefix`` (``model.layers.{i}.attn.``) in DeepSeek's names, as transformers saves them."""
        names = {"q_a_proj": "wq_a", "q_b_proj": "wq_b", "kv_proj": "wkv", "o_a_proj": "wo_a", "o_b_proj": "wo_b"}
        for name, stored in names.items():
            getattr(self, name).load_hf(src, prefix + stored)
        self.q_a_norm.load_hf(src, prefix + "q_norm.weight")
        self.kv_norm.load_hf(src, prefix + "norm.weight")
        copy_into(self.sinks, src.get(prefix + "attn_sink", (self.heads,)))
        if self.compressor is not None:
            self.compressor.load_hf(src, prefix + "compressor.")
        if self.indexer is not None:
            self.indexer.load_hf(src, prefix + "indexer.")

    def forward(self, x: Tensor, cache: V4Cache, batch: StepBatch) -> Tensor:
        """x [B, T, D] (the normalised layer input) -> [B, T, D]; appends the step's tokens to ``cache``."""
        B, T, _ = x.shape
        h, hd = self.heads, self.head_dim
        pos = batch.positions()
        cos, sin = self.rope.cos_sin(pos)  # [B, T, rope / 2]
        q_res = self.q_a_norm(self.q_a_proj(x))
        q = unit_rms(self.q_b_proj(q_res).view(B, T, h, hd), self.eps)
        q = TailRope.rotate(q, cos[:, :, None], sin[:, :, None])
        kv = TailRope.rotate(self.kv_norm(self.kv_proj(x)), cos, sin)
        comp = (self.compressor.kv_proj(x), self.compressor.gate_proj(x)) if self.compressor is not None else None
        idx = None
        if self.indexer is not None:
            ic = self.indexer.compressor
            iq = self.indexer.q_b_proj(q_res).view(B, T, self.indexer.heads, self.indexer.dim)
            idx = (ic.kv_proj(x), ic.gate_proj(x), TailRope.rotate(iq, cos[:, :, None], sin[:, :, None]),
                   self.indexer.weights_proj(x))
        slots = batch.host_slots if batch.host_slots is not None else tuple(batch.slots.tolist())
        starts = batch.host_start if batch.host_start is not None else tuple(batch.start.tolist())
        out = []
        for b, (slot, start) in enumerate(zip(slots, starts)):
            if start == 0:
                cache.reset(slot)
            keys, blocked = self._keys(cache, slot, start, kv[b], pos[b], None if comp is None else (
                comp[0][b], comp[1][b]), None if idx is None else tuple(t[b] for t in idx))
            out.append(attend(q[b: b + 1], keys[None, :, None], keys[None, :, None], blocked[None],
                              hd ** -0.5, self.sinks)[0])
        o = TailRope.rotate(torch.stack(out), cos[:, :, None], -sin[:, :, None])  # undo the rotation V carried
        g = self.groups
        wa = self.o_a_proj.weight.view(g, self.o_rank, -1)
        y = torch.einsum("btgi,goi->btgo", o.reshape(B, T, g, -1), wa).reshape(B, T, g * self.o_rank)
        return self.o_b_proj(y)

    def _keys(self, cache: V4Cache, slot: int, start: int, kv: Tensor, pos: Tensor, comp: tuple | None,
              idx: tuple | None) -> tuple[Tensor, Tensor]:
        """One sequence's keys (= values) for its new tokens, and which each query must not see (bool [T, L]):
        the cached window rows then the new rows (positions within the last ``window``), then the compressed
        entries (closed windows only; CSA: the indexer's picks). ``comp``: the sequence's compressor projections
        (values, gates); ``idx``: the indexer's (values, gates, rotated queries, head weights). Updates the slot's
        cache."""
        old = cache.window[slot]
        rows = torch.cat([old, kv])
        kpos = torch.arange(start - old.shape[0], start + kv.shape[0], device=kv.device)
        blocked = (kpos[None, :] > pos[:, None]) | (kpos[None, :] <= pos[:, None] - self.window)
        cache.append(slot, kv, comp, None if idx is None else idx[:2])
        if comp is None:
            return rows, blocked
        entries = cache.kv[slot].entries
        if idx is not None:
            seen = self.indexer.visible(idx[2], idx[3], cache.index[slot].values(), pos)
        else:  # HCA: every closed window
            ready = (pos + 1) // self.compressor.ratio
            seen = torch.arange(entries.shape[0], device=kv.device)[None, :] < ready[:, None]
        return torch.cat([rows, entries]), torch.cat([blocked, ~seen], dim=1)
