"""verispec bench: method parsing, lossless checks, metrics, reports and the harness on
synthetic Records and toy models; one real `verispec bench --quick` run (marked real)."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch
from typer.testing import CliRunner

from verispec.bench import lossless
from verispec.bench.datasets import BenchPrompt
from verispec.bench.harness import PromptBuilder, Record, fit_context, rotated, run
from verispec.bench.lossless import check_greedy, check_records, exactness_counts, first_divergence, is_near_tie
from verispec.bench.methods import BASELINE, MethodSpec, parse_method, with_baseline
from verispec.bench.metrics import OVERALL, Spread, summarize, tau, totals
from verispec.bench.peers import cut_at_eos
from verispec.bench.report import markdown, speedup_table, write_all
from verispec.bench.runners import EngineRunner, Generation, Runner
from verispec.cli import app
from verispec.drafters.base import NoDrafter
from verispec.drafters.prompt_lookup import PromptLookupDrafter
from verispec.types import SamplingParams

DRAFTERS = ("none", "prompt-lookup", "draft")


def rec(method="none", qid=1, category="rag", turn=0, repeat=0, tokens=(5, 6, 7), wall=1.0, prefill=0.5,
        steps=2, drafted=0, accepted=0, accepted_at=(), drafted_at=(), forwards=None, prompt=(1, 2),
        finish="length", cpu=None) -> Record:
    return Record(method, qid, category, turn, repeat, tuple(prompt), tuple(tokens), finish, wall, prefill,
                  steps + 1 if forwards is None else forwards, steps, drafted, accepted,
                  tuple(accepted_at), tuple(drafted_at), 100.0, cpu_s=cpu)


# ---- methods --------------------------------------------------------------------------------


def test_parse_method_keeps_colons_in_values_and_orders_options():
    spec = parse_method("draft:model=truncated:6", DRAFTERS)
    assert spec == MethodSpec("draft", (("model", "truncated:6"),))
    assert spec.label == "draft:model=truncated:6" and spec.kind == "engine"
    two = parse_method("prompt-lookup:num_candidates=3, max-ngram=4", DRAFTERS)
    assert two.options == (("num_candidates", "3"), ("max_ngram", "4"))
    assert parse_method("hf-assisted:model=truncated:4", DRAFTERS).kind == "hf"
    assert parse_method("llamacpp-pld", DRAFTERS).is_peer


@pytest.mark.parametrize("bad", ["nope", "prompt-lookup:k", "draft:=3", "hf-magic"])
def test_parse_method_rejects_bad_specs(bad):
    with pytest.raises(ValueError):
        parse_method(bad, DRAFTERS)


def test_baseline_comes_first_once():
    specs = with_baseline([parse_method(m, DRAFTERS) for m in ["prompt-lookup", "none", "prompt-lookup"]])
    assert [s.label for s in specs] == [BASELINE, "prompt-lookup"]


# ---- lossless -------------------------------------------------------------------------------


def test_first_divergence_ids_and_lengths():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 7]) == 2
    assert first_divergence([], [4]) == 0


def test_near_tie_rule():
    assert is_near_tie(4e-4, (11, 42), 42, (2,))
    assert is_near_tie(4e-4, (11, 42), 11, (2,))
    assert not is_near_tie(4e-4, (11, 42), 7, (2,))
    assert not is_near_tie(0.3, (11, 42), 42, (2,))
    assert is_near_tie(1e-5, (2, 42), None, (2,))  # candidate stopped: EOS must be in the top 2
    assert not is_near_tie(1e-5, (9, 42), None, (2,))
    assert not is_near_tie(float("nan"), (11, 42), 42, (2,))


class _FixedLogits:
    """A backend whose next-token logits are fixed: token 3 leads token 4 by ``gap``."""

    def __init__(self, gap: float):
        from verispec.models.base import ModelInfo

        self.gap = gap
        self.info = ModelInfo("fixed", 8, 64, None, (0,), 4, torch.float32, torch.device("cpu"))

    def new_cache(self, max_length=None):
        return None

    def forward(self, ids, pos, cache, tree_mask=None, want_hidden=False):
        from verispec.models.base import ModelOutput

        logits = torch.zeros(1, ids.shape[1], 8)
        logits[..., 3], logits[..., 4] = 5.0, 5.0 - self.gap
        return ModelOutput(logits, None)


def test_check_greedy_classifies_with_the_target():
    near, far = _FixedLogits(1e-4), _FixedLogits(2.0)
    assert check_greedy(near, [1], [3, 3], [3, 3]).status == "equal"
    c = check_greedy(near, [1], [3, 3], [3, 4])
    assert (c.status, c.first_divergence) == ("near-tie", 1) and c.gap == pytest.approx(1e-4, rel=1e-2)
    assert check_greedy(near, [1], [3, 3], [3, 5]).status == "mismatch"  # not the runner-up
    assert check_greedy(far, [1], [3, 3], [3, 4]).status == "mismatch"
    assert "reference 3 vs candidate 4" in c.describe([3, 3], [3, 4])


def test_check_records_counts_skips_later_turns_and_never_hides_mismatches():
    backend = _FixedLogits(2.0)
    records = [
        rec("none", 1, tokens=(3, 3)), rec("none", 1, turn=1, prompt=(1, 2, 3, 3, 9), tokens=(3,)),
        rec("pld", 1, tokens=(3, 3)), rec("pld", 1, turn=1, prompt=(1, 2, 3, 3, 9), tokens=(3,)),
        rec("none", 2, tokens=(3, 3)), rec("none", 2, turn=1, prompt=(1, 2, 3, 3, 9), tokens=(3,)),
        rec("pld", 2, tokens=(3, 4)), rec("pld", 2, turn=1, prompt=(1, 2, 3, 4, 9), tokens=(3,)),
    ]
    rows = check_records(records, "none", backend)
    assert [r.status for r in rows] == ["equal", "equal", "mismatch", "skipped"]
    assert exactness_counts(rows) == {"pld": {"equal": 2, "near-tie": 0, "mismatch": 1, "skipped": 1}}


def test_tests_exactness_helper_uses_the_package_rule():
    import exactness

    assert exactness.NEAR_TIE == lossless.NEAR_TIE
    assert exactness.compare_greedy(_FixedLogits(1e-4), [1], [3], [4]).near_tie_at == 0
    with pytest.raises(AssertionError, match="token 0"):
        exactness.compare_greedy(_FixedLogits(2.0), [1], [3], [4])


# ---- metrics --------------------------------------------------------------------------------


def test_totals_tau_alpha_per_position():
    rs = [rec("pld", 1, tokens=range(10), steps=4, drafted=8, accepted=5, accepted_at=(3, 2), drafted_at=(4, 4)),
          rec("pld", 2, tokens=range(6), steps=2, drafted=4, accepted=3, accepted_at=(2, 1), drafted_at=(2, 2))]
    s = {x.category: x for x in summarize(rs, "none")}[OVERALL]
    assert s.tau == pytest.approx((8 + 6) / 6)
    assert s.alpha == pytest.approx(8 / 12)
    assert s.per_position == pytest.approx((5 / 6, 3 / 6))
    assert s.forwards_per_token == pytest.approx(8 / 16)
    assert s.speedup.mean is None  # no baseline records


def test_peer_tau_from_forwards_counts_the_final_eos():
    # a plain peer: 5 tokens + EOS after prefill -> prefill gives token 1, 5 steps give 4 tokens + EOS
    r = rec("hf", tokens=range(5), steps=5, forwards=6, drafted=None, accepted=None, finish="eos")
    r = replace(r, accepted_at=None, drafted_at=None)
    assert tau(totals([r])) == pytest.approx(1.0)


def test_speedup_is_a_ratio_of_totals_per_category_with_spread_over_repeats():
    rs = []
    for rep, (t_base, t_pld) in enumerate([(2.0, 1.0), (2.0, 0.5)]):
        rs += [rec("none", 1, "rag", repeat=rep, tokens=range(10), wall=t_base, prefill=0.0),
               rec("pld", 1, "rag", repeat=rep, tokens=range(10), wall=t_pld, prefill=0.0),
               rec("none", 2, "qa", repeat=rep, tokens=range(10), wall=1.0, prefill=0.0),
               rec("pld", 2, "qa", repeat=rep, tokens=range(10), wall=1.0, prefill=0.0)]
    by = {(s.method, s.category): s for s in summarize(rs, "none")}
    rag = by[("pld", "rag")].speedup
    assert (rag.mean, rag.min, rag.max) == pytest.approx((3.0, 2.0, 4.0))
    assert rag.std == pytest.approx(math.sqrt(2))
    assert by[("pld", "qa")].speedup.mean == pytest.approx(1.0)
    # overall: (20 tokens / 2 s) / (20 tokens / 3 s) = 1.5 in repeat 0; 20/1.5 / (20/3) = 2 in repeat 1
    assert by[("pld", OVERALL)].speedup.mean == pytest.approx(1.75)
    assert by[("none", OVERALL)].speedup.mean == pytest.approx(1.0)


def test_decode_and_cpu_speedups():
    rs = [rec("none", tokens=range(11), wall=3.0, prefill=1.0, cpu=2.0),
          rec("pld", tokens=range(11), wall=2.0, prefill=1.0, cpu=0.5)]
    s = {x.method: x for x in summarize(rs, "none") if x.category == OVERALL}["pld"]
    assert s.speedup.mean == pytest.approx(1.5)
    assert s.decode_speedup.mean == pytest.approx(2.0)  # prefill time left out
    assert s.cpu_speedup.mean == pytest.approx(4.0)
    assert summarize([replace(r, cpu_s=None) for r in rs], "none")[-1].cpu_speedup.mean is None


def test_spread_of_single_and_empty():
    assert Spread.of([1.2]) == Spread(1.2, 0.0, 1.2, 1.2)
    assert Spread.of([None]).mean is None


# ---- report ---------------------------------------------------------------------------------


def _meta(**kw):
    return {"model": "toy", "backend": "hf", "dtype": "float32", "temperature": 0.0, "top_p": 1.0, "top_k": 0,
            "started": "now", "machine": "test", "threads": 1, "prompts": 2, "max_new_tokens": 8,
            "num_draft_tokens": 4, "repeats": 1, "warmup": 0, "command": "verispec bench", "notices": []} | kw


def test_report_tables_json_and_plots(tmp_path):
    rs = [rec("none", 1, "rag", tokens=(3, 3)), rec("pld", 1, "rag", tokens=(3, 4), wall=0.5, drafted=4,
                                                        accepted=2, accepted_at=(1, 1), drafted_at=(2, 2)),
          rec("none", 2, "qa"), rec("pld", 2, "qa", wall=0.5, drafted=2, accepted=1, accepted_at=(1,), drafted_at=(2,))]
    summaries = summarize(rs, "none")
    rows = check_records(rs, "none", _FixedLogits(2.0))
    table = "\n".join(speedup_table(summaries))
    assert "| `pld` | 2.00× | 2.00× | 2.00× |" in table and "| method | rag | qa | overall |" in table
    md = markdown(_meta(), summaries, rows, {"pld": 2**20})
    assert "**mismatch**" in md and "| `pld` | 2 | 1 | 0 | 1 | 0 |" in md
    paths = write_all(tmp_path / "out", _meta(), rs, summaries, rows, {"pld": 0})
    data = json.loads(paths["json"].read_text())
    assert len(data["records"]) == 4 and data["exactness"]["counts"]["pld"]["mismatch"] == 1
    assert data["records"][1]["token_ids"] == [3, 4]
    for key in ("speedup_plot", "cpu_speedup_plot", "acceptance_plot"):
        assert paths[key].read_bytes()[:4] == b"\x89PNG"
    sampled = markdown(_meta(temperature=0.7), summaries, [], {})
    assert "exactness" not in sampled.split("## Per method")[0] and "not checked (sampling)" in sampled


# ---- harness --------------------------------------------------------------------------------


def test_fit_context_and_rotation():
    assert fit_context([1, 5, 6, 7, 8], 3, True) == ([1, 7, 8], True)
    assert fit_context([1, 5, 6, 7, 8], 3, False) == ([6, 7, 8], True)
    assert fit_context([1, 5], 3, True) == ([1, 5], False)
    assert rotated(["a", "b", "c"], 1) == ["b", "c", "a"] and rotated(["a", "b"], 4) == ["a", "b"]


def test_cut_at_eos():
    assert cut_at_eos([5, 6, 2, 0, 0], (2,), 8) == ([5, 6], "eos")
    assert cut_at_eos([5, 6, 7], (2,), 2) == ([5, 6], "length")


class _Echo(Runner):
    """A fake runner: answers with the prompt's last token repeated; logs its calls."""

    def __init__(self, label, log):
        self.label, self.log = label, log

    def generate(self, prompt_ids, params):
        self.log.append((self.label, len(prompt_ids)))
        return Generation((prompt_ids[-1],) * 2, "length", 0.1, 0.05, 3, 2, 0, 0, (), ())

    def memory_bytes(self):
        return 0


