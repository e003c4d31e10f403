"""The EAGLE drafter (EAGLE-2 dynamic trees) with an untrained head: lossless whatever the head says.

Greedy output equals plain greedy decoding (batch 1 and 3, several tree shapes); sampled output
matches plain sampling's distribution; a head saved and loaded back gives the same proposals."""

from __future__ import annotations

import re

import pytest
import torch

import specdec
from conftest import tiny_pair
from specdec import SamplingParams
from specdec.drafters import DrafterOptions
from specdec.errors import UserError
from specdec.drafters.eagle import (EagleDrafter, EagleTreeConfig, graft_chain, keep_features, keep_features_indexed, rank_order,
                                   select_tree, top_indices, tree_config)
from specdec.models import kernels
from specdec.models.eagle import EagleConfig, EagleHead, load_eagle_head, save_eagle_head
from test_engine import MAX_NEW, PROMPTS, models, plain  # noqa: F401  (fixtures)
from test_sampling_e2e import ALPHA, PROMPT, ROWS, VOCAB, distribution_pvalues, tokens_of


def random_head(target, draft_vocab: int | None = None, seed: int = 0) -> EagleHead:
    torch.manual_seed(seed)
    c = target.config
    head = EagleHead(EagleConfig.for_target(c, draft_vocab or c.vocab_size))
    if draft_vocab:
        head.d2t = torch.randperm(c.vocab_size)[:draft_vocab].sort().values
    return head


def test_select_tree_keeps_parents_and_orders_breadth_first():
    # candidates: 0 (d1, -0.1), 1 (d1, -2), 2 (d2 under 0, -0.3), 3 (d2 under 0, -3), 4 (d3 under 2, -0.35)
    tokens = torch.tensor([[10, 11, 12, 13, 14]])
    scores = torch.tensor([[-0.1, -2.0, -0.3, -3.0, -0.35]])
    parents = torch.tensor([[-1, -1, 0, 0, 2]])
    depths = torch.tensor([[1, 1, 2, 2, 3]])
    kept_tokens, kept_parents = select_tree(tokens, scores, parents, depths, total=4)
    assert kept_tokens.tolist() == [[10, 11, 12, 14]]
    assert kept_parents.tolist() == [[-1, -1, 0, 2]]


def test_sort_free_ranking_equals_a_stable_sort():
    """top_indices and rank_order (the compiled tree bookkeeping's sort) against a stable sort, with ties."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 6, (4, 3, 37), generator=gen).float()  # many equal values
    x[0, 0, 5:] = float("-inf")
    x[1, 1, ::3] = float("nan")  # ranked as -inf (garbage in an idle slot must not give two entries one place)
    stable = torch.where(x.isnan(), float("-inf"), x).sort(dim=-1, descending=True, stable=True).indices
    assert torch.equal(top_indices(x, 7), stable[..., :7])
    assert torch.equal(rank_order(x), stable.argsort(-1))


def test_select_tree_equals_sorting_on_random_trees():
    """select_tree against the sort it replaces (keep the best by score, then order by depth and index)."""
    gen = torch.Generator().manual_seed(1)
    B, C, total = 3, 30, 12
    depths = torch.randint(1, 5, (B, C), generator=gen).sort(-1).values
    parents = torch.stack([torch.tensor([-1 if d == 1 else int(torch.nonzero(row < d)[-1]) for d in row]) for row in depths])
    scores = -torch.rand(B, C, generator=gen) - depths  # deeper scores lower: closed under parents
    tokens = torch.randint(0, 1000, (B, C), generator=gen)
    keep = (scores - 1e-4 * depths).topk(total, dim=-1).indices
    keep = keep.gather(1, (depths.gather(1, keep) * C + keep).argsort(-1))
    kept_tokens, kept_parents = select_tree(tokens, scores, parents, depths, total)
    assert torch.equal(kept_tokens, tokens.gather(1, keep))
    position = {(b, int(c)): n for b in range(B) for n, c in enumerate(keep[b])}
    for b in range(B):
        for n, c in enumerate(keep[b].tolist()):
            p = int(parents[b, c])
            assert int(kept_parents[b, n]) == (-1 if p < 0 else position[(b, p)])


def test_kept_features_land_alike_by_row_and_indexed():
    """The CPU's slice copies and the graph-safe indexed write store the same entries and leave every other
    entry alone: rows keeping all, some, none (not in the step), and a slot never held (length 0)."""
    torch.manual_seed(0)
    S, W, D = 12, 4, 3
    hidden = torch.randn(4, W, D)
    kept, length = torch.tensor([4, 2, 0, 0]), torch.tensor([9, 5, 7, 0])
    by_row = torch.randn(4, S + W - 1, D)
    indexed = by_row.clone()
    before = by_row.clone()
    keep_features(by_row, hidden, kept, length)
    keep_features_indexed(indexed, hidden, kept, length)
    assert torch.equal(by_row, indexed)
    assert torch.equal(by_row[0, 4:8], hidden[0]) and torch.equal(by_row[1, 2:4], hidden[1, :2])
    changed = (by_row != before).any(-1)  # [4, S + W - 1]
    assert changed.sum() == 6 and not changed[2:].any()


def test_a_level_expands_at_most_its_own_nodes():
    """A frontier wider than a level expands that level's nodes only (never a node of another level)."""
    assert EagleTreeConfig(depth=3, branch=1, frontier=4).candidates(3) == 3  # a chain: one node a level
    assert EagleTreeConfig(branch=2, frontier=3).candidates(3) == 2 + 4 + 6
    assert EagleTreeConfig().candidates(5) == 4 + 16 + 16 + 16 + 16


