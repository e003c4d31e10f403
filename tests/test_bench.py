"""A tiny-model bench run end to end: every method on every prompt, results.json / report.md / plots,
greedy outputs equal to plain decoding (for specdec and for transformers), and bench's bad inputs."""

from __future__ import annotations

import json
import statistics

import pytest

from conftest import tiny_folder_with_tokenizer, tiny_pair
from specdec.bench.report import format_table, write_outputs
from specdec.bench.runner import BenchConfig, run_bench
from specdec.cli import main


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    target = tiny_folder_with_tokenizer(tmp)
    tiny_pair(tmp, "llama", seed=1, logit_scale=8.0, num_hidden_layers=1)  # same vocabulary, no tokenizer
    prompts = tmp / "prompts.jsonl"
    prompts.write_text(
        '{"turns": ["the cat sat on the mat . the cat sat on"], "category": "copy"}\n'
        '{"turns": ["1 + 2 = 3 . 4 + 5 = 9 . 1 + 2 ="], "category": "math"}\n'
        '{"turns": ["The Cat sat on the mat ?"], "category": "copy"}\n'
    )
    return target, tmp / "llama-1", prompts


@pytest.fixture(scope="module")
def results(setup):
    target, draft, prompts = setup
    config = BenchConfig(task=str(prompts), limit=None, model=str(target), drafters=("ngram", "draft_model"),
                         gammas=(1, 3), peers=("hf", "hf-pld", "hf-assisted", "llamacpp"), max_new_tokens=12,
                         draft_model=str(draft), device="cpu", chat=False)
    return run_bench(config, progress=False)


def test_each_repeat_of_a_drafter_that_learns_across_requests_starts_alike(setup):
    """suffix learns from every request before: each repeat pass starts from the same state (the prompts before
    each one in that pass), so a repeat measures again instead of drafting the first pass's output for the same
    prompt. Greedy: every pass drafts and accepts the same."""
    target, _, prompts = setup
    config = BenchConfig(task=str(prompts), limit=None, model=str(target), drafters=("suffix",), gammas=(4,),
                         peers=(), max_new_tokens=12, device="cpu", chat=False, repeats=2)
    runs = [r for r in run_bench(config, progress=False)["runs"] if r["method"] == "specdec/suffix/4"]
    passes = [[(r["task_id"], r["stats"]["drafted"], r["stats"]["accepted"]) for r in runs if r["repeat"] == k] for k in (0, 1)]
    assert passes[0] == passes[1] and len(passes[0]) == 3


def test_a_drafter_variant_runs_beside_the_drafter(setup):
    """`--drafters suffix,suffix:fill=0:lookup_tokens=0`: two settings of one drafter in one interleaved run, each with
    an engine of its own built with its options over the run's (--suffix-options), both lossless."""
    from specdec.bench.runner import Runner, plan_methods

    target, _, prompts = setup
    config = BenchConfig(task=str(prompts), limit=None, model=str(target), drafters=("suffix", "suffix:fill=0:lookup_tokens=0"),
                         gammas=(4,), peers=(), max_new_tokens=12, device="cpu", chat=False,
                         drafter_extra={"max_spec_factor": 2.0})
    methods, _ = plan_methods(config, False)
    assert [m.name for m in methods] == ["specdec/none", "specdec/suffix/4", "specdec/suffix:fill=0:lookup_tokens=0/4"]
    configs = {name: engine.drafter.config for name, engine in Runner(config, methods).engines.items() if name != "specdec/none"}
    assert (configs["specdec/suffix/4"].fill, configs["specdec/suffix/4"].lookup_tokens) == (1, 8)
    assert (configs["specdec/suffix:fill=0:lookup_tokens=0/4"].fill, configs["specdec/suffix:fill=0:lookup_tokens=0/4"].lookup_tokens) == (0, 0)
    assert {c.max_spec_factor for c in configs.values()} == {2.0}
    results = run_bench(config, progress=False)
    assert [m["lossless"] for m in results["methods"][1:]] == [True, True]
    assert results["methods"][2]["options"] == (("fill", 0), ("lookup_tokens", 0))  # results.json: lists


def test_every_method_ran_on_every_prompt(results):
    names = [m["name"] for m in results["methods"]]
    assert names[0] == "specdec/none"
    assert {"specdec/ngram/1", "specdec/ngram/3", "specdec/draft_model/3", "hf", "hf-pld/3", "hf-assisted/1"} <= set(names)
    assert len(results["runs"]) == len(names) * 3
    assert results["categories"] == ["copy", "math"]


def test_greedy_outputs_equal_plain_decoding(results):
    for m in results["methods"]:
        if not m["name"].startswith("llamacpp"):
            assert m["lossless"], m["name"]
            assert m["matches_plain"] == m["num_outputs"] == 3


def test_summaries_are_measured(results):
    by_name = {m["name"]: m for m in results["methods"]}
    spec = by_name["specdec/draft_model/3"]
    assert 0 <= spec["acceptance_rate"] <= 1 and spec["mean_accepted_length"] >= 1
    assert spec["cost_coefficient"] > 0 and spec["verify_ratio"] == pytest.approx(results["calibration"]["verify_ratio"]["4"])
    assert spec["estimated_speedup"] > 0 and spec["tokens_per_s"]["median"] > 0
    assert by_name["specdec/none"]["speedup_vs_plain"]["median"] == pytest.approx(1.0)
    assert by_name["hf"]["speedup_vs_hf"]["median"] == pytest.approx(1.0)
    assert set(results["calibration"]["verify_ratio"]) == {"1", "2", "3", "4"}


