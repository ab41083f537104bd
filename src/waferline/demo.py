"""`waferline demo`: the whole project in one command. sol-mini (a small model of the Sol architecture, trained on
Shakespeare) streams a continuation with a live tokens/s; then the planner and simulator say what the full-size
gpt-5.6-sol would do on WSE-3 wafers; and an HTML report with the plots is written.

If the bundled checkpoint is missing (e.g. a source tree without models/), the demo builds a small random
`sol` checkpoint instead and says so: every mechanism is real, the text is then noise.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from waferline.errors import counted
from waferline.files import write_text_atomic

DEFAULT_PROMPT = "ROMEO.\nWhat light is this that breaks upon the wafer?\n"
BUNDLED = Path(__file__).resolve().parents[2] / "models" / "sol-mini"

DEMO_TEXT = (
    "Cerebras wafers keep the weights of a layer in on-chip SRAM and stream activations from wafer to wafer. "
    "A light cache lets many sequences live beside the weights: latent attention caches a compressed vector per "
    "token, and state-space layers keep a constant state per sequence. Experts hold most parameters; only a few "
    "are active for each token, and a shared expert sees every token. "
) * 8

SOL_DEMO_CONFIG: dict[str, Any] = {
    "model_type": "sol",
    "architectures": ["SolForCausalLM"],
    "vocab_size": 512,
    "hidden_size": 128,
    "num_hidden_layers": 6,
    "mixer_types": ["mamba2", "mamba2", "mla", "mamba2", "mamba2", "mla"],
    "ffn_types": ["dense", "moe", "moe", "moe", "moe", "moe"],
    "num_attention_heads": 4,
    "q_lora_rank": None,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "scoring_func": "softmax",
    "norm_topk_prob": True,
    "mamba_n_heads": 8,
    "mamba_d_head": 32,
    "mamba_d_state": 16,
    "mamba_n_groups": 1,
    "mamba_d_conv": 4,
    "mamba_chunk_size": 32,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
}


def write_tokenizer(directory: Path, text: str, vocab_size: int) -> None:
    """Train a byte-level BPE tokenizer on ``text`` and save it so transformers.AutoTokenizer loads it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([text], trainer)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"}, indent=2))


def _write(path: Path, text: str) -> Path:
    """Write one of the demo's files whole or not at all; a failure (a full disk) is one line, not a traceback."""
    from waferline.errors import ConfigError

    try:
        return write_text_atomic(path, text)
    except OSError as e:
        raise ConfigError(f"--out {path.parent}: cannot write {path.name} ({e.strerror or e})") from None


def build_demo_checkpoint(directory: Path, seed: int = 0) -> Path:
    """A small random `sol` checkpoint with a tokenizer (used when sol-mini is not bundled, and by tests). Its
    config.json is written last: a build stopped midway has none."""
    from waferline.model.init import write_random_checkpoint

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").unlink(missing_ok=True)
    write_tokenizer(directory, DEMO_TEXT, SOL_DEMO_CONFIG["vocab_size"])
    write_random_checkpoint(SOL_DEMO_CONFIG, directory, seed=seed)
    return directory


def is_demo_checkpoint(directory: Path) -> bool:
    """Whether ``directory`` holds a whole build_demo_checkpoint build of SOL_DEMO_CONFIG (reused, not rebuilt)."""
    try:
        return (json.loads((directory / "config.json").read_text()) == SOL_DEMO_CONFIG
                and (directory / "model.safetensors").is_file())
    except (OSError, ValueError):
        return False


class LayerTimer:
    """Wall time of every decoder layer during decode steps (forward hooks): the per-stage timeline when each
    layer is its own stage ("one wafer, one layer")."""

    def __init__(self, model: Any):
        self.model, self.handles, self.times = model, [], {}
        self._t0: dict[int, float] = {}
        for i, layer in enumerate(model.layers):
            self.handles.append(layer.register_forward_pre_hook(self._pre(i)))
            self.handles.append(layer.register_forward_hook(self._post(i)))

    def _pre(self, i: int):
        def hook(mod: Any, args: Any) -> None:
            self._t0[i] = time.perf_counter()
        return hook

    def _post(self, i: int):
        def hook(mod: Any, args: Any, out: Any) -> None:
            if args[0].shape[1] == 1:  # decode steps only
                self.times.setdefault(i, []).append(time.perf_counter() - self._t0[i])
        return hook

    def close(self) -> None:
        for h in self.handles:
            h.remove()

    def median_s(self) -> list[float]:
        import statistics

        return [statistics.median(self.times.get(i, [0.0])) for i in range(len(self.model.layers))]


