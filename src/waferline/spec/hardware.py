"""HardwareSpec and LinkSpec: devices and links as data, loaded from YAML with the source of every number."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from waferline.errors import ConfigError

DEVICE_KINDS = ("gpu", "wafer", "lpu", "rdu", "tpu", "asic", "cpu")
# How a multi-device stage is split: "tensor" = tensor/expert parallel inside a node first (GPUs, TPUs, RDUs);
# "pipeline" = one or a few layers per device first (wafers, SRAM-only chips).
PLACEMENT_STYLES = ("tensor", "pipeline")

REQUIRED_DEVICE_FIELDS = ("memory_bytes", "memory_bandwidth", "flops")
REQUIRED_LINK_FIELDS = ("bandwidth", "latency")
# Every key a hardware YAML may hold, by level: any other key is refused (a typo such as `devices_per_nodes` would
# otherwise fall back to a default without a word). host_engine and memory_bandwidth_all_cores are written by
# `waferline calibrate` (read by sim/host_params.py; informational).
TOP_LEVEL_FIELDS = ("name", "kind", "placement", "description", "device", "system", "links", "host_engine")
DEVICE_FIELDS = (*REQUIRED_DEVICE_FIELDS, "cores", "power_w", "reserve_fraction", "memory_bandwidth_all_cores")
FLOPS_PRECISIONS = ("bf16", "fp8", "fp4", "int8", "fp32")
SYSTEM_FIELDS = ("devices_per_node", "min_devices")
LINK_ROLES = ("scale_up", "scale_out", "on_chip")
# a wafer's on-chip mesh: each core linked to its 4 neighbours, one link each way (Argonne SC24 tutorial: a 2-D mesh);
# links.on_chip.bandwidth is the mesh's aggregate over these links (sim/wafer.py Fabric divides it back)
MESH_LINKS_PER_CORE = 8
# below this a mesh link would be slower than any on-chip link (WSE-3's: 3.7e9 B/s): the figure given is one link's
MIN_MESH_LINK_BYTES_PER_S = 1e8
# what one core may do at most (a wafer's or chip's figures are its cores' sums): a core reading its memory faster than
# a whole Groq LPU v1 reads its SRAM (80 TB/s, TechPowerUp; catalog groq-lpu-v1), or computing faster than a whole
# B200 (2.25 PFLOP/s dense BF16; catalog b200), is a core count or an aggregate entered wrong. WSE-3: 23 GB/s and
# 139 GFLOP/s a core. (Without this a 1-core wafer predicted 3x a 900,000-core one: its mesh term vanishes.)
MAX_CORE_MEMORY_BYTES_PER_S = 80e12
MAX_CORE_FLOPS = 2.25e15
LINK_FIELDS = ("name", "description", *REQUIRED_LINK_FIELDS)
# a number given as a mapping: its value and where it came from (measured: what `waferline calibrate` adds)
FIGURE_FIELDS = ("value", "source", "derived", "assumed", "fitted", "measured")


@dataclass(frozen=True)
class Sourced:
    """A number with where it came from: a citation, 'assumed: why', 'fitted', or 'derived: how'."""

    value: float
    source: str
    status: str = "sourced"  # sourced | assumed | fitted | derived | user

    def to_yaml(self) -> dict[str, Any]:
        key = {"sourced": "source", "derived": "derived", "assumed": "assumed", "fitted": "fitted", "user": "source"}[
            self.status
        ]
        return {"value": self.value, key: self.source if self.status != "fitted" else (self.source or True)}


@dataclass(frozen=True)
class LinkSpec:
    """A link: per-device bandwidth in bytes/s (one direction) and one-way latency in seconds."""

    name: str
    bandwidth: float
    latency: float
    description: str = ""
    sources: dict[str, Sourced] = field(default_factory=dict, compare=False, repr=False)

    def transfer_time(self, nbytes: float) -> float:
        """Seconds to move ``nbytes`` point to point over this link."""
        return self.latency + nbytes / self.bandwidth

    def allreduce_time(self, nbytes: float, n: int) -> float:
        """Ring all-reduce of ``nbytes`` among ``n`` devices: 2(n-1) latency steps bounded by log2 tree, plus
        bandwidth term."""
        if n <= 1:
            return 0.0
        steps = min(2 * (n - 1), 2 * math.ceil(math.log2(n)))
        return steps * self.latency + 2 * (n - 1) / n * nbytes / self.bandwidth


@dataclass(frozen=True)
class HardwareSpec:
    """One device type (and the system it comes in): memory, bandwidth, peak FLOP/s per precision, links."""

    name: str
    kind: str
    memory_bytes: float
    memory_bandwidth: float
    flops: dict[str, float]  # peak dense FLOP/s by precision: bf16, fp8, fp4, int8
    devices_per_node: int = 1
    min_devices: int = 1
    placement: str = "tensor"
    reserve_fraction: float = 0.1
    cores: int | None = None
    power_w: float | None = None
    scale_up: LinkSpec | None = None  # inside a node / NVLink domain
    scale_out: LinkSpec | None = None  # between nodes / systems / wafers
    on_chip: LinkSpec | None = None  # the on-die fabric (wafer mesh)
    description: str = ""
    path: str = ""
    sources: dict[str, Sourced] = field(default_factory=dict, compare=False, repr=False)

    # -- queries
    def peak_flops(self, bits: int = 16) -> float:
        """Peak dense FLOP/s for matmuls whose operands are ``bits`` wide (falls back to bf16)."""
        key = {16: "bf16", 8: "fp8", 4: "fp4"}.get(bits, "bf16")
        if key in self.flops:
            return self.flops[key]
        if bits == 8 and "int8" in self.flops:
            return self.flops["int8"]
        return self.flops["bf16"]

    def usable_bytes(self) -> float:
        return self.memory_bytes * (1.0 - self.reserve_fraction)

    def link_between(self, a: int, b: int) -> LinkSpec:
        """The link a hop between global device indices ``a`` and ``b`` uses."""
        same_node = a // max(1, self.devices_per_node) == b // max(1, self.devices_per_node)
        if same_node and self.scale_up is not None:
            return self.scale_up
        if self.scale_out is not None:
            return self.scale_out
        if self.scale_up is not None:
            return self.scale_up
        raise ConfigError(
            f"hardware {self.name!r} has no link to go from device {a} to device {b}: add scale_out to its YAML"
        )

    def intra_stage_link(self) -> LinkSpec | None:
        return self.scale_up or self.scale_out

    def source_table(self) -> list[tuple[str, float, str, str]]:
        return [(k, s.value, s.status, s.source) for k, s in sorted(self.sources.items())]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "memory_bytes": self.memory_bytes,
                "memory_bandwidth": self.memory_bandwidth, "flops": dict(self.flops),
                "devices_per_node": self.devices_per_node, "min_devices": self.min_devices, "placement": self.placement,
                "reserve_fraction": self.reserve_fraction, "cores": self.cores,
                "scale_up": self.scale_up.name if self.scale_up else None,
                "scale_out": self.scale_out.name if self.scale_out else None,
                "on_chip": self.on_chip.name if self.on_chip else None}


# ----------------------------------------------------------------------------- YAML loading

# where a key belongs when it is written at the wrong level (e.g. reserve_fraction at the top level)
_HOME = {**{k: "device" for k in DEVICE_FIELDS}, **{k: "system" for k in SYSTEM_FIELDS},
         **{k: "links" for k in LINK_ROLES}, **{k: "device.flops" for k in FLOPS_PRECISIONS}}


def _check_keys(d: dict[str, Any], known: tuple[str, ...], where: str, what: str) -> None:
    """Refuse a key of mapping ``d`` (the part ``what`` of the file ``where``) that is not in ``known``: a misspelt
    or misplaced key would otherwise be ignored and its default used."""
    import difflib

    for k in d:
        if k in known:
            continue
        close = difflib.get_close_matches(str(k), known, n=1)
        home = _HOME.get(str(k))
        hint = (f" (did you mean {close[0]!r}?)" if close
                else f" ({k!r} belongs under {home}:)" if home and not what.endswith(home) else "")
        raise ConfigError(f"{where}: unknown field {k!r} in {what}{hint}; known: {', '.join(known)}")


def _mapping(raw: Any, where: str, what: str, example: str) -> dict[str, Any]:
    """``raw`` as a mapping (absent or empty: {}), else a ConfigError naming ``what``."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: {what} must be a mapping like {example}, got {raw!r}")
    return raw


