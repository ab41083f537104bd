"""Hardware catalog and user hardware YAML: every catalog number has a source; bad files fail clearly."""

import pytest
import yaml

from waferline.errors import ConfigError
from waferline.spec.catalog import HARDWARE_DIR, list_hardware, load_hardware
from waferline.spec.hardware import catalog_links, load_hardware_file

EXPECTED = {
    "wse-2",
    "wse-3",
    "h100-sxm",
    "h200-sxm",
    "h800",
    "b200",
    "gb200-nvl72",
    "mi300x",
    "groq-lpu-v1",
    "sn40l",
    "tpu-v5p",
}

GOOD = {"name": "jalapeno-guess", "kind": "asic",
        "device": {"memory_bytes": 2.0e11, "memory_bandwidth": 1.0e13, "flops": {"bf16": 2.0e15, "fp8": 4.0e15}},
        "system": {"devices_per_node": 8},
        "links": {"scale_up": {"bandwidth": 8.0e11, "latency": 2.0e-6}, "scale_out": "ib-400g"}}


def test_catalog_has_every_device_and_links_are_not_devices():
    assert EXPECTED <= set(list_hardware())
    assert "links" not in list_hardware()
    assert {"nvlink4", "nvlink5", "nvl72", "ib-400g", "eth-100g", "wse3-mesh", "cs3-io"} <= set(catalog_links())


def _is_number(node):
    """A number, or text that reads as one: PyYAML reads `85.52e9` (no sign in the exponent) as a string."""
    if isinstance(node, bool):
        return False
    if isinstance(node, (int, float)):
        return True
    if not isinstance(node, str):
        return False
    try:
        float(node)
    except ValueError:
        return False
    return True


