"""The `suffix` drafter (SuffixDecoding): its suffix automaton (occurrence counts, longest match, most
frequent continuation), the global index's memory bound and eviction, sharing across requests (an
engine's later calls, the server's later requests), and losslessness: greedy output equal to plain greedy
decoding on unsharpened tiny models (near-ties), sampled output following the target's distribution.
The step invariants and chunked prefill are checked for it in test_step.py and test_chunked_prefill.py."""

from __future__ import annotations

import dataclasses
import itertools
import math
import random

import pytest
import torch

import specdec
import specdec.verify
from conftest import DEVICE, build_hf, save_hf, tiny_pair
from specdec import SamplingParams, SpecConfig
from specdec.batch import Request, Row, eos_ids
from specdec.drafters import DrafterOptions, build_drafter
from specdec.drafters.base import DraftShape, Proposal
from specdec.drafters.suffix import (
    GlobalIndex,
    Guess,
    Match,
    RowState,
    SuffixAutomaton,
    SuffixConfig,
    SuffixDrafter,
    add_request,
    add_text,
    align_guesses,
    build_automaton,
    draft_ahead,
    drafted_from,
    grow_draft,
    fill_by_lookup_on_device,
    match_own_text,
    match_pattern,
)
import specdec.drafters.suffix as suffix_module
from specdec.config import NgramConfig
from specdec.drafters.ngram import find_continuations, look_up
from specdec.errors import UserError
from specdec.models import load_model
from specdec.step import drafts_ahead, narrow, narrow_gammas, new_stepper, overlaps
from specdec.verify import TreeSpec
from test_engine import MAX_NEW, PROMPTS, models, plain  # noqa: F401  (fixtures)
from test_sampling_e2e import ALPHA, PROMPT, ROWS, VOCAB, always_accept, distribution_pvalues, tokens_of

TREE = {"tree_nodes": 6, "max_children": 2}


def occurrences(texts: list[list[int]], s: list[int]) -> int:
    return sum(t[i : i + len(s)] == s for t in texts for i in range(len(t) - len(s) + 1))


def row_state(text: list[int]) -> RowState:
    """A row whose prompt is `text` and whose index holds it."""
    return RowState(text, build_automaton(text), Row(0, Request(list(text), max_new_tokens=1), seed=0))


def state_of(sam: SuffixAutomaton, s: list[int]) -> int | None:
    state = 0
    for token in s:
        state = sam.next[state].get(token)
        if state is None:
            return None
    return state


# ---- the automaton -------------------------------------------------------------------------------


def test_counts_are_occurrences_and_states_stay_linear():
    """Every substring (up to 5 tokens, 3-token alphabet) of 1-4 texts is in the automaton iff it occurs, with
    its number of occurrences as the count; at most 2n + 1 states for n tokens."""
    rng = random.Random(0)
    for _ in range(200):
        texts = [[rng.randrange(3) for _ in range(rng.randint(1, 12))] for _ in range(rng.randint(1, 4))]
        sam = SuffixAutomaton()
        for text in texts:
            add_text(sam, text)
        for n in range(1, 6):
            for s in map(list, itertools.product(range(3), repeat=n)):
                state, expected = state_of(sam, s), occurrences(texts, s)
                assert (state is not None) == (expected > 0), (texts, s)
                assert state is None or sam.count[state] == expected, (texts, s)
        assert len(sam.next) <= 2 * sum(map(len, texts)) + 1
        assert sam.tokens == sum(map(len, texts))


def test_the_pattern_is_the_longest_suffix_with_a_continuation():
    rng = random.Random(1)
    for _ in range(300):
        texts = [[rng.randrange(3) for _ in range(rng.randint(1, 12))] for _ in range(rng.randint(1, 3))]
        sam = SuffixAutomaton()
        for text in texts:
            add_text(sam, text)
        query = [rng.randrange(3) for _ in range(rng.randint(1, 8))]
        longest = max([n for n in range(1, len(query) + 1)
                       if any(occurrences(texts, query[-n:] + [t]) for t in range(3))], default=0)
        assert match_pattern(sam, query).length == longest, (texts, query)
        own = texts[0]  # in its own text: the longest suffix that occurred before the end
        longest = max([n for n in range(1, len(own)) if occurrences([own[:-1]], own[-n:])], default=0)
        assert match_own_text(build_automaton(own)).length == longest, own


def test_a_match_is_exact_and_spans_earlier_texts():
    sam = SuffixAutomaton()
    add_text(sam, [1, 2, 3, 4, 5])
    add_text(sam, [9, 2, 3, 7])
    assert match_pattern(sam, [8, 1, 2, 3]) == Match(state_of(sam, [1, 2, 3]), 3)  # continues with 4
    assert match_pattern(sam, [9, 2, 3]).length == 3  # continues with 7
    assert match_pattern(sam, [6, 6, 3]).length == 1
    assert match_pattern(sam, [5]).length == 0  # 5 ends a text: nothing ever followed it
    assert match_pattern(sam, [42]).length == 0