def planner_headline() -> dict[str, Any]:
    """What the planner/simulator say about gpt-5.6-sol on WSE-3 (and GB200 NVL72) — numbers for the terminal and
    report."""
    from waferline.plan.place import place
    from waferline.plan.plan import SpeculativeConfig
    from waferline.sim.cost import load_params
    from waferline.sim.intervals import attach_intervals
    from waferline.sim.pipeline import simulate

    params = load_params()

    def predicted(plan: Any) -> Any:  # (with its 90% intervals over the fit's bootstrap parameter sets)
        return attach_intervals(simulate(plan, params=params), plan, params)

    out: dict[str, Any] = {}
    for bits in (4, 16):
        p = place("gpt-5.6-sol", "wse-3", weight_bits=bits)
        out[f"wafers_{bits}bit"] = p.num_devices
    p80 = place("gpt-5.6-sol", "wse-3", devices=80, weight_bits=4)
    r = predicted(p80)
    p80_long = place("gpt-5.6-sol", "wse-3", devices=80, weight_bits=4, context=131072, batch=16)
    out.update(one_layer_per_wafer_devices=80, tok_s_per_user=r.decode_tokens_per_s_per_user, ttft_s=r.ttft_s,
               tok_s_per_user_interval=r.intervals.get("decode_tokens_per_s_per_user"),
               ttft_s_interval=r.intervals.get("ttft_s"), stage_ms=[s.total * 1e3 for s in r.stages])
    ps = place("gpt-5.6-sol", "wse-3", devices=80, weight_bits=4, speculative=SpeculativeConfig("mtp", 3))
    rs = predicted(ps)
    out["tok_s_per_user_mtp"] = rs.decode_tokens_per_s_per_user
    out["tok_s_per_user_mtp_interval"] = rs.intervals.get("decode_tokens_per_s_per_user")
    out["memory_per_wafer_gb"] = [(s.index, s.memory.weights / 1e9, s.memory.cache / 1e9, s.memory.capacity / 1e9,
                                   (s.memory.activations + s.memory.reserve) / 1e9) for s in p80_long.stages]
    sweep = []
    for n in (40, 41, 48, 60, 80, 100, 120, 160, 200):
        pn = place("gpt-5.6-sol", "wse-3", devices=n, weight_bits=4)
        if pn.fits:
            sweep.append((n, simulate(pn).decode_tokens_per_s_per_user,
                          simulate(place("gpt-5.6-sol", "wse-3", devices=n, weight_bits=4,
                                         speculative=SpeculativeConfig("mtp", 3))).decode_tokens_per_s_per_user))
    out["sweep"] = sweep
    nvl = place("gpt-5.6-sol", "gb200-nvl72", weight_bits=4)
    out["nvl72_gpus"] = nvl.num_devices
    rn = predicted(nvl)
    out["nvl72_tok_s_per_user"] = rn.decode_tokens_per_s_per_user
    out["nvl72_tok_s_per_user_interval"] = rn.intervals.get("decode_tokens_per_s_per_user")
    return out


def headline_cell(head: dict[str, Any], key: str, scale: float = 1.0, unit: str = "") -> str:
    """A headline figure with its 90% interval: '313 (90%: 131-398)' (the value alone where it has none)."""
    from waferline.sim.intervals import fmt

    return fmt(head[key], head.get(key + "_interval"), ",.0f", scale) + unit


def decode_text(metrics: dict[str, float]) -> str:
    """The streamed run's decode speed, as the terminal and the report say it: none where no decode step ran (one
    token: the prefill's, which the engine's 0 tok/s stands for)."""
    rate = metrics["decode_tokens_per_s"]
    return f"decode {rate:.0f} tok/s" if rate > 0 else "no decode step (one token, from the prefill)"


