"""`waferline serve --speculative ngram|mtp` over worker processes: the scheduler's speculation verifies through a
pipeline (two int4 stages of one layer each, engine/pipeline/serving.py) and through AFD (one attention rank, two FFN
ranks, engine/afd/serving.py). Concurrent greedy streams through the official ``openai`` client equal the same
requests sent alone, ``LLM.generate`` with the server's engine flags and the single-process engine; drafts, accepted
drafts, the MTP head's proposals and a seeded sampled request equal the single-process engine's.

The checkpoint is a 2-layer sol (Mamba-2 + dense FFN, MLA + MoE) with an MTP head, made so that drafts are often but
not always accepted: its embedding dominates the residual stream (the next token depends mostly on the last one, so
greedy output repeats what the prompt already holds) and its MTP head passes the next token's embedding through, so
verifies keep every length and every stage rolls Mamba-2 states back."""

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import torch

from server_helpers import _metrics, int4_with_tokenizer, serve_in_thread
from test_serve_speculative import PROMPTS, Oracle, _serve
from tiny_models import build
from waferline import LLM, SamplingParams
from waferline.cli import main
from waferline.engine.scheduler import Scheduler, SchedulerConfig, Sequence
from waferline.errors import ConfigError

pytestmark = pytest.mark.usefixtures("one_thread")

MAX_LEN, MAX_TOKENS, K = 128, 20, 3
ENGINES = {
    "pipeline": {"layers_per_stage": 1, "micro_batches": 2, "weight_bits": 4},
    "afd": {"afd": True, "attention_ranks": 1, "ffn_ranks": 2},  # (16-bit weights)
}
SEEDS = [[(7 * i + 3 * j) % 11 + 3 for j in range(3 + i)] for i in range(8)]
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=5, ignore_eos=True)


def _looping_sol(out: Path) -> None:
    """The random 2-layer sol with an MTP head described in the module docstring (fp32)."""
    from safetensors.torch import load_file, save_file

    from waferline.demo import DEMO_TEXT, SOL_DEMO_CONFIG, write_tokenizer
    from waferline.model.init import write_random_checkpoint

    cfg = dict(SOL_DEMO_CONFIG, num_hidden_layers=2, mixer_types=["mamba2", "mla"], ffn_types=["dense", "moe"],
               num_nextn_predict_layers=1)
    write_random_checkpoint(cfg, out)
    f = out / "model.safetensors"
    sd = load_file(f)
    D = cfg["hidden_size"]
    sd["model.embed_tokens.weight"] *= 30
    mtp = "model.layers.2."  # (stored after the decoder layers)
    sd[mtp + "eh_proj.weight"] = torch.cat([torch.eye(D), torch.zeros(D, D)], 1)  # [enorm(embedding), hnorm(h)] -> e
    for name in ("self_attn.o_proj", "mlp.down_proj"):
        sd[f"{mtp}{name}.weight"] *= 0.05
    save_file(sd, f, metadata={"format": "pt"})
    write_tokenizer(out, DEMO_TEXT, cfg["vocab_size"])


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:

    tmp = tmp_path_factory.mktemp("serve-spec-runners")
    _looping_sol(tmp / "fp32")
    int4_with_tokenizer(tmp / "fp32", tmp / "int4")
    return {"pipeline": tmp / "int4", "afd": tmp / "fp32"}


@pytest.fixture(scope="module")
def singles(ckpts) -> dict[str, tuple[LLM, list[list[int]]]]:
    """Per engine: the single-process engine on its checkpoint, and the prompts: each seed, the engine's greedy
    continuation of it, then the seed again (the n-gram drafter finds the continuation in the prompt)."""
    out = {}
    for engine, ck in ckpts.items():
        llm = LLM(ck)
        conts = [o.token_ids for o in llm.generate(SEEDS, SamplingParams(max_tokens=6, ignore_eos=True))]
        out[engine] = (llm, [s + c + s for s, c in zip(SEEDS, conts)])
    return out


