"""Presenting a bench results document: the terminal table, results.json, report.md and PNG plots.

Every number shown comes from the results document; estimates are labelled "estimated".
"""

from __future__ import annotations

import json
from pathlib import Path

from specdec.costs import interpolate
from specdec.bench.runner import PLAIN, variant_name


def fmt(x: float | None, digits: int = 2, suffix: str = "") -> str:
    return "-" if x is None else f"{x:.{digits}f}{suffix}"


def lossless_cell(m: dict) -> str:
    """matches/outputs, marked `(text)` where a server's text, not its token ids, was compared."""
    if "lossless" not in m:
        return "-"
    return f"{m['matches_plain']}/{m['num_outputs']}" + (" (text)" if "text" in m.get("lossless_compared", "") else "")


def server_lines(results: dict) -> list[str]:
    """One line per openai peer: the server, how its outputs were compared, and its own spec-decode figures."""
    lines = []
    for m in results["methods"]:
        if "server" not in m:
            continue
        server, spec = m["server"], m.get("server_spec_decode")
        compared = {"return_token_ids": "token ids (return_token_ids)", "logprobs": "token ids (logprobs)",
                    "text": "text only (the server gave no token ids)"}.get(server.get("token_ids_from"), "-")
        line = f"{m['name']}: model {server['model']} at {server['url']}; outputs compared by {compared}; "
        if spec is None:
            line += "no spec-decode metrics"
        elif spec.get("note"):
            line += f"spec-decode metrics unusable: {spec['note']}"
        else:
            per_position = ", ".join(fmt(a) for a in spec["acceptance_per_position"][:8]) or "-"
            line += (f"server-reported spec decode over the bench's requests: acceptance {fmt(spec['acceptance_rate'])}, "
                     f"mean accepted length {fmt(spec['mean_accepted_length'])} (1 + accepted / drafts), "
                     f"{spec['drafts']:.0f} drafts, {spec['draft_tokens']:.0f} draft tokens, "
                     f"{spec['accepted_tokens']:.0f} accepted; per position: {per_position}")
        lines.append(line)
    return lines


def format_table(results: dict) -> str:
    """The compact terminal table: one line per method."""
    header = ["method", "tok/s (median [p25-p75])", "x plain", "x hf", "alpha", "tau", "c", "r(g+1)", "est. x", "lossless", "acc"]
    rows = [header]
    for m in results["methods"]:
        t = m["tokens_per_s"]
        lossless = lossless_cell(m)
        rows.append([
            m["name"],
            f"{fmt(t['median'], 1)} [{fmt(t['p25'], 1)}-{fmt(t['p75'], 1)}]",
            fmt(m["speedup_vs_plain"]["median"], 2, "x"),
            fmt(m["speedup_vs_hf"]["median"], 2, "x"),
            fmt(m.get("acceptance_rate"), 2),
            fmt(m.get("mean_accepted_length"), 2),
            fmt(m.get("cost_coefficient"), 3),
            fmt(m.get("verify_ratio"), 2),
            fmt(m.get("estimated_speedup"), 2, "x"),
            lossless,
            fmt(m["accuracy"], 2),
        ])
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    env = results["environment"]
    where = (env.get("gpu") or f"{env['processor']} ({env['cpu_threads']} threads)") + parallelism(env)
    lines.insert(0, f"{results['task']}: {results['num_prompts']} prompts, {env['device']} {env['dtype']}, {where}; "
                    f"medians over prompts; est. x = estimated speedup (formula)")
    return "\n".join(lines + [f"server: {x}" for x in server_lines(results)] + [f"note: {n}" for n in results["notes"]])


def parallelism(env: dict) -> str:
    """", tensor-parallel over N ranks" for a run whose target was sharded, else ""."""
    return f", tensor-parallel over {env['tp']} ranks" if env.get("tp", 1) > 1 else ""


