"""Plan and Stage: a serialisable deployment that both the engine and the simulator execute."""

from __future__ import annotations

import json
import numbers
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from waferline.errors import ConfigError, counted

ROLES = ("full", "attention", "ffn")
SPEC_METHODS = ("none", "draft", "mtp", "ngram", "eagle", "medusa")
MAX_DRAFT_TOKENS = 32  # (speculative methods verify a few to ~10 tokens a step; beyond 32 a step is all verify)
MAX_DEVICES = 100_000  # most devices --devices gives a plan, and one stage takes (a stage lists its device ids)
PLAN_VERSION = 1


def _count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _check_flags(where: str, obj: Any, names: tuple[str, ...]) -> None:
    """ConfigError unless each of ``names`` on ``obj`` is true or false (a plan file's "no" would read as true)."""
    for name in names:
        if not isinstance(getattr(obj, name), bool):
            raise ConfigError(f"{where} {name} must be true or false, got {getattr(obj, name)!r}")


@dataclass
class MemoryBreakdown:
    """Bytes per device of one stage, by term."""

    weights: float = 0.0
    cache: float = 0.0
    activations: float = 0.0
    reserve: float = 0.0
    capacity: float = 0.0
    rollback: float = 0.0  # speculation: the states a verify keeps for its rollback on recurrent-state layers

    @property
    def total(self) -> float:
        return self.weights + self.cache + self.rollback + self.activations + self.reserve

    @property
    def free(self) -> float:
        return self.capacity - self.total

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity * (1 + 1e-9)


@dataclass
class Stage:
    """One pipeline stage: a group of devices holding some layers (or their attention / FFN part)."""

    index: int
    role: str  # full | attention | ffn
    layers: list[int]
    device: str  # hardware id (e.g. "wse-3", "h200-sxm")
    device_ids: list[int]  # global device indices this stage spans (tensor / expert parallel inside the stage)
    weight_bits: int = 16
    kv_bits: int = 16
    has_embedding: bool = False
    has_lm_head: bool = False
    memory: MemoryBreakdown = field(default_factory=MemoryBreakdown)

    @property
    def num_devices(self) -> int:
        return len(self.device_ids)

    def __post_init__(self) -> None:
        if not _count(self.index):
            raise ConfigError(f"stage index must be an integer >= 0, got {self.index!r}")
        if self.role not in ROLES:
            raise ConfigError(f"stage {self.index}: role {self.role!r} unknown; use one of {', '.join(ROLES)}")
        if not self.device_ids:
            raise ConfigError(f"stage {self.index}: needs at least one device")
        for name in ("layers", "device_ids"):
            v = getattr(self, name)
            if not isinstance(v, list) or not v or not all(_count(x) for x in v):
                raise ConfigError(f"stage {self.index}: {name} must be a non-empty list of integers >= 0, got {v!r}")
        for name in ("weight_bits", "kv_bits"):
            if not _count(getattr(self, name)) or getattr(self, name) not in (4, 8, 16, 32):
                raise ConfigError(f"stage {self.index}: {name} must be 4, 8, 16 or 32, got {getattr(self, name)!r}")
        _check_flags(f"stage {self.index}:", self, ("has_embedding", "has_lm_head"))
        if isinstance(self.memory, dict):
            self.memory = MemoryBreakdown(**self.memory)
        for k, v in vars(self.memory).items():  # (its float fields: asdict's deep copy cost the sweeps a third)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v >= 0:
                raise ConfigError(f"stage {self.index}: memory {k} must be a number >= 0, got {v!r}")


@dataclass
class SpeculativeConfig:
    """Speculative decoding: method, draft tokens per step, acceptance rate (None = the simulator parameters' rate
    for the method)."""

    method: str = "none"
    num_tokens: int = 0
    accept_rate: float | None = None
    draft_model: str | None = None

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ConfigError(f"speculative method {self.method!r} unknown; use one of {', '.join(SPEC_METHODS)}")
        if self.accept_rate is not None and not (isinstance(self.accept_rate, numbers.Real)
                                                 and not isinstance(self.accept_rate, bool)
                                                 and 0.0 <= self.accept_rate < 1.0):
            raise ConfigError(f"accept rate must be in [0, 1), got {self.accept_rate!r}")
        if not (_count(self.num_tokens) and self.num_tokens <= MAX_DRAFT_TOKENS):
            raise ConfigError(f"num speculative tokens must be 0-{MAX_DRAFT_TOKENS}, got {self.num_tokens!r}")
        if self.draft_model is not None and not isinstance(self.draft_model, str):
            raise ConfigError(f"draft model must be a model id or path, got {self.draft_model!r}")

    @property
    def enabled(self) -> bool:
        return self.method != "none" and self.num_tokens > 0