def test_the_draft_follows_the_most_frequent_continuation():
    """After 'a b': c three times, d once. The chain takes c (3/4), then what followed 'a b c' most."""
    a, b, c, d, e, f = range(1, 7)
    sam = SuffixAutomaton()
    for text in ([a, b, c, e], [a, b, c, e], [a, b, c, f], [a, b, d]):
        add_text(sam, text)
    match = match_pattern(sam, [9, a, b])
    assert match.length == 2
    chain = grow_draft(sam, match, max_nodes=4, max_depth=4, max_children=1, min_token_prob=0.0)
    assert chain.tokens == [c, e] and chain.parents == [-1, 0]
    assert chain.probs == pytest.approx([3 / 4, 3 / 4 * 2 / 3])
    tree = grow_draft(sam, match, max_nodes=4, max_depth=4, max_children=2, min_token_prob=0.0)
    assert tree.tokens == [c, e, d, f] and tree.parents == [-1, 0, -1, 0]  # best-first: 3/4, 1/2, 1/4, 1/4
    assert grow_draft(sam, match, 4, 4, 2, min_token_prob=0.3).tokens == [c, e]  # d and f fall below 0.3
    assert grow_draft(sam, match, 4, 1, 2, min_token_prob=0.0).tokens == [c, d]  # depth bound


def test_a_match_extends_past_the_text_through_tokens_not_in_it():
    """Drafting ahead matches the row's text followed by the draft of the step in flight."""
    sam = build_automaton([5, 6, 7, 8, 5, 6])
    assert match_own_text(sam) == Match(state_of(sam, [5, 6]), 2)
    assert match_own_text(sam, [7]) == Match(state_of(sam, [5, 6, 7]), 3)  # 5 6 7 -> 8
    assert match_own_text(sam, [9]) == Match(0, 0)  # 9 occurs nowhere: no pattern
    assert match_own_text(sam, [7, 8, 5]) == Match(state_of(sam, [5, 6, 7, 8, 5]), 5)


@pytest.mark.parametrize("lookup, fill", [(0, 1), (3, 0), (3, 1)])
def test_a_guess_is_aligned_alike_on_the_host_and_the_device(lookup, fill):
    """align_guesses (the device, with a step's kept tokens already appended) and drafted_from (the host,
    later) agree on every case: the step kept the guess's first tokens, fewer, others, or none yet; and with
    the lookup (fill_by_lookup_on_device), so do the n-gram drafts that replace an empty draft (fill = 0) or
    fill a short one (fill = 1, where the lookup's continuation begins with it, and only there)."""
    rng = random.Random(0)
    S, G, k = 40, 9, 4
    cases = []
    for _ in range(200):
        text = [rng.randrange(5) for _ in range(rng.randrange(3, 20))]
        guess = [rng.randrange(5) for _ in range(rng.randrange(0, G + 1))]
        off = rng.randrange(0, 6)
        kept = guess[:off] if rng.random() < 0.6 else [rng.randrange(5) for _ in range(off)]
        cases.append((text, guess, text + kept, rng.randrange(0, k + 1)))
    tokens = torch.zeros(len(cases), S, dtype=torch.long)
    packed = torch.zeros(len(cases), G, dtype=torch.long)
    for b, (text, guess, now, _) in enumerate(cases):
        tokens[b, : len(now)] = torch.tensor(now)
        packed[b, : len(guess)] = torch.tensor(guess, dtype=torch.long)
    length = torch.tensor([len(now) for _, _, now, _ in cases])
    anchor = torch.tensor([len(text) for text, _, _, _ in cases])
    size = torch.tensor([len(guess) for _, guess, _, _ in cases])
    drafts, num = align_guesses(tokens, length, packed, anchor, size, k)
    aligned = num.clone()
    drafts, num = fill_by_lookup_on_device(tokens, length, drafts, num, lookup, fill, 3, 1)
    hits = replaced = filled = 0
    for b, (text, guess, now, limit) in enumerate(cases):
        limit = max(limit, lookup)  # drafting ahead, a step verifies at least the lookup's tokens
        expected = drafted_from(Guess(guess, len(text), limit, serial=1, lookup=lookup, fill=fill), now, NgramConfig())
        n = min(int(num[b]), limit)
        assert drafts[b, :n].tolist() == expected, (text, guess, now, limit)
        hits += bool(expected)
        replaced += lookup and not aligned[b] and bool(expected)
        filled += 0 < int(aligned[b]) < int(num[b])
    assert 20 < hits < 200 and (replaced > 20 if lookup else hits < 180), (hits, replaced)
    assert (filled > 0) == bool(lookup and fill), filled  # short drafts filled, and only where asked


def test_drafting_ahead_compiles_once_for_every_guess_width():
    """draft_ahead as run_compiled compiles it (dynamic shapes, one graph): guesses of every width, gammas and
    batch sizes need at most 4 compiles (a batch of one and a gamma of one are specialised), not one per width."""
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    torch._dynamo.reset()
    compiled = torch.compile(draft_ahead, dynamic=True, fullgraph=True, backend=counter)
    for B in (1, 2, 4):
        for k in (1, 2, 3, 4, 8, 16):
            for G in (2 * k + 1, 2 * k + 3, 3 * k + 2):
                tokens, packed = torch.randint(0, 5, (B, 64)), torch.randint(0, 5, (B, G + 2))
                packed[:, G], packed[:, G + 1] = 30, k
                compiled(tokens, torch.full((B,), 33), packed[:, :G], packed[:, G], packed[:, G + 1], k, min(k, 8), 1, 3, 1)
    assert counter.frame_count <= 4, counter.frame_count


