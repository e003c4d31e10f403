"""Findings: a few sentences computed from an Analysis, every number taken from it.

A sentence that compares groups uses only groups with at least `analysis.min_count` verified drafts,
and is left out when fewer than two such groups exist; with fewer than min_count verified drafts
overall the findings are one sentence saying so. Percentages are printed with one decimal ('{:.1%}'),
so a test can find them in the aggregates.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # rejections imports this module: type names only, no import cycle
    from specdec.analysis.rejections import Analysis, GroupRow


def write_findings(analysis: Analysis) -> list[str]:
    overall, n = analysis.overall, analysis.min_count
    if overall.verified < n:
        return [f"Only {overall.verified} draft tokens were verified (fewer than {n}): too few for findings."]
    sentences = [
        describe_overall(analysis),
        compare_token_classes(analysis),
        follow_draft_position(analysis),
        split_by_entropy(analysis),
        compare_output_positions(analysis),
        describe_top_pair(analysis),
    ]
    return [s for s in sentences if s is not None]


def pct(x: float) -> str:
    return f"{x:.1%}"


def well_sampled(rows: list[GroupRow], min_count: int) -> list[GroupRow]:
    return [r for r in rows if r.verified >= min_count]


def describe_overall(analysis: Analysis) -> str:
    o = analysis.overall
    return (
        f"Of {o.drafted} drafted tokens, {o.verified} reached the verifier and {o.accepted} were accepted "
        f"({pct(o.acceptance_rate)} of drafted, {pct(o.verified_acceptance_rate)} of verified); "
        f"{o.not_reached} were never verified because an earlier draft in the same step was rejected."
    )


def compare_token_classes(analysis: Analysis) -> str | None:
    rows = well_sampled(analysis.by_token_class, analysis.min_count)
    if len(rows) < 2:
        return None
    worst = max(rows, key=lambda r: r.rejection_rate)
    best = min(rows, key=lambda r: r.rejection_rate)
    overall = analysis.overall.rejection_rate
    points = 100 * (worst.rejection_rate - overall)
    return (
        f"'{worst.key}' drafts are rejected most often: {pct(worst.rejection_rate)} of {worst.verified} "
        f"vs {pct(overall)} overall ({points:+.1f} points); '{best.key}' drafts least often "
        f"({pct(best.rejection_rate)} of {best.verified})."
    )


def follow_draft_position(analysis: Analysis) -> str | None:
    rows = well_sampled(analysis.by_draft_position, analysis.min_count)
    if len(rows) < 2:
        return None
    first, last = rows[0], rows[-1]
    a, b = first.verified_acceptance_rate, last.verified_acceptance_rate
    trend = "falls" if b < a else "rises" if b > a else "stays"
    return (
        f"Acceptance of verified drafts {trend} from {pct(a)} at draft position {first.key} (n = {first.verified}) "
        f"to {pct(b)} at position {last.key} (n = {last.verified}); counting unverified drafts, "
        f"the acceptance rate per position goes from {pct(first.acceptance_rate)} to {pct(last.acceptance_rate)}."
    )


def split_by_entropy(analysis: Analysis) -> str | None:
    """Split the entropy buckets at the edge where acceptance below and above differ most."""
    rows = analysis.by_target_entropy
    best = None
    for cut in range(1, len(rows)):
        below, above = merge(rows[:cut]), merge(rows[cut:])
        if min(below[0], above[0]) < analysis.min_count:
            continue
        gap = abs(below[1] / below[0] - above[1] / above[0])
        if best is None or gap > best[0]:
            best = (gap, rows[cut].lo, below, above)
    if best is None:
        return None
    _, edge, (n_below, a_below), (n_above, a_above) = best
    greedy = analysis.run.get("greedy", False)
    source = " (temperature-1 softmax of the target logits)" if greedy else ""
    return (
        f"When the target's entropy{source} is below {edge:g} nats, {pct(a_below / n_below)} of {n_below} verified "
        f"drafts are accepted, vs {pct(a_above / n_above)} of {n_above} at or above {edge:g} nats."
    )


def merge(rows: list[GroupRow]) -> tuple[int, int]:
    """(verified, accepted) summed over rows."""
    return sum(r.verified for r in rows), sum(r.accepted for r in rows)


def compare_output_positions(analysis: Analysis) -> str | None:
    rows = well_sampled(analysis.by_output_position, analysis.min_count)
    if len(rows) < 2:
        return None
    first, last = rows[0], rows[-1]
    return (
        f"Acceptance of verified drafts is {pct(first.verified_acceptance_rate)} at output positions {first.key} "
        f"(n = {first.verified}) and {pct(last.verified_acceptance_rate)} at {last.key} (n = {last.verified})."
    )


def describe_top_pair(analysis: Analysis) -> str | None:
    pairs, rejected = analysis.top_rejection_pairs, analysis.overall.rejected
    if rejected < analysis.min_count or not pairs:
        return None
    top = pairs[0]
    covered = sum(p.count for p in pairs)
    return (
        f"The most common rejection is {top.draft_text!r} -> {top.target_text!r} ({top.count} of {rejected} "
        f"rejections, {pct(top.share)}); the {len(pairs)} most common pairs cover {pct(covered / rejected)}."
    )
