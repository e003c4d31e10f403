"""`suffix`: SuffixDecoding (Oliaro et al. 2024, "SuffixDecoding: Extreme Speculative Decoding for Emerging
AI Applications"), training-free. Match the longest suffix of a row's text (the *pattern*) in an index of
text seen before, then follow its most frequent continuations.

Two indexes, as in the paper:
- per request: the row's prompt and its output so far (built at `join`, extended when it drafts);
- global: earlier requests' prompts and outputs, shared by every row and batch this drafter instance
  serves (the engine's successive `generate` calls, the server's requests), so later requests draft from
  earlier ones. A request enters it once it has left its slot (seen at the next `join`).

The index is a **suffix automaton**, not a suffix tree: it is built online one token at a time (a row's
index grows by the tokens each step keeps, in amortized constant time per token), it has at most 2n
states for n tokens whatever the length of the matches (a depth-limited suffix trie holds up to depth x n
nodes, a suffix tree needs Ukkonen's algorithm to grow online), and each state counts the end positions of
its strings, so "how often did this pattern continue with token t" is one lookup: count(next(state, t)).
A token's end positions are counted when it is appended, by a walk up the suffix links.

Memory bound. A suffix automaton cannot delete text, so the global index is two generations, each an
automaton over at most max_tokens / 2 tokens (default max_tokens = 1,000,000): requests are added to the
newer; when the next one does not fit, the older generation (the oldest requests' text) is dropped and the
newer becomes the older. At most max_tokens tokens are held, at about 400 bytes of host memory each
(measured on 300k tokens of GSM8K text: 1.3 states per token, each a dict of transitions), so about 0.4 GB
at the default cap; nothing is ever rebuilt. A request longer than a generation keeps its last
max_tokens / 2 tokens.

Drafting (per row, per step), with the paper's names:
- the pattern: per request, the longest suffix of the text that occurred earlier in it with a next token;
  globally, the longest suffix of the row's last `max_pattern` tokens that occurs in a generation with a
  next token. p is its length;
- MAX_SPEC = min(gamma, floor(max_spec_factor x p)): a longer match allows a longer draft (no match, no
  draft);
- from the pattern's state, a node's children are its continuations, each with the empirical probability
  count(child) / sum of its siblings' counts; a node's probability is the product along its path. The
  speculation tree grows best-first by that probability (SuffixDecoding's greedy expansion) and stops at
  a node below `min_token_prob`, at depth MAX_SPEC or at `tree_nodes` nodes (`max_children` per node). With
  tree_nodes = 0 (the default) it is a chain: the most frequent child at each step;
- the candidates (per request, each global generation) are scored by the sum of their nodes' probabilities
  (the expected number of accepted tokens); the best one is proposed, on equal scores the one with the
  longer pattern.
Nodes are deterministic (q = None): tree and chain verification stay lossless. Proposals have the static
shape of `shape(gamma)`: a chain pads with num_drafted, a tree with num_nodes. A chain also tells the step
its longest row (Proposal.longest), and the step verifies only that wide (step.narrow: the next power of
two): the draft length follows the matches, so a large gamma (SuffixDecoding drafts up to dozens of tokens
where a request repeats earlier text) costs nothing in steps whose matches are short, and a step where no
row matched is a plain step.

The indexes are Python structures on the host, so this drafter runs eagerly (graphable = False), like
`lookahead`. It reads a row's text from the host's row (the request's prompt, then the tokens the host has
read, `Row.generated`), catching up when the row drafts and when it leaves, never from the device: a step
in which it drafts nothing does not call it, so on a GPU such steps overlap the host's work as plain ones do
(step.tell).

Drafting ahead (chains). On a GPU the next step is launched before the one in flight is read (step
pipelines), so the host does not know the tokens that step keeps. A chain is then proposed as a *guess*
anchored where the host's text ends: the draft of the step in flight (which the host knows: it made it,
`drafted_from`), then the continuation of that text, the step's own next token first, from the same
indexes. On the device, `align_guesses` compares the tokens the step in flight really kept with the
guess's first tokens and drafts what follows them. Where they differ (the step rejected a draft, or its
next token was not the guessed one) the row has no suffix draft, and the lookup below drafts instead, on
the device, which holds what the step in flight kept (`fill_by_lookup_on_device`), so a wrong guess costs
a step its suffix draft, not its whole draft; the host repeats that lookup on the same tokens when it next
guesses (`drafted_from`). Only what the device drafts is verified, so a wrong guess costs acceptance, never
exactness. Where no step is in flight (a CPU; rows that just joined) the guess starts at the row's end. The
step knows which of the rows' steps are in flight by their launch serials (`RowBatch.in_flight`). The
device's part (aligning, looking up, the clamp to the step's width: `draft_from_packed`) replays as one
CUDA graph on a graphed batch (graphs.GraphedCalls), so that the host's proposal stays inside the step in
flight. A tree is proposed from the rows' tokens as read: its steps read the step in flight first.

Drafting ahead is the default (`ahead=0` reads the step in flight first): on an H200 it put `suffix` ahead
of `ngram` on gsm8k-eval and mixed prompts, where reading first left it behind; on the repeated-request
workload through a one-row server reading first served more (docs/design.md, "Drafting ahead").

Filling by lookup (chains). A p-token pattern drafts at most floor(max_spec_factor x p) tokens, so where a
row's text repeats itself after a short pattern (translation, RAG), `suffix` alone drafts less than
`ngram`, whose lookup drafts gamma tokens after a 1- to 3-token match. A row whose draft is shorter than
`lookup_tokens` tokens (8, at most gamma) takes the continuation of its longest matching n-gram in its own text
(`ngram`'s search) instead, where that continuation begins with the draft (`fill_by_lookup`; on the host
where nothing is in flight, on the device after aligning where a step is). `fill=0` looks up only where a
row has no draft. Drafted tokens carry no q, so what is verified changes acceptance, never the output.

Options (DrafterOptions.extra): max_tokens, max_pattern, max_spec_factor, min_token_prob, tree_nodes,
max_children, ahead, lookup_tokens, fill; see SuffixConfig. (`lookup_tokens`, not `lookup`: DrafterOptions.extra
is one namespace, and EAGLE's tree reads `lookup`, its graft.)
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from specdec.batch import Row
from specdec.config import NgramConfig
from specdec.drafters.base import DraftShape, DrafterOptions, Proposal, Verified, host_tree_proposal, register
from specdec.drafters.lookahead import rows_in_view
from specdec.drafters.ngram import find_continuations, look_up, ngram_config
from specdec.errors import UserError
from specdec.graphs import GraphedCalls, next_power_of_2
from specdec.models import fused
from specdec.transfer import pack_rows, to_device


@dataclass(frozen=True)
class SuffixConfig:
    max_tokens: int = 1_000_000  # tokens the global index holds at most (two generations of half each)
    max_pattern: int = 64  # the longest suffix of a row matched against the global index
    max_spec_factor: float = 1.0  # alpha: a pattern of p tokens allows a draft of floor(alpha * p) tokens
    min_token_prob: float = 0.1  # stop growing a path whose estimated probability falls below this
    tree_nodes: int = 0  # 0: draft a chain; else a tree of at most this many nodes
    max_children: int = 3  # a tree's fan-out bound (a chain has 1)
    ahead: int = 1  # draft chains ahead of the step in flight on a GPU (see "Drafting ahead"); 0: read the step first
    lookup_tokens: int = 8  # tokens a row drafts by n-gram lookup where its own draft is shorter ("Filling by lookup"; 0: none)
    fill: int = 1  # 1: look up where a row's draft is shorter than `lookup_tokens`; 0: only where it has none

    def __post_init__(self) -> None:
        checks = [("max_tokens", self.max_tokens >= 2, "an integer >= 2"),
                  ("max_pattern", self.max_pattern >= 1, "an integer >= 1"),
                  ("max_spec_factor", self.max_spec_factor > 0, "a number > 0"),
                  ("min_token_prob", 0 <= self.min_token_prob <= 1, "a number in [0, 1]"),
                  ("tree_nodes", self.tree_nodes >= 0, "an integer >= 0 (0: a chain)"),
                  ("max_children", self.max_children >= 1, "an integer >= 1"),
                  ("ahead", self.ahead in (0, 1), "0 or 1"),
                  ("lookup_tokens", self.lookup_tokens >= 0, "an integer >= 0 (0: no lookup)"),
                  ("fill", self.fill in (0, 1), "0 or 1")]
        for name, ok, expected in checks:
            if not ok:
                raise UserError(f"suffix drafter: {name} must be {expected}, got {getattr(self, name)!r}")

    @classmethod
    def of(cls, extra: dict) -> "SuffixConfig":
        """The options `extra` gives (other drafters' keys ignored), each checked for its type."""
        values = {}
        for name, f in cls.__dataclass_fields__.items():
            if name not in extra:
                continue
            value, kind = extra[name], int if f.type == "int" else float
            number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            if not number or (kind is int and not float(value).is_integer()):
                raise UserError(f"suffix drafter: {name} must be {'an integer' if kind is int else 'a number'}, got {value!r}")
            values[name] = kind(value)
        return cls(**values)


OPTION_NAMES = tuple(SuffixConfig.__dataclass_fields__)


def parse_options(items: list[str]) -> dict[str, int | float]:
    """KEY=VALUE items of SuffixConfig's options, as numbers (`--suffix-options`, and `suffix:KEY=VALUE` in
    bench's `--drafters`); SuffixConfig checks the values when the drafter is built."""
    options = {}
    for item in filter(None, items):
        key, sep, value = (part.strip() for part in item.partition("="))
        if not sep or key not in OPTION_NAMES:
            raise UserError(f"expected KEY=VALUE with KEY one of {', '.join(OPTION_NAMES)}, got {item!r}")
        try:
            options[key] = int(value) if value.lstrip("-").isdigit() else float(value)
        except ValueError:
            raise UserError(f"{key} must be a number, got {value!r}") from None
    return options


# ---- the suffix automaton ------------------------------------------------------------------------


@dataclass
class SuffixAutomaton:
    """The suffix automaton of one or more texts (a generalized one: `start_text` begins another). State 0
    is the root (the empty string); each state is a class of substrings with the same end positions."""

    next: list[dict[int, int]] = field(default_factory=lambda: [{}])  # per state: token -> state
    link: list[int] = field(default_factory=lambda: [-1])  # suffix link: the state of the longest shorter suffix
    length: list[int] = field(default_factory=lambda: [0])  # the state's longest string
    count: list[int] = field(default_factory=lambda: [0])  # end positions of the state's strings (occurrences)
    last: int = 0  # the state of the text being added (all of it so far)
    tokens: int = 0  # tokens added, over every text


def new_state(sam: SuffixAutomaton, length: int, link: int, next_: dict[int, int], count: int) -> int:
    sam.next.append(next_)
    sam.link.append(link)
    sam.length.append(length)
    sam.count.append(count)
    return len(sam.next) - 1


def split_state(sam: SuffixAutomaton, p: int, q: int, token: int) -> int:
    """q's strings longer than length(p) + 1 stay in q; the shorter ones move to a clone (which ends where q
    does, and will end at the new position too). Transitions into q from p and its suffixes move to it."""
    clone = new_state(sam, sam.length[p] + 1, sam.link[q], dict(sam.next[q]), sam.count[q])
    while p != -1 and sam.next[p].get(token) == q:
        sam.next[p][token] = clone
        p = sam.link[p]
    sam.link[q] = clone
    return clone


def count_end(sam: SuffixAutomaton, state: int) -> None:
    """A new end position: every suffix of the text so far occurs once more."""
    while state > 0:
        sam.count[state] += 1
        state = sam.link[state]


def start_text(sam: SuffixAutomaton) -> None:
    sam.last = 0


def append_token(sam: SuffixAutomaton, token: int) -> None:
    """Extend the text being added by one token (the online construction, generalized to several texts:
    a text may repeat a substring that another text already put in the automaton)."""
    last = sam.last
    sam.tokens += 1
    q = sam.next[last].get(token)
    if q is not None:  # only in a later text: the extended string already exists
        sam.last = q if sam.length[q] == sam.length[last] + 1 else split_state(sam, last, q, token)
        count_end(sam, sam.last)
        return
    cur = new_state(sam, sam.length[last] + 1, 0, {}, 0)
    p = last
    while p != -1 and token not in sam.next[p]:
        sam.next[p][token] = cur
        p = sam.link[p]
    if p != -1:
        q = sam.next[p][token]
        sam.link[cur] = q if sam.length[p] + 1 == sam.length[q] else split_state(sam, p, q, token)
    sam.last = cur
    count_end(sam, cur)


def add_text(sam: SuffixAutomaton, tokens: list[int]) -> None:
    start_text(sam)
    for token in tokens:
        append_token(sam, token)


def build_automaton(tokens: list[int]) -> SuffixAutomaton:
    sam = SuffixAutomaton()
    add_text(sam, tokens)
    return sam


# ---- matching and drafting -----------------------------------------------------------------------


@dataclass(frozen=True)
class Match:
    """A pattern found in an automaton: its state and its length p."""

    state: int
    length: int


@dataclass(frozen=True)
class Child:
    token: int
    state: int
    prob: float  # count(child) / the sum of its siblings' counts


@dataclass
class Draft:
    """A speculation tree in topological order (a chain when every parent is the node before)."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)  # -1: the pending token (the tree's root)
    probs: list[float] = field(default_factory=list)  # each node's estimated probability (product along its path)

    @property
    def score(self) -> float:
        """The expected number of accepted tokens, if the estimates held."""
        return sum(self.probs)


def back_off(sam: SuffixAutomaton, match: Match) -> Match:
    """The longest suffix of a match that has a continuation (a next token somewhere in the texts)."""
    state, length = match.state, match.length
    while state > 0 and not sam.next[state]:
        state = sam.link[state]
        length = sam.length[state]
    return Match(state, length)


def extend_match(sam: SuffixAutomaton, match: Match, tokens: list[int], longest: int | None = None) -> Match:
    """The longest suffix of (the match's string + tokens) that occurs in the automaton (matching statistics:
    follow a transition where there is one, else fall back along suffix links), no longer than `longest` if
    given: cut to it after each token, to the state holding that suffix (a state holds the lengths above its
    suffix link's), so that matching on finds what matching the text's last `longest` tokens afresh would."""
    state, length = match.state, match.length
    for token in tokens:
        while state > 0 and token not in sam.next[state]:
            state = sam.link[state]
            length = sam.length[state]
        if token in sam.next[state]:
            state, length = sam.next[state][token], length + 1
        if longest is not None and length > longest:
            while sam.length[sam.link[state]] >= longest:
                state = sam.link[state]
            length = longest
    return Match(state, length)


def match_pattern(sam: SuffixAutomaton, text: list[int]) -> Match:
    """The longest suffix of `text` that occurs in the automaton with a continuation."""
    return back_off(sam, extend_match(sam, Match(0, 0), text))


@dataclass
class WindowMatch:
    """A row's pattern in one global generation: the match of its text's last max_pattern tokens, as of
    `text` tokens of it and `tokens` in the generation (which grows, and so invalidates it, when requests
    are added)."""

    sam: SuffixAutomaton
    tokens: int
    text: int
    match: Match


def match_own_text(sam: SuffixAutomaton, ahead: list[int] = ()) -> Match:
    """The longest suffix of the automaton's own text (then `ahead`, tokens not in it) that occurred earlier in
    it with a next token."""
    return back_off(sam, extend_match(sam, Match(sam.last, sam.length[sam.last]), ahead))


def rank_children(sam: SuffixAutomaton, state: int, k: int) -> list[Child]:
    """The k most frequent continuations of a state (ties: the smaller token), with their probabilities."""
    edges, count = sam.next[state], sam.count
    total = sum(count[s] for s in edges.values())
    best = heapq.nlargest(k, edges.items(), key=lambda edge: (count[edge[1]], -edge[0]))
    return [Child(token, s, count[s] / total) for token, s in best]


def grow_draft(sam: SuffixAutomaton, match: Match, max_nodes: int, max_depth: int, max_children: int,
               min_token_prob: float) -> Draft:
    """The speculation tree from a pattern: nodes added best-first by path probability (so a node's parent is
    always in first), none below min_token_prob, none deeper than max_depth, at most max_nodes."""
    draft, order = Draft(), itertools.count()
    frontier: list[tuple[float, int, int, int, Child]] = []  # (-probability, order, parent node, depth, child)

    def push_children(state: int, node: int, depth: int, prob: float) -> None:
        if depth < max_depth:
            for child in rank_children(sam, state, max_children):
                heapq.heappush(frontier, (-prob * child.prob, next(order), node, depth + 1, child))

    push_children(match.state, -1, 0, 1.0)
    while frontier and len(draft.tokens) < max_nodes:
        neg_prob, _, parent, depth, child = heapq.heappop(frontier)
        if -neg_prob < min_token_prob:
            break
        draft.tokens.append(child.token)
        draft.parents.append(parent)
        draft.probs.append(-neg_prob)
        push_children(child.state, len(draft.tokens) - 1, depth, -neg_prob)
    return draft


# ---- the global index ----------------------------------------------------------------------------


@dataclass
class GlobalIndex:
    """Earlier requests' texts in two generations of at most max_tokens // 2 tokens each."""

    max_tokens: int
    newer: SuffixAutomaton = field(default_factory=SuffixAutomaton)
    older: SuffixAutomaton = field(default_factory=SuffixAutomaton)

    @property
    def generations(self) -> list[SuffixAutomaton]:
        return [sam for sam in (self.newer, self.older) if sam.tokens]

    @property
    def tokens(self) -> int:
        return self.newer.tokens + self.older.tokens


def add_request(index: GlobalIndex, text: list[int]) -> None:
    """Add one request's text; when the newer generation cannot take it, the older (the oldest requests) is dropped."""
    room = index.max_tokens // 2
    text = text[-room:]
    if index.newer.tokens + len(text) > room:
        index.older, index.newer = index.newer, SuffixAutomaton()
    add_text(index.newer, text)


# ---- the drafter ---------------------------------------------------------------------------------


@dataclass
class Guess:
    """A chain proposed for a row's tokens from position `anchor` on (drafting ahead, align_guesses)."""

    tokens: list[int]
    anchor: int  # the row's length on the host when guessed
    limit: int  # the most tokens its step could draft (min(gamma, the proposal's longest))
    serial: int  # its step's launch (RowBatch.serial)
    lookup: int = 0  # its step's lookup (fill_by_lookup; 0: none)
    fill: int = 1  # SuffixConfig.fill


@dataclass
class RowState:
    text: list[int]  # what `automaton` holds: the prompt and output up to the last catch_up
    automaton: SuffixAutomaton  # over `text`
    host: Row  # the batch's row: its request's prompt, and its output as far as the host has read it
    guess: Guess | None = None  # the chain of the row's last proposal
    patterns: list[WindowMatch] = field(default_factory=list)  # per global generation, kept across steps (match_window)


def drafted_from(guess: Guess, text: list[int], ngram: NgramConfig) -> list[int]:
    """What a step drafted from `guess` for a row holding `text` when it ran: align_guesses, then
    fill_by_lookup_on_device, on the host (the same lookup on the same tokens gives the same draft)."""
    off = len(text) - guess.anchor
    held = off <= len(guess.tokens) and text[guess.anchor :] == guess.tokens[:off]
    drafted = guess.tokens[off : off + guess.limit] if held else []
    return fill_by_lookup(drafted, text, guess.lookup, guess.fill, ngram)


def fill_by_lookup(draft: list[int], text: list[int], lookup: int, fill: int, ngram: NgramConfig) -> list[int]:
    """The row's draft, or, where it is shorter than `lookup` tokens (with fill = 0: where it is empty), the
    continuation of the row's longest matching n-gram in its own text (`ngram`'s lookup, `lookup` tokens),
    where that continuation begins with the draft. A p-token pattern drafts at most floor(alpha x p)
    tokens, so where a row's text repeats itself from a short pattern (translation, RAG) `suffix` alone
    drafts less than `ngram` does (docs/design.md, "Filling by lookup")."""
    if len(draft) >= lookup or (draft and not fill):
        return draft
    looked = look_up(text, lookup, ngram.max_ngram, ngram.min_ngram)
    return looked if looked and looked[: len(draft)] == draft else draft


def align_guesses(tokens: Tensor, length: Tensor, guess: Tensor, anchor: Tensor, size: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """(drafts [B, k], num_drafted [B]): each row's guess from where the row ends now, if the tokens the row
    gained since the guess was made (a step in flight: what it kept) equal the guess's first ones; else no
    draft. tokens [B, S], length [B] as the device holds them; guess [B, G] (size [B] of it real), made when
    the row held anchor [B] tokens."""
    G = guess.shape[1]
    off = (length - anchor).clamp(min=0)  # [B]
    j = torch.arange(G, device=guess.device)  # [G]
    held = tokens.gather(1, (anchor[:, None] + j).clamp(max=tokens.shape[1] - 1))  # [B, G]
    agree = ((held == guess) | (j >= off[:, None])).all(1) & (off <= size)  # [B]
    drafts = guess.gather(1, (off[:, None] + torch.arange(k, device=guess.device)).clamp(max=G - 1))  # [B, k]
    return drafts, torch.where(agree, (size - off).clamp(0, k), 0)


def fill_by_lookup_on_device(tokens: Tensor, length: Tensor, drafts: Tensor, num: Tensor, lookup: int, fill: int,
                             max_ngram: int, min_ngram: int) -> tuple[Tensor, Tensor]:
    """fill_by_lookup for every row on the device, which holds what the step in flight kept (a guess that did
    not hold leaves its row no draft): (drafts [B, k], num_drafted [B]), the first `lookup` tokens (<= k) of
    the continuation of the row's longest matching n-gram where the row's draft (drafts [B, k], num [B]) is
    shorter and that continuation begins with it."""
    k = drafts.shape[1]
    looked, found = find_continuations(tokens, length, k, max_ngram, min_ngram)  # [B, k], [B]
    agree = ((looked == drafts) | (torch.arange(k, device=drafts.device) >= num[:, None])).all(1)  # [B]
    short = num < lookup if fill else num == 0
    take = short & found & agree & (lookup > 0)
    return torch.where(take[:, None], looked, drafts), torch.where(take, lookup, num)


def draft_ahead(tokens: Tensor, length: Tensor, guess: Tensor, anchor: Tensor, size: Tensor, k: int, lookup: int,
                fill: int, max_ngram: int, min_ngram: int) -> tuple[Tensor, Tensor]:
    """(drafts [B, k], num_drafted [B]): align_guesses, then fill_by_lookup_on_device. On CUDA one compiled function
    (fused.run_compiled): as separate kernels, launched from the host while the step in flight runs, its few
    dozen tiny operations cost more than the step. The guesses come as views of one packed copy: sliced
    inside, the packed width (which follows the guesses' lengths) would be compiled anew for every value."""
    drafts, num = align_guesses(tokens, length, guess, anchor, size, k)
    return fill_by_lookup_on_device(tokens, length, drafts, num, lookup, fill, max_ngram, min_ngram)


def draft_from_packed(tokens: Tensor, length: Tensor, packed: Tensor, k: int, lookup: int, fill: int, max_ngram: int,
                      min_ngram: int) -> tuple[Tensor, Tensor]:
    """draft_ahead over one packed copy [B, G + 3] of each row's guess (G tokens), anchor, size and limit (the
    most its step verifies): (drafts [B, k], num_drafted [B], at most the limit). On a CUDA graph's batch it
    replays as one graph (SuffixDrafter.graphed): launched as its compiled kernels, guards and wrappers, it
    took 0.22 ms of the host's 0.40 ms proposal on an H200, where a step in flight hides about 0.5 ms."""
    G = packed.shape[1] - 3
    drafts, num = fused.run_compiled(draft_ahead, tokens, length, packed[:, :G], packed[:, G], packed[:, G + 1], k, lookup,
                                     fill, max_ngram, min_ngram)
    return drafts, torch.minimum(num, packed[:, G + 2])


def live_rows(batch) -> list[tuple[int, RowState]]:
    """(slot, state) of the rows in the batch's view still running as far as the host knows (a row that
    stopped in a step in flight still drafts: the step masks it)."""
    return [(slot, row) for slot, row in rows_in_view(batch) if batch.rows.get(slot) is row.host and not row.host.finished]


def catch_up(row: RowState) -> None:
    """Index the tokens the row emitted since the last catch-up, read from the host's row (a host drafter is
    told only of the steps it drafted in, and then before their tokens are read: drafters.base)."""
    emitted = row.host.generated[len(row.text) - len(row.host.request.prompt) :]
    row.text += emitted
    for token in emitted:
        append_token(row.automaton, token)


@dataclass
class Held:
    """A row in a batch's per-slot state, not yet added to the global index. It has left its slot when the
    slot's state is no longer this row's (`RowBatch.release` drops it; a new row replaces it)."""

    slots: dict  # the batch's `draft` dict (shared by its views)
    slot: int
    row: RowState

    @property
    def released(self) -> bool:
        return self.slots.get(self.slot) is not self.row


class SuffixDrafter:
    name = "suffix"
    graphable = False
    learns_across_requests = True  # benches give each method its own instance and a cold start (see `forget`)

    def __init__(self, config: SuffixConfig, ngram: NgramConfig = NgramConfig()) -> None:
        self.config = config
        self.ngram = ngram  # the lookup where a row's draft is short (fill_by_lookup)
        self.index = GlobalIndex(config.max_tokens)
        self.held: list[Held] = []  # rows joined, oldest first, not yet in the global index
        self.graphed = GraphedCalls(draft_from_packed, copied=(2,))  # drafting ahead on a CUDA graph's batch

    def shape(self, gamma: int) -> DraftShape:
        if self.config.tree_nodes:
            return DraftShape(width=self.config.tree_nodes, depth=gamma, tree=True)
        return DraftShape(width=gamma, depth=gamma)

    def attach(self, batch) -> None:
        batch.draft = {}

    def join(self, batch, slots: Tensor, hidden: Tensor) -> None:
        self.retire_released()
        for slot in slots.tolist():
            host = batch.rows[slot]
            text = list(host.request.prompt)
            batch.draft[slot] = RowState(text, build_automaton(text), host)
            self.held.append(Held(batch.draft, slot, batch.draft[slot]))

    def forget(self) -> None:
        """Drop every earlier request from the global index (rows in slots keep their own state)."""
        self.index = GlobalIndex(self.config.max_tokens)
        self.held = [h for h in self.held if not h.released]

    def retire_released(self) -> None:
        """Add the rows that have left their slots to the global index, in the order they joined."""
        for held in [h for h in self.held if h.released]:
            catch_up(held.row)  # its host row holds its whole output now
            add_request(self.index, held.row.text)
        self.held = [h for h in self.held if not h.released]

    @property
    def drafts_ahead(self) -> bool:
        """Whether it proposes with a step in flight (Stepper.pipelines), where asked to (`ahead`): a chain can
        (propose_chain); a tree is proposed from the rows' tokens as read."""
        return bool(self.config.ahead) and not self.config.tree_nodes

    def propose(self, batch, gamma: int, u: Tensor | None) -> Proposal:
        shape = self.shape(gamma)
        rows = live_rows(batch)
        for _, row in rows:
            catch_up(row)
        return self.propose_tree(batch, shape, rows) if shape.tree else self.propose_chain(batch, gamma, rows)

    def propose_chain(self, batch, gamma: int, rows: list[tuple[int, RowState]]) -> Proposal:
        """Each row's chain, drafted ahead where the row's last proposal went to a step still in flight: that
        step's draft (drafted_from) is taken as accepted, and the chain guesses on from it, the step's own next
        token first; the device keeps what follows the tokens the step really kept, where they agree with the
        guess (align_guesses), then fills a short draft by n-gram lookup (fill_by_lookup_on_device), for every
        row. Where nothing is in flight (a CPU; a GPU step that read its rows first) each chain starts at its
        row's end, as the host holds it, and the host fills it (fill_by_lookup)."""
        c, ahead = self.config, bool(batch.in_flight)
        lookup = min(gamma, c.lookup_tokens)
        guesses, longest = {}, 0
        for slot, row in rows:
            in_flight = batch.in_flight.get(slot)  # a step over the row not yet read: its tokens are ahead
            drafted = drafted_from(row.guess, row.text, self.ngram) if row.guess and row.guess.serial == in_flight else []
            depth = gamma + 1 if in_flight else gamma  # in flight: that step's next token, then gamma
            guess = drafted + self.best_draft(row, DraftShape(depth, depth), drafted).tokens
            if not ahead:  # ahead, the device fills every row, those not in flight too (fill_by_lookup_on_device)
                guess = fill_by_lookup(guess, row.text, lookup, c.fill, self.ngram)
            guesses[slot] = guess
            longest = max(longest, min(gamma, len(guess) - (len(drafted) + 1 if in_flight else 0)))
        if ahead:  # a guess is what the step in flight drafted (at its own gamma), its next token, then gamma, and the
            longest = max(longest, lookup)  # device may fill any row's draft to `lookup` tokens
        # the longest guess (reading first: at most gamma), to a power of two: few shapes for the graphs to capture
        G = next_power_of_2(max([gamma, *map(len, guesses.values())]))
        packed = {}  # per slot: guess (padded to G), anchor, size, limit
        for slot, row in rows:
            guess = guesses[slot]
            packed[slot] = guess + [0] * (G - len(guess)) + [len(row.text), len(guess), longest]
            if self.drafts_ahead:  # what the next proposal aligns with, should this step still be in flight then
                row.guess = Guess(guess, len(row.text), min(gamma, longest), batch.serial, lookup if ahead else 0, c.fill)
        packed = to_device(pack_rows(packed, batch.capacity, G + 3), batch.device)  # [B, G + 3], one copy
        if not ahead:  # every chain starts at its row's end (read first), filled: nothing to do on the device
            return Proposal(tokens=packed[:, :gamma], num_drafted=packed[:, G + 1].clamp(max=longest), longest=longest)
        run = self.graphed if batch.static and batch.tokens.is_cuda else draft_from_packed
        drafts, num = run(batch.tokens, batch.length, packed, gamma, lookup, c.fill, self.ngram.max_ngram,
                          self.ngram.min_ngram)
        return Proposal(tokens=drafts, num_drafted=num, longest=longest)

    def propose_tree(self, batch, shape: DraftShape, rows: list[tuple[int, RowState]]) -> Proposal:
        trees = {}
        for slot, row in rows:
            draft = self.best_draft(row, shape)
            trees[slot] = draft.tokens, draft.parents
        return host_tree_proposal(trees, batch.capacity, shape.width, shape.depth, self.config.max_children, batch.device)

    def best_draft(self, row: RowState, shape: DraftShape, ahead: list[int] = ()) -> Draft:
        """The highest-scoring draft of the row's own index and the global generations, following the row's
        text and then `ahead` (tokens drafted in a step in flight)."""
        c = self.config
        max_nodes, max_children = (shape.width, c.max_children) if shape.tree else (shape.depth, 1)
        candidates = [(row.automaton, match_own_text(row.automaton, ahead))]
        candidates += [(sam, self.match_window(row, sam, ahead)) for sam in self.index.generations]
        best, best_key = Draft(), (0.0, 0)
        for sam, match in candidates:
            max_spec = min(shape.depth, int(c.max_spec_factor * match.length))
            if max_spec == 0:
                continue
            draft = grow_draft(sam, match, max_nodes, max_spec, max_children, c.min_token_prob)
            if (draft.score, match.length) > best_key:  # on equal scores, the longer pattern (more context)
                best, best_key = draft, (draft.score, match.length)
        return best

    def match_window(self, row: RowState, sam: SuffixAutomaton, ahead: list[int]) -> Match:
        """match_pattern of the row's last max_pattern tokens, then `ahead`, in a global generation: matched on
        from where the row's last proposal left it, over the tokens kept since, where the generation has not
        grown since. A proposal must fit in the step in flight to stay hidden on a GPU (about 0.5 ms on an
        H200: docs/design.md, "Out of domain"); matching the whole window again at every proposal took it
        from 0.18-0.21 ms to 0.22-0.25 ms (2-core CPU, 16 mixed prompts, the same drafts)."""
        longest = self.config.max_pattern
        kept = next((p for p in row.patterns if p.sam is sam and p.tokens == sam.tokens), None)
        if kept is None:
            kept = WindowMatch(sam, sam.tokens, 0, Match(0, 0))
            live = self.index.generations  # a dropped generation is not kept alive by a row
            row.patterns = [p for p in row.patterns if p.sam is not sam and any(p.sam is g for g in live)] + [kept]
        start = max(kept.text, len(row.text) - longest)  # after `longest` tokens nothing earlier is in the match
        kept.match, kept.text = extend_match(sam, kept.match, row.text[start:], longest), len(row.text)
        return back_off(sam, extend_match(sam, kept.match, list(ahead), longest))

    def commit(self, batch, verified: Verified) -> None:
        """Nothing to do on the device: a row's kept tokens reach its index from the host (catch_up)."""


@register("suffix")
def build(target, options: DrafterOptions) -> SuffixDrafter:
    return SuffixDrafter(SuffixConfig.of(options.extra), ngram_config(options))