def test_the_hosts_lookup_equals_the_devices():
    """ngram.look_up (the host's, over the tokens' bytes) gives find_continuations' draft (the device's) for one
    row: tokens past the row's end ignored, and token values whose bytes match across token boundaries
    (0, 1, 256, 2**16, 2**32) never matched there."""
    rng = random.Random(1)
    values = [0, 1, 256, 2**16, 2**32, 7]
    matched = 0
    for _ in range(2000):
        text = [rng.choice(values[: rng.randrange(2, 7)]) for _ in range(rng.randrange(1, 30))]
        k, S = rng.randrange(1, 9), len(text) + rng.randrange(0, 4)
        tokens = torch.tensor([text + [rng.choice(values) for _ in range(S - len(text))]])  # [1, S]
        drafts, found = find_continuations(tokens, torch.tensor([len(text)]), k, 3, 1)
        expected = drafts[0].tolist() if found.item() else []
        assert look_up(text, k, 3, 1) == expected, (text, k)
        matched += bool(expected)
    assert 1000 < matched < 2000


def test_a_rows_window_matched_on_across_steps_is_the_window_matched_afresh():
    """SuffixDrafter.match_window keeps a row's match in each global generation and matches on over the
    tokens kept since: it must find what match_pattern over the last max_pattern tokens (then `ahead`)
    finds, the same state and length, as the text grows by one token or many, the generation grows (new
    requests) or is dropped, and the match outgrows the window (a row repeating an earlier request)."""
    rng = random.Random(3)
    grew = capped = 0
    for _ in range(60):
        drafter = SuffixDrafter(SuffixConfig(max_tokens=rng.choice([40, 400]), max_pattern=rng.choice([2, 5, 8])))
        earlier = [[rng.randrange(3) for _ in range(rng.randint(5, 30))] for _ in range(2)]
        for text in earlier:
            add_request(drafter.index, text)
        row = row_state(list(rng.choice(earlier)[: rng.randint(1, 10)]))
        for _ in range(25):
            if rng.random() < 0.1:
                add_request(drafter.index, [rng.randrange(3) for _ in range(rng.randint(1, 20))])
                grew += 1
            row.text += [rng.randrange(3) for _ in range(rng.choice([1, 1, 2, 5, 12]))]
            ahead = [rng.randrange(3) for _ in range(rng.choice([0, 0, 1, 3]))]
            pattern = (row.text + ahead)[-drafter.config.max_pattern :]
            for sam in drafter.index.generations:
                want = match_pattern(sam, pattern)
                assert drafter.match_window(row, sam, ahead) == want, (row.text, ahead)
                capped += want.length == drafter.config.max_pattern
        assert len(row.patterns) <= len(drafter.index.generations)
    assert grew > 50 and capped > 200


def test_draft_length_follows_the_match_length():
    """MAX_SPEC = floor(max_spec_factor x p): a one-token pattern drafts one token, a longer one more."""
    drafter = SuffixDrafter(SuffixConfig())
    text = [1, 2, 3, 4, 5, 6, 7, 8]
    drafter.index = GlobalIndex(100)
    add_request(drafter.index, text)
    chain = DraftShape(width=6, depth=6)
    assert drafter.best_draft(row_state([5]), chain).tokens == [6]
    assert drafter.best_draft(row_state([3, 4, 5]), chain).tokens == [6, 7, 8]
    assert drafter.best_draft(row_state([9]), chain).tokens == []
    drafter = SuffixDrafter(SuffixConfig(max_spec_factor=4.0))
    add_request(drafter.index, text)
    assert drafter.best_draft(row_state([5]), chain).tokens == [6, 7, 8]


def test_on_equal_scores_the_longer_pattern_drafts():
    """The row's own text matches 1 token (then 6), the global index 3 (then 7): one-token drafts of
    probability 1 each, so the longer match decides."""
    drafter = SuffixDrafter(SuffixConfig())
    add_request(drafter.index, [1, 2, 5, 7, 8])
    text = [5, 6, 1, 2, 5]
    row = row_state(text)
    assert drafter.best_draft(row, DraftShape(width=1, depth=1)).tokens == [7]
    assert drafter.best_draft(row, DraftShape(width=3, depth=3)).tokens == [7, 8]  # a higher score too


def test_the_row_drafts_from_its_own_text():
    drafter = SuffixDrafter(SuffixConfig())
    text = [7, 1, 2, 3, 4, 8, 1, 2, 3]
    draft = drafter.best_draft(row_state(text), DraftShape(width=4, depth=4))
    assert draft.tokens == [4, 8, 1]  # p = 3: the pattern 1 2 3 occurred before, followed by 4 8 1 2 ...


