#!/usr/bin/env bash
# On the lent GPU machine (one H100 is enough), issue 9's targets: `specserve bench offline` at batch
# 1, 4, 16, 64 with plain decoding, each static n-gram configuration and the adaptive one over the
# same shapes (off, chains of 1, 2, 4, 8), on MT-Bench and on the mixed workload; then
# scripts/adaptive_targets.py checks the targets. JSON, tables and plots land in $OUT.
#
# Carry (the machine cannot pull data sets): .whl/ (as for gpu_check.sh), .devcarry/question.jsonl
# (MT-Bench) and the mixed prompts file, written here beforehand:
#   python -P -m specserve.bench_data mixed .devcarry/mixed.jsonl.gz
# Environment: BATCHES (default 1,4,16,64), NEW_TOKENS (256), REPEATS (3), MIN_BATCHES (4: each
# batch size runs at least 4 batches back to back, so batch 64 is timed over seconds, not half of
# one, and the policy's moves after the batch size changed weigh less), DATASETS ("mt-bench
# mixed"), STATIC ("ngram:1 ngram:2 ngram:4 ngram:8"), ADAPTIVE ("ngram:adaptive-8"; several, e.g.
# "ngram:adaptive-8 ngram:adaptive-8,patience=8", run variants of the settings side by side),
# BENCH_ARGS (more flags, e.g. "--spec eagle3:5:HEAD --spec eagle3:adaptive-5:HEAD").
set -uo pipefail
OUT=${OUT:-/tmp/specserve-out}
# gpu_check.sh's set-up only (wheels into /tmp/site, the model and MT-Bench into the cache, nvidia-smi).
OUT=$OUT SKIP_GPU_TESTS=1 SKIP_KERNELS=1 SKIP_BENCH=1 bash scripts/gpu_check.sh
export PYTHONPATH=/tmp/site SPECSERVE_CACHE=$HOME/spcache SPECSERVE_REPORT_DIR=$OUT PYTHONUNBUFFERED=1
# The GPU's clocks, power and clock-event reasons every 500 ms while the benches run (UTC timestamps;
# the older driver field name where the newer one is unknown): scripts/bench_rounds.py sets each
# repeat beside them, to tell a slow repeat's device from its host.
CLOCKS=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu
REASONS=clocks_event_reasons.active
nvidia-smi --query-gpu=$REASONS --format=csv,noheader > /dev/null 2>&1 || REASONS=clocks_throttle_reasons.active
# nvidia-smi itself in the background (not a subshell around it), so the trap's kill ends it
TZ=UTC nvidia-smi --query-gpu=$CLOCKS,$REASONS --format=csv,noheader,nounits -lms 500 > "$OUT/gpu_clocks.csv" 2>&1 &
clock_log=$!
trap 'kill $clock_log 2>/dev/null' EXIT
specs=()
for spec in ${STATIC:-ngram:1 ngram:2 ngram:4 ngram:8} ${ADAPTIVE:-ngram:adaptive-8}; do specs+=(--spec "$spec"); done
for dataset in ${DATASETS:-mt-bench mixed}; do
  data=$dataset
  [ "$dataset" = mixed ] && data=.devcarry/mixed.jsonl.gz
  python3 -P -m specserve.cli bench offline --dataset "$data" --batch-sizes "${BATCHES:-1,4,16,64}" \
    --max-new-tokens "${NEW_TOKENS:-256}" --repeats "${REPEATS:-3}" --min-batches "${MIN_BATCHES:-4}" \
    "${specs[@]}" ${BENCH_ARGS:-} \
    --out "$OUT/adaptive-$dataset.json" 2>&1 | grep -v "it/s" | tee "$OUT/adaptive-$dataset.log"
done
python3 -P scripts/adaptive_targets.py "$OUT"/adaptive-*.json 2>&1 | tee "$OUT/adaptive-targets.log"
python3 -P scripts/bench_rounds.py "$OUT"/adaptive-*.json --clocks "$OUT/gpu_clocks.csv" > "$OUT/bench-rounds.log" 2>&1