def _count(raw: Any, where: str, fieldname: str, sources: dict[str, Sourced], require_source: bool) -> int:
    """A whole number >= 1 (devices per node, minimum devices, cores): a fraction is refused, never truncated."""
    value = _num(raw, where, fieldname, sources, require_source)
    if value != math.floor(value):
        raise ConfigError(f"{where}: field {fieldname!r} must be a whole number >= 1, got {value:g}")
    return int(value)



# Plausibility bounds of a figure in the units the files use: a value beyond one is a unit slip (TB/s written where
# bytes/s is meant, microseconds where seconds are), refused instead of predicting 1e-10 tok/s or a day-long TTFT.
# field suffix -> (least, most, unit)
UNIT_BOUNDS: dict[str, tuple[float, float, str]] = {
    "memory_bytes": (1e6, math.inf, "bytes"),
    "memory_bandwidth": (1e9, math.inf, "bytes/s"),
    "flops": (1e9, math.inf, "FLOP/s"),
    "bandwidth": (1e6, math.inf, "bytes/s per direction"),
    "latency": (0.0, 1.0, "seconds"),
}


def _num(
    raw: Any, where: str, fieldname: str, sources: dict[str, Sourced], require_source: bool, *, positive: bool = True
) -> float:
    """Parse ``raw`` (a number or {value, source|assumed|fitted|derived}) into a float; record its source. A figure
    named in UNIT_BOUNDS must lie within its bounds."""
    if isinstance(raw, dict):
        _check_keys(raw, FIGURE_FIELDS, where, fieldname)
        if "value" not in raw:
            raise ConfigError(
                f"{where}: field {fieldname!r} is a mapping without 'value'; write {{value: 1.0e12, source: \"...\"}}"
            )
        value = raw["value"]
        kinds = [(key, kind) for key, kind in (("source", "sourced"), ("derived", "derived"), ("assumed", "assumed"),
                                               ("fitted", "fitted")) if key in raw]
        if kinds:
            key, kind = kinds[0]
            note = "fitted" if key == "fitted" and raw[key] is True else str(raw[key])
            if require_source and (raw[key] is None or raw[key] is False or not note.strip()):
                raise ConfigError(
                    f"{where}: field {fieldname!r} has an empty {key!r}: every catalog number needs its source, or "
                    "why it is assumed"
                )
        elif require_source:
            raise ConfigError(
                f"{where}: field {fieldname!r} has no 'source', 'derived', 'assumed' or 'fitted': every catalog "
                "number needs one"
            )
        else:
            note, kind = f"user: {where}", "user"
    elif isinstance(raw, (int, float, str)) and not isinstance(raw, bool):
        if require_source:
            raise ConfigError(
                f'{where}: field {fieldname!r} = {raw} has no source; write {{value: {raw}, source: "..."}} or '
                f'{{value: {raw}, assumed: "why"}}'
            )
        value, note, kind = raw, f"user: {where}", "user"
    else:
        raise ConfigError(f"{where}: field {fieldname!r} must be a number or {{value, source}}, got {raw!r}")
    given = value
    try:
        value = float(value) if not isinstance(value, bool) else None
    except (TypeError, ValueError):
        value = None
    if value is None:
        raise ConfigError(f"{where}: field {fieldname!r} must be a number, got {given!r}")
    if not math.isfinite(value) or (positive and value <= 0) or (not positive and value < 0):
        raise ConfigError(
            f"{where}: field {fieldname!r} must be {'> 0' if positive else '>= 0'} and finite, got {value}"
        )
    bound = UNIT_BOUNDS.get(fieldname.rsplit(".", 1)[-1]) or UNIT_BOUNDS.get(fieldname.split(".", 1)[0])
    if bound and not bound[0] <= value <= bound[1]:
        side = f"under {bound[0]:g}" if value < bound[0] else f"over {bound[1]:g}"
        raise ConfigError(f"{where}: field {fieldname!r} is in {bound[2]}; {value:g} is {side} (a unit slip?)")
    src = Sourced(value, note, kind)
    sources[fieldname] = src
    return value