def write_outputs(results: dict, out: Path) -> list[Path]:
    """results.json, report.md and the plots under `out`; returns the files written."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    plots = write_plots(results, out)
    (out / "report.md").write_text(render_markdown(results, plots))
    return [out / "results.json", out / "report.md", *plots]


def variant(m: dict) -> str:
    return variant_name(m["drafter"], m.get("options", ()))


def spec_methods(results: dict) -> dict[str, list[dict]]:
    """specdec methods with a drafter, grouped by drafter variant (`suffix`, `suffix:fill=0`), sorted by gamma."""
    groups: dict[str, list[dict]] = {}
    for m in results["methods"]:
        if m["family"] == "specdec" and m["drafter"] != "none" and m.get("policy", "fixed") == "fixed":
            groups.setdefault(variant(m), []).append(m)
    return {d: sorted(ms, key=lambda m: m["gamma"]) for d, ms in groups.items()}


def write_plots(results: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = spec_methods(results)
    files = []

    def save(fig, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        files.append(out / name)

    if groups:
        fig, ax = plt.subplots(figsize=(6, 4))
        for drafter, ms in groups.items():
            ax.plot([m["gamma"] for m in ms], [m["acceptance_rate"] or 0 for m in ms], "o-", label=drafter)
        ax.set(xlabel="gamma (draft tokens per step)", ylabel="acceptance rate", title="Acceptance vs gamma", ylim=(0, 1))
        ax.legend()
        save(fig, "acceptance_vs_gamma.png")

        fig, ax = plt.subplots(figsize=(6, 4))
        for drafter, ms in groups.items():
            g = [m["gamma"] for m in ms]
            line = ax.plot(g, [m["speedup_vs_plain"]["median"] for m in ms], "o-", label=f"{drafter} measured")[0]
            ax.plot(g, [m["estimated_speedup"] or 0 for m in ms], "s--", color=line.get_color(), label=f"{drafter} estimated (formula)")
            ax.plot(g, [m["estimated_speedup_tau"] or 0 for m in ms], "^:", color=line.get_color(), label=f"{drafter} estimated (from tau)")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set(xlabel="gamma", ylabel="speedup vs plain specdec", title="Measured vs estimated speedup")
        ax.legend(fontsize=7)
        save(fig, "speedup_vs_gamma.png")

        fig, ax = plt.subplots(figsize=(6, 4))
        for drafter, ms in groups.items():
            m = max(ms, key=lambda m: m["gamma"])
            rates = m["acceptance_per_position"]
            ax.plot(range(1, len(rates) + 1), [r or 0 for r in rates], "o-", label=f"{drafter}, gamma={m['gamma']}")
        ax.set(xlabel="draft position", ylabel="acceptance rate", title="Acceptance per draft position", ylim=(0, 1))
        ax.legend()
        save(fig, "acceptance_per_position.png")

    fig, ax = plt.subplots(figsize=(7, max(3, 0.28 * len(results["methods"]))))
    names = [m["name"] for m in results["methods"]]
    med = [m["tokens_per_s"]["median"] for m in results["methods"]]
    lo = [m["tokens_per_s"]["median"] - m["tokens_per_s"]["p25"] for m in results["methods"]]
    hi = [m["tokens_per_s"]["p75"] - m["tokens_per_s"]["median"] for m in results["methods"]]
    ax.barh(names, med, xerr=[lo, hi], color=["tab:grey" if n == PLAIN else "tab:blue" for n in names])
    ax.invert_yaxis()
    ax.set(xlabel="tokens/s (median over prompts, p25-p75)", title="Throughput per method")
    save(fig, "tokens_per_s.png")

    ratios = results["calibration"]["verify_ratio"]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([int(k) for k in ratios], list(ratios.values()), "o-")
    ax.set(xlabel="tokens per target forward (k)", ylabel="r(k) = t(k) / t(1)", title="Verify ratio (measured)")
    save(fig, "verify_ratio.png")
    return files


def best(results: dict, predicate) -> dict | None:
    ms = [m for m in results["methods"] if predicate(m) and m["tokens_per_s"]["median"] is not None]
    return max(ms, key=lambda m: m["tokens_per_s"]["median"]) if ms else None


def target_findings(results: dict) -> list[str]:
    """The issue's speed targets against transformers, each met or not, with what bounds it."""
    by_name = {m["name"]: m for m in results["methods"]}
    plain, hf = by_name.get(PLAIN), by_name.get("hf")
    spec = best(results, lambda m: m["family"] == "specdec" and m["drafter"] != "none")
    pld = best(results, lambda m: m["family"] == "hf-pld")
    lines = []
    if plain and hf:
        ratio = plain["speedup_vs_hf"]["median"]
        lines.append(f"Plain decoding through specdec runs at {fmt(ratio)}x transformers `generate` "
                     f"({fmt(plain['tokens_per_s']['median'], 1)} vs {fmt(hf['tokens_per_s']['median'], 1)} tok/s; target >= 1.0x: "
                     f"{'met' if ratio and ratio >= 1.0 else 'not met'}).")
    if spec and hf:
        ratio = spec["speedup_vs_hf"]["median"]
        lines.append(f"The fastest specdec method, {spec['name']}, runs at {fmt(ratio)}x transformers plain "
                     f"(target >= 2.0x: {'met' if ratio and ratio >= 2.0 else 'not met'}) and "
                     f"{fmt(spec['speedup_vs_plain']['median'])}x specdec plain.")
    if spec and pld:
        ratio = spec["tokens_per_s"]["median"] / pld["tokens_per_s"]["median"]
        lines.append(f"Against transformers prompt lookup at its best size ({pld['name']}, "
                     f"{fmt(pld['tokens_per_s']['median'], 1)} tok/s) it is {fmt(ratio)}x (target >= 1.5x: "
                     f"{'met' if ratio >= 1.5 else 'not met'}).")
    if spec and spec.get("acceptance_rate") is not None:
        lines.append(bound_explanation(spec, results["calibration"]["verify_ratio"]))
    return lines