# ---- the global index ----------------------------------------------------------------------------


def test_the_global_index_is_bounded_and_evicts_the_oldest_requests():
    index = GlobalIndex(max_tokens=100)  # generations of 50 tokens
    requests = [[1000 * r + i for i in range(20)] for r in range(6)]  # distinct tokens: request r is 1000r...
    found = []
    for text in requests:
        add_request(index, text)
        assert index.tokens <= 100
        found.append([any(match_pattern(sam, requests[r][:3]).length == 3 for sam in index.generations)
                      for r in range(len(requests))])
    assert found[1][:2] == [True, True]  # both in the newer generation
    assert found[2][:3] == [True, True, True]  # 0 and 1 moved to the older one
    assert found[4][:5] == [False, False, True, True, True]  # dropped with it, oldest first
    assert found[5] == [False, False, True, True, True, True]
    long = list(range(500, 700))
    add_request(index, long)  # longer than a generation: its last 50 tokens are kept
    assert index.newer.tokens == 50 and match_pattern(index.newer, long[-50:-45]).length == 5
    assert match_pattern(index.newer, long[:5]).length == 0


@pytest.mark.parametrize("extra, words", [
    ({"max_tokens": 1}, "max_tokens must be an integer >= 2, got 1"),
    ({"max_tokens": 2.5}, "max_tokens must be an integer, got 2.5"),
    ({"max_pattern": 0}, "max_pattern must be an integer >= 1"),
    ({"max_spec_factor": 0}, "max_spec_factor must be a number > 0"),
    ({"max_spec_factor": float("inf")}, "max_spec_factor must be a number, got inf"),
    ({"min_token_prob": 1.5}, "min_token_prob must be a number in [0, 1]"),
    ({"tree_nodes": -1}, "tree_nodes must be an integer >= 0"),
    ({"max_children": "2"}, "max_children must be an integer, got '2'"),
    ({"tree_nodes": True}, "tree_nodes must be an integer, got True"),
    ({"ahead": 2}, "ahead must be 0 or 1, got 2"),
    ({"lookup_tokens": -1}, "lookup_tokens must be an integer >= 0"),
])
def test_bad_options_are_one_line_user_errors(extra, words):
    with pytest.raises(UserError, match=words.replace("[", r"\[").replace("]", r"\]")):
        build_drafter("suffix", None, DrafterOptions(extra=extra))


def test_options_come_from_extra_and_other_drafters_keys_are_ignored():
    drafter = build_drafter("suffix", None, DrafterOptions(extra={"tree_nodes": 5, "window": 3, "max_tokens": 1000}))
    assert drafter.config == SuffixConfig(max_tokens=1000, tree_nodes=5)
    assert drafter.shape(4) == DraftShape(width=5, depth=4, tree=True)
    assert build_drafter("suffix", None).shape(4) == DraftShape(width=4, depth=4)


# ---- through the engine and the server -----------------------------------------------------------


@pytest.fixture(scope="module")
def flat(tmp_path_factory):
    """An unsharpened tiny float32 target on the exact kernels (near-ties everywhere) and its plain greedy outputs."""
    folder = save_hf(build_hf("llama", seed=0, num_hidden_layers=3), tmp_path_factory.mktemp("suffix-flat") / "t")
    target = load_model(str(folder), dtype="float32", device=DEVICE, kernels="exact")
    out = specdec.SpecEngine(target, "none").generate(PROMPTS, SpecConfig(max_new_tokens=MAX_NEW))
    return target, [r.token_ids for r in out.rows]


@pytest.mark.parametrize("extra", [{}, TREE], ids=["chain", "tree"])
@pytest.mark.parametrize("gamma", [2, 4, 16])
def test_greedy_equals_plain_alone_batched_and_again(flat, extra, gamma):
    """One drafter instance: one prompt, then all three (that prompt now in the global index), then all
    three again (all in it): each output equals plain greedy decoding."""
    target, expected = flat
    engine = specdec.SpecEngine(target, "suffix", DrafterOptions(extra=extra))
    config = SpecConfig(gamma=gamma, max_new_tokens=MAX_NEW)
    assert [r.token_ids for r in engine.generate(PROMPTS[2:], config).rows] == expected[2:]
    for _ in range(2):
        out = engine.generate(PROMPTS, config)
        assert [r.token_ids for r in out.rows] == expected
    assert out.stats.accepted > 0


@pytest.mark.parametrize("policy", ["heuristic", "cost"])
@pytest.mark.parametrize("extra", [{}, TREE], ids=["chain", "tree"])
def test_adaptive_gamma_is_lossless(flat, policy, extra):
    """The policies change gamma between steps (the cost policy may choose 0: no proposal at all)."""
    target, expected = flat
    engine = specdec.SpecEngine(target, "suffix", DrafterOptions(extra=extra))
    config = SpecConfig(gamma=2, gamma_policy=policy, gamma_max=6, max_new_tokens=MAX_NEW)
    for _ in range(2):
        assert [r.token_ids for r in engine.generate(PROMPTS, config).rows] == expected


