"""Rejection causes: one record per verified draft token, and their aggregation into `Analysis`.

`RejectionRecorder` is an engine observer (`SpecEngine.generate(..., observer=recorder)`). For each
step and each active row it records the draft positions the verifier looked at: every accepted one
and the first rejected one. Drafts after the first rejection are never verified; they are counted
per draft position in `not_reached`, so that records + not_reached == drafted and accepted records
== accepted, exactly as in the engine's SpecStats.

Per record, the target distribution p at the draft's position is the one the verifier used
(`logits_to_probs` with the run's SamplingParams), except under greedy decoding, whose p is a
one-hot: there entropy, top-1 probability and p(draft token) come from the temperature-1 softmax of
the target logits, so that they say how sure the target was. q is the drafter's distribution; it is
None for deterministic drafters (ngram, and every drafter under greedy decoding).

`build_analysis` groups the records by token class, draft position, output position, target entropy,
target top-1 probability, p(draft token) and p/q, with fixed bucket edges so that two runs (say a
drafter before and after training) compare row by row. Rates inside groups are over verified drafts:
`verified_acceptance_rate` = accepted / verified and `rejection_rate` = rejected / verified. The
docs/design.md's acceptance rate, accepted / drafted, appears where drafted is defined (overall, per draft
position). The JSON layout is documented in `ANALYSIS_SCHEMA` and versioned by `SCHEMA`.
"""

from __future__ import annotations

import bisect
import math
import re
import unicodedata
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch
from torch import Tensor

from specdec.analysis.findings import write_findings
from specdec.config import SamplingParams
from specdec.engine import StepRecord
from specdec.sampling import logits_to_probs

SCHEMA = "specdec.rejections/1"
TOKEN_CLASSES = ("number", "operator", "newline", "whitespace", "punctuation", "word_start", "word_continuation", "other")
OPERATOR_CHARS = set("+-*/×÷=<>%^±−·≤≥≠≈")
NUMBER = re.compile(r" ?\d+(?:[.,]\d+)*")
REPLACEMENT = "\ufffd"  # what decode shows for a token holding part of a UTF-8 character
INF = math.inf
OUTPUT_POSITION_EDGES = (0, 32, 64, 128, 256, INF)
ENTROPY_EDGES = (0.0, 0.1, 0.5, 1.0, 2.0, 4.0, INF)  # nats
TOP1_EDGES = (0.0, 0.5, 0.7, 0.9, 0.99, 1.0)
TARGET_PROB_EDGES = (0.0, 0.01, 0.1, 0.5, 0.9, 1.0)
P_OVER_Q_EDGES = (0.0, 0.1, 0.25, 0.5, 0.75, 1.0, INF)
TOP_PAIRS = 20

ANALYSIS_SCHEMA = {
    "schema": f"'{SCHEMA}'; bumped whenever a key changes meaning",
    "run": "what was run: model, drafter, draft_model, gamma, task, prompts, max_new_tokens, sampling params",
    "stats": "the engine's SpecStats over all prompts (steps, drafted, accepted, emitted, rates, times)",
    "overall": "one position row (below) with key 'all'",
    "by_token_class": "group rows, key = class of the draft token's text (TOKEN_CLASSES, all listed)",
    "by_draft_position": "position rows, key = 0-based position i in the draft, i = 0 .. gamma-1",
    "by_output_position": "bucket rows over the draft token's index in the generated text",
    "by_target_entropy": "bucket rows over the entropy of p at the draft's position, in nats",
    "by_target_top1_prob": "bucket rows over max p at the draft's position",
    "by_target_prob": "bucket rows over p(draft token)",
    "by_p_over_q": "bucket rows over p(draft token) / q(draft token); empty when the drafter has no q",
    "top_rejection_pairs": "the 20 most frequent (draft token -> target token) rejections: draft_token, "
    "draft_text, target_token, target_text, count, share (of all rejections)",
    "findings": "sentences computed from the numbers above",
    "min_count": "groups with fewer verified drafts than this are left out of the findings",
    "group row": "key (always a string), verified, accepted, rejected, verified_acceptance_rate (accepted / verified), "
    "rejection_rate (rejected / verified); rates are null when verified == 0",
    "bucket row": "a group row plus lo, hi: the bucket holds lo <= x < hi (the last one also x == hi); "
    "hi is null for +infinity",
    "position row": "a group row plus drafted, not_reached (drafted after a rejection in the same step, "
    "never verified) and acceptance_rate = accepted / drafted (the per-position acceptance rate of docs/design.md)",
}


