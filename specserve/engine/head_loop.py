"""The device loop with a hidden-state head drafting: EAGLE / EAGLE-3 / MTP chains queued back to back.

`DeviceLoop` runs n-gram chains, whose drafts come from the token history. A head's drafts come
from its own forwards, which read the target's features, and those can stay on the device too. One
iteration per request, all captured in one graph per batch bucket:

- the chain: steps 1 .. k-1 of the head's greedy chain (`DraftGraphs`' chain forward) from the seed,
  tail and newest extended position the last extend left in the chain bucket's static inputs;
- the verify input from those drafts (`loop_prepare` with `given` drafts), the target's forward, the
  accept (greedy, or for sampling requests the host path's test of deterministic drafts) and
  append (`loop_accept`), as in `DeviceLoop`;
- the extend at a fixed shape: the head's modules over every verify row, row i pairing the token
  that follows its position (the verify's token there: the draft it accepted, else its draw) with
  the target's feature at it (module 0), or with module m-1's output one row back (module m of an
  MTP chain; row 0 takes module m-1's tail, its output at the position before the verify's first,
  which the last extend settled), its KV at the verify's own slots. Rows past the accepted ones
  write head KV at positions the next extend rewrites before anything reads them (the chain writes
  each position before it attends to it), so the head's KV ends up as the synchronous extend over
  the accepted tokens leaves it. The last accepted row's outputs and module 0's greedy draft become
  the next tails and seed (kept where a row took nothing: a finished or pad row).

The bookkeeping around the head's forwards is one launch each (`kernels/head_glue.py`): a chain
step's input, and the extend's settle; the split argmax stores the drafts straight into the verify's
given drafts, and the seeds into the chain bucket.

Every verify row of a request sits one position past the row before, and its first one past the
position the last extend settled, so an MTP chain's shift from module to module is the same for
every request: the fixed shape carries it. The head's per-request state goes back to the requests
(`hand_back`) when the loop stops running them, as the synchronous extend would have left it, so
the synchronous path drafts on from there.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from specserve.config import SpeculativeConfig
from specserve.engine.device_loop import DeviceLoop, LoopState
from specserve.engine.host_copy import to_device
from specserve.engine.request import Request
from specserve.executor.cuda_graphs import CudaGraphs
from specserve.spec.draft_graphs import DeviceTokens, DraftGraphs
from specserve.spec.head_drafter import HeadDrafter, HeadState, has_seed, seed_tokens
from specserve_kernels import use_triton
from specserve_kernels.head_glue import extend_settle, extend_settle_ref


class HeadDeviceLoop(DeviceLoop):
    """Greedy chains of `num_steps` drafts from `drafter`'s head (its draft graphs' chain buckets
    hold the loop's drafting state), verified in the (batch, num_steps + 1) buckets of `graphs`."""

    def __init__(
        self,
        graphs: CudaGraphs,
        drafter: HeadDrafter,
        num_steps: int,
        max_context: int,
        state: LoopState | None = None,
    ) -> None:
        self.drafter = drafter
        self.draft_graphs: DraftGraphs = drafter.graphs
        device = graphs.page_table.device
        most = max(graphs.buckets.batch_sizes)
        self.given = torch.zeros(most, num_steps, dtype=torch.int64, device=device)
        self.steps_left = torch.full((most,), num_steps - 1, dtype=torch.int64, device=device)
        self.request_rows = torch.arange(most, device=device)  # a constant: none is made in a capture
        self.settle = extend_settle if use_triton(device) else extend_settle_ref
        super().__init__(graphs, num_steps, 1, 1, max_context, state)

    def ready(self, req: Request) -> bool:
        """The head has extended over every verified token and seeded the next chain."""
        return has_seed(req) and req.draft_backlog is None

    def reset_rows(self, batch: int) -> None:
        super().reset_rows(batch)
        for bucket in self.draft_graphs.chain.values():
            bucket.steps.zero_()
            bucket.base.zero_()

    def hand_back(self, reqs: list[Request]) -> None:
        """Each request's head state as the loop left it: the last extend's seed and tail at the
        request's newest verified position - 1 (what `HeadDrafter.after_target` would have stored)."""
        batch = next(b for b in self.batch_sizes if b >= len(reqs))
        bucket = self.draft_graphs.chain[batch]
        seeds = DeviceTokens(bucket.ids[: len(reqs)].clone())
        tails = bucket.tails[: len(reqs)].clone().unbind(0)
        for row, req in enumerate(reqs):
            if req.finished:
                continue
            position = len(req.token_ids) - 2
            req.draft_state = HeadState(position=position, tails=tails[row], seeds=seeds, seed_row=row)
            req.draft_computed = position + 1

    def _seed(self, reqs: list[Request]) -> None:
        """The chain bucket's inputs from each request's head state (a fresh run); pad rows idle."""
        n = len(reqs)
        batch = next(b for b in self.batch_sizes if b >= n)
        bucket = self.draft_graphs.chain[batch]
        states: list[HeadState] = [r.draft_state for r in reqs]
        seeds = seed_tokens(states, bucket.ids.device)
        head = np.zeros((3, batch), dtype=np.int64)  # ids, base, steps
        head[1, :n] = [s.position for s in states]
        head[2, :n] = self.num_steps - 1
        if not isinstance(seeds, torch.Tensor):
            head[0, :n] = seeds
        bucket.head.copy_(to_device(torch.from_numpy(head.ravel()), bucket.head.device))
        if isinstance(seeds, torch.Tensor):
            bucket.ids[:n].copy_(seeds)
        torch.stack([s.tails for s in states], out=bucket.tails[:n])

    def _switch_in(self, batch: int) -> None:
        """Behind another chain length's run: each active row's chain steps are this loop's (the
        chain bucket's seeds, tails and positions are any length's), as `extend_settle` sets them."""
        super()._switch_in(batch)
        bucket = self.draft_graphs.chain[batch]
        active = self.lengths[:batch] < self.limits[:batch]
        torch.mul(self.steps_left[:batch], active, out=bucket.steps[:batch])

    def _copy_pages(self, reqs: list[Request], batch: int) -> None:
        super()._copy_pages(reqs, batch)
        self._share_pages(batch)

    def _setup(self, reqs, limits, stop_ids, batch: int) -> None:
        """A fresh run's rows, and the chain bucket seeded from the requests' head state (after any
        capture the run needed: a capture resets the bucket's rows)."""
        super()._setup(reqs, limits, stop_ids, batch)
        self._share_pages(batch)
        self._seed(reqs)

    def _share_pages(self, batch: int) -> None:
        """The draft graphs' page table rows: the target's (the head's KV lives on the same pages)."""
        src, dst = self.graphs.page_table, self.draft_graphs.page_table
        width = min(src.shape[1], dst.shape[1])
        dst[:batch, :width].copy_(src[:batch, :width])

    def _iteration(self, batch: int) -> None:
        """Chain, verify input, forward, accept, extend: one speculative step of the first `batch`
        rows on the device; its record in `records`."""
        k, dg = self.num_steps, self.draft_graphs
        bucket = dg.chain[batch]
        if k > 1:  # the chain writes the seed and its drafts straight into the verify's given drafts
            given = self.given[:batch]
            dg.chain_forward(bucket, batch, k - 1, drafts=given)
        else:
            given = bucket.ids[:batch, None]  # the seed alone (read before the extend replaces it)
        graph, target, features = self._verify(batch, given)
        self._extend(bucket, batch, graph, target, features)

    def _extend(self, bucket, batch: int, graph, target: torch.Tensor, features: torch.Tensor) -> None:
        """The head's modules over every verify row (fixed shape), then the next seed, tails and
        position of each row that took tokens: one glue launch (`extend_settle`: module 0's tail,
        the position, the steps), a gather per further module, the lm_head over the chosen rows
        and the split argmax writing the seeds in place."""
        head, tails = self.drafter.head, bucket.tails[:batch]
        ctx = self.drafter.backend.prepare(graph.attention, self.drafter.kv_cache)
        ids = target.view(-1)
        out, to_logits = head.run(
            0, ids, features.to(self.drafter.dtype), graph.positions, ctx, from_target=True
        )
        outs, hidden = [out], out.shape[-1]
        for m in range(1, self.drafter.num_modules):  # before the settle: row 0 reads the old tails
            before = outs[-1].reshape(batch, -1, hidden)[:, :-1]  # module m-1 one row back
            shifted = torch.cat([tails[:, m - 1 : m], before], dim=1).view(-1, hidden)
            outs.append(head.run(m, ids, shifted, graph.positions, ctx, from_target=False)[0])
        records = self.records[:batch]
        selected, moved = self.settle(
            records,
            self.lengths[:batch],
            self.limits[:batch],
            self.steps_left[:batch],
            to_logits,
            out,
            tails[:, 0],
            bucket.base[:batch],
            bucket.steps[:batch],
        )
        if len(outs) > 1:  # each further module's output at the row `extend_settle` chose
            q = records.shape[1] - 2
            last = (records[:, q] - 1).clamp(min=0)
            rows = self.request_rows[:batch]
            chosen = torch.stack([o.reshape(batch, q, hidden)[rows, last] for o in outs[1:]], dim=1)
            tails[:, 1:].copy_(torch.where(moved[:, None, None], chosen.to(tails.dtype), tails[:, 1:]))
        self.draft_graphs.greedy_into(head.logits(0, selected), bucket.ids[:batch], keep=moved)


def head_loop_factory(
    drafter: object, graphs: CudaGraphs | None, max_context: int, spec: SpeculativeConfig | None
) -> Callable[[int, LoopState], DeviceLoop] | None:
    """How the engine builds a head's loop of a chain length over the loops' shared state (the
    configured chain's, or each chain tier's under adaptive speculation: they share the draft
    graphs' chain buckets, a fresh run seeding them from the requests' head state, a switch of tier
    going on from what the last run left there), or None where a head cannot draft on the device:
    no chain graphs."""
    if not isinstance(drafter, HeadDrafter) or graphs is None or drafter.graphs is None:
        return None
    if not drafter.graphs.chain or spec is None:
        return None
    return lambda num_steps, state: HeadDeviceLoop(graphs, drafter, num_steps, max_context, state)
