"""Draft trees without an engine: the EAGLE-2 search, the n-gram trie, and lossless tree verify
(greedy walks by hand; sampling by χ² on a toy target/drafter pair, where the children are drawn
without replacement from the drafter's q, the tree is pruned, and the walk continues or stops)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from specserve.config import SpeculativeConfig
from specserve.engine.request import Request
from specserve.engine.sampler import SamplingRow, filtered_probs_ref
from specserve.spec.ngram import NgramDrafter
from specserve.spec.tree import TreeSearch, build_tree
from specserve.spec.tree_verify import verify_trees
from specserve.types import SamplingParams

from engine_utils import assert_follows


def _requests(count: int, params: SamplingParams, outputs: int = 1) -> list[Request]:
    reqs = [Request(f"r{i}", [1, 2], params, seed=i) for i in range(count)]
    for r in reqs:
        r.token_ids.extend([0] * outputs)
    return reqs


def _grow(reqs, depth: int, topk: int, num_nodes: int, logits_at, vocab: int):
    """Run a TreeSearch with `logits_at(b, path tokens)` as the drafter."""
    search = TreeSearch(reqs, [depth] * len(reqs), topk, num_nodes, vocab)
    where = search.roots()
    search.expand(where, torch.stack([logits_at(b, []) for b in where.request]))
    step = 1
    while len(where := search.frontier(step)):
        paths = [search.path_tokens(b, node) for b, node in zip(where.request, where.node, strict=True)]
        search.expand(
            where, torch.stack([logits_at(b, p) for b, p in zip(where.request, paths, strict=True)])
        )
        step += 1
    return search.trees()


def _brute_force_tree(logits_at, depth: int, topk: int, num_nodes: int) -> list[tuple[int, ...]]:
    """EAGLE-2 from its definition, as the paths of the kept nodes in row order."""
    pool: dict[tuple[int, ...], float] = {}

    def children(path, score):
        logp = torch.log_softmax(logits_at(0, list(path)), -1)
        values, ids = logp.topk(topk)
        return {(*path, int(t)): score + float(v) for v, t in zip(values, ids, strict=True)}

    frontier = children((), 0.0)
    pool.update(frontier)
    for _ in range(1, depth):
        best = sorted(frontier, key=lambda p: -frontier[p])[:topk]  # no ties in random logits
        frontier = {}
        for path in best:
            frontier.update(children(path, pool[path]))
        pool.update(frontier)
    return sorted(pool, key=lambda p: (-pool[p], len(p)))[:num_nodes]


@pytest.mark.parametrize(("depth", "topk", "num_nodes"), [(3, 2, 5), (4, 3, 9), (2, 4, 64)])
def test_search_keeps_the_best_nodes_parents_first(depth, topk, num_nodes):
    vocab = 7
    g = torch.Generator().manual_seed(depth * 10 + topk)
    table = torch.randn(vocab**depth, vocab, generator=g) * 2

    def logits_at(b, path):
        return table[sum(t * vocab**i for i, t in enumerate(path)) % table.shape[0]]

    (tree,) = _grow(_requests(1, SamplingParams(temperature=0.0)), depth, topk, num_nodes, logits_at, vocab)
    expected = _brute_force_tree(logits_at, depth, topk, num_nodes)
    # Each node's path, from the parent rows.
    paths: list[tuple[int, ...]] = [()]
    for token, parent in zip(tree.tokens, tree.parents.tolist(), strict=True):
        assert parent < len(paths)
        paths.append((*paths[parent], token))
    assert paths[1:] == expected
    assert tree.depths.tolist() == [len(p) for p in paths]
    # Every row lists its node's top-k children (kept ones with their rows) in descending order.
    row_of = {p: r for r, p in enumerate(paths)}
    for r, path in enumerate(paths):
        kids = [int(t) for t in tree.cand_tokens[r] if t >= 0]
        if not kids:
            continue
        assert kids == torch.log_softmax(logits_at(0, list(path)), -1).topk(topk).indices.tolist()
        assert tree.cand_rows[r][: len(kids)].tolist() == [row_of.get((*path, t), -1) for t in kids]
    cut = tree.truncated(2)
    assert cut.num_nodes == 2 and (cut.cand_rows <= 2).all() and cut.cand_tokens.shape[0] == 3


def test_ngram_tree_merges_continuations():
    drafter = NgramDrafter(min_match=1, max_match=2)
    tokens = [1, 2, 3, 4, 1, 2, 5, 6, 1, 2, 3, 7, 1, 2]
    tree = drafter.propose_tree(tokens, depth=3, topk=2, num_nodes=5)
    # [1, 2] occurs at 8, 4, 0 (latest first): 3 7 1 / 5 6 1 / 3 4 1 (4 is the second child of 3).
    assert list(tree.tokens) == [3, 7, 1, 5, 6]
    assert list(tree.tokens[:3]) == drafter.propose(tokens, 3)  # the chain is the tree's first path
    assert tree.parents.tolist() == [0, 1, 2, 0, 4]
    assert tree.cand_tokens[0].tolist() == [3, 5] and tree.cand_rows[0].tolist() == [1, 4]
    assert tree.cand_tokens[1].tolist() == [7, 4] and tree.cand_rows[1].tolist() == [2, -1]
    assert drafter.propose_tree([5, 6, 7], 3, 2, 4) is None
    assert drafter.propose_tree(tokens, 0, 2, 4) is None


def test_greedy_walk_by_hand():
    vocab = 8
    # Root candidates [5 -> row 1, 6 -> row 2]; row 1 candidates [2 -> row 3, 3 (no row)].
    tree = build_tree([5, 6, 2], [0, 0, 1], [[(5, 1), (6, 2)], [(2, 3), (3, -1)], [], []], width=2)
    row = SamplingRow(0.0, 0, 1.0, 0.0, seed=1, counter=0)
    rows = [SamplingRow(0.0, 0, 1.0, 0.0, 1, d) for d in tree.depths.tolist()]

    def logits(argmaxes):
        out = torch.zeros(len(argmaxes), vocab)
        out[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 5.0
        return out

    # Target says 5, then 3 (a row-less candidate: accepted, the step ends with it).
    (o,) = verify_trees(logits([5, 3, 0, 0]), rows, [tree])
    assert o.tokens == [5, 3] and o.rows == [0, 1]
    # 5, 2, then the bonus at row 3.
    (o,) = verify_trees(logits([5, 2, 0, 7]), rows, [tree])
    assert o.tokens == [5, 2, 7] and o.path == [1, 3]
    # 6 (row 2, no candidates): the bonus follows; a root the drafter missed corrects at once.
    (o,) = verify_trees(logits([6, 0, 4, 0]), rows, [tree])
    assert o.tokens == [6, 4] and o.path == [2]
    a, b = verify_trees(logits([1, 0, 0, 0, 3]), [*rows, row], [tree, None])
    assert a.tokens == [1] and a.path == [] and b.tokens == [3]


@pytest.mark.parametrize(
    "row",
    [
        SamplingRow(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, counter=0),
        SamplingRow(temperature=0.7, top_k=0, top_p=0.9, min_p=0.05, seed=0, counter=0),
    ],
)
def test_deterministic_candidates_emit_the_target_distribution(row):
    """One-hot candidates (n-gram continuations): the first emitted token follows p0 (χ²), whichever
    candidates carry rows."""
    vocab, draws = 10, 12000
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(5)) * 1.5
    p0 = filtered_probs_ref(logits[0], row).numpy()
    order = np.argsort(-p0)
    cands = [(int(order[1]), 1), (int(order[0]), -1), (int(order[4]), 2)]
    tree = build_tree([cands[0][0], cands[2][0]], [0, 0], [cands, [], []], width=3)
    rows = [
        SamplingRow(row.temperature, row.top_k, row.top_p, row.min_p, s, d)
        for s in range(draws)
        for d in (0, 1, 1)
    ]
    outcomes = verify_trees(logits[[0, 1, 1] * draws], rows, [tree] * draws)
    assert_follows([o.tokens[0] for o in outcomes], p0)
    assert {len(o.tokens) for o in outcomes} == {1, 2}


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=3, top_p=0.95)],
)
def test_sampled_trees_are_lossless(params):
    """A toy pair over 4 tokens: target p0, p1(. | a) and drafter q0, q1(. | a). Trees of depth 2,
    topk 2, 3 of the 6 candidates kept, children drawn from q without replacement; verify over the
    tree, then (where it emitted one token only) a second round from the emitted token. The first
    two emitted tokens must follow p0(a) p1(b | a) exactly (χ² over the 16 pairs); a scheme that
    forgot to take drawn candidates out of q fails this test."""
    vocab, draws = 4, 8000
    g = torch.Generator().manual_seed(11)
    target = [torch.randn(vocab, generator=g) * 1.5, torch.randn(vocab, vocab, generator=g) * 1.5]
    drafter = [torch.randn(vocab, generator=g) * 1.5, torch.randn(vocab, vocab, generator=g) * 1.5]
    reqs = _requests(draws, params)

    def one_round(reqs, roots):
        def logits_at(b, path):
            last = [roots[b], *path][-1]
            return drafter[0] if last is None else drafter[1][last]

        trees = _grow(reqs, 2, 2, 3, logits_at, vocab)
        logits, rows = [], []
        for r, root, tree in zip(reqs, roots, trees, strict=True):
            logits.append(target[0] if root is None else target[1][root])
            depths = tree.depths.tolist()
            logits += [target[1][t] for t in tree.tokens]  # deeper rows: any proper distribution
            rows += [r.sampling_row(r.num_output + d) for d in depths]
        return verify_trees(torch.stack(logits), rows, trees)

    first = one_round(reqs, [None] * draws)
    short = [i for i, o in enumerate(first) if len(o.tokens) == 1]
    assert 0 < len(short) < draws  # both branches of the pair taken
    for i in short:  # the engine's next round: one more output, a new verify round
        reqs[i].token_ids.append(first[i].tokens[0])
        reqs[i].spec_verify_ct += 1
    second = iter(one_round([reqs[i] for i in short], [first[i].tokens[0] for i in short]))
    pairs = [o.tokens[:2] if len(o.tokens) > 1 else [o.tokens[0], next(second).tokens[0]] for o in first]
    row = reqs[0].sampling_row(0)
    p0 = filtered_probs_ref(target[0], row)
    p1 = torch.stack([filtered_probs_ref(target[1][a], row) for a in range(vocab)])
    assert_follows([a * vocab + b for a, b in pairs], (p0[:, None] * p1).flatten().numpy())


def test_tree_settings_are_validated():
    assert SpeculativeConfig(topk=4, num_steps=3).draft_tokens == 12
    assert SpeculativeConfig(topk=8, num_steps=6, num_draft_tokens=64).draft_tokens == 64
    assert SpeculativeConfig(num_steps=5).draft_tokens == 5
    bad = [
        ({"topk": 0}, "topk"),
        ({"topk": 17}, "topk"),
        ({"topk": True}, "topk"),
        ({"topk": 1, "num_draft_tokens": 7}, "num_draft_tokens"),
        ({"topk": 2, "num_draft_tokens": 0}, "num_draft_tokens"),
        ({"topk": 2, "num_draft_tokens": 257}, "num_draft_tokens"),
    ]
    for fields, name in bad:
        with pytest.raises(ValueError, match=f"speculative.{name}"):
            SpeculativeConfig(**fields).validate()
    for topk, nodes in itertools.product((2, 16), (1, 256)):
        SpeculativeConfig(topk=topk, num_draft_tokens=nodes).validate()