def _config(method: str) -> SchedulerConfig:
    """The scheduler the servers run (build_server's defaults, fixed K)."""
    return SchedulerConfig(max_num_seqs=8, max_model_len=MAX_LEN, chunk_tokens=16, speculative=method,
                           num_speculative_tokens=K, speculative_adaptive=False)


def _log_proposals(sch: Scheduler) -> list:
    """Record (the sequence's tokens, its drafts) of every proposal of ``sch``'s drafter from now on."""
    log: list = []
    drafter = sch.spec_dec.drafter
    inner = drafter.propose

    def propose(rows, seqs, ks, params, gens):
        props = inner(rows, seqs, ks, params, gens)
        log.extend((tuple(seqs[b]), tuple(p.tokens)) for b, p in zip(rows, props) if p.tokens)
        return props

    drafter.propose = propose
    return log


def _schedule(llm: LLM, method: str, prompts, params) -> tuple[list[list[int]], dict, list]:
    """The single-process engine's scheduler with the servers' configuration: (tokens per request, its stats, the
    drafter's proposals)."""
    sch = Scheduler(llm, _config(method))
    log = _log_proposals(sch)
    got: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        sch.add(Sequence(f"r{i}", p, params[i] if isinstance(params, list) else params,
                         lambda ev, i=i: got[i].append(ev.token_id) if ev.token_id is not None else None))
    while sch.has_work():
        sch.step()
    return [got[i] for i in range(len(prompts))], dict(sch.stats), log


@pytest.fixture(scope="module", params=[(e, m) for e in ENGINES for m in ("ngram", "mtp")], ids="-".join)
def served(request, ckpts):
    """A live server on the engine's processes with ``--speculative`` METHOD; (engine, method, app, openai client)."""
    from waferline.server.commands import build_server

    engine, method = request.param
    app = build_server(ckpts[engine], max_num_seqs=8, max_model_len=MAX_LEN, chunk_tokens=16, speculative=method,
                       num_speculative_tokens=K, speculative_adaptive=False, **ENGINES[engine])
    with serve_in_thread(app) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
        app.state.base = base
        yield engine, method, app, client


def _stream(client, prompt: list[int], **kw) -> list[int]:
    """One streamed completion of a token-id prompt: its token ids."""
    out = client.completions.create(model=client.models.list().data[0].id, prompt=prompt, max_tokens=MAX_TOKENS,
                                    stream=True, extra_body={"ignore_eos": True, "return_token_ids": True}, **kw)
    return [t for c in out if c.choices for t in (c.choices[0].model_extra.get("token_ids") or [])]


def test_concurrent_streams_equal_alone_generate_and_single_process(served, ckpts, singles):
    engine, method, app, client = served
    sch = app.state.server.engine.scheduler
    assert type(sch.runner).__name__ == ("PipelineRunner" if engine == "pipeline" else "AFDRunner")
    assert sch.runner.pipe.num_stages == 3 if engine == "afd" else 2  # (AFD: processes)
    assert sch.runner.keep_hidden == (method == "mtp")
    single, prompts = singles[engine]
    with ThreadPoolExecutor(len(prompts)) as ex:
        together = list(ex.map(lambda p: _stream(client, p, temperature=0), prompts))
    alone = [_stream(client, p, temperature=0) for p in prompts]
    want = [o.token_ids for o in single.generate(prompts, GREEDY)]
    assert together == alone == want and all(len(t) == MAX_TOKENS for t in want)
    # LLM.generate with the server's engine flags (a pipeline speculates with the method itself; AFD does not)
    extra = {"speculative": method, "num_speculative_tokens": K} if engine == "pipeline" else {}
    with LLM(ckpts[engine], **ENGINES[engine], **extra) as llm:
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want
    m = _metrics(app)
    # (every rollback depth)
    assert 0 < m["waferline_spec_accepted_tokens_total"] < m["waferline_spec_draft_tokens_total"]
    if method == "mtp":  # (the MTP head runs in the scheduler's process: its cache's pages are the scheduler's)
        table = sch.spec_dec.drafter.caches[0].table
        assert table is sch.cache.draft_table and table.max_pages > 1 and table.live == 0
        assert m['waferline_cache_pages_in_use{kind="mtp_mla"}'] == 0