def link_from_dict(d: dict[str, Any], where: str, require_source: bool = False, name: str | None = None) -> LinkSpec:
    """Build a LinkSpec from a YAML mapping, with clear errors for missing fields."""
    if not isinstance(d, dict):
        raise ConfigError(f"{where}: a link must be a mapping with bandwidth and latency, got {d!r}")
    _check_keys(d, LINK_FIELDS, where, f"link {name or d.get('name', '?')!r}")
    missing = [f for f in REQUIRED_LINK_FIELDS if f not in d]
    if missing:
        raise ConfigError(f"{where}: link {name or d.get('name', '?')!r} is missing field(s) {', '.join(missing)} "
                          "(bandwidth in bytes/s per direction, latency in seconds)")
    sources: dict[str, Sourced] = {}
    lname = str(d.get("name") or name or "link")
    bw = _num(d["bandwidth"], where, f"{lname}.bandwidth", sources, require_source)
    lat = _num(d["latency"], where, f"{lname}.latency", sources, require_source, positive=False)
    return LinkSpec(name=lname, bandwidth=bw, latency=lat, description=str(d.get("description", "")), sources=sources)


_LINKS_CACHE: dict[str, LinkSpec] | None = None


def catalog_dir() -> Path:
    return Path(__file__).parent / "catalog" / "hardware"