def speculative_text(method: str, stats: dict[str, float]) -> str:
    """What speculation did in the streamed run, as the terminal and the report say it (no acceptance where nothing
    was drafted: no draft was rejected)."""
    per_step = f"mean accepted length {stats.get('spec_mean_accepted_length', 0.0):.2f} tokens per decode step"
    if not stats.get("spec_mean_accepted_length"):  # (one token: the prefill's)
        return f"speculative {method}: nothing drafted (no decode step)"
    if not stats.get("spec_drafted"):
        return f"speculative {method}: nothing drafted (no draft found, or adaptive k chose plain steps), {per_step}"
    return (f"speculative {method}: acceptance {stats.get('spec_acceptance_rate', 0.0):.2f} "
            f"({stats.get('spec_accepted', 0):.0f} of {stats.get('spec_drafted', 0):.0f} drafts), {per_step}, "
            f"{stats.get('spec_plain_steps', 0):.0f} of {stats.get('spec_verify_steps', 0):.0f} decode "
            "steps without drafts (adaptive back-off)")


REFERENCE_TOK_S = 750  # GPT-5.6 Sol's reported decode speed per user on Cerebras WSE-3 ("up to 750 tokens per second")
REFERENCE_LABEL = f"{REFERENCE_TOK_S} tok/s per user: GPT-5.6 Sol's reported speed on Cerebras WSE-3"
REFERENCE_CAPTION = (f"The dotted line at {REFERENCE_TOK_S} tok/s per user is the speed at which GPT-5.6 Sol is "
                     f"reported to be served on Cerebras WSE-3 (announced as \"up to {REFERENCE_TOK_S} tokens per "
                     "second\"); it is a reference, not a prediction. The curves are the simulator's predictions for "
                     "gpt-5.6-sol, the project's guess at that model's configuration (its size is not published), "
                     "with 4-bit weights.")


def _fit_bar_labels(ax: Any, texts: list[tuple[Any, float, str]]) -> None:
    """Shorten or drop the labels inside the timeline's bars that are wider than their bar, so none overlap."""
    fig = ax.figure
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for t, width_ms, short in texts:
        x0 = ax.transData.transform((0.0, 0.0))[0]
        bar_px = ax.transData.transform((width_ms, 0.0))[0] - x0
        if t.get_window_extent(renderer).width > bar_px - 2:
            t.set_text(short)
            if t.get_window_extent(renderer).width > bar_px - 2:
                t.set_visible(False)