def test_verify_steps_stay_in_flight_over_a_pipeline(served, singles):
    """Over a pipeline the engine loop keeps speculative steps in flight too (engine/overlap.py): a step's verify rows
    are launched while another step is in the stages, so the stages keep working while a step is judged and the next
    one drafted (they ran one step at a time: 0.4-0.7x plain decoding at 8 rows on 2 stages, even with every draft
    backed off); the tokens are the lone requests' and the single-process engine's."""
    engine, method, app, client = served
    if engine != "pipeline":
        pytest.skip("only a pipeline's runner keeps steps in flight")
    runner = app.state.server.engine.scheduler.runner
    assert app.state.server.engine.stepper is not None
    submits: list[tuple[int, int]] = []  # (verify rows, steps already in flight) per submit
    inner = runner.submit

    def submit(decodes, prefills, verifies=(), parts=None):
        submits.append((len(verifies), len(runner._submitted)))
        return inner(decodes, prefills, verifies, parts)

    runner.submit = submit
    try:
        single, prompts = singles[engine]
        with ThreadPoolExecutor(len(prompts)) as ex:
            got = list(ex.map(lambda p: _stream(client, p, temperature=0), prompts))
    finally:
        del runner.submit
    assert got == [o.token_ids for o in single.generate(prompts, GREEDY)]
    assert any(v and busy for v, busy in submits)  # a verify launched with another step in the stages
    assert not app.state.server.engine.scheduler.busy and not runner._submitted


def test_a_dead_stage_fails_the_verifies_in_flight_then_the_pipeline_serves_again(ckpts, singles):
    """A stage killed while speculative steps are in flight (engine/overlap.py): every stream ends with an error naming
    the dead stage (none hangs), nothing stays in flight, and once the stages are rebuilt a request gives the
    single-process engine's tokens again (drafter and rollback state start afresh)."""
    import os
    import signal

    from server_helpers import _wait_until
    from waferline.server.commands import build_server

    app = build_server(ckpts["pipeline"], max_num_seqs=8, max_model_len=MAX_LEN, chunk_tokens=16, speculative="mtp",
                       num_speculative_tokens=K, speculative_adaptive=False, hang_timeout_s=4.0,
                       **ENGINES["pipeline"])
    engine = app.state.server.engine
    single, prompts = singles["pipeline"]
    with serve_in_thread(app) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)

        def doomed(p: list[int]) -> BaseException | None:
            try:
                for _ in client.completions.create(model=client.models.list().data[0].id, prompt=p, stream=True,
                                                   max_tokens=MAX_LEN - len(p) - K - 1, temperature=0,
                                                   extra_body={"ignore_eos": True}):
                    pass
            except openai.APIError as e:
                return e
            return None

        pids = engine.scheduler.runner.pipe.pids
        with ThreadPoolExecutor(4) as ex:
            futures = [ex.submit(doomed, p) for p in prompts[:4]]
            assert _wait_until(lambda: engine.scheduler.stats.get("spec_verify_steps", 0) >= 4, 30)
            os.kill(pids[0], signal.SIGKILL)
            errors = [f.result(timeout=60) for f in futures]
        assert _wait_until(lambda: engine.healthy, 60, 0.1)
        assert not engine.scheduler.busy and not engine.scheduler.runner._submitted
        assert all(isinstance(e, openai.APIError) and "stage 1" in str(e) and "died" in str(e) for e in errors), errors
        got = _stream(client, prompts[5], temperature=0)
    assert got == single.generate([prompts[5]], GREEDY)[0].token_ids