def bound_explanation(m: dict, ratios: dict[str, float]) -> str:
    """What limits a speculative method, from its measured alpha, tau, c and r at the tokens it really
    verified per step (a tree's nodes, a chain's drafts)."""
    a, tau, c = m["acceptance_rate"], m["mean_accepted_length"], m["cost_coefficient"] or 0
    verified = m.get("nodes_per_step") or m["drafted_per_step"]
    r = interpolate({int(k): v for k, v in ratios.items()}, verified + 1)
    drafting = m["drafted_per_step"] * c
    return (f"What bounds {m['name']}: each step emits tau = {fmt(tau)} tokens (acceptance {fmt(a)}, "
            f"{fmt(m['drafted_per_step'])} tokens drafted and {fmt(verified)} verified per step on average) but costs "
            f"{fmt(drafting + r)} plain steps (verify ratio r({fmt(verified + 1, 1)}) = {fmt(r)}, drafting "
            f"{fmt(drafting, 3)}); the ceiling with free verification (r = 1, c = 0) would be {fmt(tau)}x. "
            f"Raising acceptance raises tau; lowering r needs cheaper multi-token forwards.")


def estimate_findings(results: dict) -> list[str]:
    lines = []
    for drafter, ms in spec_methods(results).items():
        for m in ms:
            measured, est, est_tau = m["speedup_vs_plain"]["median"], m["estimated_speedup"], m["estimated_speedup_tau"]
            if measured and est:
                gap = est / measured - 1
                line = (f"{m['name']}: measured {fmt(measured)}x, estimated {fmt(est)}x by the formula "
                        f"({gap:+.0%}), estimated {fmt(est_tau)}x from tau")
                if abs(gap) > 0.25 and est_tau:
                    tau_gap = est_tau / measured - 1
                    line += (f" ({tau_gap:+.0%}): the formula assumes i.i.d. acceptance alpha = {fmt(m['acceptance_rate'])} "
                             f"and gamma drafts every step, while {drafter} drafted {fmt(m['drafted_per_step'])} per step")
                lines.append(line + ".")
    return lines


def policy_findings(results: dict) -> list[str]:
    """Each adaptive-gamma policy against the best fixed gamma of the same drafter (median tokens/s)."""
    lines = []
    for drafter, fixed in spec_methods(results).items():
        top = max(fixed, key=lambda m: m["tokens_per_s"]["median"])
        for m in results["methods"]:
            if m["family"] == "specdec" and variant(m) == drafter and m.get("policy", "fixed") != "fixed":
                ratio = m["tokens_per_s"]["median"] / top["tokens_per_s"]["median"]
                lines.append(f"{m['name']}: {fmt(m['tokens_per_s']['median'], 1)} tok/s, {ratio:.1%} of the best fixed gamma "
                             f"({top['name']}, {fmt(top['tokens_per_s']['median'], 1)} tok/s); "
                             f"{fmt(m['drafted_per_step'])} drafted per step, acceptance {fmt(m.get('acceptance_rate'))}.")
    return lines