@dataclass
class DraftTokenRecord:
    accepted: bool
    draft_position: int  # i, 0-based, in the step's draft
    output_position: int  # index of the draft token in the generated text
    token_id: int
    token_text: str
    token_class: str
    target_token: int  # what the target emitted there: the draft when accepted, else argmax / recovered token
    target_text: str
    target_entropy: float  # nats, of p (greedy: temperature-1 softmax)
    target_top1_prob: float
    target_prob: float  # p(draft token)
    draft_prob: float | None  # q(draft token); None for deterministic drafters
    p_over_q: float | None


@dataclass
class GroupRow:
    key: str
    verified: int
    accepted: int
    rejected: int
    verified_acceptance_rate: float | None
    rejection_rate: float | None


@dataclass
class BucketRow(GroupRow):
    lo: float
    hi: float | None  # None = +infinity


@dataclass
class PositionRow(GroupRow):
    drafted: int
    not_reached: int
    acceptance_rate: float | None  # accepted / drafted


@dataclass
class RejectionPair:
    draft_token: int
    draft_text: str
    target_token: int
    target_text: str
    count: int
    share: float  # of all rejections


@dataclass
class Analysis:
    run: dict
    stats: dict
    overall: PositionRow
    by_token_class: list[GroupRow]
    by_draft_position: list[PositionRow]
    by_output_position: list[BucketRow]
    by_target_entropy: list[BucketRow]
    by_target_top1_prob: list[BucketRow]
    by_target_prob: list[BucketRow]
    by_p_over_q: list[BucketRow]
    top_rejection_pairs: list[RejectionPair]
    min_count: int
    findings: list[str] = field(default_factory=list)
    schema: str = SCHEMA

    def to_dict(self) -> dict:
        d = asdict(self)
        return {"schema": d.pop("schema"), **d}


def classify_token(text: str) -> str:
    """The class of a token's decoded text (byte-level BPE keeps a leading space in it).

    number: digits, maybe one leading space and inner '.' / ','; operator: arithmetic, comparison or
    '=' characters, maybe space-padded; newline: contains '\\n'; whitespace: only spaces / tabs;
    punctuation: other punctuation and symbols; word_start: a space then letters, or a capitalised
    letter piece; word_continuation: letters (an apostrophe allowed, as in "'t") with no leading space;
    other: anything else (special tokens, mixed pieces, partial UTF-8 characters, '')."""
    core = text.strip(" \t")
    if "\n" in text:
        return "newline"
    if text and not core:
        return "whitespace"
    if NUMBER.fullmatch(text):
        return "number"
    if core and all(c in OPERATOR_CHARS for c in core):
        return "operator"
    if core and all(unicodedata.category(c)[0] in "PS" and c != REPLACEMENT for c in core):
        return "punctuation"
    if len(text) > 1 and text[0] == " " and text[1:].isalpha():
        return "word_start"
    if text.isalpha() and text[0].isupper():
        return "word_start"
    if text.removeprefix("'").isalpha():
        return "word_continuation"
    return "other"


def target_distribution(logits: Tensor, sampling: SamplingParams) -> Tensor:
    """logits [B, k, V] -> p [B, k, V]: the verifier's p, or the temperature-1 softmax when greedy."""
    return logits.float().softmax(-1) if sampling.greedy else logits_to_probs(logits, sampling)


