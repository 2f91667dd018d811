#!/usr/bin/env bash
# On the lent GPU machine, in one call of at most 10 minutes: the target (SmolLM2-135M-Instruct) answers
# ShareGPT prompts (first turns, or every turn with its context: PROMPTS below), an EAGLE-3 head and then
# (if time is left) a chain-MTP head are trained on those answers, and each is measured on MT-Bench (accept
# length, per-position acceptance; greedy and T=0.7; a tree shape where the engine has trees; the n-gram
# drafter beside them). docs/draft-training.md.
#
# Needs (carried): .whl/ (the gguf wheel), .devcarry/question.jsonl (MT-Bench) and
# .devcarry/train/prompts.jsonl.gz (ShareGPT prompts, written here by
# `specserve train-draft --phase prompts --data sharegpt --out .devcarry/train`); the GGUF in ~/staged/.
# Comes back in $OUT (8 files at most): results.json, train.log, eagle3/ and mtp/ (config.json +
# model.safetensors each: the head folders `--speculative METHOD --draft-model DIR` loads).
#
# Knobs (minutes are wall budgets of each phase's own work; loading and start-up come on top):
#   DATA_MINUTES=2 WORKERS=4 EAGLE3_MINUTES=2.5 MTP_MINUTES=1.25 METHODS="eagle3 mtp"
#   EAGLE3_ARGS / MTP_ARGS: extra train-draft flags, e.g. EAGLE3_ARGS="--draft-vocab 4096 --intermediate-size 768"
#   or, to train a carried head further, EAGLE3_ARGS="--init-from .devcarry/heads/eagle3 --lr 3e-4 --min-lr-ratio 0.2"
#   DEVICE=cpu SMOKE=1: a few steps of everything on the CPU, to check the script itself.
#   EVAL_TOKENS=128: new tokens per MT-Bench prompt in each evaluation.
#   GEN_BATCH=64: requests each data worker decodes together. The first run's 4 workers x 64 made
#   6.4k answer tokens/s in all, where one engine alone decodes 20k tok/s at batch 64: processes
#   time-slicing one GPU; WORKERS=1 GEN_BATCH=256 is the next thing to try.
#   GPU_TEST=1: run tests/test_train_draft.py's gpu-marked test first.
#   KEEP_DATA=1: copy the answers (responses-W.npz, token ids only) to $OUT/data/, to carry to a later call.
#   GEN_TEMPERATURE=0.8: sampled answers, not greedy ones (a second look at the target's distribution
#   over the same prompts, where greedy answers to every prompt are already in hand).
#   PROMPTS=FILE: the prompts the data workers answer (default .devcarry/train/prompts.jsonl.gz, ShareGPT first
#   turns). Every ShareGPT turn with the conversation before it: write the file once on the development machine,
#   `specserve train-draft --phase prompts --data sharegpt-turns --out .devcarry/turns`, then
#   PROMPTS=.devcarry/turns/prompts.jsonl.gz. Answers belong to their prompts file (prompt indices): DATA_IN
#   files made for another one are refused, or, written before files recorded it, silently skip those indices.
#   DATA_IN=DIR: DIR/responses-W.npz (a KEEP_DATA run's, same WORKERS) seed worker W's file, so its
#   generation resumes after the prompts already answered instead of answering them again.
#   RESPONSES_IN=a.npz,b.npz: train on these answers (e.g. a previous call's, carried) as well as on
#   those generated now; DATA_MINUTES=0 generates none.
#   SPECSERVE_TRAIN_PROFILE=N: log a torch.profiler table of training step N (where a step's time goes).
#   A budget longer than one call: RESUME=1 keeps $WORK (the warm machine's disk) from the last call,
#   SESSION_MINUTES=M ends this call's training after M minutes (the schedule stays the method's
#   *_MINUTES, the whole budget), NO_EVAL=1 skips the evaluation. E.g. EAGLE3_MINUTES=25 with
#   SESSION_MINUTES=8.5 NO_EVAL=1, then RESUME=1 twice more, the last without NO_EVAL.
#   Each head's training/log.jsonl comes back beside it.
set -uo pipefail
START=$SECONDS
LIMIT=${LIMIT:-570}  # seconds this script may take in all (the call's limit is 600)
OUT=${OUT:-/tmp/specserve-out}
WORK=${WORK:-/tmp/train-heads}
DEVICE=${DEVICE:-auto}
DATA_MINUTES=${DATA_MINUTES:-2}
WORKERS=${WORKERS:-4}
EAGLE3_MINUTES=${EAGLE3_MINUTES:-2.5}
MTP_MINUTES=${MTP_MINUTES:-1.25}
METHODS=${METHODS-eagle3 mtp}  # set but empty: no training (data only)
PROMPTS=${PROMPTS:-.devcarry/train/prompts.jsonl.gz}
mkdir -p "$OUT" "$WORK"
[ -z "${RESUME:-}" ] && rm -rf "${WORK:?}"/*
exec > >(tee "$OUT/train.log") 2>&1

if [ -d "$HOME/staged" ]; then  # the GPU machine: carried wheels and staged assets, as scripts/gpu_check.sh
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  rm -rf /tmp/site/specserve /tmp/site/specserve_kernels
  cp -r specserve /tmp/site/specserve && cp -r kernels /tmp/site/specserve_kernels
  export PYTHONPATH=/tmp/site SPECSERVE_CACHE=$HOME/spcache
  mkdir -p "$SPECSERVE_CACHE/assets/smollm2-135m-instruct" "$SPECSERVE_CACHE/assets/mt-bench"
  cp ~/staged/SmolLM2-135M-Instruct.Q4_1.gguf "$SPECSERVE_CACHE/assets/smollm2-135m-instruct/"
  cp .devcarry/question.jsonl "$SPECSERVE_CACHE/assets/mt-bench/"
  nvidia-smi --query-gpu=name,memory.total --format=csv
fi
export PYTHONUNBUFFERED=1
TRAIN=(python3 -P -m specserve.cli train-draft --device "$DEVICE" --no-progress)
# 128 new tokens per MT-Bench prompt: the first run's evaluation at 256 used up the call before MTP trained.
EVAL=(--eval-steps 5 --eval-temperatures 0,0.7 --eval-tree 8:32 --eval-tree 4:16 --eval-max-new-tokens "${EVAL_TOKENS:-128}")
STEPS=()
DATA=(--gen-batch "${GEN_BATCH:-64}" --gen-temperature "${GEN_TEMPERATURE:-0}")
if [ -n "${SMOKE:-}" ]; then  # every phase, tiny: checks the script, measures nothing
  DATA+=(--num-prompts 8 --max-new-tokens 24)
  STEPS=(--max-steps 2 --tokens-per-batch 1024)
  EVAL+=(--eval-prompts 4 --eval-max-new-tokens 16)
  WORKERS=2
fi

left() { echo $((LIMIT - (SECONDS - START))); }

# GPU_TEST=1: first the trainer's CUDA test (bf16, autocast, fused attention; about 30 s).
[ -n "${GPU_TEST:-}" ] && python3 -P -m pytest -m gpu -q -p no:cacheprovider tests/test_train_draft.py

RESPONSES=()
if [ -n "${RESPONSES_IN:-}" ]; then  # answers carried from an earlier call, beside any made now
  IFS=, read -ra given <<<"$RESPONSES_IN"
  for f in "${given[@]}"; do
    cp "$f" "$WORK/carried-${#RESPONSES[@]}.npz" && RESPONSES+=("$WORK/carried-${#RESPONSES[@]}.npz")
  done
  echo "== data: ${#RESPONSES[@]} carried files"
fi
if [ "$DATA_MINUTES" != "0" ]; then
  echo "== data: $WORKERS workers, ${DATA_MINUTES} min"
  PIDS=()
  for ((w = 0; w < WORKERS; w++)); do
    RESPONSES+=("$WORK/responses-$w.npz")
    [ -n "${DATA_IN:-}" ] && [ -f "$DATA_IN/responses-$w.npz" ] && cp "$DATA_IN/responses-$w.npz" "$WORK/"
    "${TRAIN[@]}" --phase data --data "$PROMPTS" --shard "$w/$WORKERS" --responses "$WORK/responses-$w.npz" \
      --data-minutes "$DATA_MINUTES" --out "$WORK" ${DATA[@]+"${DATA[@]}"} &
    PIDS+=($!)
  done
  wait "${PIDS[@]}"  # by id: a bare `wait` would also wait for the log's tee, which never ends
fi
ALL=$(IFS=,; echo "${RESPONSES[*]}")
echo "== data done at $((SECONDS - START))s"
if [ -n "${KEEP_DATA:-}" ]; then mkdir -p "$OUT/data" && cp "$WORK"/responses-*.npz "$OUT/data/"; fi

for method in $METHODS; do
  case $method in
    eagle3) minutes=$EAGLE3_MINUTES; extra=(--eval-ngram ${EAGLE3_ARGS:-}) ;;
    mtp) minutes=$MTP_MINUTES; extra=(--num-modules 2 --intermediate-size 768 ${MTP_ARGS:-}) ;;
    *) minutes=1; extra=() ;;
  esac
  # Loading, evaluation and export take about 90 s past the training budget.
  session=${SESSION_MINUTES:-$minutes}
  tail_s=90
  [ -n "${NO_EVAL:-}" ] && tail_s=30
  need=$(python3 -c "print(int($session * 60 + $tail_s))")
  if [ "$(left)" -lt "$need" ]; then
    echo "== $method skipped: $(left)s left, needs about ${need}s"
    continue
  fi
  phases=train,eval
  [ -n "${NO_EVAL:-}" ] && phases=train
  echo "== $method: train ${session} of ${minutes} min ($phases)"
  "${TRAIN[@]}" --phase "$phases" --method "$method" --responses "$ALL" --out "$WORK/$method" \
    --max-minutes "$minutes" --session-minutes "$session" --lr 5e-4 --checkpoint-every 500 \
    ${STEPS[@]+"${STEPS[@]}"} "${EVAL[@]}" "${extra[@]}"
  mkdir -p "$OUT/$method"
  cp "$WORK/$method/config.json" "$WORK/$method/model.safetensors" "$WORK/$method/training/log.jsonl" \
    "$OUT/$method/" 2>/dev/null
done

# results.json: data, training and acceptance of every head, in one file.
python3 - "$WORK" "$OUT/results.json" "$((SECONDS - START))" <<'EOF'
import json, sys
from pathlib import Path

import numpy as np

work, out, seconds = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
data = {"samples": 0, "tokens": 0, "answer_tokens": 0}
for path in sorted(work.glob("*.npz")):  # carried and generated answers
    with np.load(path) as f:
        data["samples"] += len(f["lengths"])
        data["tokens"] += int(f["lengths"].sum())
        data["answer_tokens"] += int(f["lengths"].sum() - f["prompt_lens"].sum())
results = {"data": data, "script_seconds": seconds, "heads": {}}
for folder in sorted(p for p in work.iterdir() if (p / "config.json").is_file()):
    log_file = folder / "training" / "log.jsonl"
    log = log_file.read_text().splitlines() if log_file.is_file() else []
    head = {
        "size_bytes": (folder / "model.safetensors").stat().st_size,
        "recipe": json.loads((folder / "config.json").read_text()).get("specserve", {}).get("recipe"),
        "last_log": json.loads(log[-1]) if log else None,
    }
    if (folder / "eval.json").is_file():
        head["eval"] = json.loads((folder / "eval.json").read_text())["reports"]
    results["heads"][folder.name] = head
out.write_text(json.dumps(results, indent=2))
for name, head in results["heads"].items():
    for r in head.get("eval", []):
        if "accept_length" in r:
            spec = r["speculative"]
            print(f"{name}: {spec['method']} topk {spec.get('topk', 1)} T={r['temperature']}: "
                  f"accept {r['accept_length']:.2f}  per position {[round(a, 2) for a in r['per_position']]}")
print(f"results: {out} ({seconds}s)")
EOF
