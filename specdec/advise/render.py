"""`advise`'s pages: summary.md (the family matrix with measured and published columns),
decision-tree.md (mermaid, plus decision-tree.png drawn with matplotlib), verdict.md, config.json
(flags `serve --config` and `generate --config` read) and measurements.json; and the terminal table.

Mermaid is written in a small subset (nodes with quoted labels, labelled edges, one class for the
path taken) that `check_mermaid` parses, so a page that would not render is caught here.
"""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

from specdec.advise.decide import (
    Tree,
    build_tree,
    break_even_batch,
    complexity,
    describe,
    easiest_retrofit,
    noise_of,
    paired_margin,
    runner_up,
    tolerance_of,
)
from specdec.advise.measurements import Measurements, Option
from specdec.advise.survey import FAMILIES

CONFIG_SCHEMA = "specdec.config/1"


# ---- summary.md: the matrix --------------------------------------------------------------------

def fmt(x: float | None, spec: str = ".2f", none: str = "-") -> str:
    return none if x is None else format(x, spec)


def matrix_rows(m: Measurements) -> list[list[str]]:
    final = {o.drafter: o for o in m.best_per_drafter()}
    partial = {o.drafter: o for o in m.best_per_drafter(m.options)}
    rows = []
    for drafter, f in sorted(FAMILIES.items(), key=lambda kv: kv[1].complexity):
        o = final.get(drafter) or partial.get(drafter)
        prompts = "" if drafter in final else f", {len(o.per_prompt)} prompt(s) only" if o else ""
        measured = ["not measured"] + ["-"] * 6 if o is None else [
            f"γ{o.gamma}", fmt(o.alpha), fmt(o.tau), f"{o.speedup:.2f}× ({o.spread[0]:.2f}-{o.spread[1]:.2f}{prompts})",
            fmt(o.c, ".3f"), f"{o.memory_mb:.0f}", {True: "yes", False: "NO", None: "-"}[o.lossless]]
        rows.append([f.method, f.drafts, f.verifies, f"{f.complexity}/5: {f.retrofit}", f.best_when, *measured,
                     f"{f.published} [{f.source}]"])
    return rows


