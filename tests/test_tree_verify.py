"""Tree verification: structure helpers (against per-node reference loops, with padding nodes and static
bounds), greedy longest-path acceptance, statistical losslessness of multi-candidate rejection sampling
(random trees, random p and q, a small vocabulary), mixed greedy / sampled rows, and graph safety.

Statistical setup as in test_verify.py: p is fixed per block entry (the root and each node), every
batch row is an independent trial. The first emitted token must follow p[root]; among rows whose
path goes through node c, the token emitted after c must follow p[c]. Broken verifiers must fail.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from conftest import DEVICE, seeded_generator
from specdec.config import SamplingParams
from specdec.sampling import RowSampling, logits_to_probs
from specdec.verify import (
    TreeSpec,
    children_table,
    longest_accepted,
    tree_greedy_verify,
    tree_rejection_sample,
    tree_uniforms_needed,
    verify_tree,
)
from test_sampling import no_host_sync
from test_verify import ALPHA, TRIALS, V, pooled_chisquare, random_dists, trial_uniforms

# root -> 0, 1, 2; 0 -> 3, 4; 1 -> 5; 3 -> 6
PARENTS = [-1, -1, -1, 0, 0, 1, 3]
N = len(PARENTS)
DEPTH, FAN_OUT = 3, 3  # the tree's static bounds


def tree(batch: int = 1, num_nodes: list[int] | None = None, bounds: bool = True) -> TreeSpec:
    parents = torch.tensor([PARENTS] * batch, device=DEVICE)
    nodes = None if num_nodes is None else torch.tensor(num_nodes, device=DEVICE)
    return TreeSpec(parents, nodes, DEPTH, FAN_OUT) if bounds else TreeSpec(parents, nodes)


@pytest.mark.parametrize("bounds", [True, False], ids=["tight bounds", "default bounds"])
def test_structure(bounds):
    t = tree(bounds=bounds)
    assert (t.max_depth, t.max_children) == ((DEPTH, FAN_OUT) if bounds else (N, N))
    assert t.parent_blocks.tolist() == [[0, 0, 0, 0, 1, 1, 2, 4]]
    assert t.depths().tolist() == [[0, 1, 1, 1, 2, 2, 2, 3]]
    mask = t.ancestor_mask()[0]
    assert mask[7].nonzero().flatten().tolist() == [0, 1, 4, 7]  # node 6 sees root, node 0, node 3, itself
    assert mask[3].nonzero().flatten().tolist() == [0, 3]
    padded = [row + [-1] * (t.max_children - 3) for row in ([1, 2, 3], [4, 5, -1], [6, -1, -1])]
    assert children_table(t)[0].tolist()[:3] == padded
    assert tree_uniforms_needed(t) == t.max_depth * t.max_children + 1


# ---------------------------------------------------------------- random trees against reference loops


def random_tree(batch: int, nodes: int, seed: int) -> tuple[list[list[int]], list[int]]:
    """Parents [batch][nodes] (each node's parent an earlier node or the root) and valid counts; padding
    nodes hang off the root."""
    g = torch.Generator().manual_seed(seed)
    parents, counts = [], []
    for _ in range(batch):
        n = int(torch.randint(0, nodes + 1, (1,), generator=g))
        row = [int(torch.randint(-1, i, (1,), generator=g)) if i else -1 for i in range(n)] + [-1] * (nodes - n)
        parents.append(row)
        counts.append(n)
    return parents, counts


def reference_structure(parents: list[int], n: int):
    """Per-node loops: depth [N+1], ancestors [N+1][N+1], children per entry (valid nodes only)."""
    T = len(parents) + 1
    parent = [0] + [p + 1 for p in parents]
    depth = [0] * T
    ancestors = [[j == i for j in range(T)] for i in range(T)]
    for i in range(1, T):
        depth[i] = depth[parent[i]] + 1
        ancestors[i] = [a or b for a, b in zip(ancestors[i], ancestors[parent[i]])]
    children = [[i + 1 for i in range(n) if parents[i] + 1 == e] for e in range(T)]
    return depth, ancestors, children


def test_structure_matches_reference_loops():
    B, nodes = 12, 9
    parents, counts = random_tree(B, nodes, seed=0)
    refs = [reference_structure(p, n) for p, n in zip(parents, counts)]
    max_depth = max(max(d) for d, _, _ in refs)
    max_children = max(len(c) for _, _, cs in refs for c in cs)
    t = TreeSpec(torch.tensor(parents, device=DEVICE), torch.tensor(counts, device=DEVICE), max_depth, max_children)
    depths, mask, kids = t.depths().tolist(), t.ancestor_mask().tolist(), children_table(t).tolist()
    for b, (depth, ancestors, children) in enumerate(refs):
        assert depths[b] == depth
        assert mask[b] == ancestors
        assert kids[b] == [c + [-1] * (max_children - len(c)) for c in children]


def test_children_beyond_the_fan_out_bound_are_left_out():
    t = TreeSpec(torch.tensor([PARENTS], device=DEVICE), None, DEPTH, 2)
    assert children_table(t)[0].tolist()[:3] == [[1, 2], [4, 5], [6, -1]]


def test_longest_accepted_takes_the_deepest_then_the_first():
    t = tree(2)
    accepted = torch.tensor([[1, 1, 1, 0, 1, 1, 0, 0],  # root, node 0, node 1, node 3, node 4 (depth 2, node 3 first)
                             [1, 0, 0, 1, 0, 0, 0, 0]], dtype=torch.bool, device=DEVICE)  # root, node 2
    path, num_accepted = longest_accepted(accepted, t)
    assert num_accepted.tolist() == [2, 1]
    assert path.tolist() == [[0, 1, 4, 0], [0, 3, 0, 0]]


# ---------------------------------------------------------------- greedy


def logits_with_argmax(argmax: list[int]) -> Tensor:
    """[1, N+1, V] logits whose argmax at each block entry is given."""
    logits = torch.randn(1, len(argmax), V, generator=seeded_generator(0), device=DEVICE)
    return logits.scatter(-1, torch.tensor([argmax], device=DEVICE)[..., None], 10.0)


@pytest.mark.parametrize("bounds", [True, False], ids=["tight bounds", "default bounds"])
def test_greedy_takes_the_longest_agreeing_path(bounds):
    nodes = torch.tensor([[1, 2, 3, 4, 5, 0, 1]], device=DEVICE)  # tokens of nodes 0..6
    # target argmax after: root=2 (-> node 1), node0=9, node1=0 (-> node 5), node2=., node3=., node4=., node5=4, node6=.
    argmax = [2, 5, 0, 5, 5, 5, 4, 5]
    result = tree_greedy_verify(nodes, tree(bounds=bounds), logits_with_argmax(argmax))
    assert result.num_accepted.tolist() == [2]
    assert result.path[0, :3].tolist() == [0, 2, 6]
    assert result.tokens[0, :3].tolist() == [2, 0, 4]  # node 1, node 5, then the target's next token


def test_greedy_with_nothing_accepted_and_padding_nodes():
    nodes = torch.tensor([[1, 2, 3, 4, 5, 0, 1]] * 2, device=DEVICE)
    argmax = [3, 5, 5, 5, 5, 5, 5, 5]  # root wants 3: node 2 (valid in row 0, padding in row 1)
    result = tree_greedy_verify(nodes, tree(2, [7, 2]), logits_with_argmax(argmax).expand(2, -1, -1))
    assert result.num_accepted.tolist() == [1, 0]
    assert result.tokens[:, 0].tolist() == [3, 3]


def test_greedy_deep_path_through_padding_is_cut():
    """Row 1 keeps only nodes 0..3: the chain root -> 0 -> 3 -> 6 agrees everywhere, but node 6 is padding."""
    nodes = torch.tensor([[1, 2, 3, 4, 5, 0, 1]] * 2, device=DEVICE)
    argmax = [1, 4, 5, 5, 1, 5, 5, 2]  # root -> node 0 (1), node 0 -> node 3 (4), node 3 -> node 6 (1)
    result = tree_greedy_verify(nodes, tree(2, [7, 4]), logits_with_argmax(argmax).expand(2, -1, -1))
    assert result.num_accepted.tolist() == [3, 2]
    assert result.path.tolist() == [[0, 1, 4, 7], [0, 1, 4, 0]]
    assert result.tokens[1, :3].tolist() == [1, 4, 1]


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


def sample_tree(t: TreeSpec, tokens: Tensor, q: Tensor | None, p: Tensor, seed: int):
    return tree_rejection_sample(tokens, q, t, p.expand(TRIALS, N + 1, V), trial_uniforms(tree_uniforms_needed(t), seed))


@pytest.mark.parametrize("deterministic", [False, True], ids=["sampled", "deterministic"])
@pytest.mark.parametrize("seed", [1, 2])
def test_tree_sampling_is_lossless(seed, deterministic):
    p, q, tokens = setup(seed, deterministic)
    result = sample_tree(tree(TRIALS, bounds=seed == 1), tokens, q, p, seed + 10)
    values = pvalues(result, p)
    assert len(values) >= 3
    assert min(values) > ALPHA / len(values), values
    assert 0 < result.num_accepted.float().mean() < 3


@pytest.mark.parametrize("deterministic", [False, True], ids=["sampled", "deterministic"])
def test_padding_nodes_are_never_accepted_and_sampling_stays_lossless(deterministic):
    """Rows keep 1..N nodes; padded rows hold tokens equal to the target's argmax (a verifier that read
    them would accept them often). No padding node is on any path and the outputs still follow p."""
    p, q, tokens = setup(4, deterministic)
    g = seeded_generator(5)
    counts = torch.randint(1, N + 1, (TRIALS,), generator=g, device=DEVICE)  # [TRIALS]
    padding = torch.arange(N, device=DEVICE) >= counts[:, None]  # [TRIALS, N]
    tokens = torch.where(padding, p[0].argmax(), tokens)
    t = TreeSpec(torch.tensor([PARENTS] * TRIALS, device=DEVICE), counts, DEPTH, FAN_OUT)
    result = sample_tree(t, tokens, q, p, seed=14)
    assert (result.path <= counts[:, None]).all()  # block index i + 1 of node i: only valid nodes
    values = pvalues(result, p)
    assert min(values) > ALPHA / len(values), values


@pytest.mark.parametrize("deterministic", [False, True], ids=["sampled", "deterministic"])
def test_a_broken_tree_verifier_is_caught(monkeypatch, deterministic):
    """Removing each rejected sibling's q is what keeps later siblings lossless: skip it and the first
    emitted token is biased towards later siblings, which the same check must detect."""
    import specdec.verify as verify

    monkeypatch.setattr(verify, "remove_rejected", lambda r, q: r)
    monkeypatch.setattr(verify, "remove_rejected_token", lambda r, mass, x, rejected: (r, mass))
    p, q, tokens = setup(3, deterministic)
    result = sample_tree(tree(TRIALS), tokens, q, p, seed=7)
    assert pooled_chisquare(result.tokens[:, 0], p[0]) < ALPHA


# ---------------------------------------------------------------- mixed rows


def test_verify_tree_mixed_rows_verify_as_if_alone():
    params = [SamplingParams(), SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_p=0.9),
              SamplingParams(temperature=0.0, top_p=0.5)]
    B = len(params)
    g = seeded_generator(9)
    logits = 2 * torch.randn(B, N + 1, V, generator=g, device=DEVICE)
    q = random_dists(B * N, g).view(B, N, V)
    tokens = torch.multinomial(q.view(-1, V), 1, generator=g).view(B, N)
    t = TreeSpec(torch.tensor([PARENTS] * B, device=DEVICE), torch.tensor([7, 5, 7, 3], device=DEVICE), DEPTH, FAN_OUT)
    u = trial_uniforms(tree_uniforms_needed(t), 0, rows=B)
    result = verify_tree(tokens, q, t, logits, RowSampling.of(params, DEVICE), u, any_sampled=True)
    greedy = tree_greedy_verify(tokens, t, logits)
    for b, s in enumerate(params):
        one = slice(b, b + 1)
        if s.greedy:
            expected = greedy
            index = b
        else:
            single = TreeSpec(t.parents[one], t.num_nodes[one], DEPTH, FAN_OUT)
            expected = tree_rejection_sample(tokens[one], q[one], single, logits_to_probs(logits[one], s), u[one])
            index = 0
        n = int(expected.num_accepted[index])
        assert result.num_accepted[b] == n
        assert torch.equal(result.tokens[b, : n + 1], expected.tokens[index, : n + 1])
        assert torch.equal(result.path[b, : n + 1], expected.path[index, : n + 1])
    all_greedy = verify_tree(tokens, q, t, logits, RowSampling.of([SamplingParams()] * B, DEVICE), u, any_sampled=False)
    assert torch.equal(all_greedy.tokens, greedy.tokens) and torch.equal(all_greedy.path, greedy.path)


# ---------------------------------------------------------------- graph safety


def test_tree_verification_is_graph_safe():
    B = 3
    t = tree(B, [7, 4, 0])
    g = seeded_generator(10)
    logits = torch.randn(B, N + 1, V, generator=g, device=DEVICE)
    p = logits.softmax(-1)
    q = random_dists(B * N, g).view(B, N, V)
    tokens = torch.randint(0, V, (B, N), generator=g, device=DEVICE)
    params = [SamplingParams(), SamplingParams(temperature=1.0, top_k=3), SamplingParams(temperature=0.5)]
    rows = RowSampling.of(params, DEVICE)
    u = trial_uniforms(tree_uniforms_needed(t), 0, rows=B)
    with no_host_sync():
        t.parent_blocks, t.valid(), t.depths(), t.ancestor_mask(), children_table(t)
        longest_accepted(torch.ones(B, N + 1, dtype=torch.bool, device=DEVICE), t)
        tree_greedy_verify(tokens, t, logits)
        tree_rejection_sample(tokens, q, t, p, u)
        tree_rejection_sample(tokens, None, t, p, u)
        verify_tree(tokens, q, t, logits, rows, u, any_sampled=True)
        verify_tree(tokens, None, t, logits, rows, u, any_sampled=False)
        TreeSpec(t.parents, t.num_nodes).depths()