def test_c_counts_in_plains_own_steps_of_the_same_run(results):
    """t1 is plain's target time per decode step in this run (beside the drafts), not the forward timed after it."""
    plain = [r["stats"] for r in results["runs"] if r["method"] == "specdec/none"]
    cal = results["calibration"]
    assert cal["t1_from"] == "plain runs"
    assert cal["t1_s"] == pytest.approx(statistics.median(s["target_s"] / s["decode_steps"] for s in plain))
    spec = next(m for m in results["methods"] if m["name"] == "specdec/draft_model/3")
    stats = [r["stats"] for r in results["runs"] if r["method"] == spec["name"]]
    draft_s, steps = sum(s["draft_s"] for s in stats), sum(s["decode_steps"] for s in stats)
    assert spec["cost_coefficient"] == pytest.approx(draft_s / steps / 3 / cal["t1_s"])


def test_missing_llama_cpp_is_a_note(results):
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is None:
        assert any(n.startswith("llamacpp: skipped") for n in results["notes"])


def test_outputs_written(results, tmp_path):
    files = write_outputs(results, tmp_path)
    names = {f.name for f in files}
    assert {"results.json", "report.md", "acceptance_vs_gamma.png", "speedup_vs_gamma.png",
            "acceptance_per_position.png", "tokens_per_s.png", "verify_ratio.png"} <= names
    assert json.loads((tmp_path / "results.json").read_text())["schema"] == "specdec.bench/1"
    report = (tmp_path / "report.md").read_text()
    assert "| specdec/ngram/3 |" in report and "estimated" in report and "## Speedup vs plain per category" in report
    table = format_table(results)
    assert "specdec/draft_model/3" in table and "x plain" in table


@pytest.mark.parametrize("args,message", [
    (["--gammas", "0,2"], "gammas must be >= 1"),
    (["--gammas", "", "--policies", "cost"], "gammas must be >= 1, got []"),
    (["--peers", "vllm"], "unknown peer"),
    (["--drafters", "magic"], "unknown drafter"),
    (["--peers", "hf-assisted"], "needs --draft-model"),
    (["--task", "/no/such/file.jsonl"], "no such task file"),
    (["--limit", "0"], "--limit must be >= 1"),
    (["--repeats", "0"], "repeats must be >= 1"),
    (["--drafters", "ngram:fill=0"], "options in --drafters are the suffix drafter's only"),
    (["--drafters", "suffix:fil=0"], "expected KEY=VALUE with KEY one of"),
    (["--drafters", "suffix:fill=x"], "fill must be a number"),
])
def test_bad_bench_input(capsys, args, message):
    assert main(["bench", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("specdec: error: ") and message in err and err.count("\n") == 1


def test_category_speedups_take_every_repeat():
    """A kind's speedup is the median over its prompts of median tok/s over repeats against plain's, as the
    overall figure: a slow first repeat (the machine busy at the start) must not decide it."""
    from specdec.bench.report import category_table
    from specdec.bench.runner import PLAIN, RunRecord, speedup_by_category

    def run(method, task, category, repeat, tps):
        return RunRecord(method, task, category, repeat, 10, 10 / tps, tps, [1], None, None, None)

    records = [run(PLAIN, t, c, k, 100.0) for t, c in (("1", "qa"), ("2", "qa"), ("3", "chat")) for k in range(3)]
    records += [run("m", "1", "qa", 0, 50.0), run("m", "1", "qa", 1, 110.0), run("m", "1", "qa", 2, 100.0),
                run("m", "2", "qa", 0, 60.0), run("m", "2", "qa", 1, 90.0), run("m", "2", "qa", 2, 120.0),
                run("m", "3", "chat", 0, 200.0), run("m", "3", "chat", 1, 200.0), run("m", "3", "chat", 2, 200.0)]
    by_category = speedup_by_category(records, "m")
    assert by_category == pytest.approx({"chat": 2.0, "qa": 0.95})  # qa: medians 1.00 and 0.90, not repeat 0's 0.55
    table = category_table({"categories": ["chat", "qa"], "methods": [{"name": "m", "speedup_vs_plain_by_category": by_category}]})
    assert "| m | 2.00x | 0.95x |" in table


def test_the_report_states_plain_decodings_own_spread():
    """With repeats, the report says how far plain's runs of one prompt moved (the noise under a speedup)."""
    from specdec.bench.report import noise_line
    from specdec.bench.runner import PLAIN, RunRecord, repeat_spread

    def run(task, repeat, tps):
        return RunRecord(PLAIN, task, "qa", repeat, 10, 10 / tps, tps, [1], None, None, None)

    spread = repeat_spread([run("1", 0, 90.0), run("1", 1, 100.0), run("1", 2, 120.0), run("2", 0, 50.0)], PLAIN)
    assert (spread["min"], spread["median"], spread["max"]) == pytest.approx((0.9, 1.0, 1.2))  # prompt 2: one run, no spread
    assert "0.900" in noise_line({"methods": [{"name": PLAIN, "repeat_spread": spread}]})
    assert repeat_spread([run("1", 0, 90.0)], PLAIN) is None
    assert noise_line({"methods": [{"name": PLAIN, "repeat_spread": None}]}) == ""
