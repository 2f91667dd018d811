"""The array versions of the EAGLE-2 search (`TreeSearch`), its forest feed (`tree_feed`) and the
forest inputs (`_forest_layout`, `build_forest_input`) against the plain-Python reference they
replaced (`tree_reference.py`), bit for bit: the same frontiers step by step, the same feeds, and
every field of every `DraftTree`, for greedy, sampling and mixed batches, mixed depths, -inf rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tree_reference import RefExpansion, RefTreeSearch, ref_forest_layout, ref_tree_feed

from specserve.engine.request import Request
from specserve.engine.sampler import uniform_noise, uniform_noise_host
from specserve.engine.step_input import Forest, _forest_layout, build_forest_input, tree_mask
from specserve.spec.tree import TreeSearch, tree_feed
from specserve.types import SamplingParams

PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.8, min_p=0.02),
]


def _requests(rng: np.random.Generator, count: int, kinds: str) -> list[Request]:
    """`kinds`: "greedy", "sampling" or "mixed"; outputs and verify rounds differ per request."""
    reqs = []
    for i in range(count):
        if kinds == "greedy":
            params = PARAMS[0]
        elif kinds == "sampling":
            params = PARAMS[1 + i % 3]
        else:
            params = PARAMS[int(rng.integers(len(PARAMS)))]
        req = Request(f"r{i}", [1, 2, 3], params, seed=int(rng.integers(2**40)))
        req.token_ids.extend(rng.integers(0, 9, int(rng.integers(0, 5))).tolist())
        req.spec_verify_ct = int(rng.integers(0, 3))
        reqs.append(req)
    return reqs


def _logits(rng: np.random.Generator, rows: int, vocab: int) -> torch.Tensor:
    """Random logits; some rows keep only 1-3 tokens (-inf elsewhere: fewer children than topk, and
    with one token a child as likely as its parent), some rows have ties."""
    x = torch.from_numpy(rng.normal(0, 2, (rows, vocab))).float()
    for r in range(rows):
        kind = 0 if r == 0 else rng.integers(6)  # every expansion has a short row
        if kind == 0:  # support smaller than topk: the children stop at the first -inf
            x[r, rng.permutation(vocab)[: vocab - int(rng.integers(1, 4))]] = float("-inf")
        elif kind == 1:  # ties: equal scores order by node id
            x[r] = torch.from_numpy(rng.integers(0, 3, vocab)).float()
    return x


def _assert_same_trees(new, ref) -> None:
    assert len(new) == len(ref)
    for a, b in zip(new, ref, strict=True):
        assert (a is None) == (b is None)
        if a is None:
            continue
        assert a.tokens == b.tokens
        for name in ("parents", "cand_tokens", "cand_rows"):
            x, y = getattr(a, name), getattr(b, name)
            assert x.dtype == y.dtype and np.array_equal(x, y), name
        assert (a.q is None) == (b.q is None)
        if a.q is not None:
            assert a.q.dtype == b.q.dtype and a.q.shape == b.q.shape and torch.equal(a.q, b.q)
        assert np.array_equal(a.depths, b.depths)


def _assert_same_feed(search: TreeSearch, feed, ref) -> None:
    assert feed.requests.tolist() == ref.requests
    assert feed.rows.tolist() == ref.rows
    bounds = np.cumsum([0, *feed.lens.tolist()])
    assert feed.lens.tolist() == [len(n) for n in ref.nodes]
    for i, b in enumerate(ref.requests):
        part = slice(bounds[i], bounds[i + 1])
        assert (feed.request[part] == b).all()
        assert feed.node[part].tolist() == ref.nodes[i]
        assert np.array_equal(feed.forest[part], ref.forest[i])


def _run_both(reqs, depths, topk, num_nodes, vocab, rng, maps=None):
    """Grow both searches in lockstep on the same random logits; every frontier and feed compared."""
    maps = maps or {}
    new = TreeSearch(reqs, depths, topk, num_nodes, vocab, **maps)
    ref = RefTreeSearch(reqs, depths, topk, num_nodes, vocab, **maps)
    where, ref_where = new.roots(), ref.roots()
    step = 0
    draft_vocab = vocab // 2 if maps else vocab
    while True:
        assert where.request.tolist() == ref_where.request and where.node.tolist() == ref_where.node
        if not len(where):
            break
        if step:
            _assert_same_feed(new, tree_feed(new, where), ref_tree_feed(ref, ref_where))
        logits = _logits(rng, len(where), draft_vocab)
        new.expand(where, logits)
        ref.expand(RefExpansion(list(ref_where.request), list(ref_where.node)), logits)
        step += 1
        where, ref_where = new.frontier(step), ref.frontier(step)
    for b, nodes in enumerate(ref.nodes):  # the node tables themselves
        assert new.count[b] == len(nodes)
        assert new.token[b, : len(nodes)].tolist() == [n.token for n in nodes]
        assert new.score[b, : len(nodes)].tolist() == [n.score for n in nodes]
        assert new.parent[b, : len(nodes)].tolist() == [n.parent for n in nodes]
    _assert_same_trees(new.trees(), ref.trees())
    return new


@pytest.mark.parametrize("kinds", ["greedy", "sampling", "mixed"])
@pytest.mark.parametrize("topk", [1, 2, 4, 8])
@pytest.mark.parametrize("num_nodes", [4, 16, 64])
def test_search_matches_the_reference(kinds, topk, num_nodes):
    rng = np.random.default_rng(topk * 100 + num_nodes + len(kinds))
    for trial in range(2):
        count = int(rng.integers(1, 7))
        reqs = _requests(rng, count, kinds)
        depths = rng.integers(0, 7, count).tolist()  # 0: nothing drafted for that request
        vocab = 6 if trial else 40  # a vocabulary smaller than topk: fewer children
        search = _run_both(reqs, depths, topk, num_nodes, vocab, rng)
        if topk == 8 and not trial:  # the -inf rows did cut some nodes' children short
            expanded = search.num_children[search.num_children > 0]
            assert not len(expanded) or (expanded < topk).any()


def test_search_matches_the_reference_with_a_draft_vocabulary():
    """EAGLE-3: draft ids map into the target vocabulary, q too."""
    rng = np.random.default_rng(7)
    vocab = 64

    def to_target_ids(ids: torch.Tensor) -> torch.Tensor:
        return ids * 2 + 1

    def to_target_probs(q: torch.Tensor, target_vocab: int) -> torch.Tensor:
        out = q.new_zeros((q.shape[0], target_vocab))
        out[:, 1::2] = q
        return out

    maps = {"to_target_ids": to_target_ids, "to_target_probs": to_target_probs}
    reqs = _requests(rng, 6, "mixed")
    _run_both(reqs, [5, 3, 6, 1, 4, 5], 4, 16, vocab, rng, maps)


def test_forest_layout_matches_the_reference():
    rng = np.random.default_rng(3)
    for _ in range(20):
        batch = int(rng.integers(1, 8))
        lens = rng.integers(1, 12, batch)
        forests = []
        for n in lens.tolist():
            if rng.random() < 0.3:
                forests.append(None)  # a causal request beside the forests
                continue
            parents = np.array([int(rng.integers(-1, j)) for j in range(n)], dtype=np.int64)
            forests.append(parents)
        if all(f is None for f in forests):
            forests[0] = np.full(lens[0], -1, dtype=np.int64)
        padded = batch + int(rng.integers(0, 3))  # CUDA-graph pad requests: causal
        query_start = np.concatenate([[0], np.cumsum(lens), np.full(padded - batch, lens.sum())])
        starts = rng.integers(0, 50, batch).tolist()
        max_query_len = int(lens.max()) + int(rng.integers(0, 3))
        positions = rng.integers(0, 100, int(lens.sum()) + 4)
        ref_positions = positions.copy()
        flags, entries = _forest_layout(Forest.of(forests), starts, query_start, max_query_len, positions)
        ref = ref_forest_layout(
            [*forests, *[None] * (padded - batch)], starts, query_start, max_query_len, ref_positions
        )
        assert np.array_equal(flags, ref[0]) and np.array_equal(entries, ref[1])
        assert np.array_equal(positions, ref_positions)


def test_forest_input_matches_a_per_token_construction():
    """Slots from each request's pages (token j at context slot start + j), positions start + depth,
    the mask of each token's ancestors, the rows read."""
    rng = np.random.default_rng(5)
    page_size = 4
    reqs, starts, tokens, parents = [], [], [], []
    lens = rng.integers(1, 9, 5)
    free = rng.permutation(200).tolist()
    for i, n in enumerate(lens.tolist()):
        req = Request(f"r{i}", [1], SamplingParams(temperature=0.0), seed=i)
        start = int(rng.integers(0, 30))
        req.pages = [free.pop() for _ in range(-(-(start + n) // page_size))]
        reqs.append(req)
        starts.append(start)
        tokens.append(rng.integers(0, 100, n))
        parents.append(np.array([int(rng.integers(-1, j)) for j in range(n)], dtype=np.int64))
    rows = np.array([0, int(lens[0]) + 1, int(lens.sum()) - 1], dtype=np.int64)
    inp = build_forest_input(
        reqs,
        starts,
        np.concatenate(tokens),
        lens,
        np.concatenate(parents),
        rows,
        page_size,
        torch.device("cpu"),
    )
    slots = [
        req.pages[p // page_size] * page_size + p % page_size
        for req, start, n in zip(reqs, starts, lens.tolist(), strict=True)
        for p in range(start, start + n)
    ]
    query_start = np.concatenate([[0], np.cumsum(lens)])
    positions = np.zeros(int(lens.sum()), dtype=np.int64)
    flags, entries = ref_forest_layout(parents, starts, query_start, int(lens.max()), positions)
    assert inp.input_ids.tolist() == np.concatenate(tokens).tolist()
    assert inp.positions.tolist() == positions.tolist()
    assert inp.attention.slot_mapping.tolist() == slots
    assert inp.last_rows.tolist() == rows.tolist()
    expected = tree_mask(torch.from_numpy(flags), torch.from_numpy(entries), int(lens.max()))
    assert torch.equal(inp.attention.custom_mask, expected)


def test_host_folded_noise_is_uniform_noise():
    rng = np.random.default_rng(1)
    seed = rng.integers(0, 2**63 - 1, 9, dtype=np.int64)
    counter = (rng.integers(0, 2**31, 9, dtype=np.int64) << 32) | rng.integers(0, 2**20, 9, dtype=np.int64)
    for salt in (0, 3):
        expected = uniform_noise(torch.from_numpy(seed), torch.from_numpy(counter), 50, salt=salt)
        assert torch.equal(uniform_noise_host(seed, counter, 50, torch.device("cpu"), salt=salt), expected)