def _numbers_without_source(node, path=""):
    """Numeric leaves not wrapped in {value, source|assumed|fitted|derived} with a non-blank note."""
    bad = []
    if isinstance(node, dict):
        if "value" in node:
            notes = [node[k] for k in ("source", "assumed", "fitted", "derived") if k in node]
            if not any(n is True or (isinstance(n, str) and n.strip()) for n in notes):
                bad.append(path)
            return bad
        for k, v in node.items():
            bad += _numbers_without_source(v, f"{path}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            bad += _numbers_without_source(v, f"{path}[{i}]")
    elif _is_number(node):
        bad.append(path)
    return bad


def test_the_source_walker_sees_numbers_read_as_text_and_blank_notes():
    """`memory_bytes: 85.52e9` loads as the string '85.52e9', and `source: ""` names nothing: both are numbers
    without a source."""
    doc = yaml.safe_load('device:\n  memory_bytes: 85.52e9\n  memory_bandwidth: {value: 3.35e12, source: ""}\n'
                         '  power_w: {value: 700, source: "700 W"}\n  reserve_fraction: {value: 0.1, fitted: true}\n'
                         'name: h100-sxm\ndescription: "80 GB"\n')
    assert doc["device"]["memory_bytes"] == "85.52e9"
    assert _numbers_without_source(doc) == [".device.memory_bytes", ".device.memory_bandwidth"]


@pytest.mark.parametrize("path", sorted(HARDWARE_DIR.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_catalog_number_carries_a_source(path):
    assert _numbers_without_source(yaml.safe_load(path.read_text())) == []


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_catalog_devices_load_with_sources(name):
    hw = load_hardware(name)
    assert hw.memory_bytes > 0 and hw.memory_bandwidth > 0 and hw.flops["bf16"] > 0
    assert {"memory_bytes", "memory_bandwidth", "flops.bf16"} <= set(hw.sources)
    assert all(s.source for s in hw.sources.values())


def test_issue_datasheet_numbers():
    wse3 = load_hardware("wse-3")
    assert wse3.memory_bytes == 44e9 and wse3.memory_bandwidth == 21e15 and wse3.flops["bf16"] == 125e15
    assert wse3.placement == "pipeline" and wse3.scale_out.bandwidth == 150e9
    h200 = load_hardware("h200-sxm")
    assert h200.memory_bytes == 150.75e9 and h200.memory_bandwidth == 4.8e12 and h200.scale_up.bandwidth * 2 == 900e9
    assert load_hardware("groq-lpu-v1").memory_bytes == 230e6
    assert load_hardware("gb200-nvl72").devices_per_node == 72


def test_user_yaml_with_plain_numbers_loads(tmp_path):
    p = tmp_path / "my_asic.yaml"
    p.write_text(yaml.safe_dump(GOOD))
    hw = load_hardware(str(p))
    assert hw.name == "jalapeno-guess" and hw.peak_flops(8) == 4.0e15 and hw.scale_out.name == "ib-400g"
    assert hw.sources["memory_bytes"].status == "user"


@pytest.mark.parametrize(
    "drop,needle", [("memory_bandwidth", "memory_bandwidth"), ("flops", "flops"), ("memory_bytes", "memory_bytes")]
)
def test_user_yaml_missing_field_is_rejected_clearly(tmp_path, drop, needle):
    bad = yaml.safe_load(yaml.safe_dump(GOOD))
    del bad["device"][drop]
    p = tmp_path / "broken.yaml"
    p.write_text(yaml.safe_dump(bad))
    with pytest.raises(ConfigError) as e:
        load_hardware(str(p))
    assert needle in str(e.value) and "broken.yaml" in str(e.value)


def test_user_yaml_bad_values_are_rejected(tmp_path):
    for mutate, needle in [(lambda d: d["device"].update(memory_bytes=-1), "memory_bytes"),
                           (lambda d: d["device"].update(flops={"fp8": 1e15}), "bf16"),
                           (lambda d: d["links"].update(scale_up="warp-drive"), "warp-drive"),
                           (lambda d: d["links"].update(scale_up={"bandwidth": 1e9}), "latency"),
                           (lambda d: d.update(kind="toaster"), "toaster"),
                           (lambda d: d.pop("name"), "name")]:
        d = yaml.safe_load(yaml.safe_dump(GOOD))
        mutate(d)
        p = tmp_path / "x.yaml"
        p.write_text(yaml.safe_dump(d))
        with pytest.raises(ConfigError, match=needle):
            load_hardware_file(p)


def test_catalog_files_must_cite(tmp_path):
    p = tmp_path / "uncited.yaml"
    p.write_text(yaml.safe_dump(GOOD))
    with pytest.raises(ConfigError, match="source"):
        load_hardware_file(p, require_source=True)


@pytest.mark.parametrize("blank", [{"source": ""}, {"source": None}, {"assumed": "  "}, {"derived": None}])
def test_catalog_numbers_need_a_nonempty_source(tmp_path, blank):
    """{value, source: ""} (or null, or blanks) names no source: refused where every number must cite one."""
    d = yaml.safe_load(yaml.safe_dump(GOOD))
    d["device"]["memory_bytes"] = {"value": 80e9, **blank}
    p = tmp_path / "blank.yaml"
    p.write_text(yaml.safe_dump(d))
    with pytest.raises(ConfigError, match="memory_bytes.*empty"):
        load_hardware_file(p, require_source=True)
    assert load_hardware_file(p).memory_bytes == 80e9  # (a user file may leave it out)


def test_unknown_hardware_names_the_catalog():
    with pytest.raises(ConfigError, match="wse-3"):
        load_hardware("no-such-chip")


def test_user_hardware_plans_and_simulates_end_to_end(tmp_path):
    from waferline.plan.place import place
    from waferline.plan.plan import Plan
    from waferline.sim.pipeline import simulate

    p = tmp_path / "my_asic.yaml"
    p.write_text(yaml.safe_dump(GOOD))
    plan = place("llama-3.1-70b", str(p), weight_bits=8)
    assert plan.fits and plan.stages[0].device == "jalapeno-guess"
    back = Plan.from_json(plan.to_json())
    r = simulate(back, prompt_len=256, output_len=64)
    assert r.decode_tokens_per_s_per_user > 0 and r.hardware == str(p.resolve())


def test_measured_host_yaml_loads_and_plans(tmp_path):
    from waferline.plan.place import place
    from waferline.sim.calibrate.hardware_yaml import write_host_yaml

    out = tmp_path / "host.yaml"
    d = write_host_yaml(out, quick=True)
    hw = load_hardware(str(out))
    assert hw.kind == "cpu" and hw.memory_bandwidth > 1e8 and hw.flops["bf16"] > 1e8 and 0 < hw.scale_up.latency < 1e-2
    assert all("measured on" in s.source or s.status == "assumed" for s in hw.sources.values())
    assert place("llama-3.2-1b", str(out), devices=2).num_stages == 2 and d["kind"] == "cpu"


@pytest.mark.parametrize("mutate, message", [
    # a fraction where a count is meant: refused, never truncated (0.5 devices per node was int()'d to 0 and divided by)
    (lambda d: d["system"].update(devices_per_node=0.5), "'devices_per_node' must be a whole number >= 1, got 0.5"),
    (lambda d: d["system"].update(devices_per_node=2.7), "'devices_per_node' must be a whole number >= 1, got 2.7"),
    (lambda d: d["system"].update(min_devices=0.5), "'min_devices' must be a whole number >= 1, got 0.5"),
    (lambda d: d["device"].update(cores=0.5), "'cores' must be a whole number >= 1, got 0.5"),
    (lambda d: d.update(system=8), "system must be a mapping like {devices_per_node: 8}, got 8"),
    (lambda d: d.update(links=["nvlink4"]), "links must be a mapping"),
    # unknown keys at every level: named, with the known ones (a typo used to fall back to the default silently)
    (lambda d: d["system"].update(devices_per_nodes=8),
     "unknown field 'devices_per_nodes' in system (did you mean 'devices_per_node'?); known: devices_per_node"),
    (lambda d: d.update(reserve_fraction=0.5),
     "unknown field 'reserve_fraction' in the top level ('reserve_fraction' belongs under device:); known: name"),
    (lambda d: d["device"]["flops"].update(bogus=1.0), "unknown field 'bogus' in device.flops; known: bf16, fp8"),
    (lambda d: d["device"].update(memory_bandwith=1e13), "unknown field 'memory_bandwith' in device (did you mean"),
    (lambda d: d["links"].update(scale_sideways="ib-400g"), "unknown field 'scale_sideways' in links"),
    (lambda d: d["links"]["scale_up"].update(latncy=1e-6), "unknown field 'latncy' in link 'scale_up'"),
    (lambda d: d["device"].update(memory_bytes={"value": 2e11, "sorce": "x"}),
     "unknown field 'sorce' in memory_bytes (did you mean 'source'?)"),
    # a non-number inside {value, source}: one line, not a traceback
    (lambda d: d["device"].update(memory_bytes={"value": "80GB", "source": "x"}),
     "field 'memory_bytes' must be a number, got '80GB'"),
    (lambda d: d["device"].update(memory_bytes={"value": None, "assumed": "x"}), "must be a number, got None"),
    # a unit slip: TB/s where bytes/s is meant predicted 2e-10 tok/s; 1e-300 crashed with ZeroDivisionError
    (lambda d: d["device"].update(memory_bandwidth=3.35),
     "field 'memory_bandwidth' is in bytes/s; 3.35 is under 1e+09 (a unit slip?)"),
    (lambda d: d["device"].update(memory_bandwidth=1e-300), "'memory_bandwidth' is in bytes/s; 1e-300 is under"),
    (lambda d: d["device"]["flops"].update(bf16=989), "field 'flops.bf16' is in FLOP/s; 989 is under"),
    (lambda d: d["links"]["scale_up"].update(latency=2), "is in seconds; 2 is over 1 (a unit slip?)"),
    # a wafer without its mesh would silently drop the fabric term
    (lambda d: d.update(kind="wafer"), "kind wafer needs device.cores and links.on_chip"),
    (lambda d: (d.update(kind="wafer"), d["device"].update(cores=1000)), "kind wafer needs links.on_chip ("),
    # one mesh link's bandwidth where the mesh's aggregate is meant: 0 tok/s and an 11-hour TTFT without a word
    (lambda d: (d.update(kind="wafer"), d["device"].update(cores=900000),
                d["links"].update(on_chip={"bandwidth": 3.7e9, "latency": 0.91e-9})),
     "links.on_chip.bandwidth is the whole mesh's, summed over its links"),
])
def test_user_yaml_mistakes_are_refused_with_file_and_field(tmp_path, mutate, message):
    d = yaml.safe_load(yaml.safe_dump(GOOD))
    mutate(d)
    p = tmp_path / "mine.yaml"
    p.write_text(yaml.safe_dump(d))
    with pytest.raises(ConfigError) as e:
        load_hardware_file(p)
    assert str(e.value).startswith(f"{p}: ") and message in str(e.value) and "\n" not in str(e.value)


def test_user_yaml_whole_counts_and_a_complete_wafer_load(tmp_path):
    d = yaml.safe_load(yaml.safe_dump(GOOD))
    d["system"].update(devices_per_node=8.0, min_devices={"value": 2, "assumed": "pairs"})
    d.update(kind="wafer")
    d["device"].update(cores=1000)
    d["links"].update(on_chip="wse3-mesh")
    p = tmp_path / "w.yaml"
    p.write_text(yaml.safe_dump(d))
    hw = load_hardware_file(p)
    assert (hw.devices_per_node, hw.min_devices, hw.cores) == (8, 2, 1000) and hw.on_chip.name == "wse3-mesh"
    assert isinstance(hw.devices_per_node, int) and isinstance(hw.cores, int)


def test_user_yaml_mistakes_fail_on_the_command_line_in_one_line(tmp_path, capsys):
    from waferline.cli import main as cli_main

    d = yaml.safe_load(yaml.safe_dump(GOOD))
    d["system"] = {"devices_per_node": 0.5}  # (was int()'d to 0: ZeroDivisionError in plan/place.py)
    p = tmp_path / "half.yaml"
    p.write_text(yaml.safe_dump(d))
    assert cli_main(["plan", "llama-3.1-8b", "--hardware", str(p)]) == 2
    err = capsys.readouterr().err.strip()
    assert "half.yaml" in err and "devices_per_node" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("path", sorted(HARDWARE_DIR.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_catalog_file_loads_under_the_strict_loader(path):
    if path.stem == "links":
        assert catalog_links()
    else:
        hw = load_hardware_file(path, require_source=True)
        assert hw.kind != "wafer" or (hw.on_chip is not None and hw.cores)


def test_gpu_memory_is_the_bytes_the_driver_reports():
    """NVIDIA and AMD quote HBM in GiB ("180 GB" on B200 is nvidia-smi's 183,359 MiB; "192 GB" on MI300X is 192 GiB):
    every GPU counts the bytes its driver reports, as h100-sxm does, not the quoted figure read as 1e9 bytes (7% less
    room for weights and cache than the part has)."""
    mib, gib = 2**20, 2**30
    reported = {"h100-sxm": 81_559 * mib, "h200-sxm": 143_771 * mib, "a100-sxm": 81_920 * mib,
                "b200": 183_359 * mib, "gb200-nvl72": 189_471 * mib, "gb300-nvl72": 284_208 * mib,
                "mi300x": 192 * gib, "mi355x": 288 * gib}
    for name, nbytes in reported.items():
        assert load_hardware(name).memory_bytes == pytest.approx(nbytes, rel=2e-4), name


def test_tpu_memory_is_the_gib_google_lists():
    """Google lists TPU HBM per chip in GiB (docs.cloud.google.com/tpu/docs/tpu7x: 95 / 32 / 192 for v5p / v6e /
    TPU7x; XLA's per-chip limit on v6e, 31.25G, is above 32e9 bytes): read as 1e9 bytes, each chip had 7% less room,
    and DeepSeek-V3 at 8 bits did not fit 8 v5p chips (95.49 GB > 95.00 GB). ICI v7's 1.2 TB/s and 9.6 Tb/s agree."""
    gib = 2**30
    for name, n in {"tpu-v5p": 95, "tpu-v6e": 32, "tpu-v7": 192}.items():
        assert load_hardware(name).memory_bytes == pytest.approx(n * gib, rel=2e-4), name
    from waferline.plan.place import place

    assert place("deepseek-v3", "tpu-v5p", weight_bits=8, devices=8).fits
    assert catalog_links()["ici-v7"].sources["ici-v7.bandwidth"].status == "sourced"


def test_tpu_rates_are_googles_spec_table():
    """docs.cloud.google.com/tpu/docs/tpu7x lists per chip, for v5p / v6e / TPU7x: HBM bandwidth 2,765 / 1,638 / 7,380
    GB/s, BF16 459 / 918 / 2,307 TFLOP/s, bidirectional ICI 1,200 / 800 / 1,200 GB/s (a link carries one direction).
    TPU7x had launch-blog figures (7.2 TB/s, 2.3 PF), 2.5% and 0.3% under the table."""
    table = {"tpu-v5p": (2765e9, 459e12, 600e9), "tpu-v6e": (1638e9, 918e12, 400e9), "tpu-v7": (7380e9, 2307e12, 600e9)}
    for name, (bw, bf16, ici) in table.items():
        hw = load_hardware(name)
        assert (hw.memory_bandwidth, hw.flops["bf16"], hw.scale_up.bandwidth) == pytest.approx((bw, bf16, ici)), name


def test_scale_out_is_the_nic_each_system_ships():
    """One NIC per GPU, of the generation the system ships: DGX/HGX A100 has ConnectX-6 HDR at 200 Gb/s (25 GB/s), GB300
    NVL72 ConnectX-8 at 800 Gb/s (100 GB/s); both were on ib-400g, whose source is ConnectX-7 on B200/GB200 (2x the
    A100's, half the GB300's)."""
    expected = {"a100-sxm": 25e9, "h100-sxm": 50e9, "h200-sxm": 50e9, "b200": 50e9, "gb200-nvl72": 50e9,
                "gb300-nvl72": 100e9}
    for name, bw in expected.items():
        link = load_hardware(name).scale_out
        assert link.bandwidth == pytest.approx(bw), name
        assert link.sources[f"{link.name}.bandwidth"].status == "sourced", name
    assert "ConnectX-6" in load_hardware("a100-sxm").scale_out.sources["ib-200g.bandwidth"].source
    assert "ConnectX-8" in load_hardware("gb300-nvl72").scale_out.sources["ib-800g.bandwidth"].source


def test_h800_rates_copied_from_h100_are_marked_assumed():
    """The H800 page cited gives no tensor rate or power, only 'very similar' to H100: those numbers are H100's,
    assumed, not sourced; its memory bandwidth and NVLink are figures the page does state."""
    src = load_hardware("h800").sources
    assert {src[k].status for k in ("flops.bf16", "flops.fp8", "power_w")} == {"assumed"}
    assert src["memory_bandwidth"].status == "sourced"


def test_a_bf16_rate_guessed_from_fp8_is_marked_assumed():
    """Groq 3's BF16 rate is not published: half its FP8 rate is an assumption, listed with the assumed numbers."""
    assert load_hardware("groq-lpu-3").sources["flops.bf16"].status == "assumed"


def test_h800_counts_its_hbm_as_h100_sxm_does():
    """Same 80 GB HBM3 part: the same bytes (NVML's 81,559 MiB), not 6.9% less (80.0e9 gave H800 less room for
    weights and cache than the identical memory on H100 SXM)."""
    h800, h100 = load_hardware("h800"), load_hardware("h100-sxm")
    assert h800.memory_bytes == h100.memory_bytes == 85.52e9 and h800.usable_bytes() == h100.usable_bytes()
    assert "81,559 MiB" in h800.sources["memory_bytes"].source


def test_a_stage_over_devices_without_a_link_is_refused_not_free(tmp_path):
    """Devices in one tensor-parallel stage with no scale_up or scale_out: the all-reduces cost nothing and the plan
    was predicted faster than with any real link (collective 0.0); now the missing link is named in one line."""
    from waferline.plan.place import place
    from waferline.sim.pipeline import simulate

    d = yaml.safe_load(yaml.safe_dump(GOOD))
    del d["links"]
    p = tmp_path / "nolinks.yaml"
    p.write_text(yaml.safe_dump(d))
    plan = place("llama-3.2-1b", str(p), devices=8)
    assert plan.num_stages == 1 and plan.stages[0].num_devices == 8
    with pytest.raises(ConfigError, match="no link between the 8 devices of a stage: add scale_up") as e:
        simulate(plan, prompt_len=16, output_len=4)
    assert "\n" not in str(e.value)
    assert simulate(place("llama-3.2-1b", str(p), devices=1), prompt_len=16, output_len=4).step_latency_s > 0


def test_a_core_count_that_gives_one_core_a_whole_chips_rates_is_refused(tmp_path):
    """A wafer's bandwidth and FLOP/s are its cores' sums. WSE-3's figures over 1 core (21 PB/s and 125 PFLOP/s in
    one core) predicted llama-3.1-8b at ~3x the 900,000-core wafer (its mesh term vanished); such a count is refused,
    naming the smallest count that is not, and a count from there up loads."""
    d = yaml.safe_load((HARDWARE_DIR / "wse-3.yaml").read_text())
    p = tmp_path / "w.yaml"
    for cores, says in ((1, "device.memory_bandwidth 2.1e+16 over 1 cores is 2.1e+16 a core"),
                        (262, "give the device's core count (at least 263)")):
        d["device"]["cores"] = cores
        p.write_text(yaml.safe_dump(d))
        with pytest.raises(ConfigError) as e:
            load_hardware_file(p)
        assert says in str(e.value) and "80e12" in str(e.value) and "\n" not in str(e.value)
    d["device"]["memory_bandwidth"] = 1e15  # (the FLOP/s alone: 125e15 over 50 cores)
    d["device"]["cores"] = 50
    p.write_text(yaml.safe_dump(d))
    with pytest.raises(ConfigError, match=r"device.flops.bf16 1.25e\+17 over 50 cores .*\(at least 56\)"):
        load_hardware_file(p)
    d = yaml.safe_load((HARDWARE_DIR / "wse-3.yaml").read_text())
    d["device"]["cores"] = 263
    p.write_text(yaml.safe_dump(d))
    assert load_hardware_file(p).cores == 263