def _builder():
    def encode(messages):
        return [len(m["content"]) for m in messages]  # one id per message: its length

    return PromptBuilder(encode, lambda ids: "x" * len(ids), max_prompt_tokens=100)


def test_run_interleaves_rotates_and_feeds_each_methods_own_answer():
    log = []
    runners = [_Echo("none", log), _Echo("pld", log)]
    prompts = [BenchPrompt(1, "mt_bench", ("aaaa", "bbb")), BenchPrompt(2, "rag", ("cc",))]
    records = run(runners, prompts, _builder(), SamplingParams(max_new_tokens=4), repeats=2, warmup=1)
    assert log[:2] == [("none", 1), ("pld", 1)]  # warm-up, not recorded
    order = [label for label, _ in log[2:]]
    assert order == ["none", "none", "pld", "pld",  # prompt 1 repeat 0: both turns of a method together
                     "pld", "pld", "none", "none",  # repeat 1: rotated
                     "none", "pld", "pld", "none"]  # prompt 2 (one turn), repeats 0 and 1
    assert len(records) == 12
    second = [r for r in records if r.turn == 1]
    assert {r.prompt_ids for r in second} == {(4, 2, 3)}  # user, own 2-token answer, user
    assert {r.category for r in records} == {"mt_bench", "rag"}


