"""Overlap scheduling: a step launched on the device whose sampled tokens the host collects later.

With overlap on, the engine schedules and launches step n+1 before it reads step n's tokens, so the
host's scheduling, input building and output processing run while the device computes. Step n+1's
input for a request still waiting on its step-n token is a FUTURE_TOKEN in the request's
`token_ids`, sent as -(row + 1) and resolved on the device from step n's sampled-token tensor
(`resolve_future_ids`). A request that stops at step n (EOS, a stop string) has one wasted row in
step n+1, discarded when that step is settled; one that reaches its token limit is `settling` and
not scheduled again. A step whose requests want logprobs scores its rows at launch, before the next
step reuses its logits, and copies them to the host with its tokens (`PendingLogprobs`): the host
reads them when it settles the step, as it reads the tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.engine.logprobs import PendingLogprobs
from specserve.engine.scheduler import ScheduledItem
from specserve.engine.step_input import StepInput


@dataclass
class InFlight:
    """A launched step: its inputs, its sampled tokens on the device and their host copy in flight."""

    items: list[ScheduledItem]
    inp: StepInput
    tokens: torch.Tensor  # [S] one sampled token per sample item, on the device
    host: torch.Tensor  # its copy on the host (valid once `done` has completed)
    done: torch.cuda.Event | None
    rows: dict[str, int]  # request id -> its row of `tokens`
    logprobs: PendingLogprobs | None  # its rows' logprobs, scored at launch, copying to the host

    @classmethod
    def start(
        cls,
        items: list[ScheduledItem],
        inp: StepInput,
        tokens: torch.Tensor,
        logprobs: PendingLogprobs | None,
    ) -> InFlight:
        done = None
        host = tokens
        if tokens.is_cuda:
            host = tokens.to("cpu", non_blocking=True)  # pinned, so the copy is truly asynchronous
            done = torch.cuda.Event()
            done.record()
        rows = {items[index].request.request_id: row for row, index in enumerate(inp.sample_items)}
        return cls(items, inp, tokens, host, done, rows, logprobs)

    def future(self) -> torch.Tensor | None:
        """What the next step resolves its FUTURE_TOKEN ids from (None: this step samples nothing)."""
        return self.tokens if self.tokens.numel() else None

    def sampled(self) -> dict[int, int]:
        """Item index -> its sampled token; waits for the copy."""
        if self.done is not None:
            self.done.synchronize()
        return dict(zip(self.inp.sample_items, self.host.tolist(), strict=True))
