"""Training draft heads for a target model by self-distillation (`specserve train-draft`).

- `data.py`: the target answers prompts through the offline engine; token ids saved, resumable.
- `turns.py`: `sharegpt-turns`, every ShareGPT human turn with the conversation before it as a prompt.
- `answers.py`: a data set's own answers as samples (no generation).
- `dataset.py`: length-grouped, token-budgeted batches in a seeded, resumable order; the draft vocabulary.
- `attention.py`: attention contexts over dense batches, with the unrolled chain's mask.
- `unroll.py`: the target pass and the unrolled, per-step loss (EAGLE-3's training-time test, MTP layers).
- `checkpoint.py`: snapshots to resume from, and the exported head folder.
- `trainer.py`: the optimisation loop.
- `evaluate.py`: accept length and per-position acceptance through the engine.
- `cli.py`: the `train-draft` subcommand.

The heads trained are the modules the drafters run (`specserve.model.draft_heads`), saved in the
layout `specserve.model.head_checkpoint` loads.
"""