def catalog_links() -> dict[str, LinkSpec]:
    """The named links of the catalog (links.yaml)."""
    global _LINKS_CACHE
    if _LINKS_CACHE is None:
        path = catalog_dir() / "links.yaml"
        data = yaml.safe_load(path.read_text()) or {}
        links = {}
        for name, d in (data.get("links") or {}).items():
            links[name] = link_from_dict(dict(d, name=name), str(path), require_source=True, name=name)
        _LINKS_CACHE = links
    return _LINKS_CACHE


def _link(raw: Any, where: str, require_source: bool, role: str) -> LinkSpec | None:
    if raw is None:
        return None
    if isinstance(raw, str):
        links = catalog_links()
        if raw not in links:
            raise ConfigError(
                f"{where}: {role} link {raw!r} is not in the catalog; known links: {', '.join(sorted(links))}; "
                "or give a mapping {bandwidth: ..., latency: ...}"
            )
        return links[raw]
    return link_from_dict(raw, where, require_source, name=role)


def _check_per_core(where: str, cores: int, bandwidth: float, flops: float) -> None:
    """Refuse a core count that leaves one core more memory bandwidth or FLOP/s than any whole chip has (the
    aggregates are the cores' sums: each core reads its own memory and computes on it)."""
    for what, total, ceiling, whole in (
        ("memory_bandwidth", bandwidth, MAX_CORE_MEMORY_BYTES_PER_S, "a whole Groq LPU v1 reads its SRAM at 80e12 B/s"),
        ("flops.bf16", flops, MAX_CORE_FLOPS, "a whole B200 computes 2.25e15 FLOP/s in BF16"),
    ):
        if total / cores > ceiling:
            raise ConfigError(
                f"{where}: device.{what} {total:g} over {cores:,} cores is {total / cores:.3g} a core, more than "
                f"{whole}; the device's figure is its cores' sum (wse-3: 21e15 B/s and 125e15 FLOP/s over 900,000 "
                f"cores): give the device's core count (at least {math.ceil(total / ceiling):,}) or check the figure"
            )


