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

Modules: ``layout`` (the split, AFD plans), ``sides`` (what each side loads), ``link`` (transport with a time split),
``ranks`` (attention and FFN ranks' compute, the worker processes), ``driver`` (``AFD``). The names below are the
public ones.
"""

from waferline.engine.afd.driver import AFD
from waferline.engine.afd.layout import DEFAULT_MICRO_BATCHES, AFDError, Layout, is_afd_plan, make_layout, plan_ranks
from waferline.engine.afd.link import AFD_SLOT_BYTES, AFLink, Clock, TimedLink
from waferline.engine.afd.ranks import AttentionRunner, FFNRunner, decode_step, encode_step, worker_main
from waferline.engine.afd.sides import ExpertSlice, FFNFront, Router, load_attention_side, load_ffn_side

__all__ = ["AFD", "AFDError", "Layout", "make_layout", "is_afd_plan", "plan_ranks", "DEFAULT_MICRO_BATCHES",
           "load_attention_side", "load_ffn_side", "Router", "FFNFront", "ExpertSlice", "Clock", "TimedLink", "AFLink",
           "AFD_SLOT_BYTES", "AttentionRunner", "FFNRunner", "encode_step", "decode_step", "worker_main"]
