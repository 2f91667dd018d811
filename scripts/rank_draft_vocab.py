"""The token ranking shipped beside a draft head (`draft_vocab.safetensors`): the target's token ids
by how often they occur in answers, most frequent first, from which `speculative.draft_vocab` = N
cuts a draft vocabulary at load (docs/speculative.md).

The answers are ShareGPT's (the `sharegpt` asset): every assistant turn, each distinct text once,
tokenized as `specserve train-draft --phase answers` reads them after the chat template's assistant
opening (cut at `--max-answer-tokens`, else closed by the end-of-turn token the target stops on, which
is counted too). Only answer tokens are counted: prompts never come out of a draft head. Ids never
seen are left out, so N is at most the ids the file holds. The metadata records the data, the counts
and the coverage (share of counted answer tokens inside the top N) for a few N.

    python -P scripts/rank_draft_vocab.py [--target smollm2-135m-instruct] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

COVERAGE_SIZES = (4096, 8192, 16384, 32768)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2-135m-instruct", help="the target model's asset name")
    parser.add_argument("--max-answer-tokens", type=int, default=2048, help="answers are cut here")
    parser.add_argument("--out", default=None, help="default: the target's shipped head folder")
    args = parser.parse_args()

    from specserve.assets import dataset_path, resolve_model
    from specserve.default_drafter import HEADS_DIR
    from specserve.model.head_checkpoint import save_ranking
    from specserve.model.hf_loader import DRAFT_VOCAB_FILE
    from specserve.model.tokenizer import load_tokenizer
    from specserve.train.answers import answer_token_counts, sharegpt_answers
    from specserve.train.dataset import token_ranking

    location = resolve_model(args.target)
    tokenizer = load_tokenizer(location.path)
    answers = sharegpt_answers(dataset_path("sharegpt"))
    counts = answer_token_counts(
        tokenizer, answers, vocab=len(tokenizer), max_answer_tokens=args.max_answer_tokens
    )
    ranking = token_ranking(counts)[: int((counts > 0).sum())]
    coverage = {n: round(float(counts[ranking[:n]].sum() / counts.sum()), 5) for n in COVERAGE_SIZES}
    metadata = {
        "target": location.name,
        "data": "sharegpt: every distinct assistant turn (specserve/train/answers.py: sharegpt_answers)",
        "answers": str(len(answers)),
        "answer_tokens": str(int(counts.sum())),
        "max_answer_tokens": str(args.max_answer_tokens),
        "end_token": str(tokenizer.eos_token),
        "ids": str(len(ranking)),
        "coverage": json.dumps(coverage),
        "made_by": "scripts/rank_draft_vocab.py",
    }
    out = Path(args.out) if args.out else HEADS_DIR / location.name / DRAFT_VOCAB_FILE
    save_ranking(out, torch.from_numpy(ranking.astype(np.int64)), metadata)
    print(f"{out}: {len(ranking)} ids from {metadata['answer_tokens']} tokens of {len(answers)} answers")
    for n, share in coverage.items():
        print(f"  top {n:>6}: {100 * share:.2f}% of answer tokens")


if __name__ == "__main__":
    main()
