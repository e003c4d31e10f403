"""The decisions `advise` makes from its measurements, as one decision tree.

The tree is built from a Measurements table, then walked; the verdict is the walk, so the drawn
tree (decision-tree.md), the verdict (verdict.md) and config.json never disagree. Questions, in order:

1. Is decode the bottleneck? Plain decode time of a typical answer against a perceptual threshold
   (100 ms by default). Below it: defer, speculation cannot be noticed.
2. Does anything beat plain decoding by more than the noise? If not: don't speculate.
3. Which drafter? The drafters that pay are asked in order of retrofit effort (survey.py), easiest
   first: the first whose speedup is within `tolerance` of the best measured one is chosen. So an
   easier method wins when the difference is within the noise, and the best wins otherwise.
4. At the user's concurrency, does it still pay? Speculation spends spare compute; at batch sizes
   past the measured break-even it costs throughput. Up to it: speculate always (`on`); beyond: the
   `cost` policy, which speculates only while the measured step times say it pays.

Tolerance: the measured noise, at most MAX_TOLERANCE, so that "within the noise" never trades away
more than that fraction of the best speedup.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from specdec.advise.measurements import Measurements, Option
from specdec.advise.survey import family_of

MAX_TOLERANCE = 0.05
NOISE_FLOOR = 0.02  # timing noise is never taken to be below this


@dataclass
class Node:
    id: str
    text: str  # the question or the leaf's advice, with the measured figures it rests on
    leaf: bool = False


@dataclass
class Edge:
    source: str
    target: str
    label: str  # "yes" / "no"


@dataclass
class Recommendation:
    action: str  # "defer" | "plain" | "speculate"
    option: Option | None = None
    spec_policy: str = "off"  # off | on | cost (serve)
    break_even_batch: float | None = None  # rows at which speculation stops paying (None: pays at every measured load)
    reason: str = ""


@dataclass
class Tree:
    nodes: list[Node] = field(default_factory=list)
    edges: list[Edge] = field(default_factory=list)
    path: list[str] = field(default_factory=list)  # node ids walked, root to leaf
    recommendation: Recommendation | None = None

    def add(self, node: Node) -> Node:
        self.nodes.append(node)
        return node

    def link(self, source: Node, target: Node, label: str) -> None:
        self.edges.append(Edge(source.id, target.id, label))

    def node(self, id: str) -> Node:
        return next(n for n in self.nodes if n.id == id)


def noise_of(m: Measurements) -> float:
    return max(m.noise, NOISE_FLOOR)


def tolerance_of(m: Measurements) -> float:
    return min(noise_of(m), MAX_TOLERANCE)


def paying(m: Measurements) -> list[Option]:
    """Each drafter's best configuration that beats plain decoding by more than the noise."""
    return [o for o in m.best_per_drafter() if o.speedup > 1 + noise_of(m)]


def by_effort(options: list[Option]) -> list[Option]:
    """Easiest retrofit first (survey.py's complexity), then faster first."""
    return sorted(options, key=lambda o: (complexity(o.drafter), -o.speedup))


def complexity(drafter: str) -> int:
    family = family_of(drafter)
    return family.complexity if family is not None else 9


def break_even_batch(batch_speedup: dict[int, float]) -> float | None:
    """Rows decoded together at which speculation stops paying: where the measured throughput ratio
    crosses 1, interpolated in log2(rows) between the measured sizes. 0 when it never pays; None when
    it pays at every measured size."""
    sizes = sorted(batch_speedup)
    if not sizes:
        return None
    if batch_speedup[sizes[0]] < 1:
        return 0.0
    for lo, hi in zip(sizes, sizes[1:]):
        if batch_speedup[hi] < 1:
            a, b = batch_speedup[lo], batch_speedup[hi]
            w = (a - 1) / (a - b)
            return 2 ** (math.log2(lo) + w * (math.log2(hi) - math.log2(lo)))
    return None


def easiest_retrofit(m: Measurements) -> Option | None:
    """The lowest-effort drafter that beats plain decoding by more than the noise."""
    options = by_effort(paying(m))
    return options[0] if options else None


def runner_up(m: Measurements, chosen: Option) -> Option | None:
    others = [o for o in m.best_per_drafter() if o.drafter != chosen.drafter]
    return others[0] if others else None


def paired_margin(a: Option, b: Option) -> float | None:
    """Median over shared prompts of a's speedup / b's, minus 1 (None without shared prompts)."""
    shared = [t for t in a.per_prompt if t in b.per_prompt and b.per_prompt[t] > 0]
    if not shared:
        return None
    ratios = sorted(a.per_prompt[t] / b.per_prompt[t] for t in shared)
    mid = len(ratios) // 2
    median = ratios[mid] if len(ratios) % 2 else (ratios[mid - 1] + ratios[mid]) / 2
    return median - 1


def node_id(kind: str, drafter: str) -> str:
    return kind + "_" + re.sub(r"\W", "_", drafter)


def describe(o: Option) -> str:
    tau = f", τ {o.tau:.2f}" if o.tau is not None else ""
    return f"{o.drafter} γ{o.gamma}: {o.speedup:.2f}× plain{tau}"


def tau_clause(o: Option) -> str:
    if o.tau is None or o.step_cost is None:
        return ""
    return f"<br/>τ {o.tau:.2f} against {o.step_cost:.2f} needed to break even"