def test_acceptance_and_drafts_equal_the_single_process_engine(served, singles):
    """The same requests give the same drafts, the same accepted drafts (/metrics) and the same tokens as on the
    single-process engine's scheduler: the MTP head, here in the scheduler's process, gets the same hidden states
    from the last stage; a seeded sampled request verifies with the same logits and generator."""
    engine, method, app, client = served
    single, prompts = singles[engine]
    params = [GREEDY] * len(prompts) + [SAMPLED]
    want, stats, want_log = _schedule(single, method, prompts + [prompts[0]], params)
    assert 0 < stats["spec_accepted"] < stats["spec_drafted"] and len(want_log) > 0
    log = _log_proposals(app.state.server.engine.scheduler)
    before = _metrics(app)
    with ThreadPoolExecutor(len(prompts)) as ex:
        got = list(ex.map(lambda p: _stream(client, p, temperature=0), prompts))
    got.append(_stream(client, prompts[0], temperature=SAMPLED.temperature, seed=SAMPLED.seed))
    after = _metrics(app)
    assert got == want
    for name, key in (("waferline_spec_draft_tokens_total", "spec_drafted"),
                      ("waferline_spec_accepted_tokens_total", "spec_accepted")):
        assert after[name] - before[name] == stats[key], name
    assert sorted(log) == sorted(want_log)


@pytest.mark.parametrize("engine, mt", [("pipeline", "gpt_oss"), ("pipeline", "qwen3_next"),
                                        ("pipeline", "deepseek_v4"), ("afd", "gpt_oss")])
def test_every_cache_kind_rolls_back_on_every_process(engine, mt, tmp_path):
    """Sliding-window rings, linear-attention states and DeepSeek-V4's compressed caches, split over two stages (or
    on an attention rank): verifies with every accepted length (a drafter that knows the answer and corrupts one
    draft at a cycling depth) give plain greedy's tokens."""
    build(mt, tmp_path)
    want = [o.token_ids for o in LLM(tmp_path).generate(PROMPTS, GREEDY)]
    flags = {"stages": 2} if engine == "pipeline" else {"afd": True, "ffn_ranks": 2}
    with LLM(tmp_path, **flags) as llm:
        sch = Scheduler(llm, SchedulerConfig(max_num_seqs=4, max_model_len=96, chunk_tokens=5,
                                             max_num_batched_tokens=24, speculative="ngram", num_speculative_tokens=4,
                                             speculative_adaptive=False))
        sch.spec_dec.drafter = Oracle([p + w for p, w in zip(PROMPTS, want)])
        got, ends = _serve(sch, PROMPTS, GREEDY)
    assert got == want and ends == ["length"] * len(PROMPTS)
    assert 0 < sch.stats["spec_accepted"] < sch.stats["spec_drafted"]


def test_serve_takes_speculative_with_stages_and_afd(ckpts, capsys):
    """`serve --speculative` passes the flag checks with --stages and with --afd; a method the server cannot draft
    with is refused, with the reason, whatever the engine."""
    from waferline.cli import build_parser
    from waferline.engine_flags import check_engine_flags
    from waferline.server.commands import build_server

    for flags in (["--stages", "2", "--speculative", "ngram"], ["--afd", "--speculative", "mtp"]):
        args = build_parser().parse_args(["serve", "--model", str(ckpts["afd"]), *flags])
        assert check_engine_flags(args) is None and args.speculative == flags[-1]
    for kw in ({"stages": 2}, {"afd": True}):
        with pytest.raises(ConfigError, match="not a checkpoint directory"):
            build_server(ckpts["afd"], speculative="draft:/x", **kw)
    assert main(["serve", "--model", str(ckpts["afd"]), "--afd", "--speculative", "medusa"]) == 2
    assert "--speculative medusa: unknown method" in capsys.readouterr().err