@pytest.mark.parametrize("extra", [{}, TREE], ids=["chain", "tree"])
def test_the_same_prompts_again_accept_far_more(models, extra):  # noqa: F811
    """The second pass of the same prompts through one engine drafts from the first pass's outputs."""
    target, _, _ = models
    engine = specdec.SpecEngine(target, "suffix", DrafterOptions(extra=extra))
    config = SpecConfig(gamma=4, max_new_tokens=MAX_NEW)
    first, second = (engine.generate(PROMPTS, config).stats for _ in range(2))
    # The first pass drafts from each prompt alone (and, drafting ahead on a GPU, by n-gram lookup), so how
    # much it accepts varies; the second drafts whole answers: nearly every draft holds and each step
    # emits nearly gamma + 1 tokens.
    assert second.accepted > first.accepted and second.acceptance_rate > 0.9, (first, second)
    assert second.decode_steps <= 1.2 * len(PROMPTS) * math.ceil(MAX_NEW / (config.gamma + 1)), (first, second)


def test_a_chain_step_runs_as_wide_as_its_longest_draft(models, plain):  # noqa: F811
    """At gamma 16, a first pass drafts from short matches and the repeat of the same prompt from the
    first pass's whole output: the steps run at powers of two that hold the rows' drafts (plain steps where
    no row matched), the repeat drafts 16 at once, and both equal plain (the narrowest power is
    test_narrowing_picks_the_smallest_power_of_two_and_leaves_trees)."""
    target, _, _ = models
    drafter = build_drafter("suffix", target)
    stepper = new_stepper(target, drafter, 1, 128, list(eos_ids(target)))
    ran = []
    for _ in range(2):
        row, = stepper.prefill([0], [Request(PROMPTS[0], MAX_NEW)])
        stepper.batch.gamma.fill_(16)
        while stepper.batch.busy:
            stepper.launch(16)
            report = stepper.read()
            ran.append((report.gamma, max([s.drafted for s in report.rows], default=0)))
        assert row.generated == plain[0]
        stepper.batch.release(0)
    assert {g for g, _ in ran} <= {0, 1, 2, 4, 8, 16} and 16 in {g for g, _ in ran}
    assert all(drafted <= g for g, drafted in ran) and (0, 0) in ran and (16, 16) in ran, ran


def test_narrowing_picks_the_smallest_power_of_two_and_cuts_trees_after_their_widest_row():
    drafter = SuffixDrafter(SuffixConfig())
    chain = drafter.shape(16)
    tokens = torch.arange(32).view(2, 16)
    for longest, expected in [(0, 0), (1, 1), (3, 4), (9, 16), (16, 16)]:
        proposal = Proposal(tokens, num_drafted=torch.tensor([longest, 0]), longest=longest)
        gamma, shape, cut = narrow(drafter, 16, chain, proposal, False)
        assert gamma == expected and shape.width == expected
        assert (cut is None) == (expected == 0)
        if cut is not None:
            assert cut.tokens.tolist() == tokens[:, :expected].tolist()
    assert narrow_gammas(12) == [1, 2, 4, 8, 12] and narrow_gammas(1) == [1]
    tree = SuffixDrafter(SuffixConfig(tree_nodes=8))
    proposal = Proposal(tokens[:, :8])
    assert narrow(tree, 16, tree.shape(16), proposal, False) == (16, tree.shape(16), proposal)
    parents = torch.tensor([[-1, 0, 0, 1, -1, -1, -1, -1], [-1, 0, 1, 2, 3, -1, -1, -1]])
    padded = Proposal(tokens[:, :8], tree=TreeSpec(parents, torch.tensor([4, 5]), 5, 2))
    gamma, shape, cut = narrow(tree, 16, tree.shape(16), padded, False)
    assert (gamma, shape.width, shape.tree) == (16, 5, True)
    assert cut.tokens.tolist() == tokens[:, :5].tolist() and cut.tree.parents.tolist() == parents[:, :5].tolist()
    assert narrow(tree, 16, tree.shape(16), padded, True) == (16, tree.shape(16), padded)  # a row samples: kept whole
    ngram = build_drafter("ngram", None)  # a device drafter: its longest row is read off num_drafted on a CPU only
    found = Proposal(tokens, num_drafted=torch.tensor([0, 16]))
    assert narrow(ngram, 16, ngram.shape(16), found, False)[0] == 16
    nothing = Proposal(tokens, num_drafted=torch.zeros(2, dtype=torch.long))
    assert narrow(ngram, 16, ngram.shape(16), nothing, False)[:2] == (0, DraftShape(0, 0))
    assert narrow(ngram, 16, ngram.shape(16), nothing, True) == (16, ngram.shape(16), nothing)  # a row samples: kept whole
    sampled = Proposal(tokens, q=torch.ones(2, 16, 3), num_drafted=torch.tensor([1, 1]))  # drew uniforms: kept whole
    assert narrow(ngram, 16, ngram.shape(16), sampled, False) == (16, ngram.shape(16), sampled)