class RejectionRecorder:
    """Engine observer: appends a DraftTokenRecord per verified draft token, counts the rest."""

    def __init__(self, sampling: SamplingParams, decode: Callable[[list[int]], str]) -> None:
        self.sampling = sampling
        self.decode = decode
        self.records: list[DraftTokenRecord] = []
        self.not_reached: list[int] = []  # per draft position
        self.texts: dict[int, str] = {}

    def __call__(self, step: StepRecord) -> None:
        if step.draft_tokens.shape[1] == 0:
            return
        if step.tree is not None:
            step = tree_as_chain(step)
        k = step.draft_tokens.shape[1]
        drafts = step.draft_tokens  # [B, k]
        p = target_distribution(step.target_logits[:, :k], self.sampling)  # [B, k, V]
        columns = {
            "token_id": drafts,
            "target_token": step.result.tokens[:, :k],  # [B, k]
            "target_entropy": torch.special.entr(p).sum(-1),  # [B, k]
            "target_top1_prob": p.amax(-1),  # [B, k]
            "target_prob": p.gather(-1, drafts[..., None]).squeeze(-1),  # [B, k]
        }
        if step.q is not None:
            columns["draft_prob"] = step.q.gather(-1, drafts[..., None]).squeeze(-1)  # [B, k]
        rows = {name: t.tolist() for name, t in columns.items()}
        drafted, accepted = step.num_drafted.tolist(), step.result.num_accepted.tolist()
        for b, active in enumerate(step.active):
            if active:
                self.record_row(b, drafted[b], accepted[b], step.num_generated[b], rows)

    def record_row(self, b: int, drafted: int, accepted: int, generated: int, rows: dict[str, list]) -> None:
        verified = min(accepted + 1, drafted)  # the accepted drafts and the first rejected one
        for i in range(verified):
            token, target = rows["token_id"][b][i], rows["target_token"][b][i]
            q = rows["draft_prob"][b][i] if "draft_prob" in rows else None
            p = rows["target_prob"][b][i]
            text = self.text(token)
            self.records.append(
                DraftTokenRecord(
                    accepted=i < accepted,
                    draft_position=i,
                    output_position=generated + i,
                    token_id=token,
                    token_text=text,
                    token_class=classify_token(text),
                    target_token=target,
                    target_text=self.text(target),
                    target_entropy=rows["target_entropy"][b][i],
                    target_top1_prob=rows["target_top1_prob"][b][i],
                    target_prob=p,
                    draft_prob=q,
                    p_over_q=None if q is None else p / q,  # q > 0: the drafter sampled this token from q
                )
            )
        if drafted > len(self.not_reached):
            self.not_reached += [0] * (drafted - len(self.not_reached))
        for i in range(verified, drafted):
            self.not_reached[i] += 1

    def text(self, token: int) -> str:
        if token not in self.texts:
            self.texts[token] = self.decode([token])
        return self.texts[token]


def tree_as_chain(step: StepRecord) -> StepRecord:
    """A tree step seen as the chain the target walked: the accepted path, then the first child
    (in proposal order) of the last accepted node, which the target rejected. Siblings tried and
    rejected along the way are not recorded (a chain drafter would not have proposed them)."""
    tree, result = step.tree, step.result
    depth = int(result.num_accepted.max()) + 1
    path = result.path[:, :depth]  # [B, D] block indices: the root (0), then the accepted nodes
    last = path.gather(1, result.num_accepted[:, None]).squeeze(1)  # [B] block of the deepest accepted
    children = (tree.parent_blocks[:, 1:] == last[:, None]) & tree.valid()  # [B, N] nodes hanging off it
    has_child = children.any(-1)  # [B]
    first_child = children.long().argmax(-1) + 1  # [B] its first child's block index
    nodes = torch.cat([path[:, 1:], path[:, :1]], dim=1)  # [B, D]: accepted node blocks, then a slot
    nodes.scatter_(1, result.num_accepted[:, None], first_child[:, None])
    chain = (nodes - 1).clamp(min=0)  # [B, D] node indices
    drafted = torch.minimum(result.num_accepted + has_child.long(), step.num_drafted)  # never past the row's budget
    # chain node i follows path[i]: the target's distribution there is what it was verified against
    logits = step.target_logits.gather(1, path[..., None].expand(-1, -1, step.target_logits.shape[-1]))
    q = None if step.q is None else step.q.gather(1, chain[..., None].expand(-1, -1, step.q.shape[-1]))
    chained = type(result)(tokens=result.tokens[:, :depth], num_accepted=result.num_accepted)
    return StepRecord(step.draft_tokens.gather(1, chain), q, drafted, logits, chained, step.num_generated, step.active)