def test_run_rejects_duplicate_labels():
    log = []
    with pytest.raises(ValueError, match="same label"):
        run([_Echo("a", log), _Echo("a", log)], [BenchPrompt(1, "qa", ("x",))], _builder(), SamplingParams())


def test_engine_runner_records_on_a_toy_target(toy_target):
    base = EngineRunner("none", toy_target, NoDrafter(), 4)
    pld = EngineRunner("prompt-lookup", toy_target, PromptLookupDrafter(), 4)
    prompts = [BenchPrompt(7, "summarization", ("ignored",))]
    builder = PromptBuilder(lambda m: [1, 5, 6, 7, 5, 6, 7, 5, 6], lambda ids: "", 100)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    records = run([base, pld], prompts, builder, params, warmup=0)
    by = {r.method: r for r in records}
    assert by["none"].new_tokens == 12 and by["none"].steps == 11 and by["none"].drafted == 0
    assert by["prompt-lookup"].token_ids == by["none"].token_ids
    assert by["prompt-lookup"].drafted > 0
    assert all(r.wall_s > 0 and r.prefill_s > 0 for r in records)
    rows = check_records(records, "none", toy_target)
    assert [r.status for r in rows] == ["equal"]


# ---- command line ---------------------------------------------------------------------------


@pytest.mark.parametrize("args,message", [
    (["-m", "bogus"], "unknown method"),
    (["-c", "poetry"], "unknown categories"),
    (["--data", "/nonexistent/q.jsonl"], "not found"),
    (["-m", "prompt-lookup:k"], "key=value"),
    (["--repeats", "0"], ">= 1"),
    (["--model", "stories260k", "--limit", "1", "-m", "none:prefix_cache_mb=x"], "must be a number"),
    (["--model", "stories260k", "--limit", "1", "-m", "prompt-lookup:k=two"], "must be an integer"),
])
def test_bad_input_is_one_line_and_exit_2(args, message, tmp_path):
    result = CliRunner().invoke(app, ["bench", "--output-dir", str(tmp_path / "out"), *args])
    assert result.exit_code == 2
    assert message in result.output and "Traceback" not in result.output