def test_a_second_identical_request_through_the_server_accepts_more(models):  # noqa: F811
    """The server keeps one drafter for every request: a request that finished is drafted from by the next."""
    from specdec.server.policy import SpecPolicy
    from specdec.server.scheduler import GenerationRequest, Scheduler, SchedulerConfig

    target, _, _ = models
    scheduler = Scheduler(target, build_drafter("suffix", target), Codec(), SpecPolicy("on", gamma=4),
                          SchedulerConfig(max_batch=2, context=128))
    accepted, outputs = [], []
    for _ in range(2):
        events = []
        emit = lambda event: events.append(dataclasses.replace(event, token_ids=list(event.token_ids)))  # noqa: E731
        scheduler.submit(GenerationRequest(PROMPTS[0], MAX_NEW, SamplingParams(), (), emit))
        while not events or not events[-1].final:
            scheduler.turn()
        outputs.append([t for e in events for t in e.token_ids])
        accepted.append(events[-1].usage["speculation"]["accepted"])
    assert outputs[0] == outputs[1] and len(outputs[0]) == MAX_NEW
    assert accepted[1] >= accepted[0] + 10, accepted  # 15 and 31 (at gamma 4, 31 is every draft of 39 tokens)


def test_steps_it_did_not_draft_in_reach_its_index_from_the_host(models):  # noqa: F811
    """A host drafter is not told of steps at gamma 0 (step.tell): a row catches up from the host's row when it
    next drafts, and a request that ends at gamma 0 enters the global index with its whole output."""
    target, _, _ = models
    drafter = build_drafter("suffix", target)
    stepper = new_stepper(target, drafter, 1, 128, [])
    batch = stepper.batch
    (row,) = stepper.prefill([0], [Request(PROMPTS[0], 12)])
    state = batch.draft[0]
    for _ in range(4):
        stepper.launch(0)
        stepper.read()
    assert state.text == PROMPTS[0]  # not told: the drafter saw only the prompt
    drafter.propose(batch, 4, None)
    held = batch.tokens[0, : int(batch.length[0])].tolist()
    assert state.text == held == PROMPTS[0] + row.generated and len(row.generated) == 5
    while batch.busy:
        stepper.launch(0)
        stepper.read()
    whole = PROMPTS[0] + row.generated
    assert len(whole) == len(PROMPTS[0]) + 12
    stepper.reset()
    drafter.retire_released()
    (sam,) = drafter.index.generations
    assert state_of(sam, whole) is not None and sam.tokens == len(whole)


def pipelined_as_with_graphs(stepper, gamma: int) -> bool:
    """What Stepper.pipelines gives with CUDA graphs, for the CPU."""
    return overlaps(stepper.drafter, gamma)


def check_rows_read_at_propose(monkeypatch, cls) -> list[int]:
    """Wrap cls.propose: every running row's tokens are on the host when the drafter proposes (every step in
    flight was read first). Returns a list that counts the proposals."""
    original, proposals = cls.propose, []

    def checked(self, batch, gamma, u):
        for slot, row in batch.rows.items():
            if slot < batch.capacity and not row.finished and slot in batch.draft:
                assert row.request.prompt + row.generated == batch.tokens[slot, : int(batch.length[slot])].tolist()
        proposals.append(gamma)
        return original(self, batch, gamma, u)

    monkeypatch.setattr(cls, "propose", checked)
    return proposals


def every_third(gamma: int):
    """A choice of gamma 0, 0, gamma, 0, 0, gamma, ... call after call."""
    turns = itertools.count()
    return lambda *args, **kwargs: gamma if next(turns) % 3 == 2 else 0


@pytest.mark.parametrize("name", ["suffix", "suffix-tree", "lookahead"])
def test_host_drafters_pipelined_at_gamma_0_propose_from_every_token(models, plain, monkeypatch, name):  # noqa: F811
    """With graphs (here forced on the CPU) a host drafter's plain steps are launched before the step in
    flight is read, and before a step where it drafts (unless it drafts ahead), the engine and the server
    read every step in flight: it proposes from all of the rows' tokens, and the outputs equal plain
    decoding."""
    from specdec.adaptive import GammaPolicy
    from specdec.drafters.lookahead import LookaheadDrafter
    from specdec.drafters.suffix import SuffixDrafter
    from specdec.server.policy import SpecPolicy
    from specdec.server.scheduler import Scheduler, SchedulerConfig
    from specdec.step import Stepper

    target, _, _ = models
    options = {"suffix": DrafterOptions(extra={"ahead": 0}), "suffix-tree": DrafterOptions(extra=TREE)}.get(name, DrafterOptions())
    name = name.removesuffix("-tree")
    monkeypatch.setattr(Stepper, "pipelines", pipelined_as_with_graphs)
    proposals = check_rows_read_at_propose(monkeypatch, SuffixDrafter if name == "suffix" else LookaheadDrafter)
    monkeypatch.setattr(GammaPolicy, "choose", every_third(3))
    engine = specdec.SpecEngine(target, name, options)
    out = engine.generate(PROMPTS, SpecConfig(gamma=3, gamma_policy="heuristic", max_new_tokens=MAX_NEW))
    assert [r.token_ids for r in out.rows] == plain and proposals

    proposals.clear()
    monkeypatch.setattr(SpecPolicy, "choose", every_third(4))
    scheduler = Scheduler(target, build_drafter(name, target, options), Codec(), SpecPolicy("on", gamma=4),
                          SchedulerConfig(max_batch=4, context=128))
    assert serve_in_turns(scheduler, PROMPTS) == plain and proposals