def summary_md(m: Measurements) -> str:
    head = ["method", "what drafts", "what verifies", "retrofit effort", "best when", "γ", "α", "τ",
            "speedup (p25-p75)", "c", "MiB", "lossless", "published (theirs) [source]"]
    lines = [f"# Speculative decoding, measured: {m.task} on {device_line(m)}", "",
             conditions(m), "",
             "Measured columns are this run's (each drafter at its fastest γ here; speedup = tokens/s vs plain "
             "decoding of the same target, median over prompts, with quartiles). The last column is what the "
             "method's authors published on their own models and hardware: a reference, not a prediction.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(cell.replace("|", "/") for cell in row) + " |" for row in matrix_rows(m)]
    lines += ["", "## Every configuration measured", "",
              "| configuration | prompts | tokens/s | speedup | p25-p75 | α | τ | c | step cost (τ to break even) |",
              "|---|---|---|---|---|---|---|---|---|"]
    for o in sorted(m.options, key=lambda o: -o.speedup):
        lines.append(f"| {o.name} | {len(o.per_prompt)} | {o.tokens_per_s:.1f} | {o.speedup:.2f}× | "
                     f"{o.spread[0]:.2f}-{o.spread[1]:.2f} | {fmt(o.alpha)} | {fmt(o.tau)} | {fmt(o.c, '.3f')} | "
                     f"{fmt(o.step_cost)} |")
    ratios = m.environment.get("verify_ratio") or {}
    if ratios:
        lines += ["", f"Verify ratio r(k) = one target forward over k new tokens ÷ over one, at a context of "
                      f"{m.environment.get('context_len')} tokens: "
                  + ", ".join(f"r({k}) {v:.2f}" for k, v in sorted((int(k), v) for k, v in ratios.items())) + ". "
                  "c = draft seconds per drafted token ÷ one plain step; a configuration pays when τ exceeds its step "
                  "cost (draft time + r of the tokens it verifies, in plain steps)."]
    peers = m.environment.get("peers") or {}
    if peers:
        lines += ["", "Peers on the same prompts (tokens/s vs specdec plain): "
                  + ", ".join(f"{k} {v:.2f}×" for k, v in peers.items() if v is not None)]
    return "\n".join(lines + notes_md(m)) + "\n"


def device_line(m: Measurements) -> str:
    env = m.environment
    where = env.get("gpu") or env.get("processor") or m.device
    threads = f", {env['cpu_threads']} CPU threads" if m.device == "cpu" and env.get("cpu_threads") else ""
    return f"{where} ({m.device}{threads})"


def conditions(m: Measurements) -> str:
    mode = "greedy" if m.greedy else "sampling"
    phases = m.environment.get("phases") or {}
    spent = ", ".join(f"{k.removesuffix('_s').replace('_', ' ')} {v:.0f} s" for k, v in phases.items())
    return (f"Model {m.model}, {m.dtype}, kernels {m.kernels}, batch 1, {mode}; {m.num_prompts} prompts; plain decoding "
            f"{m.plain_tokens_per_s:.1f} tokens/s; timing noise {noise_of(m):.1%}; measured in {m.elapsed_s:.0f} s "
            f"of a {m.budget_s:.0f} s budget" + (f" ({spent})." if spent else "."))


def notes_md(m: Measurements) -> list[str]:
    return ["", "Notes:", *[f"- {n}" for n in m.notes]] if m.notes else []


# ---- decision-tree.md: mermaid -----------------------------------------------------------------

def mermaid_label(text: str) -> str:
    return text.replace('"', "#quot;")


def to_mermaid(tree: Tree) -> str:
    lines = ["flowchart TD"]
    for n in tree.nodes:
        label = mermaid_label(n.text)
        lines.append(f'    {n.id}["{label}"]' if n.leaf else f'    {n.id}{{"{label}"}}')
    for e in tree.edges:
        lines.append(f"    {e.source} -->|{e.label}| {e.target}")
    lines.append("    classDef taken fill:#d9f2d9,stroke:#2e7d32,stroke-width:3px")
    lines.append(f"    class {','.join(tree.path)} taken")
    return "\n".join(lines)


NODE = re.compile(r'^(?P<id>[A-Za-z_]\w*)(?:\["(?P<box>[^"]*)"\]|\{"(?P<rhombus>[^"]*)"\})$')
EDGE = re.compile(r"^(?P<a>[A-Za-z_]\w*) -->\|(?P<label>[^|\"]+)\| (?P<b>[A-Za-z_]\w*)$")
CLASSDEF = re.compile(r"^classDef [A-Za-z_]\w* [\w#:,.\-]+$")
CLASS = re.compile(r"^class (?P<ids>[A-Za-z_]\w*(?:,[A-Za-z_]\w*)*) [A-Za-z_]\w*$")


def check_mermaid(text: str) -> list[str]:
    """Problems that would stop the subset of mermaid written here from rendering (empty when none)."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if not lines or lines[0] not in ("flowchart TD", "flowchart LR", "graph TD"):
        return ["the first line must be a flowchart header"]
    problems, ids, used = [], set(), []
    for n, line in enumerate(lines[1:], 2):
        if node := NODE.match(line):
            if node["id"] in ids:
                problems.append(f"line {n}: node {node['id']} defined twice")
            ids.add(node["id"])
        elif edge := EDGE.match(line):
            used += [(n, edge["a"]), (n, edge["b"])]
        elif cls := CLASS.match(line):
            used += [(n, i) for i in cls["ids"].split(",")]
        elif not CLASSDEF.match(line):
            problems.append(f"line {n}: not a node, edge or class: {line[:60]}")
    problems += [f"line {n}: {i} is used but never defined" for n, i in used if i not in ids]
    return problems


def decision_tree_md(m: Measurements, tree: Tree) -> str:
    mermaid = to_mermaid(tree)
    return (f"# Decision tree: {m.task} on {device_line(m)}\n\n{conditions(m)}\n\n"
            "Branches carry this run's thresholds; the highlighted path is the one these measurements take. "
            "Drafters that pay are asked easiest-to-adopt first; one within the tolerance "
            f"({tolerance_of(m):.0%}) of the fastest counts as fast as it. `decision-tree.png` draws the same tree.\n\n"
            f"```mermaid\n{mermaid}\n```\n")


def draw_tree(tree: Tree, path: Path) -> None:
    """The tree as a PNG (matplotlib: mermaid's own renderer needs a browser)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    children: dict[str, list[tuple[str, str]]] = {}
    for e in tree.edges:
        children.setdefault(e.source, []).append((e.target, e.label))
    x: dict[str, float] = {}
    y: dict[str, int] = {}
    slot = [0]

    def place(node: str, depth: int) -> None:
        y[node] = depth
        kids = children.get(node, [])
        for kid, _ in kids:
            place(kid, depth + 1)
        if kids:
            x[node] = sum(x[k] for k, _ in kids) / len(kids)
        else:
            x[node] = slot[0]
            slot[0] += 1

    place(tree.nodes[0].id, 0)
    width, depth = max(slot[0], 2), max(y.values()) + 1
    fig, ax = plt.subplots(figsize=(3.2 * width, 1.9 * depth))
    ax.set_xlim(-0.7, width - 0.3)
    ax.set_ylim(-depth + 0.4, 0.6)
    ax.axis("off")
    taken = set(tree.path)
    for e in tree.edges:
        on_path = e.source in taken and e.target in taken
        ax.annotate("", xy=(x[e.target], -y[e.target] + 0.25), xytext=(x[e.source], -y[e.source] - 0.25),
                    arrowprops={"arrowstyle": "->", "color": "#2e7d32" if on_path else "#888", "lw": 2 if on_path else 1})
        ax.text((x[e.source] + x[e.target]) / 2, -(y[e.source] + y[e.target]) / 2, e.label, fontsize=8,
                ha="center", va="center", bbox={"boxstyle": "round", "fc": "white", "ec": "none"})
    for n in tree.nodes:
        text = "\n".join(textwrap.fill(part, 34) for part in n.text.split("<br/>"))
        ax.text(x[n.id], -y[n.id], text, ha="center", va="center", fontsize=7,
                bbox={"boxstyle": "square,pad=0.4" if n.leaf else "round,pad=0.4",
                      "fc": "#d9f2d9" if n.id in taken else "#f4f4f4",
                      "ec": "#2e7d32" if n.id in taken else "#999", "lw": 2 if n.id in taken else 1})
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- verdict.md -------------------------------------------------------------------------------

def verdict_answers(m: Measurements, tree: Tree) -> list[tuple[str, str]]:
    """The four questions, answered with this run's numbers."""
    rec = tree.recommendation
    noise = noise_of(m)
    share = m.decode_ms / (m.decode_ms + m.prefill_ms)
    bottleneck = (f"{'Yes' if m.decode_ms >= m.threshold_ms else 'No'}. A typical answer is {m.output_tokens:.0f} tokens "
                  f"(median, capped by max_new_tokens) at {m.ms_per_token:.1f} ms each: {m.decode_ms:.0f} ms of decoding "
                  f"against a {m.threshold_ms:.0f} ms threshold, {share:.0%} of prefill + decode (prefill of a median "
                  f"prompt: {m.prefill_ms:.0f} ms).")
    best = m.best()
    if best is None or not best.batch_speedup:
        scale = "Not measured: no drafter's throughput was measured with several rows."
    else:
        chosen = rec.option if rec and rec.option else best
        rows = ", ".join(f"{k} rows {v:.2f}×" for k, v in sorted(chosen.batch_speedup.items()))
        b = break_even_batch(chosen.batch_speedup)
        where = ("it pays at every measured batch size" if b is None else
                 "it does not pay even at one row in this test" if b == 0 else f"it stops paying at about {b:.0f} rows")
        scale = (f"{chosen.drafter} γ{chosen.gamma}, measured decode throughput vs plain with several rows decoded "
                 f"together: {rows}; {where}. At serving scale use the `cost` "
                 "policy, which speculates only while the measured step times say it pays.")
    easy = easiest_retrofit(m)
    retrofit = ("None: no drafter beats plain decoding by more than the noise." if easy is None else
                f"{easy.drafter} ({FAMILIES[easy.drafter].retrofit if easy.drafter in FAMILIES else ''}): "
                f"{easy.speedup:.2f}× here.")
    return [("Is decode the bottleneck?", bottleneck), ("Would any variant help at serving scale?", scale),
            ("Which is the easiest retrofit?", retrofit), ("Recommendation", recommendation_text(m, tree))]


def recommendation_text(m: Measurements, tree: Tree) -> str:
    rec, noise = tree.recommendation, noise_of(m)
    if rec.action == "defer":
        return f"**Defer speculation**: {rec.reason}."
    if rec.action == "plain":
        return f"**Don't speculate**: {rec.reason}."
    o = rec.option
    margin = o.speedup - 1
    text = (f"**{o.drafter}, γ {o.gamma}** ({'every step' if rec.spec_policy == 'on' else 'with the cost policy'}): "
            f"{o.speedup:.2f}× plain (p25-p75 {o.spread[0]:.2f}-{o.spread[1]:.2f}), a margin of {margin:+.0%} against "
            f"a noise of {noise:.1%}.")
    other = runner_up(m, o)
    if other is not None:
        vs = paired_margin(o, other)
        if vs is not None:
            close = abs(vs) <= noise
            text += (f" Against the runner-up, {describe(other)}: {vs:+.1%} per prompt (median)"
                     + (", within the noise: the two are equally good here" if close else "") + ".")
    if o is not m.best():
        best = m.best()
        text += (f" The fastest measured, {describe(best)}, is within {tolerance_of(m):.0%}; {o.drafter} is "
                 f"chosen because it is easier to adopt (effort {complexity(o.drafter)}/5 against "
                 f"{complexity(best.drafter)}/5).")
    return text


def verdict_md(m: Measurements, tree: Tree) -> str:
    lines = [f"# Verdict: {m.task} on {device_line(m)}", "", conditions(m), ""]
    for i, (q, a) in enumerate(verdict_answers(m, tree), 1):
        lines += [f"## {i}. {q}", "", a, ""]
    lines += ["Use it: `specdec serve --config config.json` or `specdec generate --config config.json \"...\"` "
              "(flags given on the command line win).", ""]
    return "\n".join(lines + notes_md(m)) + "\n"


# ---- config.json ------------------------------------------------------------------------------

def config_of(m: Measurements, tree: Tree) -> dict:
    """The flags to use: drafter, gamma, serve's policy; where to speculate or not, and why."""
    rec = tree.recommendation
    out = {"schema": CONFIG_SCHEMA, "drafter": "none", "spec_policy": "off"}
    if rec.action == "speculate":
        o = rec.option
        out = {"schema": CONFIG_SCHEMA, "drafter": o.drafter, "gamma": o.gamma, "spec_policy": rec.spec_policy,
               **o.options}
    out["advised"] = {"action": rec.action, "reason": rec.reason, "task": m.task, "model": m.model,
                      "device": device_line(m), "dtype": m.dtype,
                      "speedup": rec.option.speedup if rec.option else None,
                      "break_even_batch": rec.break_even_batch}
    return out


def format_terminal(m: Measurements, tree: Tree) -> str:
    head = f"{'configuration':<24} {'prompts':>7} {'tok/s':>7} {'speedup':>8} {'p25-p75':>11} {'α':>5} {'τ':>5} {'c':>6} {'MiB':>5}"
    lines = [conditions(m), "", head, "-" * len(head),
             f"{'specdec/none (plain)':<24} {m.num_prompts:>7} {m.plain_tokens_per_s:>7.1f} {'1.00×':>8}"]
    for o in sorted(m.options, key=lambda o: -o.speedup):
        lines.append(f"{o.name:<24} {len(o.per_prompt):>7} {o.tokens_per_s:>7.1f} {o.speedup:>7.2f}× "
                     f"{o.spread[0]:>5.2f}-{o.spread[1]:<5.2f} {fmt(o.alpha):>5} {fmt(o.tau):>5} {fmt(o.c, '.3f'):>6} "
                     f"{o.memory_mb:>5.0f}")
    lines.append("")
    for i, (q, a) in enumerate(verdict_answers(m, tree), 1):
        lines.append(f"{i}. {q} {a.replace('**', '')}")
    return "\n".join(lines + [f"note: {n}" for n in m.notes])


def write_outputs(m: Measurements, out: Path) -> tuple[Tree, list[Path]]:
    """Every page of an advise run into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    tree = build_tree(m)
    mermaid_problems = check_mermaid(to_mermaid(tree))
    if mermaid_problems:
        raise AssertionError(f"the decision tree's mermaid does not parse: {mermaid_problems}")
    files = {"summary.md": summary_md(m), "decision-tree.md": decision_tree_md(m, tree), "verdict.md": verdict_md(m, tree),
             "config.json": json.dumps(config_of(m, tree), indent=1) + "\n",
             "measurements.json": json.dumps(m.to_dict(), indent=1) + "\n"}
    paths = []
    for name, text in files.items():
        (out / name).write_text(text)
        paths.append(out / name)
    draw_tree(tree, out / "decision-tree.png")
    return tree, paths + [out / "decision-tree.png"]


def headline(m: Measurements, tree: Tree) -> str:
    rec = tree.recommendation
    if rec.action != "speculate":
        return f"Verdict: {'defer' if rec.action == 'defer' else 'do not speculate'}: {rec.reason}."
    o: Option = rec.option
    return (f"Best drafter here: {o.drafter} γ{o.gamma}, {o.speedup:.2f}× plain decoding "
            f"({m.plain_tokens_per_s * o.speedup:.0f} vs {m.plain_tokens_per_s:.0f} tokens/s)"
            + (f", τ {o.tau:.2f}" if o.tau else "") + ".")


def side_by_side(runs: dict[str, Measurements]) -> str:
    """The family matrix with several advise runs' measured columns next to each other (e.g. a CPU and a
    GPU run of the same model), for the survey in docs/."""
    names = list(runs)
    head = ["method", "retrofit effort", "best when"] + [f"{n}: γ, τ, speedup" for n in names] + ["published [source]"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for drafter, f in sorted(FAMILIES.items(), key=lambda kv: kv[1].complexity):
        cells = [f.method, f"{f.complexity}/5", f.best_when]
        for m in runs.values():
            final = {o.drafter: o for o in m.best_per_drafter()}
            partial = {o.drafter: o for o in m.best_per_drafter(m.options)}
            o = final.get(drafter) or partial.get(drafter)
            cells.append("not measured" if o is None else
                         f"γ{o.gamma}, τ {fmt(o.tau)}, {o.speedup:.2f}×" + ("" if drafter in final else
                                                                           f" ({len(o.per_prompt)} prompt(s))"))
        cells.append(f"{f.published} [{f.source}]")
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    lines += ["", *[f"- **{n}**: {conditions(m)} Recommendation: {headline(m, build_tree(m))}" for n, m in runs.items()]]
    return "\n".join(lines) + "\n"