def test_transformers_peers_match_our_baseline_on_a_toy_target(toy_target):
    from verispec.bench.peers import HFGenerateRunner

    eos = toy_target.info.eos_token_ids
    runners = [EngineRunner("none", toy_target, NoDrafter(), 4),
               HFGenerateRunner("hf-generate", toy_target.model, "plain", 4, eos),
               HFGenerateRunner("hf-pld", toy_target.model, "pld", 4, eos)]
    builder = PromptBuilder(lambda m: [1, 5, 6, 7, 5, 6, 7, 5, 6], lambda ids: "", 100)
    for ignore_eos in (True, False):
        params = SamplingParams(max_new_tokens=16, ignore_eos=ignore_eos)
        records = run(runners, [BenchPrompt(1, "qa", ("x",))], builder, params, warmup=0)
        by = {r.method: r for r in records}
        assert by["hf-generate"].token_ids == by["none"].token_ids
        assert by["hf-pld"].token_ids == by["none"].token_ids
        assert by["hf-generate"].target_forwards == by["none"].target_forwards
        assert by["hf-pld"].target_forwards <= by["hf-generate"].target_forwards


def test_presets_yield_to_explicit_options():
    from verispec.bench.command import QUICK, resolve_preset

    assert resolve_preset(True, [], None, [], None, None) == QUICK
    p = resolve_preset(True, ["qa"], 3, ["draft"], 16, 2)
    assert (p.categories, p.limit, p.methods, p.max_new_tokens, p.warmup) == (("qa",), 3, ("draft",), 16, 2)
    assert resolve_preset(False, [], 0, [], None, None).limit == 0  # 0 = all prompts


def test_peers_that_cannot_run_are_skipped_with_a_notice(tmp_path):
    from verispec.api import load_model
    from verispec.bench.command import BenchOptions, build_runners

    lm = load_model("stories260k")
    opts = BenchOptions(None, ("qa",), 1, (), "stories260k", "hf", "float32", 0.0, 1.0, 0, 0, 8, 4, "fixed",
                        1, 0, 1, False, None, 1e-3, tmp_path, False, False)
    specs = with_baseline([parse_method(m, DRAFTERS) for m in ["llamacpp-pld", "hf-generate"]])
    runners, notices = build_runners(specs, lm, opts)
    assert [r.label for r in runners] == ["none", "hf-generate"]
    assert len(notices) == 1 and notices[0].startswith("llamacpp-pld skipped")
    with pytest.raises(ValueError, match="no option"):
        build_runners([parse_method("hf-pld:bogus=1", DRAFTERS)], lm, opts)
    (pld,), _ = build_runners([parse_method("prompt-lookup:num_candidates=3,k=24", DRAFTERS)], lm, opts)
    assert pld.engine.num_draft_tokens == 24 and pld.drafter.num_candidates == 3