def serve_in_turns(scheduler, prompts: list[list[int]]) -> list[list[int]]:
    """Submit greedy requests for every prompt, turn the decode loop by hand until all finished: their tokens."""
    from specdec.server.scheduler import GenerationRequest

    outputs, finals = [[] for _ in prompts], []
    for prompt, tokens in zip(prompts, outputs):
        def emit(event, tokens=tokens):
            tokens.extend(event.token_ids)
            finals.append(event.final)
        scheduler.submit(GenerationRequest(prompt, MAX_NEW, SamplingParams(), (), emit))
    while sum(finals) < len(prompts):
        scheduler.turn()
    return outputs


def test_drafting_ahead_at_a_smaller_gamma_than_the_step_in_flight(models, plain, monkeypatch):  # noqa: F811
    """A step at gamma 16 in flight, the next launched at gamma 2 (a policy's choice): the guess holds the
    16 drafted in flight, then more; decoding still equals plain."""
    from specdec.step import Stepper

    target, _, _ = models
    monkeypatch.setattr(Stepper, "pipelines", pipelined_as_with_graphs)
    ahead = count_drafted_ahead(monkeypatch)
    drafter = build_drafter("suffix", target, DrafterOptions(extra={"ahead": 1}))
    stepper = new_stepper(target, drafter, 1, 128, list(eos_ids(target)))
    for _ in range(2):  # the second time, the global index holds the whole answer
        row, = stepper.prefill([0], [Request(PROMPTS[0], MAX_NEW)])
        stepper.batch.gamma.fill_(16)
        gammas = itertools.cycle([16, 2])
        while stepper.batch.busy:
            stepper.launch(next(gammas))
            if len(stepper.in_flight) > 1:
                stepper.read()
        while stepper.in_flight:
            stepper.read()
        assert row.generated == plain[0]
        stepper.batch.release(0)
    assert max(ahead) == 16, ahead


def test_drafting_ahead_between_plain_steps_equals_plain(flat, monkeypatch):
    """The cost policy's pattern, gamma 0, 0, gamma, ...: a drafting step proposed while a plain step is in flight
    guesses that step's token and goes on from it (the plain step drafted nothing from any guess); where the
    guess fails the row looks up n-grams. Engine and server, pipelining forced on the CPU, on a near-tie
    target: equal plain."""
    from specdec.adaptive import GammaPolicy
    from specdec.server.policy import SpecPolicy
    from specdec.server.scheduler import Scheduler, SchedulerConfig
    from specdec.step import Stepper

    target, plain = flat
    monkeypatch.setattr(Stepper, "pipelines", pipelined_as_with_graphs)
    ahead, looked_up = count_drafted_ahead(monkeypatch), count_looked_up(monkeypatch)
    monkeypatch.setattr(GammaPolicy, "choose", every_third(3))
    engine = specdec.SpecEngine(target, "suffix")
    out = engine.generate(PROMPTS, SpecConfig(gamma=3, gamma_policy="heuristic", max_new_tokens=MAX_NEW))
    assert [r.token_ids for r in out.rows] == plain and ahead and sum(looked_up) > 0

    monkeypatch.setattr(SpecPolicy, "choose", every_third(4))
    scheduler = Scheduler(target, build_drafter("suffix", target), Codec(), SpecPolicy("on", gamma=4),
                          SchedulerConfig(max_batch=4, context=128))
    assert serve_in_turns(scheduler, PROMPTS) == plain


def count_drafted_ahead(monkeypatch) -> list[int]:
    """Wrap drafted_from: the lengths of the drafts a row's chain was guessed on from (a step in flight)."""
    lengths, original = [], suffix_module.drafted_from

    def counted(guess, text, ngram):
        drafted = original(guess, text, ngram)
        lengths.append(len(drafted))
        return drafted

    monkeypatch.setattr(suffix_module, "drafted_from", counted)
    return lengths


def count_looked_up(monkeypatch) -> list[int]:
    """Wrap the host's n-gram lookup (fill_by_lookup's look_up, also drafted_from's repeat of the device's): per call, 1
    where it found a draft. The device drafted the same (fill_by_lookup_on_device; the host and the device lookups
    agree, test_the_hosts_lookup_equals_the_devices), and counting on the host leaves the device's tail as it
    runs (a CUDA graph on CUDA: GraphedCalls)."""
    found, original = [], suffix_module.look_up

    def counted(text, k, max_ngram, min_ngram):
        drafted = original(text, k, max_ngram, min_ngram)
        found.append(int(bool(drafted)))
        return drafted

    monkeypatch.setattr(suffix_module, "look_up", counted)
    return found