def _figures(timeline_ms: list[float], kinds: list[str], head: dict[str, Any],
             name: str = "sol-mini") -> dict[str, Any]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from waferline.spec.catalog import load_model

    # legends go below the axes ("outside lower center") so they never cover data or reference lines
    figs: dict[str, Any] = {}
    fig, ax = plt.subplots(figsize=(9, 2.8), layout="constrained")
    t = 0.0
    colors = {"mamba2": "#4c9be8", "mla": "#e8774c", "gqa": "#8bc34a"}
    labels = []
    for i, (ms, kind) in enumerate(zip(timeline_ms, kinds)):
        ax.barh(0, ms, left=t, color=colors.get(kind, "#999"), edgecolor="white")
        labels.append((ax.text(t + ms / 2, 0, f"L{i}\n{kind}", ha="center", va="center", fontsize=7), ms, f"L{i}"))
        t += ms
    ax.set_yticks([])
    ax.set_xlim(0, t if t > 0 else 1.0)
    ax.set_xlabel("ms within one decode step (one token through every layer = every stage)")
    shown = name.replace("$", r"\$")  # (a directory name, shown as written: no mathtext)
    ax.set_title(f"{shown}: per-layer (per-stage) timeline of one decode step, measured")
    _fit_bar_labels(ax, labels)
    figs["timeline"] = fig

    fig, ax = plt.subplots(figsize=(9, 3.6), layout="constrained")
    mem = head["memory_per_wafer_gb"]
    idx = [m[0] for m in mem]
    ax.bar(idx, [m[1] for m in mem], label="weights (4-bit + scales)", color="#4c9be8")
    ax.bar(
        idx,
        [m[2] for m in mem],
        bottom=[m[1] for m in mem],
        label="KV cache (16 sequences x 128k tokens)",
        color="#e8774c",
    )
    ax.bar(idx, [m[4] for m in mem], bottom=[m[1] + m[2] for m in mem], label="activations + reserve", color="#bbbbbb")
    ax.axhline(mem[0][3], color="k", ls="--", lw=1, label=f"SRAM per wafer ({mem[0][3]:.0f} GB)")
    ax.set_ylim(0, max([mem[0][3]] + [m[1] + m[2] + m[4] for m in mem]) * 1.12)
    ax.set_xlabel("wafer (stage)")
    ax.set_ylabel("GB")
    ax.set_title("gpt-5.6-sol on 80 WSE-3 wafers, one layer per wafer: memory per wafer (predicted)")
    fig.legend(loc="outside lower center", ncol=4, fontsize=8, frameon=False)
    figs["memory"] = fig

    fig, ax = plt.subplots(figsize=(7, 4.0), layout="constrained")
    ctx = [2 ** k for k in range(10, 21)]
    for name, label in (("gpt-5.6-sol-gqa", "GQA (8 KV heads)"), ("gpt-5.6-sol-mla", "MLA latent"),
                        ("gpt-5.6-sol-hybrid", "hybrid 3 Mamba-2 : 1 MLA")):
        spec = load_model(name)
        ax.plot(ctx, [spec.cache_bytes_per_seq(c, 16) / 1e9 for c in ctx], marker="o", ms=3, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("cache per sequence, GB (bf16)")
    ax.set_title("KV / state bytes vs context, gpt-5.6-sol variants (ModelSpec accounting)", fontsize=11)
    fig.legend(loc="outside lower center", ncol=3, fontsize=8, frameon=False)
    figs["kv"] = fig

    fig, ax = plt.subplots(figsize=(7, 4.2), layout="constrained")
    sw = head["sweep"]
    ax.plot([s[0] for s in sw], [s[1] for s in sw], marker="o", label="predicted, no speculation")
    ax.plot([s[0] for s in sw], [s[2] for s in sw], marker="s", label="predicted, MTP k=3 (acceptance 0.85 assumed)")
    ax.axhline(REFERENCE_TOK_S, color="k", ls=":", lw=1, label=REFERENCE_LABEL)
    ax.set_ylim(0, max([REFERENCE_TOK_S] + [max(s[1], s[2]) for s in sw]) * 1.12)
    ax.set_xlabel("WSE-3 wafers")
    ax.set_ylabel("decode tok/s per user")
    ax.set_title("gpt-5.6-sol, 4-bit weights: predicted tokens/s vs wafers")
    fig.legend(loc="outside lower center", ncol=1, fontsize=8, frameon=False)
    figs["sweep"] = fig
    return figs


def add_prediction_sections(rep: Any, figs: dict[str, Any], head: dict[str, Any]) -> None:
    """The report's gpt-5.6-sol sections: the planner's table, memory per wafer, cache vs context, tokens/s vs
    wafers."""
    rep.add("gpt-5.6-sol on WSE-3 — the planner's answer",
            table=[["question", "answer"], ["wafers needed, 4-bit", head["wafers_4bit"]],
                   ["wafers needed, 16-bit", head["wafers_16bit"]],
                   ["tok/s per user, 80 wafers, 4-bit", headline_cell(head, "tok_s_per_user")],
                   ["... with MTP (k=3, acceptance 0.85 assumed)", headline_cell(head, "tok_s_per_user_mtp")],
                   ["TTFT (1,000-token prompt)", headline_cell(head, "ttft_s", 1e3, " ms")],
                   ["GB200 NVL72 4-bit: GPUs", head["nvl72_gpus"]],
                   ["GB200 NVL72: tok/s per user", headline_cell(head, "nvl72_tok_s_per_user")]],
            note="Simulator predictions (fitted on published results; see docs/planner.md); 90% intervals over the "
                 "fit's bootstrap parameter sets (parameter uncertainty only; the MTP row's acceptance is assumed, "
                 "not in its interval). gpt-5.6-sol is a speculative config.")
    rep.add("Memory per wafer", figure=figs["memory"])
    rep.add("KV / state bytes vs context", figure=figs["kv"])
    rep.add("Predicted tokens/s vs number of wafers", figure=figs["sweep"], note=REFERENCE_CAPTION)


def run_demo(out_dir: str = "demo_out", max_tokens: int = 160, json_out: bool = False, report: bool = True,
             prompt: str | None = None, model: str | None = None, weight_bits: int = 4, group_size: int = 32,
             layers_per_stage: int = 1, speculative: str | None = None, num_speculative_tokens: int = 3) -> int:
    from rich.console import Console
    from rich.live import Live
    from rich.markup import escape
    from rich.table import Table
    from rich.text import Text

    from waferline.engine.llm import LLM
    from waferline.engine.sampling import SamplingParams

    console = Console(stderr=json_out, emoji=False)  # (no :name: emoji codes: names and text print as they are)
    prompt = DEFAULT_PROMPT if prompt is None else prompt
    out = Path(out_dir)
    ckpt = Path(model) if model else BUNDLED
    name = ckpt.resolve().name  # (what the report calls the checkpoint: sol-mini unless --model names another)
    if model and not (ckpt / "config.json").is_file():
        from waferline.errors import ConfigError

        raise ConfigError(f"--model {model}: not a checkpoint directory (config.json + *.safetensors)")
    from waferline.files import check_writable

    check_writable(out / "demo.json", "--out")  # (before the work: a directory that cannot be made fails here)
    out.mkdir(parents=True, exist_ok=True)
    bundled = model is None and (ckpt / "model.safetensors").is_file()
    trained = model is not None or bundled  # (a checkpoint given: whatever its weights are, the demo runs them)
    what = "trained sol-mini" if bundled else f"checkpoint {name}" if model else "RANDOM weights"
    if not trained:
        ckpt = out / "sol-demo-random"
        name = ckpt.name
        built = is_demo_checkpoint(ckpt)  # (made by an earlier run: reused, as its int4 copy is)
        console.print(f"[yellow]sol-mini not found at {escape(str(BUNDLED))}; "
                      f"{'reusing the' if built else 'building a'} small RANDOM sol checkpoint "
                      "instead (the text will be noise). Rebuild sol-mini with: python train/sol_mini.py[/yellow]")
        if not built:
            build_demo_checkpoint(ckpt)
    from waferline.engine.inputs import is_int4_checkpoint

    stored_int4 = is_int4_checkpoint(ckpt)  # (an int4 checkpoint runs as it is: int4 whatever --weight-bits says)
    if stored_int4:
        weight_bits = 4
    elif weight_bits == 4:  # the canonical int4 file (RTN), made once and reused: what a wafer would hold
        from waferline.model.quant import QuantOptions, quantize_checkpoint

        qdir = out / f"{name}-int4-g{group_size}"  # (named as the report names it: `--model .` is not "-int4-g32")
        # reused only while it is the int4 copy of this very checkpoint (the source's path, and the sizes and times of
        # its files: the weights, and the config and tokenizer the copy carries; not the demo's own outputs)
        source = json.dumps({"source": str(ckpt.resolve()), "group_size": group_size, "method": "rtn",
                             "files": sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns)
                                             for f in ckpt.iterdir() if f.is_file() and not f.name.startswith(".")
                                             and f.name not in ("demo.json", "waferline-report.html"))})
        stamp = qdir / ".waferline-source.json"
        if not (qdir / "model.safetensors").is_file() or not stamp.is_file() or stamp.read_text() != source:
            with console.status(escape(f"quantizing {name} to int4 (RTN, group {group_size}) -> {qdir}")):
                quantize_checkpoint(ckpt, qdir, QuantOptions(group_size=group_size), force=True)
            _write(stamp, source)
        ckpt = qdir
    from waferline import kernels

    kernels.prepare()  # a first run builds them here, announced, not inside the timed steps or stage processes
    # per-layer timing in one process (each layer is one stage of the one-layer-per-wafer plan)
    single = LLM(ckpt, dtype="bfloat16")
    prompt_len = len(single.encode(prompt))
    room = single.max_model_len - prompt_len  # (the timing and structured-output runs take at most what is left)
    if max_tokens > room:
        from waferline.errors import ConfigError

        raise ConfigError(f"--prompt of {counted(prompt_len, 'token')} + --max-tokens {max_tokens} exceeds the "
                          f"model's context of {single.max_model_len} tokens; shorten the prompt or lower --max-tokens")
    timer = LayerTimer(single.model)
    single.generate([prompt], SamplingParams(max_tokens=min(16, room)))
    timer.close()
    timeline_ms = [t * 1e3 for t in timer.median_s()]
    del single
    spec_kw: dict[str, Any] = {}
    if speculative:  # exact speculative decoding (engine/speculative/); under the pipeline when layers_per_stage
        spec_kw = {"speculative": speculative, "num_speculative_tokens": num_speculative_tokens}
    if layers_per_stage:
        llm = LLM(ckpt, dtype="bfloat16", layers_per_stage=layers_per_stage, **spec_kw)
    else:
        llm = LLM(ckpt, dtype="bfloat16", **spec_kw)
    spec = llm.spec
    kinds = [(layer.mixer or layer.ffn).kind for layer in spec.layers]  # (Nemotron-H: a layer is a mixer or an FFN)
    moe = next((layer.ffn for layer in spec.layers if layer.ffn is not None and layer.ffn.kind == "moe"), None)
    growth = spec.cache_growth(16)  # (a long sequence's: past the sliding windows, with the recurrent states)
    console.print(
        f"[bold]{escape(ckpt.name)}[/bold]: {spec.num_layers} layers ({' '.join(kinds)}), "
        f"{spec.params_total() / 1e6:.1f}M parameters ({spec.params_active() / 1e6:.1f}M active), "
        f"MoE {moe.num_experts if moe else 0} experts; "
        f"cache {growth[0]:.0f} B/token + {growth[1] / 1e3:.1f} kB/sequence "
        "(bf16)"
    )
    per_stage = min(layers_per_stage, spec.num_layers)  # (a K above the model's layers: one stage of all of them)
    n_stages = -(-spec.num_layers // per_stage) if layers_per_stage else 1
    plan_text = (f"{counted(n_stages, 'stage process', 'stage processes')} ({counted(per_stage, 'layer')} per "
                 "stage, activations over torch.distributed gloo)" if layers_per_stage else "single process")
    plan_text += "; " + (
        "int4 weights (as the checkpoint stores them), bf16 compute" if stored_int4 else
        f"int4 weights (RTN, group {group_size}), bf16 compute" if weight_bits == 4 else "bf16 weights and compute"
    )
    if speculative:
        plan_text += f"; speculative decoding: {speculative}, up to {num_speculative_tokens} drafts per step (adaptive)"
    console.print(f"plan: {plan_text}", markup=False)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.8, top_p=0.95, seed=0)
    text = Text(prompt, style="cyan")
    n, t_first = 0, None
    result = None
    with Live(text, console=console, refresh_per_second=12, transient=False) as live:
        pieces: list[int] = []
        for event in llm.stream([prompt], params):
            if isinstance(event, list):
                result = event[0]
                break
            _, tok = event
            pieces.append(tok)
            n += 1
            if t_first is None:
                t_first = time.perf_counter()
            rate = (n - 1) / max(time.perf_counter() - t_first, 1e-9) if n > 1 else 0.0
            live.update(
                Text.assemble((prompt, "cyan"), llm.decode(pieces),
                              (f"\n[{counted(n, 'token')}" + (f", {rate:.0f} tok/s]" if n > 1 else "]"), "bold green"))
            )
    # the same plan held to a JSON Schema (structured output, engine/structured.py): the served feature, here in-process
    schema = {"type": "object", "properties": {"speaker": {"enum": ["HAMLET", "OPHELIA", "HORATIO", "KING"]},
                                               "line": {"type": "string", "maxLength": 48}},
              "required": ["speaker", "line"], "additionalProperties": False}
    shaped_max = min(96, room)
    shaped = llm.generate([prompt], SamplingParams(max_tokens=shaped_max, temperature=0.8, seed=0,
                                                   json_schema=schema))[0]
    if llm._pipeline is not None:
        llm.close()
    assert result is not None
    try:
        valid = shaped.finish_reason == "stop" and json.loads(shaped.text)["speaker"] in schema["properties"][
            "speaker"]["enum"]
    except ValueError:
        valid = False
    console.print(f"\nstructured output (a JSON Schema: speaker + line, same plan): [cyan]{escape(shaped.text)}[/cyan] "
                  f"({'valid JSON of the schema' if valid else f'cut at {shaped_max} tokens'})")
    m = result.metrics
    console.print(f"{decode_text(m)}, TTFT {m['ttft_s'] * 1e3:.0f} ms, "
                  f"{counted(len(result.token_ids), 'token')} ({escape(what)})")
    spec_stats = {k: v for k, v in m.items() if k.startswith("spec_")}
    if speculative:
        console.print(speculative_text(speculative, spec_stats), markup=False)
    head = planner_headline()
    t = Table(
        title="gpt-5.6-sol (~3T total / ~150B active, 80 layers; speculative config) on Cerebras WSE-3 — predicted"
    )
    t.add_column("question")
    t.add_column("answer", justify="right")
    t.add_row("wafers needed, 4-bit weights", f"{head['wafers_4bit']}")
    t.add_row("wafers needed, 16-bit weights", f"{head['wafers_16bit']}")
    t.add_row("tok/s per user, one layer per wafer (80), 4-bit", headline_cell(head, "tok_s_per_user"))
    t.add_row("  ... with MTP speculation (k=3, acceptance 0.85 assumed)", headline_cell(head, "tok_s_per_user_mtp"))
    t.add_row("TTFT, 1,000-token prompt", headline_cell(head, "ttft_s", 1e3, " ms"))
    t.add_row("GB200 NVL72, 4-bit: GPUs / tok/s per user",
              f"{head['nvl72_gpus']} / {headline_cell(head, 'nvl72_tok_s_per_user')}")
    t.caption = ("(90%: low-high): over the fit's bootstrap parameter sets, parameter uncertainty only; the MTP "
                 "acceptance is assumed, its range not included")
    console.print(t)
    console.print("commands: waferline plan gpt-5.6-sol --hardware wse-3 --weight-bits 4 ; "
                  "waferline simulate gpt-5.6-sol --hardware wse-3 --weight-bits 4 --devices 80 [--speculative mtp]")
    summary = {
        "checkpoint": str(ckpt),
        "trained": bundled,  # (the bundled sol-mini; a checkpoint given: "checkpoint" names it)
        "weight_bits": weight_bits,
        "plan": plan_text,
        "prompt": prompt,
        "text": result.text,
        "token_ids": result.token_ids,
        "decode_tokens_per_s": m["decode_tokens_per_s"],
        "ttft_s": m["ttft_s"],
        "speculative": speculative,
        **spec_stats,
        "structured_output": {"schema": schema, "text": shaped.text, "valid": valid},
        "layer_ms": timeline_ms,
        "planner": {k: v for k, v in head.items() if k not in ("memory_per_wafer_gb",)},
    }
    if report:
        from waferline.report.html import Report

        figs = _figures(timeline_ms, kinds, head, name)
        rep = Report(
            "waferline demo report", f"{name} run and gpt-5.6-sol predictions — {time.strftime('%Y-%m-%d %H:%M')}"
        )
        rep.add(
            "The run",
            text=prompt + result.text,
            note=f"{counted(len(result.token_ids), 'token')}, {decode_text(m)}, TTFT "
                 f"{m['ttft_s'] * 1e3:.0f} ms "
            f"({what if trained else 'random weights: the text is noise'}), {weight_bits}-bit weights, "
            "sampled T=0.8 top-p 0.95 seed 0"
            + (f"; {speculative_text(speculative, spec_stats)}" if speculative else ""),
        )
        rep.add(
            "Per-stage timeline",
            figure=figs["timeline"],
            note="Median wall time of each layer during decode steps, measured in a short single-process run of the "
                 "same "
            "checkpoint (each layer is one stage in the one-layer-per-wafer plan). The streamed run used: "
            f"{plan_text}.",
        )
        add_prediction_sections(rep, figs, head)
        # --- the twin (report/twin_section.py): a cached `waferline twin` result, not a new run (keeps the demo fast)
        try:
            from waferline.report.twin_section import add_twin_sections, load_result

            add_twin_sections(rep, *load_result())
        except Exception as e:  # noqa: BLE001 - the twin section must never break the demo
            rep.add(
                "The twin: simulator vs engine on this machine",
                text=f"twin section unavailable: {type(e).__name__}: {e}",
            )
        # --- end of the twin
        path = _write(out / "waferline-report.html", rep.to_html())
        summary["report"] = str(path)
        console.print(f"report: {path}", markup=False)
    _write(out / "demo.json", json.dumps(summary, indent=2))
    if json_out:
        print(json.dumps(summary))
    return 0
