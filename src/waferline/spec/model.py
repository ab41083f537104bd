"""ModelSpec: a model architecture as data, and the one accounting of parameters, bytes, FLOPs and cache.

Both the engine and the planner/simulator use this module; nothing else counts parameters or bytes. The parsers
that turn a Hugging Face ``config.json`` into a ModelSpec, one per ``model_type``, live in spec/configs.py. Needs no
torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from waferline.errors import ConfigError

BYTES_16 = 2
STATE_BYTES = 4  # the recurrent state of a Mamba-2 or linear-attention layer is float32 whatever the model dtype


# int4 group sizes (weights per scale along a matmul's input dimension): a weight's groups are this size, or its
# largest halving (>= 16) that divides the weight's width
INT4_GROUP_SIZES = (16, 32, 64, 128, 256)

# a matmul weight as the byte accounting sees it: (K inputs, N outputs, how many such matrices)
Matmul = tuple[int, int, int]


def group_for(K: int, group_size: int) -> int | None:
    """The group size used for a tensor with ``K`` inputs: ``group_size`` if it divides K, else ``K`` when
    ``K < group_size``, else the largest halving of it (>= 16) that divides K; None when none does."""
    if K % group_size == 0:
        return group_size
    if K < group_size and K % 2 == 0:
        return K
    g = group_size // 2
    while g >= 16:
        if K % g == 0:
            return g
        g //= 2
    return None


def quantized_bytes(
    n_params: float, bits: int, group_size: int = 128, scale_bits: int = 16, zeros: bool = False
) -> float:
    """Bytes to store ``n_params`` weights at ``bits`` with one scale (and zero) per ``group_size`` weights (a flat
    count: matmul weights are counted by :func:`matmul_bytes`, each matrix in the groups its width allows)."""
    if bits not in (4, 8, 16, 32):
        raise ConfigError(f"weight bits must be 4, 8, 16 or 32, got {bits}")
    if bits >= 16:
        return n_params * bits / 8
    per_group = (scale_bits / 8) * (2 if zeros else 1)
    return n_params * bits / 8 + math.ceil(n_params / group_size) * per_group


def matmul_count(matmuls: Iterable[Matmul]) -> int:
    """Parameters of the matmul weights ``(K, N, count)``."""
    return sum(K * N * count for K, N, count in matmuls)


def matmul_bytes(matmuls: Iterable[Matmul], bits: int, group_size: int = 128, scale_bits: int = 16,
                 zeros: bool = False) -> float:
    """Bytes to store the matmul weights ``(K, N, count)`` at ``bits``, as ``waferline quantize`` stores them: below
    16 bits each matrix has one scale (and zero) per group of its K inputs, of the size :func:`group_for` gives
    (``group_size``, else its largest halving that divides K, one group per row where K < ``group_size``), and a
    matrix none divides stays 16-bit."""
    if bits not in (4, 8, 16, 32):
        raise ConfigError(f"weight bits must be 4, 8, 16 or 32, got {bits}")
    per_group = (scale_bits / 8) * (2 if zeros else 1)
    total = 0.0
    for K, N, count in matmuls:
        n = K * N * count
        if bits >= 16:
            total += n * bits / 8
            continue
        g = group_for(K, group_size)
        total += n * BYTES_16 if g is None else n * bits / 8 + n // g * per_group
    return total


# ----------------------------------------------------------------------------- mixers


@dataclass(frozen=True)
class AttentionSpec:
    """Grouped-query attention (MHA/GQA/MQA), optionally sliding-window and with attention sinks."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    sliding_window: int | None = None
    sinks: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    kind: str = "gqa"
    q_rank: int = 0  # low-rank query D -> q_rank (normed) -> heads x head_dim (Step-3's MFA); 0 = a plain q_proj
    output_gate: bool = False  # the query projection also yields a per-channel sigmoid gate on the output (Qwen3-Next)

    def _q_width(self) -> int:
        return self.num_heads * self.head_dim * (2 if self.output_gate else 1)

    def params(self) -> int:
        n = self.matmul_params() + self.q_rank  # (+ the norm of the low-rank query)
        if self.qkv_bias:
            n += self._q_width() + 2 * self.num_kv_heads * self.head_dim
        if self.o_bias:
            n += self.hidden_size
        if self.qk_norm:
            n += 2 * self.head_dim
        if self.sinks:
            n += self.num_heads
        return n

    def small_params(self) -> int:
        """Parameters kept at 16 bits when quantising (biases, norms, sinks)."""
        return self.params() - self.matmul_params()

    def matmul_params(self) -> int:
        return matmul_count(self.matmuls())

    def matmuls(self) -> list[Matmul]:
        """(K, N, count) of each matmul weight: q (or its low-rank pair), k and v, o."""
        d, hd = self.hidden_size, self.head_dim
        q = [(d, self.q_rank, 1), (self.q_rank, self._q_width(), 1)] if self.q_rank else [(d, self._q_width(), 1)]
        return q + [(d, self.num_kv_heads * hd, 2), (self.num_heads * hd, d, 1)]

    def cache_elems_per_token(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim

    def cache_bytes_per_token(self, kv_bits: int = 16) -> float:
        return self.cache_elems_per_token() * kv_bits / 8

    def cached_tokens(self, context_len: int) -> int:
        return context_len if self.sliding_window is None else min(context_len, self.sliding_window)

    def state_bytes_per_seq(self, state_bits: int = 16) -> float:
        return 0.0

    def attention_flops(self, context_len: int) -> float:
        """Score and value FLOPs for one new token attending to ``context_len`` cached tokens."""
        return 4.0 * self.num_heads * self.head_dim * self.cached_tokens(context_len)


@dataclass(frozen=True)
class MLASpec:
    """DeepSeek multi-head latent attention: caches only the normalised latent c_KV and the rotary key."""

    hidden_size: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    attention_bias: bool = False  # biases on q_a_proj (with a low-rank query), kv_a_proj_with_mqa and o_proj
    kind: str = "mla"
    sliding_window: None = None

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def matmul_params(self) -> int:
        return matmul_count(self.matmuls())

    def matmuls(self) -> list[Matmul]:
        """(K, N, count) of each matmul weight: q_a / q_b (or q), kv_a, kv_b, o."""
        h, d, qk = self.num_heads, self.hidden_size, self.qk_head_dim
        q = [(d, self.q_lora_rank, 1), (self.q_lora_rank, h * qk, 1)] if self.q_lora_rank else [(d, h * qk, 1)]
        return q + [(d, self.kv_lora_rank + self.qk_rope_head_dim, 1), *self.kept_16bit_matmuls(),
                    (h * self.v_head_dim, d, 1)]

    def small_params(self) -> int:
        n = (self.q_lora_rank or 0) + self.kv_lora_rank  # the two latent RMSNorms
        if self.attention_bias:
            n += (self.q_lora_rank or 0) + self.kv_lora_rank + self.qk_rope_head_dim + self.hidden_size
        return n

    def kept_16bit_matmuls(self) -> list[Matmul]:
        """Matmuls that stay 16-bit in int4 checkpoints: kv_b_proj, whose halves W_UK / W_UV are absorbed."""
        return [(self.kv_lora_rank, self.num_heads * (self.qk_nope_head_dim + self.v_head_dim), 1)]

    def kept_16bit_params(self) -> int:
        return matmul_count(self.kept_16bit_matmuls())

    def params(self) -> int:
        return self.matmul_params() + self.small_params()

    def cache_elems_per_token(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    def cache_bytes_per_token(self, kv_bits: int = 16) -> float:
        return self.cache_elems_per_token() * kv_bits / 8

    def cached_tokens(self, context_len: int) -> int:
        return context_len

    def state_bytes_per_seq(self, state_bits: int = 16) -> float:
        return 0.0

    def attention_flops(self, context_len: int) -> float:
        """Absorbed decode: each head scores against (latent + rope) and reads the latent as values."""
        per_tok = 2 * self.num_heads * (2 * self.kv_lora_rank + self.qk_rope_head_dim)
        return float(per_tok * context_len)


class _StateMixer:
    """Mixers with a constant per-sequence state and no per-token cache (Mamba-1/2, Gated DeltaNet)."""

    def cache_elems_per_token(self) -> int:
        return 0

    def cache_bytes_per_token(self, kv_bits: int = 16) -> float:
        return 0.0

    def cached_tokens(self, context_len: int) -> int:
        return 0

    def rollback_bytes_per_seq(self, num_tokens: int, state_bits: int = 16) -> float:
        """What a speculative verify of ``num_tokens`` drafts keeps per sequence beside its state, so that a rejected
        suffix can be dropped: the state after each of its ``num_tokens + 1`` tokens (an engine that verifies on
        recurrent state keeps them until the rewind, or holds one state slot per verified token)."""
        return (num_tokens + 1) * self.state_bytes_per_seq(state_bits) if num_tokens > 0 else 0.0


@dataclass(frozen=True)
class Mamba2Spec(_StateMixer):
    """Mamba-2 (SSD) mixer: constant-size conv + SSM state per sequence."""

    hidden_size: int
    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int
    conv_kernel: int
    conv_bias: bool = True
    proj_bias: bool = False
    chunk_size: int = 256
    time_step_limit: tuple[float, float] = (0.0, float("inf"))
    norm_eps: float = 1e-5
    kind: str = "mamba2"
    sliding_window: None = None

    @property
    def d_inner(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.d_inner + 2 * self.n_groups * self.state_size

    def matmul_params(self) -> int:
        return matmul_count(self.matmuls())

    def matmuls(self) -> list[Matmul]:
        """(K, N, count): in_proj (z, x, B, C, dt) and out_proj."""
        d = self.hidden_size
        return [(d, 2 * self.d_inner + 2 * self.n_groups * self.state_size + self.num_heads, 1), (self.d_inner, d, 1)]

    def small_params(self) -> int:
        n = self.conv_dim * self.conv_kernel + 3 * self.num_heads + self.d_inner  # conv, dt_bias/A_log/D, norm
        if self.conv_bias:
            n += self.conv_dim
        if self.proj_bias:
            n += 2 * self.d_inner + 2 * self.n_groups * self.state_size + self.num_heads + self.hidden_size
        return n

    def params(self) -> int:
        return self.matmul_params() + self.small_params()

    def state_elems(self) -> int:
        return self.conv_dim * (self.conv_kernel - 1) + self.num_heads * self.head_dim * self.state_size

    def state_bytes_per_seq(self, state_bits: int = 16) -> float:
        """The conv window at ``state_bits`` (the model's dtype) and the SSM state, float32 whatever the model dtype
        (as the engine's Mamba2Cache holds them)."""
        conv = self.conv_dim * (self.conv_kernel - 1)
        return conv * state_bits / 8 + self.num_heads * self.head_dim * self.state_size * STATE_BYTES

    def attention_flops(self, context_len: int) -> float:
        # state update + readout: ~ 2 FLOPs per state element each, per token
        return 4.0 * self.num_heads * self.head_dim * self.state_size


@dataclass(frozen=True)
class Mamba1Spec(_StateMixer):
    """Mamba-1 selective SSM (Jamba): accounting only, the engine does not run it."""

    hidden_size: int
    d_inner: int
    state_size: int
    conv_kernel: int
    dt_rank: int
    kind: str = "mamba"
    sliding_window: None = None

    def matmul_params(self) -> int:
        return matmul_count(self.matmuls())

    def matmuls(self) -> list[Matmul]:
        """(K, N, count): in_proj, x_proj, dt_proj, out_proj."""
        d, di = self.hidden_size, self.d_inner
        return [(d, 2 * di, 1), (di, self.dt_rank + 2 * self.state_size, 1), (self.dt_rank, di, 1), (di, d, 1)]

    def small_params(self) -> int:
        # conv (+ bias), A_log, D, dt_proj's bias, and the RMSNorms of the time step, B and C
        return (self.d_inner * (self.conv_kernel + 1) + self.d_inner * self.state_size + 2 * self.d_inner
                + self.dt_rank + 2 * self.state_size)

    def params(self) -> int:
        return self.matmul_params() + self.small_params()

    def state_bytes_per_seq(self, state_bits: int = 16) -> float:
        return (self.d_inner * (self.conv_kernel - 1) + self.d_inner * self.state_size) * state_bits / 8

    def attention_flops(self, context_len: int) -> float:
        return 4.0 * self.d_inner * self.state_size


@dataclass(frozen=True)
class GatedDeltaNetSpec(_StateMixer):
    """Gated DeltaNet linear attention (Qwen3-Next): a gated delta rule over q/k/v short convolutions, a gated RMSNorm
    on the output; constant-size conv + recurrent state per sequence."""

    hidden_size: int
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    chunk_size: int = 64  # tokens per chunk of the chunked prefill (engine only; any size gives the same numbers)
    kind: str = "gdn"
    sliding_window: None = None

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    def matmul_params(self) -> int:
        return matmul_count(self.matmuls())

    def matmuls(self) -> list[Matmul]:
        """(K, N, count): in_proj_qkvz, in_proj_ba, out_proj."""
        d = self.hidden_size
        return [(d, 2 * self.key_dim + 2 * self.value_dim, 1), (d, 2 * self.num_v_heads, 1), (self.value_dim, d, 1)]

    def small_params(self) -> int:
        return (2 * self.key_dim + self.value_dim) * self.conv_kernel + 2 * self.num_v_heads + self.head_v_dim

    def params(self) -> int:
        return self.matmul_params() + self.small_params()

    def state_bytes_per_seq(self, state_bits: int = 16) -> float:
        """The conv window at ``state_bits`` (the model's dtype) and the recurrent state, float32 whatever the model
        dtype (as the engine's LinearAttentionCache holds them)."""
        conv = (2 * self.key_dim + self.value_dim) * (self.conv_kernel - 1)
        return conv * state_bits / 8 + self.num_v_heads * self.head_k_dim * self.head_v_dim * STATE_BYTES

    def attention_flops(self, context_len: int) -> float:
        return 4.0 * self.num_v_heads * self.head_k_dim * self.head_v_dim


@dataclass(frozen=True)
class KimiDeltaSpec(_StateMixer):
    """Kimi Delta Attention (Kimi Linear): a gated delta rule with a per-channel decay, q/k/v short convolutions, a
    low-rank forget gate and a low-rank sigmoid output gate; constant-size conv + recurrent state per sequence."""

    hidden_size: int
    num_heads: int
    head_dim: int
    conv_kernel: int
    chunk_size: int = 64  # tokens per chunk of the chunked prefill (engine only; any size gives the same numbers)
    kind: str = "kda"
    sliding_window: None = None

    @property
    def qkv_dim(self) -> int:
        return self.num_heads * self.head_dim

    def matmul_params(self) -> int:
        return matmul_count(self.matmuls())

    def matmuls(self) -> list[Matmul]:
        """(K, N, count): q, k, v; the forget and output gates' two low-rank halves; b_proj; o."""
        d, c, hd = self.hidden_size, self.qkv_dim, self.head_dim
        return [(d, c, 3), (d, hd, 2), (hd, c, 2), (d, self.num_heads, 1), (c, d, 1)]

    def small_params(self) -> int:
        # the three convs, dt_bias (per channel), A_log (per head), the gated output norm
        return 3 * self.qkv_dim * self.conv_kernel + self.qkv_dim + self.num_heads + self.head_dim

    def params(self) -> int:
        return self.matmul_params() + self.small_params()

    def state_bytes_per_seq(self, state_bits: int = 16) -> float:
        """The conv window at ``state_bits`` (the model's dtype) and the float32 recurrent state."""
        return (3 * self.qkv_dim * (self.conv_kernel - 1) * state_bits / 8
                + self.num_heads * self.head_dim * self.head_dim * STATE_BYTES)

    def attention_flops(self, context_len: int) -> float:
        return 4.0 * self.num_heads * self.head_dim * self.head_dim


# ----------------------------------------------------------------------------- compressed / sparse attention
#
# Capacity and speed differ for these schemes: the cache a sequence holds (``cache_bytes_at``) is not what one
# decode token reads from it (``cache_read_bytes``). For the plain mixers above both are the whole cache.

INDEX_SCALE_BYTES = 4  # one fp32 scale per fp8 indexer key (DeepSeek-V3.2 inference code: fp8 keys, per-token scale)


def _index_key_bytes(index_head_dim: int, index_bits: int) -> float:
    """Bytes of one cached lightning-indexer key: ``index_head_dim`` at ``index_bits`` plus a 4-byte scale below 16."""
    return index_head_dim * index_bits / 8 + (INDEX_SCALE_BYTES if index_bits < 16 else 0)


@dataclass(frozen=True)
class DSASpec:
    """DeepSeek sparse attention (V3.2): MLA plus a lightning indexer.

    The indexer keeps one ``index_head_dim`` key per token (fp8 + scale); per decode token it scores every cached
    token (reads all indexer keys) and the MLA core then attends to the top ``index_topk`` tokens only (reads
    their latents). Capacity: MLA latent + indexer key per token. Speed: latents of min(context, top-k) tokens +
    indexer keys of all tokens.
    """

    hidden_size: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 2048
    index_bits: int = 8
    attention_bias: bool = False
    kind: str = "dsa"
    sliding_window: None = None

    def _mla(self) -> MLASpec:
        return MLASpec(self.hidden_size, self.num_heads, self.q_lora_rank, self.kv_lora_rank,
                       self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim, self.attention_bias)

    def indexer_matmul_params(self) -> int:
        """wq_b (q_lora -> heads x dim), wk (d -> dim); the fp32 weights_proj (d -> heads) counts as small."""
        q_in = self.q_lora_rank or self.hidden_size
        return q_in * self.index_n_heads * self.index_head_dim + self.hidden_size * self.index_head_dim

    def indexer_small_params(self) -> int:
        return self.hidden_size * self.index_n_heads + 2 * self.index_head_dim  # weights_proj, k_norm (LayerNorm)

    def small_matmul_params(self) -> int:
        """Matmul weights counted with the small parameters: the indexer's weights_proj (a product per token)."""
        return self.hidden_size * self.index_n_heads

    def matmul_params(self) -> int:
        return matmul_count(self.matmuls())

    def matmuls(self) -> list[Matmul]:
        """MLA's, and the indexer's wq_b and wk."""
        q_in = self.q_lora_rank or self.hidden_size
        return self._mla().matmuls() + [(q_in, self.index_n_heads * self.index_head_dim, 1),
                                        (self.hidden_size, self.index_head_dim, 1)]

    def kept_16bit_matmuls(self) -> list[Matmul]:
        return self._mla().kept_16bit_matmuls()

    def small_params(self) -> int:
        return self._mla().small_params() + self.indexer_small_params()

    def kept_16bit_params(self) -> int:
        return self._mla().kept_16bit_params()

    def params(self) -> int:
        return self.matmul_params() + self.small_params()

    def latent_bytes_per_token(self, kv_bits: int = 16) -> float:
        return self._mla().cache_bytes_per_token(kv_bits)

    def index_bytes_per_token(self) -> float:
        return _index_key_bytes(self.index_head_dim, self.index_bits)

    def cache_elems_per_token(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim + self.index_head_dim

    def cache_bytes_per_token(self, kv_bits: int = 16) -> float:
        return self.latent_bytes_per_token(kv_bits) + self.index_bytes_per_token()

    def cached_tokens(self, context_len: int) -> int:
        return context_len

    def attended_tokens(self, context_len: int) -> int:
        return min(context_len, self.index_topk)

    def cache_bytes_at(self, context_len: int, kv_bits: int = 16) -> float:
        return self.cache_bytes_per_token(kv_bits) * context_len

    def cache_read_bytes(self, context_len: int, kv_bits: int = 16) -> float:
        """Cache bytes one decode token reads: top-k latents + every indexer key."""
        return (self.latent_bytes_per_token(kv_bits) * self.attended_tokens(context_len)
                + self.index_bytes_per_token() * context_len)

    def state_bytes_per_seq(self, state_bits: int = 16) -> float:
        return 0.0

    def attention_flops(self, context_len: int) -> float:
        """Indexer scores over all cached tokens + absorbed MLA over the top-k (the heads' weighted sum of the
        ReLU'd scores is elementwise, not counted)."""
        index = 2.0 * self.index_n_heads * self.index_head_dim * context_len
        return index + self._mla().attention_flops(self.attended_tokens(context_len))


@dataclass(frozen=True)
class CompressedAttentionSpec:
    """Compressed attention in the style of DeepSeek-V4 (CSA / HCA): shared-KV MQA over three sources.

    * a sliding window of the last ``window`` tokens, uncompressed (``kv_dim`` elements each);
    * compressed entries, one per ``compress_ratio`` tokens (``kv_dim`` elements each);
    * if ``index_topk`` > 0 (CSA), a lightning indexer with one key per compressed entry that picks the top-k
      entries; if 0 (HCA), every compressed entry is attended densely.

    Capacity per sequence: window + entries x (kv + indexer key), plus the compressor state: the projected values
    and gates of the tokens of the window still open (CSA: two series per token, also for the indexer) and, for
    CSA's overlapping windows, the last closed window's first-series values and gates (as DeepSeek-V4's reference
    caches them). Read per decode token: window + min(entries, top-k) (or all entries) x kv + entries x indexer
    key. ``compress_ratio`` 0 means a pure sliding-window layer.
    """

    hidden_size: int
    num_heads: int
    head_dim: int  # query/output head width; also the shared K=V width of the one KV head
    q_lora_rank: int
    compress_ratio: int
    window: int
    index_topk: int = 0
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_bits: int = 8  # 0: the indexer keys are held at the KV's precision
    o_groups: int = 1
    o_lora_rank: int = 0  # grouped output projection: heads*head_dim -> o_groups*o_lora_rank -> d; 0 = plain o_proj
    kind: str = "compressed"
    sliding_window: None = None  # the window is part of the scheme, not a plain sliding-window layer

    @property
    def kv_dim(self) -> int:
        return self.head_dim

    def _compressor_params(self, width: int) -> int:
        """kv_proj and gate_proj (d -> width), a per-position bias; CSA overlaps windows (width doubled)."""
        return 2 * self.hidden_size * width + self.compress_ratio * width

    def matmul_params(self) -> int:
        return matmul_count(self.matmuls())

    def matmuls(self) -> list[Matmul]:
        """(K, N, count): wq_a, wq_b, wkv, wo_a (one [heads x head_dim / o_groups -> o_groups x o_lora_rank] matrix)
        and wo_b (or o), the compressor's kv and gate, the indexer's compressor kv and gate, wq_b and weights_proj."""
        d, h, hd, g = self.hidden_size, self.num_heads, self.head_dim, self.o_groups
        out = [(d, self.q_lora_rank, 1), (self.q_lora_rank, h * hd, 1), (d, hd, 1)]
        out += [(h * hd // g, g * self.o_lora_rank, 1), (g * self.o_lora_rank, d, 1)] if self.o_lora_rank \
            else [(h * hd, d, 1)]
        if self.compress_ratio:
            out.append((d, 2 * hd if self.index_topk else hd, 2))
        if self.index_topk:
            out += [(d, 2 * self.index_head_dim, 2), (self.q_lora_rank, self.index_n_heads * self.index_head_dim, 1),
                    (d, self.index_n_heads, 1)]
        return out

    def small_params(self) -> int:
        n = self.q_lora_rank + self.head_dim + self.num_heads  # q norm, kv norm, sinks
        if self.compress_ratio:
            n += self.compress_ratio * (2 * self.head_dim if self.index_topk else self.head_dim) + self.head_dim
        if self.index_topk:  # position bias, the indexer compressor's norm
            n += self.compress_ratio * 2 * self.index_head_dim + self.index_head_dim
        return n

    def params(self) -> int:
        return self.matmul_params() + self.small_params()

    def entries(self, context_len: int) -> int:
        return context_len // self.compress_ratio if self.compress_ratio else 0

    def index_bytes_per_entry(self, kv_bits: int = 16) -> float:
        if not self.index_topk:
            return 0.0
        return _index_key_bytes(self.index_head_dim, self.index_bits or kv_bits)

    def compressor_state_bytes(self, context_len: int, kv_bits: int = 16) -> float:
        """The compressor's per-sequence state at ``context_len``: values and gates of the ``context_len %
        compress_ratio`` tokens of the open window (CSA: ``2 x head_dim`` + the indexer's ``2 x index_head_dim`` per
        token), and once a window has closed, CSA's overlap: the last window's first-series values and its gates,
        which carry the fp32 position bias (fp32 whatever the KV's precision)."""
        if not self.compress_ratio:
            return 0.0
        sparse = bool(self.index_topk)
        width = (2 if sparse else 1) * self.head_dim + (2 * self.index_head_dim if sparse else 0)
        pending = 2 * width * (context_len % self.compress_ratio) * kv_bits / 8
        if not sparse or context_len < self.compress_ratio:
            return pending
        overlap = self.compress_ratio * (self.head_dim + self.index_head_dim)
        return pending + overlap * (kv_bits / 8 + 4)

    def peak_cache_bytes(self, context_len: int, kv_bits: int = 16) -> float:
        """The most a sequence holds on its way to ``context_len`` tokens: at ``context_len``, or where the last
        window before it was one token short of closing (its compressor state then at its largest), whichever is
        more (between window ends the held bytes only grow)."""
        held = self.cache_bytes_at(context_len, kv_bits)
        if not self.compress_ratio:
            return held
        last_open = context_len - context_len % self.compress_ratio - 1
        return max(held, self.cache_bytes_at(last_open, kv_bits)) if last_open >= 1 else held

    def most_bytes_beyond_entries(self, kv_bits: int = 16) -> float:
        """The most a sequence holds besides its compressed entries and their indexer keys, at any length: a full
        window and the compressor's largest state (a window one token short of closing, and CSA's overlap)."""
        state = self.compressor_state_bytes(2 * self.compress_ratio - 1, kv_bits) if self.compress_ratio else 0.0
        return self.kv_dim * kv_bits / 8 * self.window + state

    def cache_elems_per_token(self) -> int:
        """Long-context elements per token (window excluded): kv + indexer key per ``compress_ratio`` tokens."""
        if not self.compress_ratio:
            return 0
        return (self.kv_dim + (self.index_head_dim if self.index_topk else 0)) // self.compress_ratio

    def cache_bytes_per_token(self, kv_bits: int = 16) -> float:
        """Asymptotic bytes per token of context (window excluded)."""
        if not self.compress_ratio:
            return 0.0
        return (self.kv_dim * kv_bits / 8 + self.index_bytes_per_entry(kv_bits)) / self.compress_ratio

    def cached_tokens(self, context_len: int) -> int:
        return min(context_len, self.window) + self.entries(context_len)

    def attended_entries(self, context_len: int) -> int:
        e = self.entries(context_len)
        return min(e, self.index_topk) if self.index_topk else e

    def cache_bytes_at(self, context_len: int, kv_bits: int = 16) -> float:
        kv = self.kv_dim * kv_bits / 8
        e = self.entries(context_len)
        return (kv * (min(context_len, self.window) + e) + self.index_bytes_per_entry(kv_bits) * e
                + self.compressor_state_bytes(context_len, kv_bits))

    def cache_read_bytes(self, context_len: int, kv_bits: int = 16) -> float:
        kv = self.kv_dim * kv_bits / 8
        return (kv * (min(context_len, self.window) + self.attended_entries(context_len))
                + self.index_bytes_per_entry(kv_bits) * self.entries(context_len))

    def state_bytes_per_seq(self, state_bits: int = 16) -> float:
        return 0.0

    def attention_flops(self, context_len: int) -> float:
        """MQA score + value over window + attended entries, plus indexer scores over all entries."""
        attended = min(context_len, self.window) + self.attended_entries(context_len)
        index = 2.0 * self.index_n_heads * self.index_head_dim * self.entries(context_len) if self.index_topk else 0.0
        return 4.0 * self.num_heads * self.head_dim * attended + index


MixerSpec = (AttentionSpec | MLASpec | DSASpec | CompressedAttentionSpec | Mamba2Spec | Mamba1Spec | GatedDeltaNetSpec
             | KimiDeltaSpec)


# ----------------------------------------------------------------------------- FFNs


@dataclass(frozen=True)
class DenseFFNSpec:
    """A dense MLP: gated (gate/up/down, SwiGLU) or plain (up/down, e.g. relu²)."""

    hidden_size: int
    intermediate_size: int
    gated: bool = True
    bias: bool = False
    kind: str = "dense"

    def matmul_params(self) -> int:
        return matmul_count(self.matmuls())

    def matmuls(self) -> list[Matmul]:
        """(K, N, count): gate and up (or up), down."""
        d, i = self.hidden_size, self.intermediate_size
        return [(d, i, 2 if self.gated else 1), (i, d, 1)]

    def small_params(self) -> int:
        if not self.bias:
            return 0
        return (2 if self.gated else 1) * self.intermediate_size + self.hidden_size

    def params(self) -> int:
        return self.matmul_params() + self.small_params()

    def active_params(self) -> int:
        return self.params()

    def active_matmul_params(self) -> int:
        return self.matmul_params()


@dataclass(frozen=True)
class MoESpec:
    """Mixture of experts: a router, routed experts (top-k of E) and optional always-on shared experts."""

    hidden_size: int
    num_experts: int
    top_k: int
    expert_intermediate: int
    num_shared: int = 0
    shared_intermediate: int = 0  # total width of all shared experts together
    shared_bias: bool = False  # biases on the shared experts' projections (mlp_bias: DeepSeek-V2, Nemotron-H)
    gated: bool = True
    expert_bias: bool = False
    router_bias: bool = False  # a learned bias in the router linear (GPT-OSS)
    scoring: str = "softmax"  # softmax | sigmoid
    correction_bias: bool = False  # DeepSeek-V3 e_score_correction_bias (selection only)
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling: float = 1.0
    softmax_after_topk: bool = False  # GPT-OSS: top-k on logits, softmax over the chosen
    shared_gate: bool = False  # Qwen2-MoE style sigmoid gate on the shared expert
    kind: str = "moe"

    def _expert_matmul_params(self) -> int:
        return matmul_count(self.expert_matmuls())

    def _expert_bias_params(self) -> int:
        return (2 if self.gated else 1) * self.expert_intermediate + self.hidden_size if self.expert_bias else 0

    def expert_matmuls(self) -> list[Matmul]:
        """(K, N, count) of one routed expert's weights: gate and up (or up), down."""
        d, i = self.hidden_size, self.expert_intermediate
        return [(d, i, 2 if self.gated else 1), (i, d, 1)]

    def expert_params(self) -> int:
        """Parameters of one routed expert."""
        return self._expert_matmul_params() + self._expert_bias_params()

    def expert_bytes(self, bits: int = 16, group_size: int = 128, zeros: bool = False) -> float:
        """Stored bytes of one routed expert: its weights at ``bits`` (+ scales), its biases 16-bit."""
        return (matmul_bytes(self.expert_matmuls(), bits, group_size, zeros=zeros)
                + self._expert_bias_params() * BYTES_16)

    def _shared_matmuls(self) -> list[Matmul]:
        d, s = self.hidden_size, self.shared_intermediate
        return [(d, s, 2 if self.gated else 1), (s, d, 1)] if s else []

    def _shared_matmul_params(self) -> int:
        return matmul_count(self._shared_matmuls())

    def _shared_small_params(self) -> int:
        """The shared experts' biases and sigmoid gate (a [d -> 1] weight, 16-bit as routers are)."""
        if not self.shared_intermediate:
            return 0
        n = (2 if self.gated else 1) * self.shared_intermediate + self.hidden_size if self.shared_bias else 0
        return n + (self.hidden_size if self.shared_gate else 0)

    def shared_params(self) -> int:
        return self._shared_matmul_params() + self._shared_small_params()

    def router_params(self) -> int:
        n = self.hidden_size * self.num_experts
        if self.router_bias:
            n += self.num_experts
        if self.correction_bias:
            n += self.num_experts
        return n

    def params(self) -> int:
        return self.router_params() + self.num_experts * self.expert_params() + self.shared_params()

    def active_params(self) -> int:
        return self.router_params() + self.top_k * self.expert_params() + self.shared_params()

    def matmuls(self) -> list[Matmul]:
        """(K, N, count): every routed expert's weights, and the shared experts' (biases and gates are small)."""
        return [(k, n, c * self.num_experts) for k, n, c in self.expert_matmuls()] + self._shared_matmuls()

    def matmul_params(self) -> int:
        return self.num_experts * self._expert_matmul_params() + self._shared_matmul_params()

    def small_params(self) -> int:
        """The router, and the experts' biases and shared gate (16-bit when the matmuls are quantized)."""
        return self.router_params() + self.num_experts * self._expert_bias_params() + self._shared_small_params()

    def active_matmul_params(self) -> int:
        return self.top_k * self._expert_matmul_params() + self._shared_matmul_params()


FFNSpec = DenseFFNSpec | MoESpec


def _kept_16bit(part: Any, bits: int) -> list[Matmul]:
    """Matmuls of ``part`` that int4/int8 checkpoints keep at 16 bits (MLA's kv_b_proj)."""
    return part.kept_16bit_matmuls() if bits < 16 and hasattr(part, "kept_16bit_matmuls") else []


def _part_bytes(part: Any, bits: int, group_size: int, zeros: bool = False) -> float:
    """Stored bytes of a mixer or an FFN: its matmuls at ``bits`` (+ scales; those kept 16-bit at 16), its small
    parameters (norms, routers, biases) 16-bit."""
    kept = _kept_16bit(part, bits)
    mm = list(part.matmuls())
    for m in kept:
        mm.remove(m)
    return (matmul_bytes(mm, bits, group_size, zeros=zeros) + matmul_bytes(kept, 16)
            + part.small_params() * BYTES_16)


# ----------------------------------------------------------------------------- layers and model


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer: a mixer and an FFN (either may be None, as in Nemotron-H's single-block layers)."""

    index: int
    mixer: MixerSpec | None
    ffn: FFNSpec | None
    hidden_size: int
    hc_mult: int = 0  # hyper-connections (DeepSeek-V4): the residual stream as this many copies; 0 = a plain residual

    def _parts(self) -> list[Any]:
        return [p for p in (self.mixer, self.ffn) if p is not None]

    def norm_params(self) -> int:
        return self.hidden_size * len(self._parts())

    def hc_params(self) -> int:
        """The hyper-connection weights around each part: a (2 + n) x n by n x d map, its bias and 3 scales."""
        n = self.hc_mult
        return len(self._parts()) * ((2 + n) * n * (n * self.hidden_size + 1) + 3) if n else 0

    def params(self) -> int:
        return sum(p.params() for p in self._parts()) + self.norm_params() + self.hc_params()

    def active_params(self) -> int:
        n = self.norm_params() + self.hc_params() + (self.mixer.params() if self.mixer else 0)
        return n + (self.ffn.active_params() if self.ffn else 0)

    def cache_shard_limit(self) -> int:
        """How many tensor-parallel devices this layer's cache can be split over (0: as many as there are). GQA's K/V
        go down to one KV head a device (more ranks hold copies); a latent or KV head every query head reads (MLA,
        DSA, DeepSeek-V4's compressed cache) is held whole by every rank, as vLLM's and SGLang's tensor-parallel MLA
        hold it (data-parallel attention, which splits the batch instead, is not modelled); recurrent state splits
        by its heads."""
        kind = getattr(self.mixer, "kind", "")
        if kind == "gqa":
            return int(self.mixer.num_kv_heads)
        return 1 if kind in ("mla", "dsa", "compressed") else 0

    def weight_bytes(self, bits: int = 16, group_size: int = 128, zeros: bool = False) -> float:
        """Stored bytes: matmul weights at ``bits`` (+ scales, each matrix's groups as ``matmul_bytes`` sizes them);
        norms, routers, biases stay 16-bit."""
        return (sum(_part_bytes(p, bits, group_size, zeros) for p in self._parts())
                + (self.norm_params() + self.hc_params()) * BYTES_16)

    def mixer_weight_bytes(self, bits: int = 16, group_size: int = 128) -> float:
        """Bytes of the mixer part (attention side of an attention/FFN split), with its norm (and hyper-connection)."""
        if self.mixer is None:
            return 0.0
        hc = self.hc_params() // len(self._parts())
        return _part_bytes(self.mixer, bits, group_size) + (self.hidden_size + hc) * BYTES_16

    def ffn_weight_bytes(self, bits: int = 16, group_size: int = 128) -> float:
        """Bytes of the FFN part (FFN side of an attention/FFN split), with its norm (and hyper-connection)."""
        if self.ffn is None:
            return 0.0
        hc = self.hc_params() // len(self._parts())
        return _part_bytes(self.ffn, bits, group_size) + (self.hidden_size + hc) * BYTES_16

    def cache_bytes_per_token(self, kv_bits: int = 16) -> float:
        return self.mixer.cache_bytes_per_token(kv_bits) if self.mixer else 0.0

    def cache_bytes_per_seq(self, context_len: int, kv_bits: int = 16, state_bits: int = 16) -> float:
        """Cache one sequence holds at ``context_len`` (capacity)."""
        if self.mixer is None:
            return 0.0
        m = self.mixer
        if hasattr(m, "cache_bytes_at"):
            return m.cache_bytes_at(context_len, kv_bits) + m.state_bytes_per_seq(state_bits)
        return m.cache_bytes_per_token(kv_bits) * m.cached_tokens(context_len) + m.state_bytes_per_seq(state_bits)

    def peak_cache_bytes_per_seq(self, context_len: int, kv_bits: int = 16, state_bits: int = 16) -> float:
        """The most cache one sequence holds on its way to ``context_len`` tokens (what memory must leave room
        for): ``cache_bytes_per_seq`` but for a compressed cache, whose held bytes drop each time a compression
        window closes (DeepSeek-V4's CSA / HCA: 18.4 MB per sequence at 1,023 tokens, 13.0 MB at 1,024)."""
        m = self.mixer
        if m is not None and hasattr(m, "peak_cache_bytes"):
            return m.peak_cache_bytes(context_len, kv_bits) + m.state_bytes_per_seq(state_bits)
        return self.cache_bytes_per_seq(context_len, kv_bits, state_bits)

    def rollback_bytes_per_seq(self, num_tokens: int, state_bits: int = 16) -> float:
        """Bytes a speculative verify of ``num_tokens`` drafts keeps per sequence beside the cache (recurrent-state
        mixers: the state after each verified token); 0 for attention, whose rejected entries are overwritten."""
        fn = getattr(self.mixer, "rollback_bytes_per_seq", None)
        return fn(num_tokens, state_bits) if fn is not None else 0.0

    def cache_read_bytes_per_seq(self, context_len: int, kv_bits: int = 16, state_bits: int = 16) -> float:
        """Cache bytes one decode token of one sequence moves at ``context_len`` (speed): the whole cache for
        GQA / MLA, less for sparse and compressed attention (DSA top-k, compressed top-k); a recurrent state (Mamba,
        linear attention) is read and written back whole every step, so it counts twice."""
        if self.mixer is None:
            return 0.0
        m = self.mixer
        state = 2 * m.state_bytes_per_seq(state_bits)
        if hasattr(m, "cache_read_bytes"):
            return m.cache_read_bytes(context_len, kv_bits) + state
        return m.cache_bytes_per_token(kv_bits) * m.cached_tokens(context_len) + state

    def hc_flops_per_part(self) -> float:
        """One token's hyper-connection products around each part: the (2 + n) x n by n x d map and the n x n mix of
        the streams (the weighted sums in and out of the part are elementwise, not counted)."""
        n = self.hc_mult
        return 2.0 * n * n * self.hidden_size * (n + 3) if n else 0.0

    def mixer_flops_per_token(self, context_len: int = 0) -> float:
        """Forward FLOPs of the mixer (attention side) for one token with ``context_len`` tokens of context (with
        its hyper-connection)."""
        if self.mixer is None:
            return 0.0
        small = self.mixer.small_matmul_params() if hasattr(self.mixer, "small_matmul_params") else 0
        return (2.0 * (self.mixer.matmul_params() + small) + self.mixer.attention_flops(context_len)
                + self.hc_flops_per_part())

    def ffn_flops_per_token(self) -> float:
        """Forward FLOPs of the FFN (router + active experts + shared experts and their gate) for one token (with its
        hyper-connection)."""
        if self.ffn is None:
            return 0.0
        f = 2.0 * self.ffn.active_matmul_params() + self.hc_flops_per_part()
        if isinstance(self.ffn, MoESpec):
            gate = 1 if self.ffn.shared_gate and self.ffn.shared_intermediate else 0
            f += 2.0 * self.hidden_size * (self.ffn.num_experts + gate)
        return f

    def flops_per_token(self, context_len: int = 0) -> float:
        """Forward FLOPs for one decoded token with ``context_len`` tokens of context: every matmul (routers, gates
        and hyper-connections included) and the mixer's attention or state terms; norms, activations, softmax and
        other elementwise work are not counted."""
        return self.mixer_flops_per_token(context_len) + self.ffn_flops_per_token()


@dataclass
class ModelSpec:
    """A whole model: embeddings, a list of layers, the LM head, and optional MTP layers."""

    name: str
    model_type: str
    vocab_size: int
    hidden_size: int
    layers: list[LayerSpec]
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    mtp_layers: list[LayerSpec] = field(default_factory=list)
    hf_config: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    # -- parameters
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def lm_head_params(self) -> int:
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    def hc_head_params(self) -> int:
        """With hyper-connections, the final collapse of the n streams: an n by n x d map, n biases, one scale."""
        n = self.layers[-1].hc_mult if self.layers else 0
        return n * (n * self.hidden_size + 1) + 1 if n else 0

    def params_total(self) -> int:
        """All parameters, excluding MTP layers (as DeepSeek reports 671B without its 14B MTP module)."""
        return (self.embedding_params() + self.lm_head_params() + self.hidden_size + self.hc_head_params()
                + sum(layer.params() for layer in self.layers))

    def params_active(self) -> int:
        """Parameters touched per token (routed experts: top-k only), embeddings and head included."""
        return (self.embedding_params() + self.lm_head_params() + self.hidden_size + self.hc_head_params()
                + sum(layer.active_params() for layer in self.layers))

    def mtp_params(self) -> int:
        """MTP modules: each a decoder layer plus its input projection [2d -> d] (DeepSeek-V4's: two [d -> d], for the
        embedding and the hidden state), three norms and, with hyper-connections, its own collapse of the streams
        (embeddings and LM head are shared with the main model)."""
        d = self.hidden_size
        return sum(layer.params() + 2 * d * d + 3 * d + self.hc_head_params() for layer in self.mtp_layers)

    def mtp_weight_bytes(self, bits: int = 16, group_size: int = 128, layers: list[Any] | None = None) -> float:
        """Stored bytes of the MTP modules (``mtp_params``' parts: the layer and its [2d -> d] projection at ``bits``,
        the norms and a collapse of the streams 16-bit); ``layers``: modules of other layers' shape (an EAGLE-style
        head: the first layer's)."""
        d = self.hidden_size
        return sum(layer.weight_bytes(bits, group_size) + matmul_bytes([(2 * d, d, 1)], bits, group_size)
                   + (3 * d + self.hc_head_params()) * BYTES_16
                   for layer in (self.mtp_layers if layers is None else layers))

    # -- bytes
    def embed_bytes(self, embed_bits: int = 16) -> float:
        """The embedding table [vocab, d] at ``embed_bits`` (below 16: groups of 128 along d, as ``matmul_bytes``)."""
        return matmul_bytes([(self.hidden_size, self.vocab_size, 1)], embed_bits)

    def lm_head_bytes(self, embed_bits: int = 16) -> float:
        small = self.hidden_size + self.hc_head_params()  # the final norm (and the hyper-connection's collapse)
        head = [(self.hidden_size, self.vocab_size, 1)] if self.lm_head_params() else []
        return matmul_bytes(head, embed_bits) + small * BYTES_16

    def weight_bytes(self, bits: int = 16, group_size: int = 128, embed_bits: int = 16, zeros: bool = False) -> float:
        return (self.embed_bytes(embed_bits) + self.lm_head_bytes(embed_bits)
                + sum(layer.weight_bytes(bits, group_size, zeros) for layer in self.layers))

    def cache_bytes_per_token(self, kv_bits: int = 16) -> float:
        return sum(layer.cache_bytes_per_token(kv_bits) for layer in self.layers)

    def cache_bytes_per_seq(self, context_len: int, kv_bits: int = 16, state_bits: int = 16) -> float:
        return sum(layer.cache_bytes_per_seq(context_len, kv_bits, state_bits) for layer in self.layers)

    def rollback_bytes_per_seq(self, num_tokens: int, state_bits: int = 16) -> float:
        """What a speculative verify of ``num_tokens`` drafts keeps per sequence beside the cache (all layers:
        ``LayerSpec.rollback_bytes_per_seq``)."""
        return sum(layer.rollback_bytes_per_seq(num_tokens, state_bits) for layer in self.layers)

    def cache_growth(self, kv_bits: int = 16, state_bits: int = 16) -> tuple[float, float]:
        """(bytes per token, fixed bytes) of one long sequence's cache: what each further token of context adds
        (sliding-window layers past their window add nothing; a compressed cache adds its average), and what a
        sequence holds beyond that (the windows, the recurrent states, open compression windows). The
        ``cache_bytes_per_token`` sum counts every layer's cached token, windowed or not (the paging unit)."""
        c = 1 << 24  # (past every window and compression period)
        at_c, at_2c = self.cache_bytes_per_seq(c, kv_bits, state_bits), self.cache_bytes_per_seq(2 * c, kv_bits,
                                                                                                   state_bits)
        per_token = (at_2c - at_c) / c
        return per_token, max(0.0, at_c - per_token * c)

    def cache_read_bytes_per_seq(self, context_len: int, kv_bits: int = 16, state_bits: int = 16) -> float:
        """Cache bytes one decode token of one sequence moves at ``context_len`` (all layers; a recurrent state read
        and written back)."""
        return sum(layer.cache_read_bytes_per_seq(context_len, kv_bits, state_bits) for layer in self.layers)

    def lm_head_flops_per_token(self) -> float:
        """The LM head's product for one token (computed whether or not its weights are tied to the embedding), and
        with hyper-connections the map that collapses the n streams."""
        n = self.layers[-1].hc_mult if self.layers else 0
        return 2.0 * self.vocab_size * self.hidden_size + 2.0 * n * n * self.hidden_size

    def flops_per_token(self, context_len: int = 0) -> float:
        return self.lm_head_flops_per_token() + sum(layer.flops_per_token(context_len) for layer in self.layers)

    def summary(self) -> dict[str, Any]:
        kinds: dict[str, int] = {}
        for layer in self.layers:
            key = f"{layer.mixer.kind if layer.mixer else '-'}+{layer.ffn.kind if layer.ffn else '-'}"
            kinds[key] = kinds.get(key, 0) + 1
        return {
            "name": self.name, "model_type": self.model_type, "layers": self.num_layers, "layer_kinds": kinds,
            "params_total": self.params_total(), "params_active": self.params_active(),
            "kv_bytes_per_token_bf16": self.cache_bytes_per_token(16),
        }
