"""Mamba-2 (SSD) mixer: chunked-scan prefill and recurrent decode over a constant-size per-slot conv + SSM state.

One module serves the three Hugging Face families that use this mixer (``bamba``, ``nemotron_h``,
``granitemoehybrid``); in transformers 5.x their mixers are the same code, and only configuration differs:

====================  ==============================  ======================  =======================================
family                HF mixer weight prefix          conv activation         dt clamp in the T > 1 (chunked) path
====================  ==============================  ======================  =======================================
bamba                 ``model.layers.{i}.mamba.``     ``config.hidden_act``   ``config.time_step_limit``
granitemoehybrid      ``model.layers.{i}.mamba.``     ``config.hidden_act``   ``config.time_step_limit``
nemotron_h            ``backbone.layers.{i}.mixer.``  ``mamba_hidden_act``    ``config.time_step_limit`` (*)
                      (in memory: ``model.layers.``)
====================  ==============================  ======================  =======================================

(*) or ``mamba_dt_limit``; transformers before 5.25 clamped nemotron_h at ``(config.time_step_min, inf)`` instead.

HF clamps dt to the limit only in its chunked path; its single-token (decode) path never clamps. With the default
limit ``(0, inf)`` that is a no-op, but a limit such as ``(time_step_min, inf)`` makes the two paths differ. By default
this module does the same as HF (``clamp_dt_in_decode=False``); pass ``True`` to clamp in both paths (then chunked
prefill, speculative verify and plain decode are mutually consistent, at the cost of differing from HF's decode).

The computation: ``in_proj`` -> [z | xBC | dt]; causal depthwise conv over xBC (with the cached K-1 previous
inputs) + activation; x, B, C split (B/C shared by the heads of a group); dt = softplus(dt + dt_bias);
state h <- exp(dt*A) h + dt * x B^T; y = C h + D x; y * silu(z), RMS-normalised per group, times the norm weight;
``out_proj``. The SSM state and all scan arithmetic are float32 whatever the model dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from waferline import kernels
from waferline.errors import ConfigError
from waferline.model.context import StepBatch
from waferline.model.layers import Linear, kept_args
from waferline.model.weights import WeightSource, copy_into
from waferline.spec.model import Mamba2Spec

_ACTS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "relu": F.relu,
    "identity": lambda t: t,
    "linear": lambda t: t,
}


def causal_depthwise_conv(full: Tensor, weight: Tensor, bias: Tensor | None, T: int) -> Tensor:
    """``F.conv1d(full, weight[:, None], bias, groups=C)`` for ``full [B, C, K - 1 + T]`` and ``weight [C, K]``: the
    last T outputs as K shifted multiply-adds in fp32 (exact products, fp32 sums, one rounding to ``full``'s dtype, as
    a 16-bit convolution accumulates). ATen's 16-bit depthwise convolution on a CPU without oneDNN's bf16 kernels
    (AVX2) runs one slow 2-D convolution per channel: 6 of sol-mini's Mamba-2 layers took 70 ms of a 33-token prompt's
    200 ms there."""
    K = weight.shape[-1]
    w = weight.float()
    acc = full[:, :, 0:T].float() * w[:, 0, None]
    for k in range(1, K):
        acc.addcmul_(full[:, :, k:k + T].float(), w[:, k, None])
    if bias is not None:
        acc += bias.float()[:, None]
    return acc.to(full.dtype)


@dataclass
class Mamba2Cache:
    """Per-layer Mamba-2 state for up to ``num_slots`` sequences; its size does not depend on sequence length.

    conv: the last ``conv_kernel - 1`` inputs of the causal conv, ``[num_slots, conv_dim, conv_kernel - 1]``, model
    dtype.
    ssm:  the SSM state, ``[num_slots, num_heads, head_dim, state_size]``, always float32.
    """

    conv: Tensor
    ssm: Tensor
    # speculative verify: when keep_trail is set, a T > 1 forward runs the decode recurrence token by token and records
    # per slot the (conv, ssm) state after each of its T tokens ([T, ...] each), so ``rewind`` keeps any prefix. Keyed
    # by slot, so verifies of other slots (another micro-batch in a pipeline) in between do not disturb it.
    # With the fused operator the SSM part of a trail is not the T states themselves (a [T, H, P, N] fp32 tensor per
    # slot, written every verify) but what replays them: the state before the verify (``ssm_prev``, one persistent
    # row per slot) and the verify's per-token inputs (``_Replay``); ``ssm_after`` recomputes the state after k tokens
    # by the same arithmetic, so a rewind lands on exactly the state plain decoding would have.
    keep_trail: bool = False
    trail: dict[int, tuple[Tensor, Tensor | _Replay]] = field(default_factory=dict)
    ssm_prev: Tensor | None = None

    @property
    def num_slots(self) -> int:
        return int(self.ssm.shape[0])

    def nbytes(self) -> int:
        return self.conv.numel() * self.conv.element_size() + self.ssm.numel() * self.ssm.element_size()

    def reset(self, slots: Tensor) -> None:
        """Zero the state of ``slots`` (a slot starting a new sequence) and drop the trail of a verify of the slots'
        previous sequences whose rewind never came."""
        slots = torch.as_tensor(slots, dtype=torch.long, device=self.ssm.device).reshape(-1)
        self.conv.index_fill_(0, slots, 0)
        self.ssm.index_fill_(0, slots, 0)
        if self.trail:
            for s in slots.tolist():
                self.trail.pop(s, None)

    def snapshot(self, slots: Tensor) -> tuple[Tensor, Tensor]:
        """Copies of the (conv, ssm) state of ``slots``, e.g. to roll back after a rejected speculative verify."""
        slots = torch.as_tensor(slots, dtype=torch.long, device=self.ssm.device).reshape(-1)
        return self.conv.index_select(0, slots), self.ssm.index_select(0, slots)

    def restore(self, slots: Tensor, state: tuple[Tensor, Tensor]) -> None:
        """Write back a ``snapshot`` of ``slots``."""
        slots = torch.as_tensor(slots, dtype=torch.long, device=self.ssm.device).reshape(-1)
        self.conv.index_copy_(0, slots, state[0].to(self.conv.dtype))
        self.ssm.index_copy_(0, slots, state[1].to(self.ssm.dtype))

    def rewind(self, slots: Tensor, keep: list[int]) -> None:
        """After a T-token forward with ``keep_trail``: give row b the state after its first ``keep[b]`` (>= 1)
        tokens."""
        for b, k in enumerate(keep):
            s = int(slots[b])
            if s not in self.trail:
                raise RuntimeError(f"Mamba2Cache.rewind: no trail for slot {s} (run the verify with keep_trail=True)")
            conv_after, rec = self.trail.pop(s)
            if k < conv_after.shape[0]:
                self.conv[s].copy_(conv_after[k - 1])
                if isinstance(rec, _Replay):  # replayed straight into the cache row (no temporary state)
                    row = self.ssm[s: s + 1]
                    row.copy_(self.ssm_prev[s: s + 1])
                    rec.replay(row, k)
                else:
                    self.ssm[s].copy_(rec[k - 1])

    def ssm_after(self, slot: int, k: int) -> Tensor:
        """The SSM state of ``slot`` after the first ``k`` (>= 1) tokens of its recorded verify, ``[H, P, N]``."""
        rec = self.trail[slot][1]
        if not isinstance(rec, _Replay):
            return rec[k - 1]
        h = self.ssm_prev[slot: slot + 1].clone()
        rec.replay(h, k)
        return h[0]


@dataclass
class _Replay:
    """One slot's verify inputs to the fused state update (``[T, ...]`` each): replayed from
    ``Mamba2Cache.ssm_prev``."""

    dA: Tensor
    dtx: Tensor
    Bm: Tensor
    Cm: Tensor

    def replay(self, h: Tensor, k: int) -> None:
        """Advance ``h`` ([1, H, P, N], the state before the verify) in place through the first ``k`` tokens."""
        torch.ops.waferline.ssm_update(h, self.dA[None, :k], self.dtx[None, :k], self.Bm[None, :k], self.Cm[None, :k],
                                       _NO_TRAIL)


def _segsum(a: Tensor) -> Tensor:
    """For a [..., L] tensor of per-step log-decays, the [..., L, L] matrix of sum_{s < k <= l} a_k (−inf where s > l).

    Summed directly (masked cumulative sum) rather than as a difference of prefix sums, which loses precision once
    the prefix sums grow large.
    """
    L = a.shape[-1]
    strict = torch.ones(L, L, dtype=torch.bool, device=a.device).tril(-1)  # [k, s]: k > s
    x = a[..., :, None].expand(*a.shape, L).masked_fill(~strict, 0.0)  # [..., k, s] = a_k if k > s
    out = torch.cumsum(x, dim=-2)  # [..., l, s] = sum_{s < k <= l} a_k
    causal = torch.ones(L, L, dtype=torch.bool, device=a.device).tril(0)
    return out.masked_fill_(~causal, float("-inf"))


class Mamba2Mixer(nn.Module):
    """The Mamba-2 mixer of one layer. ``forward`` reads and updates a ``Mamba2Cache`` at the rows ``batch.slots``."""

    def __init__(self, spec: Mamba2Spec, dtype: torch.dtype = torch.float32, act: str = "silu",
                 time_step_limit: tuple[float, float] | None = None, clamp_dt_in_decode: bool = False):
        super().__init__()
        if spec.num_heads % spec.n_groups != 0:
            raise ConfigError(f"mamba2: num_heads {spec.num_heads} is not a multiple of n_groups {spec.n_groups}")
        if spec.conv_kernel < 2:
            raise ConfigError(f"mamba2: conv_kernel must be >= 2, got {spec.conv_kernel}")
        if act not in _ACTS:
            raise ConfigError(f"mamba2: unsupported conv activation {act!r}; use one of {sorted(_ACTS)}")
        self.spec = spec
        self.act_name = act
        self._act = _ACTS[act]
        lim = spec.time_step_limit if time_step_limit is None else time_step_limit
        self.time_step_limit = (float(lim[0]), float(lim[1]))
        self._clamp = self.time_step_limit != (0.0, float("inf"))
        self.clamp_dt_in_decode = clamp_dt_in_decode

        H, P, N, G, K = spec.num_heads, spec.head_dim, spec.state_size, spec.n_groups, spec.conv_kernel
        self.H, self.P, self.N, self.G, self.K = H, P, N, G, K
        self.d_inner = spec.d_inner
        self.conv_dim = spec.conv_dim
        self.in_proj = Linear(spec.hidden_size, self.d_inner + self.conv_dim + H, spec.proj_bias, dtype)
        self.conv_weight = nn.Parameter(torch.zeros(self.conv_dim, K, dtype=dtype))
        self.conv_bias = nn.Parameter(torch.zeros(self.conv_dim, dtype=dtype)) if spec.conv_bias else None
        # the per-head scalars are tiny: keep them float32 whatever the model dtype
        self.dt_bias = nn.Parameter(torch.zeros(H, dtype=torch.float32))
        self.A_log = nn.Parameter(torch.zeros(H, dtype=torch.float32))
        self.D = nn.Parameter(torch.ones(H, dtype=torch.float32))
        self.norm_weight = nn.Parameter(torch.ones(self.d_inner, dtype=dtype))
        self.out_proj = Linear(self.d_inner, spec.hidden_size, spec.proj_bias, dtype)
        self.requires_grad_(False)

    # ------------------------------------------------------------------ state and weights

    def new_cache(self, num_slots: int, device: torch.device | str | None = None) -> Mamba2Cache:
        device = device if device is not None else self.conv_weight.device
        return Mamba2Cache(
            conv=torch.zeros(num_slots, self.conv_dim, self.K - 1, dtype=self.conv_weight.dtype, device=device),
            ssm=torch.zeros(num_slots, self.H, self.P, self.N, dtype=torch.float32, device=device),
        )

    def load_hf(self, src: WeightSource, prefix: str) -> None:
        """Load the HF mixer tensors under ``prefix`` (e.g. ``model.layers.3.mamba.``)."""
        s = self.spec
        copy_into(self.in_proj.weight, src.get(prefix + "in_proj.weight", tuple(self.in_proj.weight.shape)))
        if s.proj_bias:
            copy_into(self.in_proj.bias, src.get(prefix + "in_proj.bias", (self.in_proj.out_features,)))
            copy_into(self.out_proj.bias, src.get(prefix + "out_proj.bias", (s.hidden_size,)))
        copy_into(self.out_proj.weight, src.get(prefix + "out_proj.weight", (s.hidden_size, self.d_inner)))
        name = prefix + "conv1d.weight"
        flat = src.has(name) and tuple(src.shape(name)) == (self.conv_dim, self.K)
        w = src.get(name, (self.conv_dim, self.K) if flat else (self.conv_dim, 1, self.K))
        copy_into(self.conv_weight, w.reshape(self.conv_dim, self.K))
        if s.conv_bias:
            copy_into(self.conv_bias, src.get(prefix + "conv1d.bias", (self.conv_dim,)))
        copy_into(self.dt_bias, src.get(prefix + "dt_bias", (self.H,)))
        copy_into(self.A_log, src.get(prefix + "A_log", (self.H,)))
        copy_into(self.D, src.get(prefix + "D", (self.H,)))
        copy_into(self.norm_weight, src.get(prefix + "norm.weight", (self.d_inner,)))

    # ------------------------------------------------------------------ forward

    def forward(self, x: Tensor, cache: Mamba2Cache, batch: StepBatch) -> Tensor:
        """x [B, T, hidden] -> [B, T, hidden]; row b continues the sequence held in cache slot ``batch.slots[b]``."""
        if x.shape[1] == 1:
            return self._step(x, cache, batch.slots, batch.slot0)
        if cache.keep_trail:
            return self._recurrent(x, cache, batch.slots, batch.slot0)
        return self._scan(x, cache, batch.slots)

    def _consts(self) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """-exp(A_log) [H], D [H, 1], the fp32 gated-norm weight, the fp32 dt_bias [H] and D flat [H]: derived once from
        the loaded weights (the decode step would otherwise recompute them every token), again when one of them is
        replaced or changed in place (its version)."""
        p = self._parameters
        a, d, n, b = p["A_log"], p["D"], p["norm_weight"], p["dt_bias"]
        # (weights loaded under torch.inference_mode are inference tensors, which keep no version: only their
        # replacement is seen)
        versions = tuple(-1 if t.is_inference() else t._version for t in (a, d, n, b))
        c = self.__dict__.get("_const")
        if (c is None or c[0] is not a or c[1] is not d or c[2] is not n or c[3] is not b or c[4] != versions):
            D = d.float()[:, None]
            derived = (-torch.exp(a.float()), D, n.float(), b if b.dtype == torch.float32 else b.float(), D.view(-1))
            c = self.__dict__["_const"] = (a, d, n, b, versions, derived)
        return c[5]

    def _gated_norm_out(self, y: Tensor, z: Tensor, dtype: torch.dtype) -> Tensor:
        """y (float32) * silu(z), RMS-normalised within each of the n_groups groups, scaled, then out_proj."""
        shp = y.shape
        g = y * F.silu(z if z.dtype == torch.float32 else z.float())
        g = g.view(*shp[:-1], self.G, self.d_inner // self.G)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True).add_(self.spec.norm_eps))
        g = g.view(shp) * self._consts()[2]
        return self.out_proj(g if dtype == torch.float32 else g.to(dtype))

    def _mixes_fused(self, cache: Mamba2Cache, x: Tensor) -> bool:
        """Whether decode and verify steps run everything between the projections as waferline::mamba2_mix: the fused
        state update applies, a SiLU conv, the conv state and weight in the activations' dtype."""
        return (
            self.act_name in ("silu", "swish")
            and cache.conv.dtype == x.dtype == self._parameters["conv_weight"].dtype
            and _fused(cache, x)
        )

    def _mix(self, x: Tensor, cache: Mamba2Cache, slots: Tensor, record: bool) -> list[Tensor]:
        A, _, norm, dtb, D = self._consts()
        lo, hi = self.time_step_limit
        return torch.ops.waferline.mamba2_mix(
            self.in_proj(x),
            cache.conv,
            slots,
            self.conv_weight,
            _NO_TRAIL if self.conv_bias is None else self.conv_bias,
            dtb,
            A,
            D,
            norm,
            cache.ssm,
            cache.ssm_prev if record else _NO_TRAIL,
            self.G,
            self.spec.norm_eps,
            self.clamp_dt_in_decode and self._clamp,
            lo,
            hi,
            record,
        )

    def step_args(self, x: Tensor, cache: Mamba2Cache, batch: StepBatch) -> tuple | None:
        """``waferline::mamba_ffn_layer``'s mixer arguments (after ``x``, its norm and epsilon; up to the FFN norm) for
        a decode step (one new token per row) or a speculative verify (T tokens per row, ``cache.keep_trail``: it
        records what :meth:`keep_record` keeps for a rewind, as :meth:`_recurrent` does) whose mixer runs as in_proj ->
        mamba2_mix -> out_proj (see :meth:`_mixes_fused`) with both projections int4 in waferline's CPU layout, without
        biases, computing in x's dtype; else None. The projections' tensors are kept between calls and checked by
        identity (kept_args)."""
        record = x.shape[1] > 1
        if (record and not cache.keep_trail) or not self._mixes_fused(cache, x):
            return None
        w = kept_args(self, "_int4_cache", x.dtype, lambda deps: self._int4_args(x.dtype, deps))
        if w is None:
            return None
        A, _, norm, dtb, D = self._consts()
        lo, hi = self.time_step_limit
        conv_b = self._parameters.get("conv_bias")
        conv, slots, ssm, prev = self.step_dynamic(cache, batch)
        return (*w[:3], conv, slots, self._parameters["conv_weight"], _NO_TRAIL if conv_b is None else conv_b,
                dtb, A, D, norm, ssm, self.G, self.spec.norm_eps, self.clamp_dt_in_decode and self._clamp,
                lo, hi, *w[3:], prev, record)

    STEP_DYNAMIC = (3, 4, 11, 20)  # where step_args' per-step values (step_dynamic's, in order) sit

    @staticmethod
    def step_dynamic(cache: Mamba2Cache, batch: StepBatch) -> tuple:
        """The arguments of :meth:`step_args` that change from step to step (the rest are the weights): the conv and
        SSM states, the rows' slots and, for a verify (T > 1), the state buffer its record starts from."""
        record = batch.T > 1
        if record and cache.ssm_prev is None:
            cache.ssm_prev = torch.empty_like(cache.ssm)
        return cache.conv, batch.slots, cache.ssm, cache.ssm_prev if record else _NO_TRAIL

    @staticmethod
    def keep_record(cache: Mamba2Cache, slots: Tensor, rec: list[Tensor]) -> None:
        """Keep a verify's record (mamba2_mix's: dA, dt x, B, C, the conv state after each token) as each slot's trail,
        for ``Mamba2Cache.rewind``."""
        dA, dtx, Bg, Cg, conv_after = rec
        for b, s in enumerate(slots.tolist()):
            cache.trail[s] = (conv_after[b], _Replay(dA[b], dtx[b], Bg[b], Cg[b]))

    def _int4_args(self, dtype: torch.dtype, deps: list) -> tuple | None:
        out: list[Any] = []
        for name in ("in_proj", "out_proj"):
            lin = self._modules.get(name)
            deps.append((self._modules, name, lin))
            q = lin._modules.get("int4") if lin is not None else None
            if q is None:
                return None
            deps.append((lin._modules, "int4", q))
            bias = lin._parameters.get("bias")
            deps.append((lin._parameters, "bias", bias))
            if q.backend != "cpu_waferline" or q.compute_dtype != dtype or q.lead or bias is not None:
                return None
            for key in ("packed", "scales_zeros"):
                deps.append((q._buffers, key, q._buffers.get(key)))
            out += [q.packed, q.scales_zeros, q.group_size]
        return tuple(out)

    def _step(self, x: Tensor, cache: Mamba2Cache, slots: Tensor, slot0: int | None = None) -> Tensor:
        """One new token per row: the recurrent form (the decode hot loop). With consecutive slots (``slot0``) the
        states are updated in place through views; otherwise gathered and scattered back."""
        if self._mixes_fused(cache, x):  # conv, activations, state update and gated norm as one op
            return self.out_proj(self._mix(x, cache, slots, record=False)[0])
        Bsz = x.shape[0]
        H, P, N, G = self.H, self.P, self.N, self.G
        A, D, *_ = self._consts()
        zxbcdt = self.in_proj(x[:, 0])
        z, xBC, dt = zxbcdt.split([self.d_inner, self.conv_dim, H], dim=-1)

        # causal conv: window = [K-1 cached inputs | new input]
        conv = cache.conv[slot0: slot0 + Bsz] if slot0 is not None else cache.conv.index_select(0, slots)
        new = xBC[:, :, None] if xBC.dtype == conv.dtype else xBC[:, :, None].to(conv.dtype)
        window = torch.cat([conv, new], dim=-1)
        if slot0 is not None:
            conv.copy_(window[:, :, 1:])
        else:
            cache.conv.index_copy_(0, slots, window[:, :, 1:])
        xBC = (window * self.conv_weight).sum(-1)
        if self.conv_bias is not None:
            xBC = xBC + self.conv_bias
        xBC = self._act(xBC)
        xs, Bm, Cm = (xBC if xBC.dtype == torch.float32 else xBC.float()).split([self.d_inner, G * N, G * N], dim=-1)

        dt = F.softplus((dt if dt.dtype == torch.float32 else dt.float()) + self.dt_bias)  # [B, H]
        if self.clamp_dt_in_decode and self._clamp:
            dt = dt.clamp(self.time_step_limit[0], self.time_step_limit[1])
        dA = torch.exp(dt * A)  # [B, H]

        xs = xs.view(Bsz, H, P)
        R = H // G
        if _fused(cache, x):  # one fused pass over the state (waferline.kernels), as _recurrent does with T tokens
            h = cache.ssm[slot0: slot0 + Bsz] if slot0 is not None else cache.ssm.index_select(0, slots)
            y = torch.ops.waferline.ssm_update(h, dA[:, None], (dt[:, :, None] * xs)[:, None], Bm.reshape(Bsz, 1, G, N),
                                               Cm.reshape(Bsz, 1, G, N), _NO_TRAIL)
            if slot0 is None:
                cache.ssm.index_copy_(0, slots, h)
            return self._gated_norm_out((y.view(Bsz, H, P) + D * xs).view(Bsz, 1, self.d_inner), z[:, None], x.dtype)
        # h <- h * exp(dt A) + (dt x) B ; y = C . h + D x. Heads of a group share B and C: heads viewed as [G, R].
        # The same ops, in the same order, as _recurrent (a speculative verify must reproduce decode exactly).
        dBx = (dt[:, :, None] * xs).view(Bsz, G, R, P, 1) * Bm.view(Bsz, G, 1, 1, N)
        if slot0 is not None:  # the state rows themselves, updated in place
            h = cache.ssm[slot0: slot0 + Bsz].view(Bsz, G, R, P, N)
            torch.addcmul(dBx, h, dA.view(Bsz, G, R, 1, 1), out=h)
        else:  # gathered, updated, scattered back
            h = torch.addcmul(dBx, cache.ssm.index_select(0, slots).view(Bsz, G, R, P, N), dA.view(Bsz, G, R, 1, 1))
            cache.ssm.index_copy_(0, slots, h.view(Bsz, H, P, N))
        y = (h * Cm.view(Bsz, G, 1, 1, N)).sum(-1).view(Bsz, H, P) + D * xs
        return self._gated_norm_out(y.view(Bsz, 1, self.d_inner), z[:, None], x.dtype)

    def _scan(self, x: Tensor, cache: Mamba2Cache, slots: Tensor) -> Tensor:
        """T > 1 new tokens per row, continuing from each row's cached state: the chunked SSD scan."""
        Bsz, T, _ = x.shape
        H, P, N, G, K = self.H, self.P, self.N, self.G, self.K
        Q = self.spec.chunk_size
        zxbcdt = self.in_proj(x)
        z, xBC, dt = zxbcdt.split([self.d_inner, self.conv_dim, H], dim=-1)

        # causal depthwise conv over [K-1 cached inputs | T new inputs]
        full = torch.cat([cache.conv.index_select(0, slots), xBC.transpose(1, 2).to(cache.conv.dtype)], dim=-1)
        cache.conv.index_copy_(0, slots, full[:, :, -(K - 1):].to(cache.conv.dtype))
        xBC = causal_depthwise_conv(full, self.conv_weight, self.conv_bias, T)  # [B, C, T]
        xBC = self._act(xBC).transpose(1, 2).float()
        xs, Bm, Cm = xBC.split([self.d_inner, G * N, G * N], dim=-1)
        xs = xs.reshape(Bsz, T, H, P)
        Bm = Bm.reshape(Bsz, T, G, N)
        Cm = Cm.reshape(Bsz, T, G, N)

        dt = F.softplus(dt.float() + self.dt_bias)  # [B, T, H]
        if self._clamp:
            dt = dt.clamp(self.time_step_limit[0], self.time_step_limit[1])
        a = dt * -torch.exp(self.A_log)  # per-step log decay, [B, T, H]
        y_skip = self.D[:, None] * xs
        xdt = xs * dt[..., None]

        # pad T up to a multiple of Q (zero input, zero log-decay: padding neither adds to nor decays the state)
        nc = -(-T // Q)
        pad = nc * Q - T
        if pad:
            xdt = F.pad(xdt, (0, 0, 0, 0, 0, pad))
            a = F.pad(a, (0, 0, 0, pad))
            Bm = F.pad(Bm, (0, 0, 0, 0, 0, pad))
            Cm = F.pad(Cm, (0, 0, 0, 0, 0, pad))
        R = H // G
        # chunked views; heads split as (g, r) so B/C broadcast over the r heads of their group
        xc = xdt.view(Bsz, nc, Q, G, R, P)
        Bc = Bm.view(Bsz, nc, Q, G, N)
        Cc = Cm.view(Bsz, nc, Q, G, N)
        ac = a.view(Bsz, nc, Q, G, R).permute(0, 1, 3, 4, 2)  # [B, c, g, r, Q]
        acum = torch.cumsum(ac, dim=-1)  # [B, c, g, r, Q]

        # 1. within-chunk (diagonal blocks): y[l] = sum_{s<=l} (C_l . B_s) exp(sum_{s<k<=l} a_k) xdt[s]
        CB = torch.einsum("bclgn,bcsgn->bcgls", Cc, Bc)  # [B, c, g, l, s]
        M = (
            _segsum(ac).exp_().mul_(CB[:, :, :, None])
            if not torch.is_grad_enabled()
            else _segsum(ac).exp() * CB[:, :, :, None]
        )  # [B, c, g, r, l, s] (in place: the largest tensors here)
        y = torch.einsum("bcgrls,bcsgrp->bclgrp", M, xc)
        del M, CB

        # 2. state contributed by each chunk alone, at its end
        to_end = torch.exp(acum[..., -1:] - acum)  # [B, c, g, r, Q]
        chunk_states = torch.einsum("bcsgn,bcgrs,bcsgrp->bcgrpn", Bc, to_end, xc)  # [B, c, g, r, P, N]

        # 3. states at chunk starts: h_start[c] = sum_{z<=c} exp(sum of chunk decays z..c-1) * (h0 if z == 0 else
        # S[z-1])
        h0 = cache.ssm.index_select(0, slots).view(Bsz, 1, G, R, P, N)
        S = torch.cat([h0, chunk_states], dim=1)  # [B, nc+1, g, r, P, N]
        tot = F.pad(acum[..., -1].permute(0, 2, 3, 1), (1, 0))  # [B, g, r, nc+1]: per-chunk total log decay
        chunk_decay = torch.exp(_segsum(tot))  # [B, g, r, c, z]
        starts = torch.einsum("bgrcz,bzgrpn->bcgrpn", chunk_decay, S)  # [B, nc+1, g, r, P, N]
        cache.ssm.index_copy_(0, slots, starts[:, -1].reshape(Bsz, H, P, N).to(cache.ssm.dtype))

        # 4. contribution of each chunk's start state: y[l] += exp(acum[l]) C_l . h_start
        y_off = (
            torch.einsum("bclgn,bcgrpn->bclgrp", Cc, starts[:, :-1]) * torch.exp(acum).permute(0, 1, 4, 2, 3)[..., None]
        )
        y = (y + y_off).reshape(Bsz, nc * Q, H, P)[:, :T] + y_skip
        return self._gated_norm_out(y.reshape(Bsz, T, self.d_inner), z, x.dtype)


    def _recurrent(self, x: Tensor, cache: Mamba2Cache, slots: Tensor, slot0: int | None = None) -> Tensor:
        """A few new tokens per row (a speculative verify) by the decode recurrence, token after token, recording in
        ``cache.trail`` the (conv, ssm) state after each (the SSM state as a replay with the fused operator) so a
        rejected suffix can be dropped (``Mamba2Cache.rewind``).
        Same arithmetic as ``_step`` (dt clamp included), so verify logits match plain decoding's; everything but the
        state recurrence itself is computed for all T tokens at once."""
        if self._mixes_fused(cache, x):  # as _step's fused op, T tokens, recording what a rewind replays
            if cache.ssm_prev is None:
                cache.ssm_prev = torch.empty_like(cache.ssm)
            g, *rec = self._mix(x, cache, slots, record=True)
            self.keep_record(cache, slots, rec)
            return self.out_proj(g)
        Bsz, T, _ = x.shape
        H, P, N, G, K = self.H, self.P, self.N, self.G, self.K
        R = H // G
        A, D, *_ = self._consts()
        z, xBC, dt = self.in_proj(x).split([self.d_inner, self.conv_dim, H], dim=-1)
        full = torch.cat([cache.conv.index_select(0, slots), xBC.transpose(1, 2).to(cache.conv.dtype)], dim=-1)
        windows = full.unfold(-1, K, 1)  # [B, C, T, K]: the conv window of each new token (a view)
        xBC = (windows * self.conv_weight[:, None, :]).sum(-1).transpose(1, 2)  # [B, T, C]
        if self.conv_bias is not None:
            xBC = xBC + self.conv_bias
        xBC = self._act(xBC)
        xs, Bm, Cm = (xBC if xBC.dtype == torch.float32 else xBC.float()).split([self.d_inner, G * N, G * N], dim=-1)
        dt = F.softplus((dt if dt.dtype == torch.float32 else dt.float()) + self.dt_bias)  # [B, T, H]
        if self.clamp_dt_in_decode and self._clamp:
            dt = dt.clamp(self.time_step_limit[0], self.time_step_limit[1])
        xs = xs.view(Bsz, T, H, P)
        if _fused(cache, x):  # T tokens through the fused update (the same arithmetic as _step), replayable
            # Recording all T states cost a fresh [B, T, H, P, N] buffer per verify, kept until the rewind: at sol-mini
            # batch 8 x 4 tokens that is 2 MB per layer of first-touch pages, which doubled the update's time
            # (~460 vs ~180 us); the state before the verify is kept instead and a rewind replays the kept tokens.
            if cache.ssm_prev is None:
                cache.ssm_prev = torch.empty_like(cache.ssm)
            dA, dtx, Bg, Cg = torch.exp(dt * A), dt[..., None] * xs, Bm.reshape(Bsz, T, G, N), Cm.reshape(Bsz, T, G, N)
            if slot0 is not None:  # consecutive slots: the state rows themselves, updated in place
                h = cache.ssm[slot0: slot0 + Bsz]
                cache.ssm_prev[slot0: slot0 + Bsz].copy_(h)
            else:
                h = cache.ssm.index_select(0, slots)
                cache.ssm_prev.index_copy_(0, slots, h)
            y = torch.ops.waferline.ssm_update(h, dA, dtx, Bg, Cg, _NO_TRAIL) + D * xs
            if slot0 is None:
                cache.ssm.index_copy_(0, slots, h)
            records: list[Tensor | _Replay] = [_Replay(dA[b], dtx[b], Bg[b], Cg[b]) for b in range(Bsz)]
        else:  # the eager chain: every state recorded
            dA6 = torch.exp(dt * A).view(Bsz, T, G, R, 1, 1)
            dBx = (dt[..., None] * xs).view(Bsz, T, G, R, P, 1) * Bm.view(Bsz, T, G, 1, 1, N)  # [B, T, G, R, P, N]
            h = cache.ssm.index_select(0, slots).view(Bsz, G, R, P, N)
            states = []
            for t in range(T):
                h = torch.addcmul(dBx[:, t], h, dA6[:, t])
                states.append(h)
            ssm_trail = torch.stack(states, dim=1)  # [B, T, G, R, P, N]
            y = (ssm_trail * Cm.view(Bsz, T, G, 1, 1, N)).sum(-1).view(Bsz, T, H, P) + D * xs
            cache.ssm.index_copy_(0, slots, h.view(Bsz, H, P, N).to(cache.ssm.dtype))
            records = list(ssm_trail.view(Bsz, T, H, P, N).unbind(0))
        cache.conv.index_copy_(0, slots, full[:, :, -(K - 1):])
        conv_trail = full.unfold(-1, K - 1, 1)[:, :, 1:].transpose(1, 2)  # [B, T, C, K-1]: conv state after each token
        for b, s in enumerate(slots.tolist()):
            cache.trail[s] = (conv_trail[b], records[b])
        return self._gated_norm_out(y.reshape(Bsz, T, self.d_inner), z, x.dtype)


_NO_TRAIL = torch.empty(0)  # ssm_update's "no per-token states"


def _fused(cache: Mamba2Cache, x: Tensor) -> bool:
    """Whether the state update runs as the fused CPU operator: on CPU, an fp32 state, the operators built."""
    return x.device.type == "cpu" and cache.ssm.dtype == torch.float32 and kernels.available()


def hf_mixer_prefix(model_type: str, layer: int, src: WeightSource | None = None) -> str:
    """The weight-name prefix of layer ``layer``'s Mamba-2 mixer in a Hugging Face checkpoint.

    nemotron_h files (hub, and ``save_pretrained`` in transformers 5.x) say ``backbone.layers.{i}.mixer.``, while the
    in-memory transformers module says ``model.layers.{i}.mixer.``; with ``src`` given, the one present is returned.
    """
    if model_type in ("bamba", "granitemoehybrid"):
        return f"model.layers.{layer}.mamba."
    if model_type == "nemotron_h":
        in_memory = f"model.layers.{layer}.mixer."
        if src is not None and src.has(in_memory + "A_log"):
            return in_memory
        return f"backbone.layers.{layer}.mixer."
    raise ConfigError(f"mamba2: no known mixer prefix for model_type {model_type!r}")


def hf_mixer_kwargs(model_type: str, hf_config: dict) -> dict:
    """Constructor flags (beyond the spec) that make ``Mamba2Mixer`` reproduce a family's HF mixer."""
    if model_type in ("bamba", "granitemoehybrid"):
        return {"act": hf_config.get("hidden_act", "silu")}
    if model_type == "nemotron_h":
        return {"act": hf_config.get("mamba_hidden_act", "silu")}
    raise ConfigError(f"mamba2: no known HF mixer for model_type {model_type!r}")
