"""Rendering of a rejection Analysis: analysis.json, records.jsonl, analysis.md with its PNG plots
(matplotlib, Agg backend), and the compact terminal summary. Nothing here computes a new number."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from specdec.analysis.rejections import Analysis, DraftTokenRecord, GroupRow, PositionRow
from specdec.errors import UserError

PLOTS = {
    "token_class": "rejection_by_token_class.png",
    "draft_position": "acceptance_by_draft_position.png",
    "target_entropy": "acceptance_by_target_entropy.png",
    "output_position": "acceptance_by_output_position.png",
}


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise UserError("plots need matplotlib: pip install 'specdec[report]'") from e


def write_outputs(analysis: Analysis, records: list[DraftTokenRecord], out: Path) -> None:
    """analysis.json, records.jsonl, the plots and analysis.md under `out` (created if missing)."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / "analysis.json").write_text(json.dumps(analysis.to_dict(), indent=2) + "\n")
        with open(out / "records.jsonl", "w") as f:
            f.writelines(json.dumps(asdict(r)) + "\n" for r in records)
        write_plots(analysis, out)
        (out / "analysis.md").write_text(format_markdown(analysis))
    except OSError as e:
        raise UserError(f"cannot write to {out}: {e.strerror or e}") from e


def write_plots(analysis: Analysis, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    overall = analysis.overall
    plot_bars(analysis.by_token_class, [("rejection rate", "rejection_rate")], "Rejection rate by draft token class",
              overall.rejection_rate, out / PLOTS["token_class"])
    plot_bars(analysis.by_draft_position,
              [("accepted / verified", "verified_acceptance_rate"), ("accepted / drafted", "acceptance_rate")],
              "Acceptance by draft position", None, out / PLOTS["draft_position"])
    plot_bars(analysis.by_target_entropy, [("accepted / verified", "verified_acceptance_rate")],
              "Acceptance by target entropy (nats)", overall.verified_acceptance_rate, out / PLOTS["target_entropy"])
    plot_bars(analysis.by_output_position, [("accepted / verified", "verified_acceptance_rate")],
              "Acceptance by output position", overall.verified_acceptance_rate, out / PLOTS["output_position"])


def plot_bars(rows: list[GroupRow], series: list[tuple[str, str]], title: str, reference: float | None, path: Path) -> None:
    """Grouped bars of rate fields per row, each group labelled with its verified count."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.6))
    width = 0.8 / len(series)
    for s, (label, attr) in enumerate(series):
        xs = [j + (s - (len(series) - 1) / 2) * width for j in range(len(rows))]
        heights = [getattr(r, attr) or 0.0 for r in rows]
        ax.bar(xs, heights, width, label=label)
    for j, r in enumerate(rows):
        ax.annotate(f"n={r.verified}", (j, 1.0), ha="center", va="bottom", fontsize=7)
    if reference is not None:
        ax.axhline(reference, color="grey", linestyle="--", linewidth=1, label="overall")
    ax.set_xticks(range(len(rows)), [r.key for r in rows], rotation=30 if len(rows) > 6 else 0, fontsize=8)
    ax.set_ylim(0, 1.1)
    ax.set_ylabel("rate")
    ax.set_title(title)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))  # outside the axes: never over a bar
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def format_markdown(analysis: Analysis) -> str:
    run = analysis.run
    lines = [
        "# Rejection analysis",
        "",
        " ".join(f"{k} `{v}`;" for k, v in run.items()).rstrip(";"),
        "",
        "## Findings",
        "",
        *[f"- {s}" for s in analysis.findings],
        "",
        f"Findings use groups with at least {analysis.min_count} verified drafts. "
        "Rates in groups are over verified drafts (a draft after a rejection in its step is never verified).",
        "",
        "## Overall and by draft position",
        "",
        *position_table([analysis.overall, *analysis.by_draft_position]),
        "",
        f"![acceptance by draft position]({PLOTS['draft_position']})",
        "",
        "## By token class",
        "",
        *group_table(analysis.by_token_class),
        "",
        f"![rejection by token class]({PLOTS['token_class']})",
        "",
    ]
    for title, rows, plot in [
        ("By target entropy (nats)", analysis.by_target_entropy, PLOTS["target_entropy"]),
        ("By output position", analysis.by_output_position, PLOTS["output_position"]),
        ("By target top-1 probability", analysis.by_target_top1_prob, None),
        ("By target probability of the draft token", analysis.by_target_prob, None),
        ("By p/q", analysis.by_p_over_q, None),
    ]:
        if rows:
            lines += [f"## {title}", "", *group_table(rows), ""]
            lines += [f"![{title.lower()}]({plot})", ""] if plot else []
    lines += ["## Most frequent rejections (draft -> target)", "", "| # | draft | target | count | share |", "|---|---|---|---|---|"]
    lines += [
        f"| {i} | {cell(repr(p.draft_text))} | {cell(repr(p.target_text))} | {p.count} | {p.share:.1%} |"
        for i, p in enumerate(analysis.top_rejection_pairs, 1)
    ]
    return "\n".join(lines) + "\n"


def cell(text: str) -> str:
    return text.replace("|", "\\|")


def rate(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def group_table(rows: list[GroupRow]) -> list[str]:
    head = ["| group | verified | accepted | rejected | accepted / verified | rejection rate |", "|---|---|---|---|---|---|"]
    return head + [
        f"| {cell(r.key)} | {r.verified} | {r.accepted} | {r.rejected} | {rate(r.verified_acceptance_rate)} | {rate(r.rejection_rate)} |"
        for r in rows
    ]


def position_table(rows: list[PositionRow]) -> list[str]:
    head = [
        "| draft position | drafted | verified | not reached | accepted | acceptance rate (of drafted) | accepted / verified |",
        "|---|---|---|---|---|---|---|",
    ]
    return head + [
        f"| {r.key} | {r.drafted} | {r.verified} | {r.not_reached} | {r.accepted} | {rate(r.acceptance_rate)} | {rate(r.verified_acceptance_rate)} |"
        for r in rows
    ]


def format_summary(analysis: Analysis, out: Path) -> str:
    """Findings and a small table by token class, for the terminal."""
    rows = [("class", "verified", "rejected", "rate")]
    rows += [(r.key, str(r.verified), str(r.rejected), rate(r.rejection_rate)) for r in [analysis.overall, *analysis.by_token_class] if r.verified]
    widths = [max(len(row[c]) for row in rows) for c in range(4)]
    table = ["  ".join(v.ljust(w) if c == 0 else v.rjust(w) for c, (v, w) in enumerate(zip(row, widths))) for row in rows]
    return "\n".join([*analysis.findings, "", *table, "", f"written to {out}/ (analysis.json, analysis.md, plots)"])