def build_tree(m: Measurements) -> Tree:
    """The decision tree for these measurements, with the path they take through it."""
    tree = Tree()
    noise, tol = noise_of(m), tolerance_of(m)
    decode = tree.add(Node("decode", f"Decode time per answer ≥ {m.threshold_ms:.0f} ms?<br/>"
                                     f"measured {m.decode_ms:.0f} ms: {m.output_tokens:.0f} tokens × {m.ms_per_token:.1f} ms"))
    defer = tree.add(Node("defer", "Defer: decode is not the bottleneck<br/>(prefill, network or the client dominate)", leaf=True))
    tree.link(decode, defer, "no")
    best = m.best()
    pays = tree.add(Node("pays", f"Any drafter beats plain by more than the noise ({noise:.0%})?<br/>"
                                 + (f"best: {describe(best)}" if best else "no drafter measured")))
    tree.link(decode, pays, "yes")
    plain = tree.add(Node("plain", "Defer: don't speculate, decode plainly<br/>(no drafter beats it beyond the noise)", leaf=True))
    tree.link(pays, plain, "no")
    tree.path.append(decode.id)
    if m.decode_ms < m.threshold_ms:
        tree.path.append(defer.id)
        tree.recommendation = Recommendation("defer", reason=f"a typical answer decodes in {m.decode_ms:.0f} ms, "
                                                             f"below the {m.threshold_ms:.0f} ms threshold")
        return tree
    tree.path.append(pays.id)
    candidates = paying(m)
    if not candidates:
        tree.path.append(plain.id)
        tree.recommendation = Recommendation("plain", reason=f"the best drafter ({describe(best)}) is within the "
                                             f"{noise:.0%} noise of plain decoding" if best else "no drafter could run")
        return tree
    top = max(candidates, key=lambda o: o.speedup)
    chosen = choose_drafter(tree, pays, by_effort(candidates), top, tol)
    add_load_question(tree, m, chosen)
    return tree


def choose_drafter(tree: Tree, parent: Node, ordered: list[Option], top: Option, tol: float) -> Option:
    """A chain of 'is the next-easiest drafter within tol of the best?' questions, ending at the best."""
    previous, label = parent, "yes"
    for o in ordered:
        if o is top:
            node = tree.add(Node(node_id("use", o.drafter), f"{o.drafter} γ{o.gamma}: the fastest measured, "
                                                     f"{o.speedup:.2f}× plain{tau_clause(o)}"))
            tree.link(previous, node, label)
            tree.path.append(node.id)
            return o
        question = tree.add(Node(node_id("ask", o.drafter), f"{o.drafter} (retrofit effort {complexity(o.drafter)}/5) within "
                                                     f"{tol:.0%} of the best ({top.drafter} {top.speedup:.2f}×)?<br/>"
                                                     f"measured {o.speedup:.2f}×{tau_clause(o)}"))
        tree.link(previous, question, label)
        tree.path.append(question.id)
        if o.speedup >= top.speedup * (1 - tol):
            node = tree.add(Node(node_id("use", o.drafter), f"{o.drafter} γ{o.gamma}: as fast within the noise, easier"))
            tree.link(question, node, "yes")
            tree.path.append(node.id)
            return o
        hypothetical = tree.add(Node(node_id("use", o.drafter), f"{o.drafter} γ{o.gamma}", leaf=True))
        tree.link(question, hypothetical, "yes")
        previous, label = question, "no"
    raise AssertionError("the best option is among the ordered ones")


def add_load_question(tree: Tree, m: Measurements, chosen: Option) -> None:
    """Below the chosen drafter: does it still pay at the largest concurrency the user asked about?"""
    b = break_even_batch(chosen.batch_speedup)
    load = max(m.concurrency) if m.concurrency else 1
    measured = ", ".join(f"{k} rows {v:.2f}×" for k, v in sorted(chosen.batch_speedup.items()))
    if not chosen.batch_speedup:
        limit = "not measured beyond one row"
    elif b is None:
        largest = max(chosen.batch_speedup)
        limit = f"pays at every measured batch size ({measured})" + (
            f"; {load} rows not measured" if load > largest else "")
    else:
        limit = f"stops paying at ≈{b:.0f} rows ({measured})"
    node = tree.add(Node("load", f"Concurrency {load} within the batch size where it pays?<br/>"
                                 f"{limit}"))
    tree.link(tree.node(tree.path[-1]), node, "then")
    always = tree.add(Node("on", f"Speculate: {chosen.drafter} γ{chosen.gamma}, every step (policy on)", leaf=True))
    adaptive = tree.add(Node("cost", f"Speculate with the cost policy: {chosen.drafter} up to γ{chosen.gamma} "
                                     f"while it pays, plain beyond", leaf=True))
    tree.link(node, always, "yes")
    tree.link(node, adaptive, "no")
    tree.path.append(node.id)
    known = bool(chosen.batch_speedup) and load <= max(chosen.batch_speedup)  # unmeasured loads are not assumed to pay
    pays_at_load = load <= 1 or (known and (b is None or load <= b))
    tree.path.append(always.id if pays_at_load else adaptive.id)
    tree.recommendation = Recommendation("speculate", chosen, "on" if pays_at_load else "cost", b,
                                         reason=f"{describe(chosen)}; {limit}")