def hardware_from_dict(data: dict[str, Any], where: str = "<dict>", require_source: bool = False) -> HardwareSpec:
    """Validate a hardware mapping (catalog or user YAML) and build a HardwareSpec. Unknown keys are refused at every
    level; counts (devices_per_node, min_devices, cores) must be whole numbers."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: a hardware file must be a YAML mapping, got {type(data).__name__}")
    if data.get("name") is None or str(data["name"]).strip() == "":
        raise ConfigError(f"{where}: missing field 'name' (the hardware id, e.g. name: my-asic)")
    _check_keys(data, TOP_LEVEL_FIELDS, where, "the top level")
    dev = data.get("device")
    if not isinstance(dev, dict):
        raise ConfigError(f"{where}: missing mapping 'device' with fields {', '.join(REQUIRED_DEVICE_FIELDS)} "
                          "(memory_bytes, memory_bandwidth in bytes/s, flops: {bf16: FLOP/s})")
    _check_keys(dev, DEVICE_FIELDS, where, "device")
    missing = [f for f in REQUIRED_DEVICE_FIELDS if f not in dev]
    if missing:
        raise ConfigError(
            f"{where}: device is missing field(s) {', '.join(missing)}; required: {', '.join(REQUIRED_DEVICE_FIELDS)} "
            "(memory_bytes in bytes, memory_bandwidth in bytes/s, flops: {bf16: peak dense FLOP/s})"
        )
    kind = str(data.get("kind", "asic"))
    if kind not in DEVICE_KINDS:
        raise ConfigError(f"{where}: kind {kind!r} unknown; use one of {', '.join(DEVICE_KINDS)}")
    sources: dict[str, Sourced] = {}
    mem = _num(dev["memory_bytes"], where, "memory_bytes", sources, require_source)
    bw = _num(dev["memory_bandwidth"], where, "memory_bandwidth", sources, require_source)
    fl = dev["flops"]
    if not isinstance(fl, dict) or "bf16" not in fl:
        raise ConfigError(
            f"{where}: device.flops must be a mapping with at least 'bf16' (peak dense FLOP/s), got {fl!r}"
        )
    _check_keys(fl, FLOPS_PRECISIONS, where, "device.flops")
    flops = {str(k): _num(v, where, f"flops.{k}", sources, require_source) for k, v in fl.items()}
    cores = _count(dev["cores"], where, "cores", sources, require_source) if "cores" in dev else None
    if cores is not None:
        _check_per_core(where, cores, bw, flops["bf16"])
    power = _num(dev["power_w"], where, "power_w", sources, require_source) if "power_w" in dev else None
    reserve = _num(
        dev.get("reserve_fraction", {"value": 0.1, "assumed": "default 10% for runtime, workspace, fragmentation"}),
        where,
        "reserve_fraction",
        sources,
        require_source,
        positive=False,
    )
    if reserve >= 0.9:
        raise ConfigError(f"{where}: reserve_fraction {reserve} leaves no memory; use a fraction such as 0.1")
    sysd = _mapping(data.get("system"), where, "system", "{devices_per_node: 8}")
    _check_keys(sysd, SYSTEM_FIELDS, where, "system")
    dpn = _count(sysd.get("devices_per_node", {"value": 1, "assumed": "single device"}), where, "devices_per_node",
                 sources, require_source)
    min_dev = _count(sysd.get("min_devices", {"value": 1, "assumed": "any count"}), where, "min_devices", sources,
                     require_source)
    placement = str(data.get("placement", "pipeline" if kind in ("wafer", "lpu") else "tensor"))
    if placement not in PLACEMENT_STYLES:
        raise ConfigError(f"{where}: placement {placement!r} unknown; use one of {', '.join(PLACEMENT_STYLES)}")
    links = _mapping(data.get("links"), where, "links", "{scale_up: nvlink4, scale_out: ib-400g}")
    _check_keys(links, LINK_ROLES, where, "links")
    scale_up = _link(links.get("scale_up"), where, require_source, "scale_up")
    scale_out = _link(links.get("scale_out"), where, require_source, "scale_out")
    on_chip = _link(links.get("on_chip"), where, require_source, "on_chip")
    if kind == "wafer":
        # the wafer's mesh term (sim/wafer.py Fabric) needs both: without them it would be dropped without a word
        lacking = [f for f, v in (("device.cores", cores), ("links.on_chip", on_chip)) if v is None]
        if lacking:
            raise ConfigError(
                f"{where}: kind wafer needs {' and '.join(lacking)} (the processing elements and the on-wafer mesh "
                "link, e.g. on_chip: wse3-mesh or {bandwidth: ..., latency: ...}) for its fabric term; use kind asic "
                "for a device without an on-chip mesh"
            )
        per_link = on_chip.bandwidth / (cores * MESH_LINKS_PER_CORE)
        if per_link < MIN_MESH_LINK_BYTES_PER_S:
            raise ConfigError(
                f"{where}: links.on_chip.bandwidth is the whole mesh's, summed over its links (wse3-mesh: 26.75e15 "
                f"B/s, 214 Pb/s); {on_chip.bandwidth:g} B/s over {cores:,} cores x {MESH_LINKS_PER_CORE} links is "
                f"{per_link:.3g} B/s a link: give the aggregate (one link's bandwidth x cores x "
                f"{MESH_LINKS_PER_CORE})"
            )
    return HardwareSpec(name=str(data["name"]), kind=kind, memory_bytes=mem, memory_bandwidth=bw, flops=flops,
                        devices_per_node=dpn, min_devices=min_dev, placement=placement, reserve_fraction=reserve,
                        cores=cores, power_w=power, scale_up=scale_up, scale_out=scale_out, on_chip=on_chip,
                        description=str(data.get("description", "")), path=where, sources=sources)


def load_hardware_file(path: str | Path, require_source: bool | None = None) -> HardwareSpec:
    """Load a hardware YAML file (catalog files must cite every number; user files may give plain numbers)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"no hardware file at {path}")
    try:
        data = yaml.safe_load(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not valid YAML: {e}") from None
    if require_source is None:
        require_source = catalog_dir() in path.resolve().parents
    return hardware_from_dict(data, str(path), require_source=require_source)