@pytest.mark.parametrize("gamma", [4, 16])
def test_drafting_ahead_with_a_step_in_flight_equals_plain(flat, monkeypatch, gamma):
    """With graphs (forced on the CPU) and `ahead`, a suffix chain is proposed while the step before is in flight, as a
    guess past that step's draft that the device aligns with what the step kept; on a near-tie target, in
    the engine (one prompt, then all three twice: the global index grows) and the server (all three, then
    again), the outputs equal plain decoding, and the repeats draft ahead from whole drafts in flight."""
    from specdec.server.policy import SpecPolicy
    from specdec.server.scheduler import Scheduler, SchedulerConfig
    from specdec.step import Stepper

    target, expected = flat
    monkeypatch.setattr(Stepper, "pipelines", pipelined_as_with_graphs)
    ahead, options = count_drafted_ahead(monkeypatch), DrafterOptions()  # drafting ahead is the default
    looked_up = count_looked_up(monkeypatch)
    assert drafts_ahead(build_drafter("suffix", target)) and not drafts_ahead(build_drafter("suffix", target, DrafterOptions(extra={"ahead": 0})))
    assert not drafts_ahead(build_drafter("suffix", target, DrafterOptions(extra={"ahead": 1, **TREE})))
    engine = specdec.SpecEngine(target, "suffix", options)
    config = SpecConfig(gamma=gamma, max_new_tokens=MAX_NEW)
    assert [r.token_ids for r in engine.generate(PROMPTS[2:], config).rows] == expected[2:]
    for _ in range(2):
        out = engine.generate(PROMPTS, config)
        assert [r.token_ids for r in out.rows] == expected
    assert out.stats.acceptance_rate > 0.5 and max(ahead) >= min(gamma, 8), (out.stats.acceptance_rate, ahead)
    assert sum(looked_up) > 0  # some drafts were replaced or filled by n-gram lookup (fill_by_lookup), and stayed lossless

    ahead.clear()
    scheduler = Scheduler(target, build_drafter("suffix", target, options), Codec(), SpecPolicy("on", gamma=gamma),
                          SchedulerConfig(max_batch=4, context=128))
    for _ in range(2):
        assert serve_in_turns(scheduler, PROMPTS) == expected
    assert max(ahead) >= min(gamma, 8), ahead


class Codec:
    """The scheduler's codec for a model without a tokenizer: token ids only, no text."""

    eos_token_id = None

    def decode(self, ids: list[int]) -> str:
        return ""

    def decode_more(self, state, ids: list[int]) -> str:
        return ""


def test_rows_joining_and_leaving_decode_as_alone(models, plain):  # noqa: F811
    """Slot 1 leaves early and a new row takes it (the leaving row then enters the global index) while slot 0
    runs on; a third row joins slot 2: every row gives the tokens of decoding its prompt alone."""
    target, _, _ = models
    drafter = build_drafter("suffix", target)
    stepper = new_stepper(target, drafter, 3, 128, list(eos_ids(target)))
    batch = stepper.batch
    batch.gamma.fill_(3)
    first, leaving = stepper.prefill([0, 1], [Request(PROMPTS[0], MAX_NEW), Request(PROMPTS[1], MAX_NEW)])
    for _ in range(3):
        stepper.launch(3)
        stepper.read()
    batch.release(1)
    joined = stepper.prefill([1, 2], [Request(PROMPTS[2], MAX_NEW), Request(PROMPTS[1], MAX_NEW)])
    assert drafter.index.tokens == len(PROMPTS[1]) + len(leaving.generated)  # the row that left, prompt and output
    batch.gamma.fill_(3)
    while batch.busy:
        stepper.launch(3)
        stepper.read()
    assert first.generated == plain[0]
    assert [r.generated for r in joined] == [plain[2], plain[1]]


# ---- sampling ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """test_sampling_e2e's tiny target: a VOCAB-token vocabulary, so each position has few likely tokens."""
    return tiny_pair(tmp_path_factory.mktemp("suffix-e2e"), "llama", seed=0, logit_scale=4.0, vocab_size=VOCAB)[0]


def sample(target, drafter, seed: int, extra: dict | None = None):
    spec = SpecConfig(gamma=3, max_new_tokens=4, sampling=SamplingParams(temperature=1.0, seed=seed))
    return specdec.SpecEngine(target, drafter, DrafterOptions(extra=extra or {})).generate([PROMPT] * ROWS, spec)


@pytest.fixture(scope="module")
def plain_sample(small):
    return tokens_of(sample(small, "none", seed=1))


@pytest.mark.parametrize("extra", [{}, TREE], ids=["chain", "tree"])
def test_sampling_matches_plain(small, plain_sample, extra):
    out = sample(small, "suffix", seed=2, extra=extra)
    assert 0 < out.stats.accepted < out.stats.drafted
    pvalues = distribution_pvalues(tokens_of(out), plain_sample)
    assert min(pvalues.values()) > ALPHA / len(pvalues), pvalues


def test_a_broken_verifier_is_caught_with_suffix_drafts(small, plain_sample, monkeypatch):
    monkeypatch.setattr(specdec.verify, "rejection_sample", always_accept)
    pvalues = distribution_pvalues(tokens_of(sample(small, "suffix", seed=2)), plain_sample)
    assert min(pvalues.values()) < ALPHA, pvalues
