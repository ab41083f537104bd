"""Per-layer and per-stage cost: roofline (bytes, FLOPs) plus explicit fixed latencies, with fitted parameters per
device class."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from waferline.errors import ConfigError
from waferline.plan.plan import MAX_DRAFT_TOKENS, SpeculativeConfig
from waferline.sim.wafer import Fabric, fabric_work
from waferline.spec.hardware import HardwareSpec
from waferline.spec.model import MoESpec

if TYPE_CHECKING:
    from waferline.spec.model import ModelSpec

FITTED_PATH = Path(__file__).parent / "fitted.yaml"
STATE_BITS = 16

# parameter name -> (prior value, prior log-sd, lower bound, upper bound, meaning)
CLASS_PARAMS: dict[str, tuple[float, float, float, float, str]] = {
    "bw_eff": (0.75, 0.3, 0.05, 1.0, "achieved fraction of peak memory bandwidth in decode"),
    "flops_eff": (0.5, 0.5, 0.02, 1.0, "achieved fraction of peak FLOP/s in prefill"),
    "layer_latency_s": (
        10e-6,
        1.5,
        1e-7,
        2e-4,
        "fixed latency per layer per decode step (launches, syncs; on a wafer the per-layer reduction across the mesh)",
    ),
    "fabric_links": (
        4.0,
        2.0,
        1.0,
        1e3,
        "links of the on-wafer mesh a streamed activation vector is spread over (1 = one link; sim/wafer.py)",
    ),
    "moe_latency_s": (5e-6, 2.0, 1e-8, 2e-4, "extra latency per MoE layer (router top-k, token dispatch and combine)"),
    "hop_latency_s": (
        5e-6,
        1.5,
        1e-7,
        1e-4,
        "latency of one hop between devices of different stages (overrides the link's assumed latency)",
    ),
}


# the range a fit may move the per-token acceptance of speculative decoding in, and the per-request overhead of a
# client-measured TTFT in (seconds)
ACCEPT_BOUNDS = (0.3, 0.97)
TTFT_OVERHEAD_BOUNDS = (1e-4, 2.0)
# the most favourable end of each class parameter's bounds: the fastest a device can be under this model
_FAVOURABLE = {"bw_eff": 3, "flops_eff": 3, "fabric_links": 3, "layer_latency_s": 2, "moe_latency_s": 2,
               "hop_latency_s": 2}


@dataclass
class ClassParams:
    """Fitted/assumed cost parameters of one device class (gpu, wafer, lpu, rdu, ...)."""

    bw_eff: float = 0.75
    flops_eff: float = 0.5
    layer_latency_s: float = 10e-6
    fabric_links: float = 4.0
    moe_latency_s: float = 5e-6
    hop_latency_s: float | None = None
    status: dict[str, str] = field(default_factory=dict)
    # what-if, never fitted or stored: a term (sim/explain.py's TERMS) -> the factor its time is divided by in every
    # step (``simulate --explain`` sizes its levers by re-simulating with one)
    speedup: dict[str, float] = field(default_factory=dict)


@dataclass
class SimParams:
    """All parameters that no datasheet gives: per device class, speculative acceptance, request overhead."""

    classes: dict[str, ClassParams] = field(default_factory=dict)
    accept_rate: dict[str, float] = field(
        default_factory=lambda: {"draft": 0.8, "mtp": 0.85, "eagle": 0.8, "medusa": 0.6, "ngram": 0.5}
    )
    num_tokens: dict[str, int] = field(
        default_factory=lambda: {"draft": 5, "mtp": 3, "eagle": 6, "medusa": 4, "ngram": 4}
    )
    draft_models: dict[str, str] = field(
        default_factory=lambda: {
            "llama": "llama-3.2-1b",
            "qwen3": "qwen3-0.6b",
            "qwen3_moe": "qwen3-0.6b",
            "qwen3_next": "qwen3-0.6b",
            "default": "llama-3.2-1b",
        }
    )
    ttft_overhead_s: float = 0.0
    default_prompt_len: int = 1000
    default_output_len: int = 500
    fitted_on: str = ""
    status: dict[str, str] = field(default_factory=dict)
    # parameter sets refit on resampled rows (`calibrate --published`): name -> value of each fitted parameter
    # (class.param, accept_rate.method, ttft_overhead_s); `simulate` predicts with each for its 90% intervals
    bootstrap: list[dict[str, float]] = field(default_factory=list)
    bootstrap_info: str = ""
    speedup: dict[str, float] = field(default_factory=dict)  # (what-if: see ClassParams.speedup)

    def for_hardware(self, hw: HardwareSpec) -> ClassParams:
        cp = self.classes.get(hw.name) or self.classes.get(hw.kind) or self.classes.get("gpu") or ClassParams()
        return replace(cp, speedup=self.speedup) if self.speedup else cp

    def draft_tokens(self, sp: SpeculativeConfig) -> int:
        """Drafts a verify checks per step under ``sp`` (a SpeculativeConfig): its own count, else this method's
        default (``num_tokens``); 0 without speculation. The simulator's k, and what the planner counts a verify's
        rollback states for (plan.place)."""
        return 0 if sp.method == "none" else sp.num_tokens or self.num_tokens.get(sp.method, 4)

    def sped_up(self, term: str, factor: float) -> SimParams:
        """A copy whose steps take ``term`` (a key of sim/explain.py's TERMS) ``factor`` times less time."""
        return replace(self, speedup={term: factor})

    def copy(self) -> SimParams:
        return replace(self, classes={k: replace(v, status=dict(v.status)) for k, v in self.classes.items()},
                       accept_rate=dict(self.accept_rate), num_tokens=dict(self.num_tokens),
                       draft_models=dict(self.draft_models), status=dict(self.status),
                       bootstrap=list(self.bootstrap))

    def with_values(self, values: dict[str, float]) -> SimParams:
        """A copy with the named fitted parameters replaced (a bootstrap set); a class that takes the gpu values
        (no data: tpu, asic) follows the set's gpu values too, and a class that takes a value shared with the named
        class (status "fitted, shared by ...", sim/fit.py SHARED) follows that value."""
        out = replace(self, classes={k: replace(v) for k, v in self.classes.items()},
                      accept_rate=dict(self.accept_rate), bootstrap=[])
        for name, v in values.items():
            if name == "ttft_overhead_s":
                out.ttft_overhead_s = v
            elif name.startswith("accept_rate."):
                out.accept_rate[name.split(".", 1)[1]] = v
            else:
                cname, pname = name.split(".", 1)
                if pname not in CLASS_PARAMS:
                    raise ConfigError(f"parameter set names unknown parameter {name!r}")
                for cn, cp in out.classes.items():
                    st = cp.status.get(pname, "")
                    if (cn == cname or (cname == "gpu" and st.startswith("assumed: as gpu"))
                            or cname in st.partition("shared by ")[2].split(", ")):
                        setattr(cp, pname, v)
        return out

    def ceiling(self) -> SimParams:
        """A copy with every fitted or assumed term at the most favourable end of its physical bounds (efficiencies
        1, latencies at their floor, acceptance at its cap, no request overhead): what the model predicts for a
        deployment then is the fastest it allows with the catalog's numbers as they are (datasheet and assumed)."""
        out = self.copy()
        out.bootstrap = []
        for cp in out.classes.values():
            for name, end in _FAVOURABLE.items():
                if getattr(cp, name) is not None:  # (no hop latency of its own: the link's, as the catalog has it)
                    setattr(cp, name, CLASS_PARAMS[name][end])
        out.accept_rate = {m: max(a, ACCEPT_BOUNDS[1]) for m, a in out.accept_rate.items()}  # (a given file may
        out.ttft_overhead_s = min(out.ttft_overhead_s, TTFT_OVERHEAD_BOUNDS[0])  # hold values past the fit's bounds)
        return out

    def parameter_sets(self) -> list[SimParams]:
        """One SimParams per stored bootstrap set (empty when the fit stored none)."""
        return [self.with_values(v) for v in self.bootstrap]

    # -- YAML
    def to_yaml_dict(self) -> dict[str, Any]:
        def val(v: Any, status: str) -> dict[str, Any]:
            if status.startswith("fitted"):  # "fitted" or "fitted, shared by gpu, rdu" (sim/fit.py SHARED)
                shared = status.partition("shared by ")[2]
                return {"value": v, "fitted": True} | ({"shared_by": shared} if shared else {})
            return {
                "value": v,
                "assumed": status[len("assumed: ") :]
                if status.startswith("assumed: ")
                else "prior, not constrained by the data",
            }

        classes = {}
        for name, cp in self.classes.items():
            d = {}
            for p in CLASS_PARAMS:
                v = getattr(cp, p)
                if v is not None:
                    d[p] = val(float(v), cp.status.get(p, "assumed"))
            classes[name] = d
        return {
            "fitted_on": self.fitted_on,
            "classes": classes,
            "speculative": {
                "accept_rate": {
                    m: val(float(a), self.status.get(f"accept_rate.{m}", "assumed"))
                    for m, a in self.accept_rate.items()
                },
                "num_tokens": {
                    m: {"value": int(k), "assumed": "default draft length per method"}
                    for m, k in self.num_tokens.items()
                },
                "draft_models": dict(self.draft_models),
            },
            "ttft_overhead_s": val(float(self.ttft_overhead_s), self.status.get("ttft_overhead_s", "assumed")),
            "defaults": {
                "prompt_len": {
                    "value": self.default_prompt_len,
                    "assumed": "prompt length when a source does not state it",
                },
                "output_len": {
                    "value": self.default_output_len,
                    "assumed": "output length when a source does not state it",
                },
            },
        } | ({"bootstrap": {"method": self.bootstrap_info, "names": sorted(self.bootstrap[0]),
                            "sets": [[float(f"{b[k]:.6g}") for k in sorted(self.bootstrap[0])]
                                     for b in self.bootstrap]}} if self.bootstrap else {})

    @classmethod
    def from_yaml_dict(cls, d: dict[str, Any], where: str = "fitted.yaml") -> SimParams:
        def num(x: Any, name: str) -> tuple[float, str]:
            if isinstance(x, dict):
                if "value" not in x:
                    raise ConfigError(f"{where}: {name} has no value")
                st = (
                    "fitted" + (f", shared by {x['shared_by']}" if x.get("shared_by") else "")
                    if x.get("fitted")
                    else (
                        "assumed: " + str(x["assumed"])
                        if isinstance(x.get("assumed"), str) and not str(x["assumed"]).startswith("prior")
                        else "assumed"
                    )
                )
                return float(x["value"]), st
            return float(x), "assumed"

        sp = cls()
        try:
            sp.fitted_on = str(d.get("fitted_on", ""))
            for cname, cd in (d.get("classes") or {}).items():
                cp = ClassParams(hop_latency_s=None)
                for p, raw in (cd or {}).items():
                    if p not in CLASS_PARAMS:
                        raise ConfigError(
                            f"{where}: class {cname!r} has unknown parameter {p!r}; known: {', '.join(CLASS_PARAMS)}"
                        )
                    v, st = num(raw, f"{cname}.{p}")
                    lo, hi = CLASS_PARAMS[p][2], CLASS_PARAMS[p][3]
                    if not lo * (1 - 1e-9) <= v <= hi * (1 + 1e-9):  # (a fit may land on a bound)
                        raise ConfigError(f"{where}: {cname}.{p} = {v:g} is outside its physical range "
                                          f"[{lo:g}, {hi:g}]")
                    setattr(cp, p, v)
                    cp.status[p] = st
                sp.classes[cname] = cp
            spd = d.get("speculative") or {}
            for m, raw in (spd.get("accept_rate") or {}).items():
                v, st = num(raw, f"accept_rate.{m}")
                if not 0.0 <= v < 1.0:
                    raise ConfigError(f"{where}: accept_rate.{m} = {v:g} is not a probability in [0, 1)")
                sp.accept_rate[m] = v
                sp.status[f"accept_rate.{m}"] = st
            for m, raw in (spd.get("num_tokens") or {}).items():
                k = num(raw, f"num_tokens.{m}")[0]
                if not math.isfinite(k) or k != int(k) or not 1 <= k <= MAX_DRAFT_TOKENS:
                    raise ConfigError(f"{where}: num_tokens.{m} = {k:g} is not a whole number of drafted tokens in "
                                      f"[1, {MAX_DRAFT_TOKENS}]")
                sp.num_tokens[m] = int(k)
            sp.draft_models.update(spd.get("draft_models") or {})
            if "ttft_overhead_s" in d:
                sp.ttft_overhead_s, sp.status["ttft_overhead_s"] = num(d["ttft_overhead_s"], "ttft_overhead_s")
                if not 0.0 <= sp.ttft_overhead_s <= TTFT_OVERHEAD_BOUNDS[1]:
                    raise ConfigError(f"{where}: ttft_overhead_s = {sp.ttft_overhead_s:g} is outside [0, "
                                      f"{TTFT_OVERHEAD_BOUNDS[1]:g}] s")
            dd = d.get("defaults") or {}
            if "prompt_len" in dd:
                sp.default_prompt_len = int(num(dd["prompt_len"], "prompt_len")[0])
            if "output_len" in dd:
                sp.default_output_len = int(num(dd["output_len"], "output_len")[0])
            bs = d.get("bootstrap") or {}
            if bs:
                names = [str(n) for n in bs.get("names") or []]
                for row in bs.get("sets") or []:
                    if len(row) != len(names):
                        raise ConfigError(f"{where}: a bootstrap set has {len(row)} values for {len(names)} names")
                    for n, v in zip(names, row):  # (the same physical ranges as the values above)
                        pname = n.split(".", 1)[-1]
                        if n.startswith("accept_rate."):
                            ok, rng = 0.0 <= float(v) < 1.0, "[0, 1)"
                        elif n == "ttft_overhead_s":
                            ok, rng = 0.0 <= float(v) <= TTFT_OVERHEAD_BOUNDS[1], f"[0, {TTFT_OVERHEAD_BOUNDS[1]:g}]"
                        elif "." in n and pname in CLASS_PARAMS:
                            lo, hi = CLASS_PARAMS[pname][2], CLASS_PARAMS[pname][3]
                            ok, rng = lo * (1 - 1e-9) <= float(v) <= hi * (1 + 1e-9), f"[{lo:g}, {hi:g}]"
                        else:
                            raise ConfigError(f"{where}: bootstrap names unknown parameter {n!r}")
                        if not ok:
                            raise ConfigError(f"{where}: bootstrap set value {n} = {float(v):g} is outside its "
                                              f"physical range {rng}")
                    sp.bootstrap.append({n: float(v) for n, v in zip(names, row)})
                sp.bootstrap_info = str(bs.get("method", ""))
        except (TypeError, ValueError, AttributeError) as e:
            raise ConfigError(f"{where}: malformed simulator parameters: {e}") from None
        return sp

    def save(self, path: str | Path = FITTED_PATH, header: str = "") -> None:
        d = self.to_yaml_dict()
        bs = d.pop("bootstrap", None)
        text = yaml.safe_dump(d, sort_keys=False)
        if bs:  # one line per set
            text += yaml.safe_dump({"bootstrap": bs}, sort_keys=False, default_flow_style=None, width=200)
        from waferline.files import write_text_atomic

        try:  # (whole or not at all)
            write_text_atomic(path, (header + "\n" if header else "") + text, make_parents=True)
        except OSError as e:  # (a full disk after the fit's minute: one line, the file that was there kept)
            raise ConfigError(f"cannot write the simulator parameters to {path}: {e.strerror or e}") from None


_PARAMS_CACHE: dict[str, SimParams] = {}


def load_params(path: str | Path | None = None) -> SimParams:
    """The simulator parameters (sim/fitted.yaml unless ``path`` is given)."""
    p = Path(path) if path else FITTED_PATH
    key = str(p.resolve()) + (str(p.stat().st_mtime) if p.is_file() else "")
    if key in _PARAMS_CACHE:
        return _PARAMS_CACHE[key]
    if not p.is_file():
        if path:
            raise ConfigError(f"no simulator parameter file at {p}")
        sp = SimParams(classes={"gpu": ClassParams()})
    else:
        try:
            d = yaml.safe_load(p.read_text())
        except yaml.YAMLError as e:
            raise ConfigError(f"{p}: not valid YAML ({str(e).splitlines()[0]})") from None
        except (OSError, UnicodeDecodeError) as e:  # (a binary file, one this user may not read)
            raise ConfigError(f"{p}: cannot read simulator parameters ({getattr(e, 'strerror', None) or e})") from None
        if not isinstance(d, dict) or not (d.keys() & {"classes", "speculative", "ttft_overhead_s"}):
            raise ConfigError(f"{p}: not simulator parameters (a mapping with classes, speculative and/or "
                              "ttft_overhead_s, as sim/fitted.yaml has)")
        sp = SimParams.from_yaml_dict(d, str(p))
    _PARAMS_CACHE[key] = sp
    return sp


# ----------------------------------------------------------------------------- per-layer tables


@dataclass(frozen=True)
class LayerCost:
    """Everything the cost model needs about one layer at a given precision and context (from spec.model)."""

    index: int
    weight_bytes: float  # resident, all experts
    mixer_bytes: float
    ffn_bytes: float
    dense_ffn_bytes: float  # FFN bytes excluding routed experts
    expert_bytes: float  # bytes of one routed expert
    num_experts: int
    top_k: int
    cache_bytes: float  # per sequence at the context
    mixer_flops: float  # per token at the context
    ffn_flops: float  # per token
    is_moe: bool
    kv_shards: int = 0  # most devices the cache splits over (GQA: KV heads), 0 = no limit
    kind_id: int = 0  # layers with equal kind_id (in one table) have identical costs
    cache_read_bytes: float | None = None  # per sequence per decode token at the context; None = all of cache_bytes
    # per sequence per verified token past the first: the recurrent state a speculative verify writes for its rollback
    # (``LayerSpec.rollback_bytes_per_seq``: the state after each token; the last is the write-back ``cache_read``
    # counts); 0 for attention
    trail_bytes: float = 0.0
    # elements / phases of the activation vectors a decode token streams through a wafer's mesh (sim/wafer.py)
    fabric_mixer_elems: float = 0.0
    fabric_mixer_phases: int = 0
    fabric_ffn_elems: float = 0.0
    fabric_ffn_phases: int = 0

    @property
    def cache_read(self) -> float:
        """Cache bytes a decode token of one sequence reads (sparse / compressed attention: less than held)."""
        return self.cache_bytes if self.cache_read_bytes is None else self.cache_read_bytes


_TABLE_CACHE: dict[tuple, tuple[Any, list[LayerCost]]] = {}  # (the spec held: its id is not reused)


def layer_table(spec: ModelSpec, weight_bits: int, kv_bits: int, context: int, group: int = 128) -> list[LayerCost]:
    """Per-layer bytes / FLOPs of ``spec`` (cached: sweeps reuse it)."""
    key = (id(spec), spec.name, weight_bits, kv_bits, context, group)
    hit = _TABLE_CACHE.get(key)
    if hit is not None and hit[0] is spec:
        return hit[1]
    memo: dict[tuple, LayerCost] = {}
    out = []
    for layer in spec.layers:
        sig = (repr(layer.mixer), repr(layer.ffn))
        proto = memo.get(sig)
        if proto is not None:
            out.append(replace(proto, index=layer.index))
            continue
        ffn = layer.ffn
        moe = isinstance(ffn, MoESpec)
        eb = ffn.expert_bytes(weight_bits, group) if moe else 0.0
        fb = layer.ffn_weight_bytes(weight_bits, group)
        total_f = layer.flops_per_token(context)
        mixer_f = layer.mixer_flops_per_token(context)
        fw = fabric_work(layer)
        lc = LayerCost(
            index=layer.index,
            weight_bytes=layer.weight_bytes(weight_bits, group),
            mixer_bytes=layer.mixer_weight_bytes(weight_bits, group),
            ffn_bytes=fb,
            dense_ffn_bytes=fb - (ffn.num_experts * eb if moe else 0.0),
            expert_bytes=eb,
            num_experts=ffn.num_experts if moe else 0,
            top_k=ffn.top_k if moe else 0,
            cache_bytes=layer.cache_bytes_per_seq(context, kv_bits, STATE_BITS),
            cache_read_bytes=layer.cache_read_bytes_per_seq(context, kv_bits, STATE_BITS),
            trail_bytes=layer.rollback_bytes_per_seq(2, STATE_BITS) - layer.rollback_bytes_per_seq(1, STATE_BITS),
            mixer_flops=mixer_f,
            ffn_flops=max(0.0, total_f - mixer_f),
            is_moe=moe,
            kv_shards=layer.cache_shard_limit(),
            kind_id=len(memo),
            fabric_mixer_elems=fw.mixer_elems,
            fabric_mixer_phases=fw.mixer_phases,
            fabric_ffn_elems=fw.ffn_elems,
            fabric_ffn_phases=fw.ffn_phases,
        )
        memo[sig] = lc
        out.append(lc)
    if len(_TABLE_CACHE) > 256:
        _TABLE_CACHE.clear()
    _TABLE_CACHE[key] = (spec, out)
    return out


# ----------------------------------------------------------------------------- step cost


@dataclass
class StepCost:
    """Seconds one stage spends on one step, by term."""

    compute: float = 0.0
    memory: float = 0.0
    roofline: float = 0.0  # sum over ops of max(compute, memory)
    fixed: float = 0.0
    comm: float = 0.0  # collective communication inside the stage (tensor / expert parallel)
    fabric: float = 0.0  # activation vectors streamed through a wafer's mesh (sim/wafer.py)
    fabric_distance: float = 0.0  # the part of ``fabric`` spent crossing the region (hops), not streaming
    cores_used: float = 0.0  # on a wafer: the share of the stage's cores its layers' regions take
    # (compute, memory) of each op added (a layer, the LM head): each costs the larger of the two, so what faster
    # FLOPs or reads save follows them op by op, not the sums (sim/explain.py)
    ops: list[tuple[float, float]] = field(default_factory=list, repr=False)

    @property
    def total(self) -> float:
        return self.roofline + self.fixed + self.comm + self.fabric

    def add(self, o: StepCost) -> None:
        self.compute += o.compute
        self.memory += o.memory
        self.roofline += o.roofline
        self.fixed += o.fixed
        self.comm += o.comm
        self.fabric += o.fabric
        self.fabric_distance += o.fabric_distance
        self.cores_used += o.cores_used
        self.ops.extend(o.ops or [(o.compute, o.memory)])


def compute_bits(weight_bits: int, hw: HardwareSpec) -> int:
    """Matmul precision: 8-bit weights run on fp8/int8 units where the device has them; 4-bit weights run on fp4
    units where the device has them (Blackwell NVFP4), else compute in 16-bit (W4A16)."""
    if weight_bits == 8 and ("fp8" in hw.flops or "int8" in hw.flops):
        return 8
    if weight_bits == 4 and "fp4" in hw.flops:
        return 4
    return 16


def _touched_experts(num_experts: int, top_k: int, tokens: float) -> float:
    if num_experts <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def stage_step(layers: list[LayerCost], role: str, n_dev: int, hw: HardwareSpec, prm: ClassParams, hidden: int,
               batch: int, tokens: float, weight_bits: int, lm_head_bytes: float = 0.0, lm_head_flops: float = 0.0,
               spatial_resident: float | None = None, resident_batch: int | None = None,
               verify: bool = False, regions: list[LayerCost] | None = None,
               layout_batch: int | None = None) -> StepCost:
    """Time for one stage to process ``batch`` sequences x ``tokens`` new tokens each.

    On a spatial (wafer) device each layer runs on its own region of cores, so a layer's bytes are read at
    the region's share of the bandwidth: every layer costs resident-bytes-of-the-stage / bandwidth. A layer's region
    holds its weights and the cache of every resident sequence (``resident_batch``, default ``batch``), as
    ``spatial_resident`` counts them. ``regions``: ``layers`` at the context the plan lays the regions out for (its
    ``context_len``): a region keeps its size while the cache it holds is shorter (a shorter prompt on the same plan
    reads less, on the same cores), so its share of the cores, and what it computes, do not move with the workload's
    context (``region_bytes``).

    ``verify``: the step is a speculative verify of ``tokens`` per sequence, which on a recurrent-state layer writes the
    state after each of them for the rollback (``LayerCost.trail_bytes``), not once: (tokens - 1) states more per
    sequence on the memory term (on a wafer, at its region's share of the bandwidth, as its resident bytes are).

    ``layout_batch``: the sequences of the decode step a wafer's regions are laid out for (``region_share``): the
    plan's decode micro-batch, one token each, whichever step runs (default ``resident_batch``, else ``batch``).
    """
    sp = prm.speedup
    bw = hw.memory_bandwidth * prm.bw_eff * sp.get("weights and cache read", 1.0)
    fl = hw.peak_flops(compute_bits(weight_bits, hw)) * prm.flops_eff * sp.get("compute", 1.0)
    spatial = hw.kind == "wafer"
    fabric = Fabric.of(hw) if spatial else None
    n_tok = batch * tokens
    out = StepCost()
    link = hw.intra_stage_link() if n_dev > 1 else None
    if spatial and n_dev > 1:
        link = hw.scale_out
    if n_dev > 1 and link is None:  # (else the stage's all-reduces or exchanges would cost nothing)
        raise ConfigError(f"hardware {hw.name!r} has no link between the {n_dev} devices of a stage: add "
                          f"{'scale_out' if spatial else 'scale_up'} to its YAML")
    act_bytes = n_tok * hidden * 2.0
    resident = spatial_resident
    if spatial and resident is None:
        resident = sum(region_bytes(lc, role, resident_batch or batch, regions[i] if regions else None)
                       for i, lc in enumerate(layers)) + lm_head_bytes
    # a wafer stage's regions fill the fewest of its wafers whose SRAM holds them (``fill``): more wafers than that
    # leave the rest idle rather than spread a layer over wafers it does not need (its vectors would cross between them)
    fill = n_dev
    if spatial and resident and hw.usable_bytes() > 0:
        fill = max(1, min(n_dev, math.ceil(resident / hw.usable_bytes() - 1e-9)))
    crossing = filled = 0.0  # (one transfer between a stage's wafers; the wafers its one-wafer regions fill)
    if spatial and link is not None:
        crossing = (prm.hop_latency_s if prm.hop_latency_s is not None else link.latency) + act_bytes / link.bandwidth
    for i, lc in enumerate(layers):
        if role == "attention":
            wbytes, flops, fixed_frac, moe = lc.mixer_bytes, lc.mixer_flops, 0.5, False
            cache, cache_rd = lc.cache_bytes * batch, lc.cache_read * batch
        elif role == "ffn":
            wbytes, flops, fixed_frac, moe = lc.ffn_bytes, lc.ffn_flops, 0.5, lc.is_moe
            cache = cache_rd = 0.0
        else:
            wbytes, flops, fixed_frac, moe = lc.weight_bytes, lc.mixer_flops + lc.ffn_flops, 1.0, lc.is_moe
            cache, cache_rd = lc.cache_bytes * batch, lc.cache_read * batch
        trail = lc.trail_bytes * (tokens - 1) * batch if verify and role != "ffn" else 0.0
        if moe and role != "attention":
            touched = _touched_experts(lc.num_experts, lc.top_k, n_tok)
            read = wbytes - lc.num_experts * lc.expert_bytes + touched * lc.expert_bytes
        else:
            read = wbytes
        flops_all = flops * n_tok
        held = cache * (resident_batch / batch) if resident_batch and batch else cache  # (its region's cache)
        room = wbytes + held  # (its region's bytes: what it holds, or what the plan lays it out for if more)
        if spatial:
            reg = regions[i] if regions else lc
            if regions:
                room = max(room, region_bytes(lc, role, resident_batch or batch, reg))
            share = max(room / resident * fill / n_dev, 1e-12) if resident else 1.0
            if fabric is not None:
                share = region_share(reg, role, room, share, n_dev, hw, prm, fabric,
                                     layout_batch or resident_batch or batch, compute_bits(weight_bits, hw))
            # (its region reads what it holds now, and writes the trail, at the region's share of the bandwidth)
            t_mem = (wbytes + held + trail) / (share * n_dev * bw) if (read + cache) > 0 else 0.0
            t_cmp = flops_all / n_dev / (fl * share)
        else:
            kv_dev = min(n_dev, lc.kv_shards) if lc.kv_shards else n_dev
            t_mem = (read / n_dev + (cache_rd + trail) / kv_dev) / bw
            t_cmp = flops_all / n_dev / fl
        fixed = fixed_frac * prm.layer_latency_s
        if moe:
            fixed += prm.moe_latency_s  # router top-k, dispatch to the chosen experts and combine
        fixed /= sp.get("fixed per layer", 1.0)
        fab = dist = 0.0
        if fabric is not None:  # weight-stationary on a wafer: the activations travel (sim/wafer.py)
            elems, phases = _fabric_work(lc, role)
            stream, dist = fabric.time(elems, phases, n_tok, share * n_dev, prm.fabric_links)
            stream, dist = stream / sp.get("mesh streaming", 1.0), dist / sp.get("mesh distance", 1.0)
            fab = stream + dist
        comm = 0.0
        if link is not None:
            if spatial:
                if share * n_dev > 1 + 1e-9:  # a layer split over wafers: exchange halves twice
                    comm = 2 * crossing
                else:  # (a region within one wafer exchanges nothing; the stage's wafer crossings: below)
                    filled += share * n_dev
            else:
                comm = (2 * fixed_frac) * link.allreduce_time(act_bytes, n_dev)
            comm /= sp.get("collectives", 1.0)
        out.add(StepCost(compute=t_cmp, memory=t_mem, roofline=max(t_cmp, t_mem), fixed=fixed, comm=comm,
                         fabric=fab, fabric_distance=dist, cores_used=share if fabric is not None else 0.0))
    if filled > 0:  # the regions side by side, in layer order: the activations cross each wafer boundary they fill
        filled += lm_head_bytes / resident * fill if lm_head_bytes and resident else 0.0
        out.comm += (min(n_dev, math.ceil(filled - 1e-9)) - 1) * crossing / sp.get("collectives", 1.0)
    if lm_head_bytes:
        t_mem = (resident / fill / bw) if spatial else lm_head_bytes / n_dev / bw
        t_cmp = lm_head_flops * n_tok / fill / fl
        head_cores = lm_head_bytes / resident * fill / n_dev if fabric is not None and resident else 0.0
        out.add(StepCost(compute=t_cmp, memory=t_mem, roofline=max(t_cmp, t_mem),
                         fixed=0.5 * prm.layer_latency_s / sp.get("fixed per layer", 1.0), cores_used=head_cores))
    return out


def _fabric_work(lc: LayerCost, role: str) -> tuple[float, int]:
    """(elements, phases) a token of ``role``'s part of ``lc`` streams through a wafer's mesh."""
    elems = phases = 0
    if role != "ffn":
        elems, phases = lc.fabric_mixer_elems, lc.fabric_mixer_phases
    if role != "attention":
        elems, phases = elems + lc.fabric_ffn_elems, phases + lc.fabric_ffn_phases
    return elems, int(phases)


_SHARES: dict[tuple, float] = {}


def region_share(region: LayerCost, role: str, room: float, proportional: float, n_dev: int, hw: HardwareSpec,
                 prm: ClassParams, fabric: Fabric, batch: int, bits: int) -> float:
    """The share of a stage's cores a layer's region takes on a wafer: laid out for the plan's decode step (one token
    for each of ``batch`` sequences, the micro-batch a stage steps at once, at the plan's context), the fastest between
    the fewest cores whose SRAM holds the region's ``room`` bytes and the layer's share of the stage in proportion to
    its bytes (``proportional``: the stage's layers side by side fill the wafers that hold them). A smaller region
    reads its bytes at its cores' share of the bandwidth (and computes at their share of the FLOP/s) but its vectors
    cross fewer hops (``Fabric.time``): one large layer alone on a wafer does not have to spread over all of it. The
    region keeps this size whatever step runs on it (a prefill, a verify), and whatever term ``--explain`` speeds up
    (its levers are what-ifs on the same layout)."""
    lo = room / (n_dev * hw.usable_bytes()) if hw.usable_bytes() > 0 else proportional
    if lo >= proportional or room <= 0:  # (the stage's bytes fill its SRAM, or overflow it: the plan does not fit)
        return proportional
    elems, phases = _fabric_work(region, role)
    if phases <= 0:
        return proportional
    flops = (region.mixer_flops if role != "ffn" else 0.0) + (region.ffn_flops if role != "attention" else 0.0)
    bw, fl = hw.memory_bandwidth * prm.bw_eff, hw.peak_flops(bits) * prm.flops_eff
    key = (elems, phases, flops, room, proportional, n_dev, fabric, lo, prm.fabric_links, batch, bw, fl)
    hit = _SHARES.get(key)
    if hit is not None:
        return hit
    whole = max(room / (n_dev * bw), flops * batch / (n_dev * fl))  # its roofline on all of the stage's cores

    def step(s: float) -> float:
        stream, dist = fabric.time(elems, phases, batch, s * n_dev, prm.fabric_links)
        return whole / s + stream + dist

    # (roofline / s + distance x sqrt(s): least at s = (2 roofline / distance at s = 1)^(2/3) while the streaming
    # front is narrower than the region's side; the bounds cover the rest)
    d1 = fabric.time(elems, phases, batch, n_dev, prm.fabric_links)[1]
    best = (2 * whole * n_dev / d1) ** (2 / 3) / n_dev if d1 > 0 else proportional
    share = min((lo, proportional, min(max(best, lo), proportional)), key=step)
    if len(_SHARES) > 200_000:  # (a long sweep: keep the memo bounded)
        _SHARES.clear()
    _SHARES[key] = share
    return share


def region_bytes(lc: LayerCost, role: str, batch: int, region: LayerCost | None = None) -> float:
    """The bytes of a layer's region on a wafer (``role``'s weights and the cache of ``batch`` sequences): what
    ``lc`` holds, or what ``region`` (the layer at the plan's context) lays out, whichever is more."""
    if role == "ffn":
        return lc.ffn_bytes
    w = lc.mixer_bytes if role == "attention" else lc.weight_bytes
    return w + max(lc.cache_bytes, region.cache_bytes if region is not None else 0.0) * batch


def hop_time(hw: HardwareSpec, prm: ClassParams, a: int, b: int, nbytes: float) -> float:
    """One activation transfer from device ``a`` to device ``b`` (fitted hop latency when the class has one)."""
    link = hw.link_between(a, b)
    lat = prm.hop_latency_s if (prm.hop_latency_s is not None and link is not hw.scale_up) else link.latency
    return (lat + nbytes / link.bandwidth) / prm.speedup.get("device hops", 1.0)


def expected_tokens_per_step(accept: float, k: int) -> float:
    """Expected tokens emitted per verify step with k drafted tokens and per-token acceptance ``accept``."""
    if k <= 0:
        return 1.0
    if accept >= 1.0:
        return float(k + 1)
    return (1.0 - accept ** (k + 1)) / (1.0 - accept)
