"""Teacher-forced agreement of a draft head with its target, by position in the answer.

Where in an answer does a head fall short? `unrolled_loss` scores each chain step's argmax against
the target's over samples cut at each `--cuts` answer length; differencing consecutive cuts gives
the agreement inside each window (docs/draft-training.md, tenth and eleventh GPU runs).

    python -P scripts/head_agreement.py RESPONSES.npz HEAD_DIR [--samples 60] [--min-answer 200]
        [--cuts 32,64,128,256] [--max-prompt 300] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from specserve.model.head_checkpoint import head_method, load_head
from specserve.model.loader import load_model
from specserve.train.data import Samples, cut_loops, load_samples
from specserve.train.dataset import make_batch
from specserve.train.unroll import unrolled_loss


def _cut(samples: Samples, idx: np.ndarray, answer_len: int) -> Samples:
    lens = np.minimum(samples.lengths[idx], samples.prompt_lens[idx] + answer_len)
    tokens = np.concatenate([samples.sample(i)[:n] for i, n in zip(idx, lens, strict=True)])
    return Samples(tokens, lens, samples.prompt_lens[idx], samples.prompt_index[idx], samples.meta)


def agreement(head, target, samples: Samples, steps: int, device) -> tuple[np.ndarray, np.ndarray]:
    """Per chain step: the share of answer positions where head and target agree, and their count."""
    batch = make_batch(samples, np.arange(len(samples)), int(samples.lengths.max()), device)
    result = unrolled_loss(head, target, batch, steps, 0.8)
    return np.array(result.step_accuracy), np.array(result.positions)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("responses", help="a responses/answers .npz of the target's answers")
    p.add_argument("head", help="a head folder")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--samples", type=int, default=60)
    p.add_argument("--min-answer", type=int, default=200, help="answers shorter than this are skipped")
    p.add_argument("--max-prompt", type=int, default=300, help="prompts longer than this are skipped")
    p.add_argument("--cuts", default="32,64,128,256", help="answer lengths bounding the windows")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    device = torch.device(args.device)
    torch.set_grad_enabled(False)
    loaded = load_model(args.model, device=args.device, dtype=torch.float32)
    method = head_method(json.loads((Path(args.head) / "config.json").read_text()))
    head = load_head(args.head, method, loaded.model, device, torch.float32)
    samples = cut_loops(load_samples(args.responses), 16)
    answers = samples.lengths - samples.prompt_lens
    keep = (samples.prompt_lens <= args.max_prompt) & (answers >= args.min_answer)
    idx = np.nonzero(keep)[0][: args.samples]
    print(f"{args.responses}: {len(idx)} samples, mean prompt {samples.prompt_lens[idx].mean():.0f} tokens")
    low, before, count = 0, 0.0, 0
    for cut in map(int, args.cuts.split(",")):
        acc, n = agreement(head, loaded.model, _cut(samples, idx, cut), args.steps, device)
        inside = (acc * n - before * count) / np.maximum(n - count, 1)
        print(
            f"answer tokens [{low}, {cut}): agreement per step {np.round(inside, 3).tolist()} ({int((n - count)[0])} positions)"
        )
        low, before, count = cut, acc, n


if __name__ == "__main__":
    main()