@dataclass
class Plan:
    """A deployment: model, hardware, stages, precision, cache budget, micro-batches and speculation."""

    model: str
    hardware: str
    stages: list[Stage]
    weight_bits: int = 16
    kv_bits: int = 16
    embed_bits: int = 16
    group_size: int = 128
    context_len: int = 4096
    batch: int = 1
    micro_batches: int = 1
    afd: bool = False
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    fits: bool = True
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    version: int = PLAN_VERSION

    def __post_init__(self) -> None:
        if not isinstance(self.stages, list) or not self.stages:
            raise ConfigError("a plan needs at least one stage")
        for name in ("context_len", "batch", "micro_batches", "group_size"):
            if not _count(getattr(self, name)) or getattr(self, name) < 1:
                raise ConfigError(f"plan {name} must be an integer >= 1, got {getattr(self, name)!r}")
        for name in ("weight_bits", "kv_bits", "embed_bits"):  # (32: fp32, as the engine runs on a CPU)
            if not _count(getattr(self, name)) or getattr(self, name) not in (4, 8, 16, 32):
                raise ConfigError(f"plan {name} must be 4, 8, 16 or 32, got {getattr(self, name)!r}")
        _check_flags("plan", self, ("afd", "fits"))
        for name in ("problems", "notes"):  # (each printed as a line)
            v = getattr(self, name)
            if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
                raise ConfigError(f"plan {name} must be a list of strings, got {v!r}"[:200])

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def num_devices(self) -> int:
        return len({d for s in self.stages for d in s.device_ids})

    @property
    def attention_ranks(self) -> int:
        """The attention ranks of the AFD engine's layout (every attention stage a data-parallel replica of every
        layer, with the LM head; every FFN stage an expert shard of the same FFN layers), as
        ``place(..., afd=True, attention_ranks=M, ffn_ranks=N)`` makes it; 0 for any other plan."""
        att = [s for s in self.stages if s.role == "attention"]
        ffn = [s for s in self.stages if s.role == "ffn"]
        if not self.afd or not att or not ffn or len(att) + len(ffn) != len(self.stages):
            return 0
        same = len({tuple(s.layers) for s in att}) == 1 and len({tuple(s.layers) for s in ffn}) == 1
        return len(att) if same and all(s.has_lm_head for s in att) else 0

    def layer_stage(self, layer: int, role: str = "full") -> Stage:
        for s in self.stages:
            if layer in s.layers and (s.role == role or s.role == "full"):
                return s
        raise ConfigError(f"layer {layer} is in no {role} stage of this plan")

    # -- serialisation
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for s, sd in zip(self.stages, d["stages"]):
            if not s.memory.rollback:  # (attention, or no speculation: nothing kept beside the cache)
                del sd["memory"]["rollback"]
            sd["memory"]["total"] = s.memory.total
            sd["memory"]["fits"] = s.memory.fits
        return d

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        if not isinstance(d, dict):
            raise ConfigError(f"malformed plan: expected a JSON object, got {type(d).__name__}")
        try:
            d = dict(d)
            if not _count(d.get("version", PLAN_VERSION)) or d.get("version", PLAN_VERSION) != PLAN_VERSION:
                raise ConfigError(f"plan version {d.get('version')!r} is not supported (this waferline reads version "
                                  f"{PLAN_VERSION})")
            stages = []
            raw = d.pop("stages")
            if not isinstance(raw, list):
                raise ConfigError(f"malformed plan: stages must be a list, got {type(raw).__name__}")
            for sd in raw:
                if not isinstance(sd, dict):
                    raise ConfigError(f"malformed plan: a stage must be an object, got {sd!r}"[:200])
                sd = dict(sd)
                mem = {
                    k: v for k, v in (sd.pop("memory", None) or {}).items() if k in MemoryBreakdown.__dataclass_fields__
                }
                stages.append(Stage(memory=MemoryBreakdown(**mem), **sd))
            spec = SpeculativeConfig(**(d.pop("speculative", None) or {}))
            return cls(stages=stages, speculative=spec, **d)
        except (TypeError, ValueError, AttributeError) as e:
            raise ConfigError(f"malformed plan: {e}") from None
        except KeyError as e:
            raise ConfigError(f"malformed plan: missing {e.args[0]!r}") from None

    @classmethod
    def from_json(cls, text: str) -> Plan:
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"plan is not valid JSON: {e}") from None
        except RecursionError:
            raise ConfigError("plan is not valid JSON: nested deeper than Python decodes") from None
        except ValueError:  # an integer beyond the interpreter's digit limit (sys.get_int_max_str_digits)
            raise ConfigError("plan is not valid JSON: a number with too many digits") from None
        return cls.from_dict(d)

    def check(self, spec: Any, hw: Any) -> None:
        """ConfigError unless this plan places ``spec`` (a ModelSpec) on ``hw`` (a HardwareSpec): every layer's mixer
        in one full or attention stage and every FFN in one full or ffn stage (or in one per data-parallel attention
        rank / expert-sharded FFN rank: every layer as many times), on that hardware; and
        ``fits`` false (with the reason) where a stage's memory exceeds its capacity, whatever the file says."""
        n = len(spec.layers)
        full = [st.index for st in self.stages if st.role == "full"]
        if self.afd and full or not self.afd and len(full) < len(self.stages):  # (the simulator times the two apart)
            raise ConfigError(f"plan afd is true but stage(s) {full[:8]} are 'full' stages" if self.afd else
                              "plan afd is false but it has attention/FFN stages: an AFD plan says afd: true")
        for side, roles in (("mixer", ("full", "attention")), ("ffn", ("full", "ffn"))):
            seen: dict[int, int] = {}
            for st in self.stages:
                if st.role in roles:
                    for layer in st.layers:
                        if layer >= n:
                            raise ConfigError(f"plan stage {st.index}: layer {layer} does not exist "
                                              f"({spec.name} has {n})")
                        seen[layer] = seen.get(layer, 0) + 1
            needed = [i for i, lc in enumerate(spec.layers) if (lc.mixer if side == "mixer" else lc.ffn) is not None]
            missing = [i for i in needed if i not in seen]
            # (once each; with data-parallel attention ranks or expert-sharded FFN ranks, once per rank: evenly)
            usual = max(set(seen.values()), key=list(seen.values()).count) if seen else 1
            uneven = sorted(i for i, c in seen.items() if c != usual)
            if missing or uneven:
                raise ConfigError(f"plan does not place {spec.name}'s layers evenly ({side}): "
                                  + ", ".join(x for x in (f"missing {missing[:8]}" if missing else "",
                                                          f"{uneven[:8]} placed other than {usual}x" if uneven else "")
                                              if x))
        owner: dict[int, int] = {}
        for st in self.stages:  # (memory is checked per stage: two stages on one device would each seem to fit)
            for d in st.device_ids:
                if owner.setdefault(d, st.index) != st.index:
                    raise ConfigError(f"plan stages {owner[d]} and {st.index} both use device {d}; give each stage "
                                      "devices of its own")
        wrong = sorted({st.device for st in self.stages if st.device != hw.name})
        if wrong:
            raise ConfigError(f"plan stages are on {', '.join(map(str, wrong))}, not on {hw.name} ({self.hardware})")
        self._check_order(n)
        over = [st for st in self.stages if not st.memory.fits]
        if over and self.fits:
            self.fits = False
            self.problems = [*self.problems, *(f"stage {st.index}: {st.memory.total / 1e9:,.2f} GB needed, "
                                               f"{st.memory.capacity / 1e9:,.2f} GB per device" for st in over)]

    def check_model(self, spec: Any, where: str | Path) -> None:
        """ConfigError naming both unless this plan was placed for the model of the checkpoint at ``where`` (``spec``,
        its ModelSpec), as the engine runs it: where the plan's model is one this machine can read (a catalog id, or a
        config or checkpoint that is still there), that model has the checkpoint's architecture and layer count; else
        the plan's last layer is the checkpoint's (the engine says which layers a stage lacks or repeats)."""
        from waferline.errors import WaferlineError
        from waferline.spec.catalog import load_model

        n = len(spec.layers)
        top = max(x for st in self.stages for x in st.layers)
        try:
            placed = load_model(self.model)
        except (WaferlineError, OSError, ValueError):  # (a name this machine cannot resolve: its layers say enough)
            placed = None
        if placed is not None and (placed.model_type, len(placed.layers)) != (spec.model_type, n):
            raise ConfigError(f"the plan was placed for {self.model} ({placed.model_type}, "
                              f"{counted(len(placed.layers), 'layer')}); {where} is {spec.model_type} with "
                              f"{counted(n, 'layer')}: place a plan for this checkpoint (waferline plan {where} ...)")
        if placed is None and top != n - 1:
            raise ConfigError(f"the plan places layers up to {top} of {self.model}; {where} has {counted(n, 'layer')} "
                              f"(0-{n - 1}): place a plan for this checkpoint (waferline plan {where} ...)")

    def _check_order(self, n: int) -> None:
        """ConfigError unless the stages are numbered 0, 1, ... in order, hold their layers in order (a pipeline: the
        stages one after another hold 0..n-1, each a contiguous range, as the engine runs them; attention/FFN pools:
        each pool's stages one after another; data-parallel ranks: each rank every layer, in order) and the embedding
        and LM head sit where a token enters and leaves (the first and last stage; AFD: the attention stages')."""
        where = [st.index for st in self.stages]
        if where != list(range(len(self.stages))):
            raise ConfigError(f"plan stage indices are {where[:8]}{'...' if len(where) > 8 else ''}: number the stages "
                              "0, 1, 2, ... in the order a token passes them")

        def spans(stages: list[Stage]) -> str:
            return ", ".join(f"stage {st.index}: {st.layers[0]}-{st.layers[-1]}" if len(st.layers) > 1 else
                             f"stage {st.index}: {st.layers[0]}" for st in stages[:8])

        ranks = self.attention_ranks
        for role in ("full",) if not self.afd else ("attention", "ffn"):
            stages = [st for st in self.stages if st.role == role]
            runs = [st.layers for st in stages] if ranks else [[x for st in stages for x in st.layers]]
            if role == "full" and runs[0] != list(range(n)) or any(a >= b for r in runs for a, b in zip(r, r[1:])):
                raise ConfigError(f"plan {role} stages do not hold the layers in order ({spans(stages)}): "
                                  + ("each rank holds every layer, in order" if ranks else
                                     "each stage holds the range of layers after the one before it"))
            ends = [st for st in stages if role != "ffn"]
            want = [(True, True) if ranks else (i == 0, i == len(ends) - 1) for i in range(len(ends))]
            got = [(st.has_embedding, st.has_lm_head) for st in ends]
            wrong = [st.index for st in stages if role == "ffn" and (st.has_embedding or st.has_lm_head)]
            wrong += [st.index for st, w, g in zip(ends, want, got) if w != g]
            if wrong:
                raise ConfigError(f"plan stage(s) {wrong[:8]}: the embedding belongs to the first "
                                  f"{'full' if role == 'full' else 'attention'} stage and the LM head to the last"
                                  + (" (each data-parallel attention rank holds both)" if ranks else "")
                                  + ", and no other stage holds them")

    def save(self, path: str | Path) -> None:
        """Write the plan as JSON: whole or not at all (a temporary file renamed into place)."""
        from waferline.files import write_text_atomic

        p = Path(path)
        try:
            write_text_atomic(p, self.to_json(), make_parents=True)
        except OSError as e:
            raise ConfigError(f"cannot write the plan to {p}: {e.strerror or e}") from None

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"no plan file at {p}")
        try:
            text = p.read_text(encoding="utf-8")
        except OSError as e:
            raise ConfigError(f"cannot read the plan {p}: {e.strerror or e}") from None
        except UnicodeDecodeError:
            raise ConfigError(f"plan {p} is not a JSON text file (not UTF-8)") from None
        return cls.from_json(text)