def build_analysis(
    records: list[DraftTokenRecord], not_reached: list[int], gamma: int, run: dict, stats: dict, min_count: int = 30
) -> Analysis:
    """Aggregate records (and per-position not_reached counts) into the Analysis, findings included."""
    analysis = Analysis(
        run=run,
        stats=stats,
        overall=position_row("all", records, sum(not_reached)),
        by_token_class=[group_row(c, [r for r in records if r.token_class == c]) for c in TOKEN_CLASSES],
        by_draft_position=[
            position_row(str(i), [r for r in records if r.draft_position == i], not_reached[i] if i < len(not_reached) else 0)
            for i in range(max(gamma, len(not_reached)))
        ],
        by_output_position=bucket_rows(records, "output_position", OUTPUT_POSITION_EDGES),
        by_target_entropy=bucket_rows(records, "target_entropy", ENTROPY_EDGES),
        by_target_top1_prob=bucket_rows(records, "target_top1_prob", TOP1_EDGES),
        by_target_prob=bucket_rows(records, "target_prob", TARGET_PROB_EDGES),
        by_p_over_q=bucket_rows(records, "p_over_q", P_OVER_Q_EDGES) if any(r.p_over_q is not None for r in records) else [],
        top_rejection_pairs=count_rejection_pairs(records),
        min_count=min_count,
    )
    analysis.findings = write_findings(analysis)
    return analysis


def ratio(a: int, b: int) -> float | None:
    return a / b if b else None


def group_row(key: str, records: list[DraftTokenRecord]) -> GroupRow:
    accepted = sum(r.accepted for r in records)
    rejected = len(records) - accepted
    return GroupRow(key, len(records), accepted, rejected, ratio(accepted, len(records)), ratio(rejected, len(records)))


def position_row(key: str, records: list[DraftTokenRecord], not_reached: int) -> PositionRow:
    g = group_row(key, records)
    drafted = g.verified + not_reached
    return PositionRow(**asdict(g), drafted=drafted, not_reached=not_reached, acceptance_rate=ratio(g.accepted, drafted))


def bucket_index(x: float, edges: tuple[float, ...]) -> int:
    """The bucket lo <= x < hi of `edges` (the last bucket also takes x == its hi)."""
    return min(max(bisect.bisect_right(edges, x) - 1, 0), len(edges) - 2)


def bucket_label(lo: float, hi: float, last: bool) -> str:
    if hi == INF:
        return f"{lo:g}+" if isinstance(lo, int) else f"[{lo:g}, inf)"
    if isinstance(lo, int) and isinstance(hi, int):
        return f"{lo}-{hi - 1}"
    return f"[{lo:g}, {hi:g}{']' if last else ')'}"


def bucket_rows(records: list[DraftTokenRecord], attr: str, edges: tuple[float, ...]) -> list[BucketRow]:
    """One row per bucket of `edges` (empty buckets included) over the records where attr is not None."""
    buckets: list[list[DraftTokenRecord]] = [[] for _ in edges[:-1]]
    for r in records:
        x = getattr(r, attr)
        if x is not None:
            buckets[bucket_index(x, edges)].append(r)
    rows = []
    for j, members in enumerate(buckets):
        lo, hi = edges[j], edges[j + 1]
        g = group_row(bucket_label(lo, hi, j == len(buckets) - 1), members)
        rows.append(BucketRow(**asdict(g), lo=lo, hi=None if hi == INF else hi))
    return rows


def count_rejection_pairs(records: list[DraftTokenRecord], top: int = TOP_PAIRS) -> list[RejectionPair]:
    """The `top` most frequent (draft token -> target token) rejections, ties in order of first sight."""
    rejected = [r for r in records if not r.accepted]
    texts = {r.token_id: r.token_text for r in rejected} | {r.target_token: r.target_text for r in rejected}
    counts = Counter((r.token_id, r.target_token) for r in rejected)
    return [
        RejectionPair(d, texts[d], t, texts[t], n, n / len(rejected))
        for (d, t), n in counts.most_common(top)
    ]
