"""`specdec advise`: the decision tree on hand-made measurement tables (every branch reached, thresholds
respected at their edges, "defer" when nothing beats the noise), the mermaid it writes parses,
config.json round-trips into `generate` and `serve`, and a tiny-model run end to end."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from conftest import tiny_folder_with_tokenizer
from specdec.advise.decide import MAX_TOLERANCE, break_even_batch, build_tree, easiest_retrofit
from specdec.advise.measurements import Measurements, Option
from specdec.advise.render import check_mermaid, config_of, to_mermaid, write_outputs
from specdec.cli import apply_config, build_parser, main


def option(drafter: str, speedup: float, gamma: int = 4, batch: dict | None = None, prompts: int = 3) -> Option:
    return Option(name=f"specdec/{drafter}/{gamma}", drafter=drafter, gamma=gamma,
                  per_prompt={f"t{i}": speedup for i in range(prompts)}, tokens_per_s=10 * speedup, alpha=0.5, tau=2.0,
                  c=0.05, verified_per_step=gamma, step_cost=2.0 / speedup, batch_speedup=dict(batch or {}))


def table(*options: Option, output_tokens: float = 100, tokens_per_s: float = 50, noise: float = 0.03,
          concurrency=(1, 8, 32), threshold_ms: float = 100) -> Measurements:
    return Measurements(model="m", device="cpu", dtype="float32", kernels="cpu-exact", task="t", greedy=True,
                        num_prompts=3, plain_tokens_per_s=tokens_per_s, output_tokens=output_tokens, prefill_ms=20,
                        threshold_ms=threshold_ms, noise=noise, options=list(options), concurrency=list(concurrency))


PAYS_TO_8 = {1: 1.5, 8: 1.2, 32: 0.8}

CASES = {
    "defer": table(option("eagle", 2.0), output_tokens=4, tokens_per_s=100),  # 40 ms of decoding
    "plain": table(option("ngram", 1.02), option("eagle", 0.9)),
    "easier_wins": table(option("ngram", 1.48, batch=PAYS_TO_8), option("eagle", 1.50, batch=PAYS_TO_8)),
    "best_wins": table(option("ngram", 1.2), option("eagle", 1.5, batch=PAYS_TO_8), concurrency=(1, 4)),
    "cost_beyond": table(option("eagle", 1.5, batch=PAYS_TO_8), concurrency=(1, 32)),
}


def test_every_branch_is_reachable():
    paths = {name: build_tree(m).path for name, m in CASES.items()}
    assert paths["defer"] == ["decode", "defer"]
    assert paths["plain"] == ["decode", "pays", "plain"]
    assert paths["easier_wins"] == ["decode", "pays", "ask_ngram", "use_ngram", "load", "cost"]
    assert paths["best_wins"] == ["decode", "pays", "ask_ngram", "use_eagle", "load", "on"]
    assert paths["cost_beyond"] == ["decode", "pays", "use_eagle", "load", "cost"]
    every_node = {n.id for m in CASES.values() for n in build_tree(m).nodes}
    assert every_node == {node for path in paths.values() for node in path} | {"use_ngram"}


def test_recommendations_and_configs():
    actions = {name: build_tree(m).recommendation for name, m in CASES.items()}
    assert [actions[k].action for k in CASES] == ["defer", "plain", "speculate", "speculate", "speculate"]
    assert actions["best_wins"].option.drafter == "eagle" and actions["best_wins"].spec_policy == "on"
    assert actions["cost_beyond"].spec_policy == "cost"
    assert 8 < actions["cost_beyond"].break_even_batch < 32
    for name in ("defer", "plain"):
        config = config_of(CASES[name], build_tree(CASES[name]))
        assert (config["drafter"], config["spec_policy"]) == ("none", "off")
    config = config_of(CASES["best_wins"], build_tree(CASES["best_wins"]))
    assert (config["drafter"], config["gamma"], config["spec_policy"]) == ("eagle", 4, "on")


def test_thresholds_are_respected_at_their_edges():
    # decode time exactly at the threshold counts as the bottleneck
    assert build_tree(table(option("eagle", 2.0), output_tokens=5, tokens_per_s=50)).path[:2] == ["decode", "pays"]
    assert build_tree(table(option("eagle", 2.0), output_tokens=4.9, tokens_per_s=50)).path == ["decode", "defer"]
    # a speedup of exactly 1 + noise does not pay; just above it does
    assert build_tree(table(option("ngram", 1.05), noise=0.05)).recommendation.action == "plain"
    assert build_tree(table(option("ngram", 1.051), noise=0.05)).recommendation.action == "speculate"
    # the noise floor: a tiny measured noise still needs 2 %
    assert build_tree(table(option("ngram", 1.015), noise=0.001)).recommendation.action == "plain"
    # the easier drafter wins exactly at the tolerance, not below it; the tolerance is capped
    tol = 0.03
    at = table(option("ngram", 1.5 * (1 - tol) + 1e-9), option("eagle", 1.5), noise=tol)
    below = table(option("ngram", 1.5 * (1 - tol) - 1e-3), option("eagle", 1.5), noise=tol)
    assert build_tree(at).recommendation.option.drafter == "ngram"
    assert build_tree(below).recommendation.option.drafter == "eagle"
    noisy = table(option("ngram", 1.5 * (1 - MAX_TOLERANCE) - 1e-3), option("eagle", 1.5), noise=0.2)
    assert build_tree(noisy).recommendation.option.drafter == "eagle"


def test_defer_when_every_speedup_is_within_the_noise():
    m = table(option("ngram", 1.04), option("eagle", 1.06), option("medusa", 0.97), noise=0.07)
    tree = build_tree(m)
    assert tree.recommendation.action == "plain" and tree.path[-1] == "plain"
    assert easiest_retrofit(m) is None


def test_a_load_beyond_the_measured_batch_sizes_is_not_assumed_to_pay():
    m = table(option("eagle", 1.5, batch={1: 1.5, 8: 1.2}), concurrency=(1, 32))
    assert build_tree(m).recommendation.spec_policy == "cost"
    assert build_tree(replace(m, concurrency=[1, 8])).recommendation.spec_policy == "on"


def test_break_even_batch():
    assert break_even_batch({}) is None
    assert break_even_batch({1: 0.9, 8: 0.5}) == 0.0
    assert break_even_batch({1: 1.5, 8: 1.1}) is None
    assert break_even_batch({1: 1.5, 4: 1.0 + 1e-12, 16: 0.5}) == pytest.approx(4, rel=1e-6)
    assert break_even_batch({2: 1.2, 8: 0.8}) == pytest.approx(4)  # halfway in log2 rows


def test_mermaid_parses_for_every_case():
    for m in CASES.values():
        assert check_mermaid(to_mermaid(build_tree(m))) == []


@pytest.mark.parametrize("text, problem", [
    ("graph XY\n a[\"x\"]", "flowchart header"),
    ('flowchart TD\n a["x"]\n a -->|yes| b', "b is used but never defined"),
    ('flowchart TD\n a["say "hi""]', "not a node"),
    ('flowchart TD\n a["x"]\n a["y"]', "defined twice"),
    ('flowchart TD\n a["x"]\n class a,c taken', "c is used but never defined"),
])
def test_mermaid_check_catches_mistakes(text, problem):
    assert any(problem in p for p in check_mermaid(text))


def test_quotes_in_labels_are_escaped():
    m = table(replace(option("ngram", 1.5), drafter='ng"ram'))
    assert check_mermaid(to_mermaid(build_tree(m))) == []


def test_measurements_round_trip_through_json():
    m = CASES["cost_beyond"]
    back = Measurements.from_dict(json.loads(json.dumps(m.to_dict())))
    assert back.options[0].batch_speedup == m.options[0].batch_speedup
    assert build_tree(back).path == build_tree(m).path


def write_config(tmp_path, case: str = "best_wins"):
    m = CASES[case]
    write_outputs(m, tmp_path)
    return tmp_path / "config.json"


def parse_with_config(argv: list[str]):
    parser = build_parser()
    return apply_config(parser, parser.parse_args(argv), argv)


def test_config_round_trips_into_generate_and_serve(tmp_path):
    path = str(write_config(tmp_path))
    g = parse_with_config(["generate", "hi", "--config", path])
    assert (g.drafter, g.gamma, g.tree_nodes) == ("eagle", 4, None)
    s = parse_with_config(["serve", "--config", path])
    assert (s.drafter, s.gamma, s.spec_policy) == ("eagle", 4, "on")
    assert parse_with_config(["serve", "--config", path, "--gamma", "2"]).gamma == 2  # the command line wins
    plain = str(write_config(tmp_path / "plain", "plain"))
    assert parse_with_config(["serve", "--config", plain]).spec_policy == "off"
    shape = tmp_path / "shape.json"  # every tree flag is a config key too (CONFIG_KEYS)
    shape.write_text('{"drafter": "eagle", "tree_branch": 2, "tree_frontier": 3, "tree_lookup": 0}')
    tree = parse_with_config(["generate", "hi", "--config", str(shape)])
    assert (tree.tree_branch, tree.tree_frontier, tree.tree_lookup) == (2, 3, 0)


@pytest.mark.parametrize("content, message", [
    ("{not json", "not valid JSON"),
    ('{"drafter": "eagle", "colour": "red"}', "unknown key(s) ['colour']"),
    ("[1, 2]", "expected a JSON object"),
])
def test_bad_config_is_one_clear_line(tmp_path, capsys, content, message):
    path = tmp_path / "config.json"
    path.write_text(content)
    assert main(["generate", "hi", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_missing_config_is_one_clear_line(tmp_path, capsys):
    assert main(["serve", "--config", str(tmp_path / "nope.json")]) == 2
    assert "No such file" in capsys.readouterr().err


def test_advise_end_to_end_on_a_tiny_model(tmp_path, capsys):
    folder = tiny_folder_with_tokenizer(tmp_path)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the cat sat on the mat . the cat sat on\n1 + 2 = 3 . 4 + 5 = 9 . 1 + 2 =\n")
    out = tmp_path / "advise"
    code = main(["advise", "--task", str(prompts), "--model", str(folder), "--device", "cpu", "--raw",
                 "--drafters", "ngram,layer_skip", "--peers", "", "--concurrency", "1,2", "--budget-s", "60",
                 "--max-new-tokens", "12", "--threshold-ms", "0.001", "--out", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "specdec/ngram/2" in printed and "Recommendation" in printed
    for name in ("summary.md", "decision-tree.md", "decision-tree.png", "verdict.md", "config.json", "measurements.json"):
        assert (out / name).stat().st_size > 0
    assert "r(2) " in (out / "summary.md").read_text()  # the verify ratios behind every step cost
    tree_md = (out / "decision-tree.md").read_text()
    assert check_mermaid(tree_md.split("```mermaid\n")[1].split("```")[0]) == []
    m = Measurements.from_dict(json.loads((out / "measurements.json").read_text()))
    assert m.num_prompts == 2 and {o.drafter for o in m.options} == {"ngram", "layer_skip"}
    assert all(o.lossless for o in m.options)
    assert m.batch_plain_tokens_per_s.keys() == {2}  # one row: the rounds measured it
    assert all(o.batch_speedup[1] == o.speedup for o in m.options if o.batch_speedup)
    config = parse_with_config(["generate", "x", "--config", str(out / "config.json")])
    assert config.drafter in ("none", "ngram", "layer_skip")


def test_advise_bad_input(capsys):
    assert main(["advise", "--drafters", "ngram,nope", "--budget-s", "1"]) == 2
    assert "unknown drafter" in capsys.readouterr().err
    assert main(["advise", "--budget-s", "-1"]) == 2
    assert "--budget-s must be > 0" in capsys.readouterr().err


def test_fit_budget_drops_peers_then_extra_gammas_then_drafters():
    from specdec.advise.measure import AGAIN, fit_budget
    from specdec.bench.runner import PLAIN, Method

    methods = [Method(PLAIN, "specdec", "none"), Method(AGAIN, "specdec", "none"), Method("hf", "hf"),
               Method("specdec/ngram/2", "specdec", "ngram", 2), Method("specdec/ngram/4", "specdec", "ngram", 4),
               Method("specdec/eagle/3", "specdec", "eagle", 3), Method("specdec/lookahead/4", "specdec", "lookahead", 4)]
    seconds = {PLAIN: 3, AGAIN: 3, "hf": 9, "specdec/ngram/2": 2, "specdec/ngram/4": 4, "specdec/eagle/3": 2,
               "specdec/lookahead/4": 5}
    speedup = {"specdec/ngram/2": 1.3, "specdec/ngram/4": 1.1, "specdec/eagle/3": 1.2, "specdec/lookahead/4": 0.7}
    names = lambda kept: [m.name for m in kept]  # noqa: E731
    assert names(fit_budget(methods, seconds, speedup, 1e9, 2, [])) == names(methods)
    notes: list[str] = []
    kept = fit_budget(methods, seconds, speedup, 2 * 13, 2, notes)  # 28 s a round; 13 fit
    assert names(kept) == [PLAIN, AGAIN, "specdec/ngram/2", "specdec/eagle/3"]
    assert [n.split(":")[0] for n in notes] == ["hf", "specdec/ngram/4", "specdec/lookahead/4"]
    # the slower drafter goes, whatever its time: eagle (1.2x) stays over ngram/4 (1.1x) among extras
    speedup["specdec/ngram/2"] = 0.9
    kept = fit_budget(methods, seconds, speedup, 0, 2, [])
    assert names(kept) == [PLAIN, AGAIN, "specdec/ngram/4", "specdec/eagle/3"]


def test_a_configuration_dropped_early_is_shown_but_not_recommended():
    partial = option("eagle", 1.9, prompts=1)  # fast on the one prompt it got before it was dropped
    m = table(partial, option("ngram", 1.3, batch=PAYS_TO_8), option("medusa", 1.2))
    assert build_tree(m).recommendation.option.drafter == "ngram"
    from specdec.advise.render import summary_md

    assert "1.90× (1.90-1.90, 1 prompt(s) only)" in summary_md(m)


def test_drift_within_a_round_favours_nobody_and_is_not_noise():
    from specdec.advise.measure import AGAIN, per_prompt_speedups, relative_noise
    from specdec.bench.runner import PLAIN, RunRecord

    def run(method: str, task: str, speed: float) -> RunRecord:
        return RunRecord(method, task, None, 0, 100, 100 / speed, speed, [], None, None, None)

    records = []
    for task in ("a", "b", "c"):  # the machine slows steadily through each round: plain 100 -> 80
        records += [run(PLAIN, task, 100), run("early", task, 95), run("late", task, 85), run(AGAIN, task, 80)]
    early, late = per_prompt_speedups(records, "early"), per_prompt_speedups(records, "late")
    assert early == pytest.approx({t: 95 / (100 - 20 / 3) for t in "abc"})  # plain's speed at the run's place
    assert late == pytest.approx({t: 85 / (100 - 40 / 3) for t in "abc"})
    assert relative_noise(records) == pytest.approx(0.0)  # the same drift every round: no noise
    records[3] = run(AGAIN, "a", 90)
    records[-1] = run(AGAIN, "c", 100)  # rounds that drift differently: that is noise
    assert relative_noise(records) == pytest.approx(math.exp(1.4826 * math.log(100 / 90) / 2) - 1)
