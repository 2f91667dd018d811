"""The recurrent-state commit kernel against its torch reference, and its checks."""

from __future__ import annotations

import pytest
import torch

from specserve_kernels.state_commit import check_commits, commit_states, commit_states_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _tensors(seed: int, layers: int, slots: int, rows: int, ssm: tuple, conv: tuple, dtype):
    g = torch.Generator().manual_seed(seed)
    out = [
        torch.randn(layers, n, *shape, generator=g).to(dt).to(DEVICE)
        for n, shape, dt in (
            (slots, ssm, torch.float32),
            (slots, conv, dtype),
            (rows, ssm, torch.float32),
            (rows, conv, dtype),
        )
    ]
    return out


@pytest.mark.parametrize(
    ("layers", "slots", "rows", "ssm", "conv", "dtype"),
    [
        (2, 5, 7, (4, 8, 16), (3, 192), torch.float32),
        (3, 17, 40, (8, 16, 16), (3, 96), torch.bfloat16),  # a state of 2048 values: two blocks
        (1, 3, 1, (1, 2, 3), (1, 5), torch.float16),
    ],
)
def test_random_commits_match_the_reference(layers, slots, rows, ssm, conv, dtype):
    for seed in range(2):
        gen = torch.Generator().manual_seed(100 + seed)
        count = int(torch.randint(1, min(slots, rows) + 1, (1,), generator=gen))
        dst = torch.randperm(slots, generator=gen)[:count]
        src = torch.randint(0, rows, (count,), generator=gen)
        live_ssm, live_conv, snap_ssm, snap_conv = _tensors(seed, layers, slots, rows, ssm, conv, dtype)
        expected_ssm, expected_conv = live_ssm.clone(), live_conv.clone()
        for s, d in zip(src.tolist(), dst.tolist(), strict=True):
            expected_ssm[:, d] = snap_ssm[:, s]
            expected_conv[:, d] = snap_conv[:, s]
        index = [t.to(DEVICE) for t in (src, dst)]
        ref_ssm, ref_conv = live_ssm.clone(), live_conv.clone()
        commit_states_ref(ref_ssm, ref_conv, snap_ssm, snap_conv, *index)
        commit_states(live_ssm, live_conv, snap_ssm, snap_conv, *index)
        assert torch.equal(live_ssm, expected_ssm) and torch.equal(live_conv, expected_conv)
        assert torch.equal(ref_ssm, expected_ssm) and torch.equal(ref_conv, expected_conv)


def test_bad_commits_are_refused():
    live_ssm, live_conv, snap_ssm, snap_conv = _tensors(0, 2, 4, 3, (2, 2, 2), (3, 4), torch.float32)
    check_commits([0, 2], [3, 1], num_rows=3, num_slots=4)
    bad = {
        "src": ([3], [0]),  # no such snapshot row
        "dst": ([0, 1], [2, 2]),  # a slot written twice
    }
    for match, (src, dst) in bad.items():
        with pytest.raises(ValueError, match=match):
            check_commits(src, dst, num_rows=3, num_slots=4)
        index = [torch.tensor(a, dtype=torch.int64, device=DEVICE) for a in (src, dst)]
        for fn in (commit_states, commit_states_ref):
            with pytest.raises(ValueError, match=match):
                fn(live_ssm, live_conv, snap_ssm, snap_conv, *index)
    with pytest.raises(ValueError, match="dst"):
        check_commits([0], [4], num_rows=3, num_slots=4)
    with pytest.raises(ValueError, match="conv"):  # snapshots of another shape
        commit_states(
            live_ssm,
            live_conv,
            snap_ssm,
            snap_conv[..., :2],
            *[torch.zeros(1, dtype=torch.int64, device=DEVICE)] * 2,
        )
    with pytest.raises(ValueError, match="src"):
        commit_states(
            live_ssm,
            live_conv,
            snap_ssm,
            snap_conv,
            torch.zeros(1, dtype=torch.int32, device=DEVICE),
            torch.zeros(1, dtype=torch.int64, device=DEVICE),
        )
    empty = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    before = live_ssm.clone()
    commit_states(live_ssm, live_conv, snap_ssm, snap_conv, empty, empty)
    assert torch.equal(live_ssm, before)
