"""Tree verification: structure helpers, greedy longest-path acceptance, and statistical losslessness
of multi-candidate rejection sampling (random trees, random p and q, a small vocabulary).

Statistical setup as in test_verify.py: p is fixed per block entry (the root and each node), every
batch row is an independent trial. The first emitted token must follow p[root]; among rows whose
path goes through node c, the token emitted after c must follow p[c]. Broken verifiers must fail.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from conftest import DEVICE, seeded_generator
from test_verify import ALPHA, TRIALS, V, pooled_chisquare, random_dists
from specdec.verify import TreeSpec, children_table, tree_greedy_verify, tree_rejection_sample

# root -> 0, 1, 2; 0 -> 3, 4; 1 -> 5; 3 -> 6
PARENTS = [-1, -1, -1, 0, 0, 1, 3]
N = len(PARENTS)


def tree(batch: int = 1, num_nodes: list[int] | None = None) -> TreeSpec:
    parents = torch.tensor([PARENTS] * batch, device=DEVICE)
    return TreeSpec(parents, None if num_nodes is None else torch.tensor(num_nodes, device=DEVICE))


def test_structure():
    t = tree()
    assert t.parent_blocks.tolist() == [[0, 0, 0, 0, 1, 1, 2, 4]]
    assert t.depths().tolist() == [[0, 1, 1, 1, 2, 2, 2, 3]]
    mask = t.ancestor_mask()[0]
    assert mask[7].nonzero().flatten().tolist() == [0, 1, 4, 7]  # node 6 sees root, node 0, node 3, itself
    assert mask[3].nonzero().flatten().tolist() == [0, 3]
    assert children_table(t)[0].tolist()[:3] == [[1, 2, 3], [4, 5, -1], [6, -1, -1]]


def logits_with_argmax(argmax: list[int]) -> Tensor:
    """[1, N+1, V] logits whose argmax at each block entry is given."""
    logits = torch.randn(1, len(argmax), V, generator=seeded_generator(0), device=DEVICE)
    return logits.scatter(-1, torch.tensor([argmax], device=DEVICE)[..., None], 10.0)


def test_greedy_takes_the_longest_agreeing_path():
    nodes = torch.tensor([[1, 2, 3, 4, 5, 0, 1]], device=DEVICE)  # tokens of nodes 0..6
    # target argmax after: root=2 (-> node 1), node0=9, node1=0 (-> node 5), node2=., node3=., node4=., node5=4, node6=.
    argmax = [2, 5, 0, 5, 5, 5, 4, 5]
    result = tree_greedy_verify(nodes, tree(), logits_with_argmax(argmax))
    assert result.num_accepted.tolist() == [2]
    assert result.path[0, :3].tolist() == [0, 2, 6]
    assert result.tokens[0, :3].tolist() == [2, 0, 4]  # node 1, node 5, then the target's next token


def test_greedy_with_nothing_accepted_and_padding_nodes():
    nodes = torch.tensor([[1, 2, 3, 4, 5, 0, 1]] * 2, device=DEVICE)
    argmax = [3, 5, 5, 5, 5, 5, 5, 5]  # root wants 3: node 2 (valid in row 0, padding in row 1)
    result = tree_greedy_verify(nodes, tree(2, [7, 2]), logits_with_argmax(argmax).expand(2, -1, -1))
    assert result.num_accepted.tolist() == [1, 0]
    assert result.tokens[:, 0].tolist() == [3, 3]


# ---------------------------------------------------------------- statistical losslessness


def setup(seed: int, deterministic: bool):
    """p [N+1, V] per entry; node tokens [TRIALS, N] drawn from q (siblings share their parent's q)
    or, for deterministic nodes, distinct tokens per sibling group."""
    g = seeded_generator(seed)
    p = random_dists(N + 1, g)
    if deterministic:
        tokens = torch.tensor([[0, 1, 2, 3, 4, 0, 5]], device=DEVICE).expand(TRIALS, N)
        return p, None, tokens
    q_at = random_dists(N + 1, g)  # the draft's distribution after each entry
    q = q_at[torch.tensor(PARENTS, device=DEVICE) + 1]  # [N, V]: a node is drawn from its parent's q
    tokens = torch.multinomial(q, TRIALS, replacement=True, generator=g).T  # [TRIALS, N]
    return p, q.expand(TRIALS, N, V), tokens


def pvalues(result, p: Tensor) -> list[float]:
    """First token vs p[root]; the token after each depth-1 node c (rows whose path goes through c) vs p[c]."""
    values = [pooled_chisquare(result.tokens[:, 0], p[0])]
    for c in (1, 2, 3):
        rows = (result.path[:, 1] == c) & (result.num_accepted >= 1)
        if rows.sum() > 200:
            values.append(pooled_chisquare(result.tokens[rows, 1], p[c]))
    return values


@pytest.mark.parametrize("deterministic", [False, True], ids=["sampled", "deterministic"])
@pytest.mark.parametrize("seed", [1, 2])
def test_tree_sampling_is_lossless(seed, deterministic):
    p, q, tokens = setup(seed, deterministic)
    result = tree_rejection_sample(tokens, q, tree(TRIALS), p.expand(TRIALS, N + 1, V), seeded_generator(seed + 10))
    values = pvalues(result, p)
    assert len(values) >= 3
    assert min(values) > ALPHA / len(values), values
    assert 0 < result.num_accepted.float().mean() < 3


@pytest.mark.parametrize("deterministic", [False, True], ids=["sampled", "deterministic"])
def test_a_broken_tree_verifier_is_caught(monkeypatch, deterministic):
    """Removing each rejected sibling's q is what keeps later siblings lossless: skip it and the first
    emitted token is biased towards later siblings, which the same check must detect."""
    import specdec.verify as verify

    monkeypatch.setattr(verify, "remove_rejected", lambda r, q: r)
    p, q, tokens = setup(3, deterministic)
    result = tree_rejection_sample(tokens, q, tree(TRIALS), p.expand(TRIALS, N + 1, V), seeded_generator(7))
    assert pooled_chisquare(result.tokens[:, 0], p[0]) < ALPHA