@pytest.mark.parametrize("tree", [EagleTreeConfig(), EagleTreeConfig(depth=3, branch=2, frontier=2, total_tokens=5),
                                  EagleTreeConfig(depth=3, branch=1, frontier=4), EagleTreeConfig(lookup=5),
                                  EagleTreeConfig(depth=3, branch=2, frontier=2, total_tokens=5, lookup=2)],
                         ids=["default", "small", "chain", "lookup", "small-lookup"])
@pytest.mark.parametrize("batch", [1, 3])
def test_eagle_greedy_equals_plain(models, plain, tree, batch):  # noqa: F811
    target, _, _ = models
    prompts, expected = (PROMPTS, plain) if batch == 3 else (PROMPTS[2:], plain[2:])
    drafter = EagleDrafter(target, random_head(target, draft_vocab=64), tree)
    out = specdec.SpecEngine(target, drafter).generate(prompts, specdec.SpecConfig(gamma=5, max_new_tokens=MAX_NEW))
    assert [r.token_ids for r in out.rows] == expected
    assert out.stats.draft_nodes > 0


def test_graft_chain_follows_the_tree_then_adds_nodes():
    """tree: root -> 5 (node 0) -> 7 (node 2); root -> 6 (node 1) -> 8 (node 3)."""
    tokens, parents = torch.tensor([[5, 6, 7, 8]] * 4), torch.tensor([[-1, -1, 0, 1]] * 4)
    chain = torch.tensor([[5, 7, 9], [6, 9, 9], [5, 7, 8], [1, 2, 3]])
    out_tokens, out_parents, num_nodes = graft_chain(tokens, parents, chain, torch.tensor([True, True, True, False]))
    assert num_nodes.tolist() == [5, 6, 5, 4]
    assert out_tokens[:, 4:].tolist() == [[9, 0, 0], [9, 9, 0], [8, 0, 0], [0, 0, 0]]  # 8 is node 1's child, not 7's
    assert out_parents[:, 4:].tolist() == [[2, -1, -1], [1, 4, -1], [2, -1, -1], [-1, -1, -1]]  # padding: under the root
    assert torch.equal(out_tokens[:, :4], tokens) and torch.equal(out_parents[:, :4], parents)
    held = graft_chain(tokens[:1], parents[:1], torch.tensor([[6, 8]]), torch.tensor([True]))  # the tree holds it all
    assert held[2].tolist() == [4] and held[1][0, 4:].tolist() == [-1, -1]


def test_a_grafted_lookup_is_accepted_where_the_head_is_not(models):  # noqa: F811
    """On a prompt that repeats itself a random head's tree is rejected; the grafted prompt-lookup branch
    is accepted, and the output stays the target's (greedy equality is the test above)."""
    target, _, _ = models
    prompt = [[3, 9, 14, 27, 40, 11, 5, 8] * 6]
    config = specdec.SpecConfig(gamma=5, max_new_tokens=48)
    plain_out = specdec.SpecEngine(target, "none").generate(prompt, config)
    runs = {}
    for lookup in (0, 5):
        drafter = EagleDrafter(target, random_head(target, draft_vocab=64), EagleTreeConfig(lookup=lookup))
        runs[lookup] = specdec.SpecEngine(target, drafter).generate(prompt, config)
        assert runs[lookup].rows[0].token_ids == plain_out.rows[0].token_ids
    assert runs[5].stats.accepted > 2 * max(runs[0].stats.accepted, 1)
    nodes_per_step = {k: r.stats.draft_nodes / r.stats.decode_steps for k, r in runs.items()}
    assert nodes_per_step[5] > nodes_per_step[0]  # the grafted nodes are counted