def markdown_table(results: dict) -> str:
    cols = ["method", "tok/s median", "p25", "p75", "x plain", "x hf", "alpha", "tau", "c", "r(g+1)",
            "est. x (formula)", "est. x (tau)", "lossless", "accuracy"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for m in results["methods"]:
        t = m["tokens_per_s"]
        lossless = lossless_cell(m)
        cells = [m["name"], fmt(t["median"], 1), fmt(t["p25"], 1), fmt(t["p75"], 1),
                 fmt(m["speedup_vs_plain"]["median"]), fmt(m["speedup_vs_hf"]["median"]),
                 fmt(m.get("acceptance_rate")), fmt(m.get("mean_accepted_length")), fmt(m.get("cost_coefficient"), 3),
                 fmt(m.get("verify_ratio")), fmt(m.get("estimated_speedup")), fmt(m.get("estimated_speedup_tau")),
                 lossless, fmt(m["accuracy"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def category_table(results: dict) -> str:
    """Median speedup vs plain per category (when the task set has categories): per prompt, median tokens/s
    over repeats against plain's, as the results table (runner.speedup_by_category)."""
    cats = results["categories"]
    if not cats:
        return ""
    lines = ["| method | " + " | ".join(cats) + " |", "|" + "---|" * (len(cats) + 1)]
    for m in results["methods"]:
        by_category = m.get("speedup_vs_plain_by_category", {})
        cells = [fmt(by_category[cat]) + "x" if cat in by_category else "-" for cat in cats]
        lines.append(f"| {m['name']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def noise_line(results: dict) -> str:
    """How far plain decoding's own repeats moved around their per-prompt medians (runner.repeat_spread): the
    noise under the speedups, which a reader needs to judge a category's cell against a 5 % target."""
    plain = next((m for m in results["methods"] if m["name"] == PLAIN), None)
    spread = plain and plain.get("repeat_spread")
    if not spread:
        return ""
    return (f"Noise: plain decoding's repeats of one prompt ran at {spread['p25']:.3f}-{spread['p75']:.3f}x that "
            f"prompt's median speed (quartiles; min {spread['min']:.3f}, max {spread['max']:.3f}): how far one prompt's "
            f"measurement moves between runs on this machine. A category's cell, the median over its few prompts, "
            f"moves by a part of that between runs.")


def render_markdown(results: dict, plots: list[Path]) -> str:
    env, cfg, cal = results["environment"], results["config"], results["calibration"]
    where = (env.get("gpu") or f"{env['processor']}, {env['cpu_threads']} CPU threads") + parallelism(env)
    parts = [
        f"# specdec bench: {results['task']}",
        f"{results['num_prompts']} prompts, {cfg['max_new_tokens']} new tokens at most, "
        f"temperature {cfg['sampling']['temperature']}, {cfg['repeats']} repeat(s); model `{env['model']}` "
        f"({env['dtype']}) on {env['device']} ({where}); torch {env['torch']}, transformers {env['transformers']}, "
        f"Python {env['python']}, {env['platform']}.",
        "Methods ran interleaved prompt by prompt after a warm-up. Speeds are medians over prompts (p25-p75 shown); "
        "speedups are medians of per-prompt ratios. c and r were measured in this run "
        f"(r(k) at a context of {cal['context_len']} tokens; c in units of t1 = {cal['t1_s'] * 1e3:.2f} ms, "
        f"from the {cal['t1_from']}); speedups marked 'est.' are estimates, not measurements.",
        "## Results", markdown_table(results),
    ]
    cats = category_table(results)
    if cats:
        parts += ["## Speedup vs plain per category", cats]
    noise = noise_line(results)
    if noise:
        parts += [noise]
    if "floor_tokens_per_s" in cal:
        plain = next(m for m in results["methods"] if m["name"] == PLAIN)
        share = plain["tokens_per_s"]["median"] / cal["floor_tokens_per_s"]
        parts += ["## The memory-bandwidth floor",
                  f"A forward reads {cal['weight_bytes'] / 1e9:.2f} GB of weights; a device copy moved "
                  f"{cal['copy_bandwidth_gbs']:.0f} GB/s (reads and writes), so one forward takes at least "
                  f"{cal['floor_forward_s'] * 1e3:.2f} ms: {cal['floor_tokens_per_s']:.0f} tokens/s. Plain decoding through "
                  f"specdec reaches {plain['tokens_per_s']['median']:.1f} tokens/s, {share:.1%} of that floor "
                  f"(a measured single forward: {float(cal['forward_s']['1']) * 1e3:.2f} ms)."]
    servers = server_lines(results)
    if servers:
        parts += ["## OpenAI-compatible servers",
                  "Each server got the same prompts' token ids; its speed is whole requests over HTTP. Lossless "
                  "marked (text) compares the server's text with specdec plain's decoded text, not token ids. "
                  "Spec-decode figures are the server's own counters (vllm:spec_decode_*), not specdec's.",
                  "\n".join(f"- {line}" for line in servers)]
    parts += ["## Against the targets", "\n".join(f"- {line}" for line in target_findings(results))]
    policies = policy_findings(results)
    if policies:
        parts += ["## Adaptive gamma against the best fixed gamma", "\n".join(f"- {line}" for line in policies)]
    est = estimate_findings(results)
    if est:
        parts += ["## Measured vs estimated", "\n".join(f"- {line}" for line in est)]
    if results["notes"]:
        parts += ["## Notes", "\n".join(f"- {n}" for n in results["notes"])]
    parts += ["## Plots"] + [f"![{p.stem}]({p.name})" for p in plots]
    return "\n\n".join(parts) + "\n"
