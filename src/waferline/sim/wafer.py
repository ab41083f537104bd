"""The on-wafer fabric term of a layer's decode step: weight-stationary dataflow on a 2-D mesh of processing elements.

A layer placed on a wafer keeps its weights where they are (in the SRAM of the PEs of its region) and moves the
activations instead. Per decode token a layer therefore pays, besides reading its local weights (the spatial roofline
in ``cost.stage_step``), for the vectors that cross its region:

* **streaming**: every GEMV's input is broadcast into the PEs holding its weights and its output is reduced out of
  them. Each such vector crosses the fabric through a front of links; a link carries the fabric's per-link bandwidth
  (the published aggregate divided by 4 neighbour links x 2 directions per PE). ``elements x bytes / (link bandwidth x
  fabric_links)``, where ``fabric_links`` -- how many links a vector front is effectively spread over -- is the one
  fitted term (bounded: at least one link, at most the region's side).
* **distance**: each phase also travels the region's side (a square of the layer's share of the wafer's PEs) at the
  mesh's per-hop latency: bigger regions cost more hops. A whole wafer is ~950 hops across; a layer's region is the
  fastest for its decode step between the fewest cores that hold its bytes and its byte share of the stage
  (``cost.region_share``), so one layer alone on a wafer need not span it.

Which vectors cross is derived from the layer's shapes (``fabric_work``): the layer input, and each matmul's output once
(a mixer: each product's output, the output projection's input instead of its own; MLA, DSA and V4-style compressed
attention from their shapes, whose low-rank products read their rank's width; any other mixer as ``matmul params / d``,
exact for a GQA block: q, k, v and the attention output), a dense FFN's gate, up and down outputs, and for a MoE block
the router logits, the dispatch of the input to the chosen experts, one expert's gate/up/down outputs (the chosen
experts and the shared expert run side by side in their own regions) and the combine. Activations move in 16-bit (16-bit
compute).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from waferline.spec.hardware import MESH_LINKS_PER_CORE
from waferline.spec.model import DenseFFNSpec, MoESpec

if TYPE_CHECKING:
    from waferline.spec.hardware import HardwareSpec
    from waferline.spec.model import LayerSpec

ACT_BYTES = 2.0  # activations cross the fabric in 16-bit (the deployments compute in 16-bit)
# vector phases a block's activations cross the region in (each one travels the region's side once)
MIXER_PHASES = 4  # input broadcast, q/k/v (or latent) to the attention, its output to the projection, output
DENSE_FFN_PHASES = 3  # input broadcast, gate/up outputs to the down projection, output
MOE_PHASES = 5  # router, dispatch to the chosen experts, gate/up to down inside an expert, expert output, combine


@dataclass(frozen=True)
class FabricWork:
    """Elements (per token) and phases of the vectors one layer's blocks stream through the fabric."""

    mixer_elems: float = 0.0
    mixer_phases: int = 0
    ffn_elems: float = 0.0
    ffn_phases: int = 0


def fabric_work(layer: LayerSpec) -> FabricWork:
    """What one decode token of ``layer`` streams through the mesh (see the module docstring for the rule)."""
    d = layer.hidden_size
    mixer_elems, mixer_phases = 0.0, 0
    if layer.mixer is not None:
        mixer_elems = d + _mixer_vectors(layer.mixer, d)
        mixer_phases = MIXER_PHASES
    ffn = layer.ffn
    ffn_elems, ffn_phases = 0.0, 0
    if isinstance(ffn, MoESpec):
        up = 2 if ffn.gated else 1
        one_expert = up * ffn.expert_intermediate + d  # gate/up and down outputs of one expert
        shared = up * ffn.shared_intermediate + d if ffn.num_shared else 0.0
        ffn_elems = ffn.num_experts + d + max(one_expert, shared) + d  # router logits, dispatch, expert, combine
        ffn_phases = MOE_PHASES
    elif isinstance(ffn, DenseFFNSpec):
        ffn_elems = d + (2 if ffn.gated else 1) * ffn.intermediate_size + d  # in, gate/up, down
        ffn_phases = DENSE_FFN_PHASES
    return FabricWork(mixer_elems, mixer_phases, ffn_elems, ffn_phases)


def _mixer_vectors(mixer: object, d: int) -> float:
    """Elements of the vectors a mixer's products write, per token: each product's output, the output projection's
    replaced by its input (the attention's output; the projection's own output is the next block's input). MLA (and
    DSA, MLA with an indexer) and DeepSeek-V4-style compressed attention: their low-rank products read their rank's
    width, not ``d``, so they are counted from their shapes; any other mixer as ``matmul params / d`` (each product
    reads the layer input: exact for GQA and Mamba-2's in/out projections)."""
    from waferline.spec.model import CompressedAttentionSpec, DSASpec, MLASpec

    if isinstance(mixer, CompressedAttentionSpec):  # (every product's output but the one back to d; the attention's)
        return float(sum(n * c for _, n, c in mixer.matmuls()) - d + mixer.num_heads * mixer.head_dim)
    if isinstance(mixer, (MLASpec, DSASpec)):
        mla = mixer if isinstance(mixer, MLASpec) else mixer._mla()
        *inner, (o_in, _, _) = mla.matmuls()
        extra = mixer.matmuls()[len(inner) + 1:]  # (DSA: the indexer's products)
        return float(sum(n * c for _, n, c in inner + extra) + o_in)
    return mixer.matmul_params() / d  # type: ignore[attr-defined]


_FABRICS: dict[tuple, Fabric] = {}


@dataclass(frozen=True)
class Fabric:
    """The mesh a wafer's layers sit on, from the hardware spec (sources in the catalog)."""

    pes: int  # processing elements on one wafer
    link_bytes_per_s: float  # one link, one direction
    hop_s: float  # latency of one hop

    @classmethod
    def of(cls, hw: HardwareSpec) -> Fabric | None:
        """The fabric of a wafer-kind device with a published core count and on-chip mesh; None otherwise."""
        mesh = hw.on_chip
        if hw.kind != "wafer" or mesh is None or not hw.cores:
            return None
        key = (hw.cores, mesh.bandwidth, mesh.latency)
        hit = _FABRICS.get(key)  # (the sweeps ask once per stage)
        if hit is None:
            hit = _FABRICS[key] = cls(pes=int(hw.cores), hop_s=mesh.latency,
                                      link_bytes_per_s=mesh.bandwidth / (hw.cores * MESH_LINKS_PER_CORE))
        return hit

    def side(self, share: float) -> float:
        """Hops across a square region holding ``share`` of the wafer's PEs (at least one PE)."""
        return math.sqrt(max(1.0, self.pes * (share if share < 1.0 else 1.0)))

    def time(self, elems: float, phases: int, tokens: float, share: float, links: float) -> tuple[float, float]:
        """(streaming, distance) seconds for ``tokens`` vectors of ``elems`` elements each in ``phases`` phases
        across a region holding ``share`` of the wafer. ``links``: the fitted width of one vector's front; several
        vectors (a prompt's tokens) stream side by side, up to the region's side (its bisection) in all."""
        if elems <= 0 or phases <= 0:
            return 0.0, 0.0
        side = self.side(share)
        width = min(max(links, 1.0) * max(tokens, 1.0), side)
        return tokens * elems * ACT_BYTES / (self.link_bytes_per_s * width), phases * side * self.hop_s