@pytest.mark.parametrize("kind, message", [
    ("no-config", "no config.json (not an EAGLE head folder)"),
    ("config-lacks-a-key", "config.json lacks hidden_size"),
    ("misshapen", "model.safetensors does not match its config.json: fc.weight is"),
    ("corrupt", "is not a readable safetensors file"),
    ("no-d2t", "weights missing from the EAGLE head: ['d2t']"),
])
def test_a_broken_head_folder_is_one_user_error(models, tmp_path, kind, message):  # noqa: F811
    """What `--eagle-head DIR` reads: each way a folder can be broken is one UserError naming it."""
    import json

    from safetensors.torch import load_file, save_file

    target, _, _ = models
    folder = tmp_path / "head"
    save_eagle_head(random_head(target, draft_vocab=32), folder)
    weights, config = folder / "model.safetensors", json.loads((folder / "config.json").read_text())
    state = load_file(str(weights))
    if kind == "no-config":
        (folder / "config.json").unlink()
    elif kind == "config-lacks-a-key":
        del config["hidden_size"]
        (folder / "config.json").write_text(json.dumps(config))
    elif kind == "misshapen":
        save_file({**state, "fc.weight": state["fc.weight"][:, :5].contiguous()}, str(weights))
    elif kind == "corrupt":
        weights.write_bytes(weights.read_bytes()[:100])
    else:
        save_file({k: v for k, v in state.items() if k != "d2t"}, str(weights))
    with pytest.raises(UserError, match=re.escape(message)):
        load_eagle_head(folder)


def test_eagle_registered_and_saved_head_round_trips(models, tmp_path):  # noqa: F811
    target, _, _ = models
    head = random_head(target, draft_vocab=32, seed=3)
    save_eagle_head(head, tmp_path / "head")
    loaded = load_eagle_head(tmp_path / "head")
    assert torch.equal(loaded.d2t, head.d2t)
    for (name, a), b in zip(head.state_dict().items(), loaded.state_dict().values()):
        if not name.startswith("lm_head"):
            assert torch.equal(a, b), name
    options = DrafterOptions(extra={"eagle_path": str(tmp_path / "head")})
    out_a = specdec.SpecEngine(target, "eagle", options).generate(PROMPTS, specdec.SpecConfig(max_new_tokens=12))
    tree = tree_config(target, DrafterOptions())  # the registered drafter's defaults (a grafted lookup too)
    out_b = specdec.SpecEngine(target, EagleDrafter(target, head, tree)).generate(PROMPTS, specdec.SpecConfig(max_new_tokens=12))
    assert out_a.stats.accepted_per_position == out_b.stats.accepted_per_position


def test_a_head_drafting_on_the_cpu_runs_q8_0_blocks(models):  # noqa: F811
    """A draft level reads the whole head at one row: on the CPU its layers run as Q8_0 blocks beside a float
    target too (quantize_head); on a GPU they stay the target's dtype. Greedy output is unchanged either way."""
    from specdec.models import cpu_gemm
    from specdec.models.linear import Linear

    target, _, _ = models
    head = random_head(target, draft_vocab=32, seed=3).attach(target)
    qtypes = {m.qtype for m in head.modules() if isinstance(m, Linear)}
    on_cpu = next(target.parameters()).device.type == "cpu"
    assert qtypes == ({"Q8_0"} if on_cpu and cpu_gemm.available() else {None})


def test_a_head_attached_for_training_runs_pytorchs_layers(models):  # noqa: F811
    """Training and its held-out metrics run trees as long as the examples (the 7-step training mask): the
    exact path's visibility tables are [B, T, W, W], which ran an H200 out of memory; a training head takes
    PyTorch's layers on every device."""
    target, _, _ = models
    head = random_head(target, draft_vocab=32, seed=3)
    head.attach(target, kernels=False)
    assert all(layer.kernels == "library" for layer in head.layers)
    assert not any(kernels.runs_triton(layer, torch.device(d), torch.float32) for layer in head.layers for d in ("cpu", "cuda"))


@pytest.mark.parametrize("lookup", [0, 2])
def test_eagle_sampling_matches_plain_sampling(tmp_path, lookup):
    check_sampling_matches_plain(tmp_path, random_head, lookup)


def check_sampling_matches_plain(tmp_path, make_head, lookup: int = 0) -> None:
    """Seeded sampling through a tree drafter with the head make_head(target) gives plain sampling's
    distribution (per-position chi-square p-values, Bonferroni)."""
    target = tiny_pair(tmp_path, "llama", seed=0, logit_scale=4.0, vocab_size=VOCAB)[0]
    config = lambda seed: specdec.SpecConfig(gamma=3, max_new_tokens=4, sampling=SamplingParams(temperature=1.0, seed=seed))  # noqa: E731
    plain_tokens = tokens_of(specdec.SpecEngine(target, "none").generate([PROMPT] * ROWS, config(1)))
    drafter = EagleDrafter(target, make_head(target), EagleTreeConfig(depth=3, branch=3, frontier=2, total_tokens=6, lookup=lookup))
    out = specdec.SpecEngine(target, drafter).generate([PROMPT] * ROWS, config(2))
    assert 0 < out.stats.accepted < out.stats.drafted
    pvalues = distribution_pvalues(tokens_of(out), plain_tokens)
    assert min(pvalues.values()) > ALPHA / len(pvalues), pvalues
