#!/usr/bin/env bash
# On the lent GPU machine: an A/B of the adaptive engine in one call, where runs of separate calls
# swing too much to compare (docs/benchmarks.md, fifteenth session). `specserve bench offline` runs
# the static configurations and adaptive with this tree (A), then adaptive alone with the files of
# VARIANT swapped in (B), on each data set; scripts/adaptive_targets.py judges both against A's
# static rows.
#
# VARIANT: "PACKAGE_PATH=FILE ..." (e.g. "specserve/engine/adaptive_control.py=.devcarry/b.py"),
# files carried in .devcarry/. Environment as scripts/adaptive_gpu.sh: BATCHES (default 4,16,64),
# DATASETS ("mt-bench mixed"), STATIC, ADAPTIVE, REPEATS (2), MIN_BATCHES (4), NEW_TOKENS (256).
set -uo pipefail
OUT=${OUT:-/tmp/specserve-out}
OUT=$OUT SKIP_GPU_TESTS=1 SKIP_KERNELS=1 SKIP_BENCH=1 bash scripts/gpu_check.sh > "$OUT/setup.log" 2>&1
export PYTHONPATH=/tmp/site SPECSERVE_CACHE=$HOME/spcache PYTHONUNBUFFERED=1
mkdir -p /tmp/ab/a
static=(); for spec in ${STATIC:-ngram:1 ngram:2 ngram:4 ngram:8}; do static+=(--spec "$spec"); done
adaptive=(--spec "${ADAPTIVE:-ngram:adaptive-8}")
swap() {  # $1: a or b
  for pair in ${VARIANT:?VARIANT names the files of B}; do
    target=/tmp/site/${pair%%=*}
    [ -f /tmp/ab/a/$(basename "$target") ] || cp "$target" /tmp/ab/a/
    if [ "$1" = b ]; then cp "${pair#*=}" "$target"; else cp /tmp/ab/a/$(basename "$target") "$target"; fi
  done
}
for dataset in ${DATASETS:-mt-bench mixed}; do
  data=$dataset; [ "$dataset" = mixed ] && data=.devcarry/mixed.jsonl.gz
  for variant in a b; do
    swap $variant
    specs=("${adaptive[@]}"); [ $variant = a ] && specs=("${static[@]}" "${adaptive[@]}")
    python3 -P -m specserve.cli bench offline --dataset "$data" --batch-sizes "${BATCHES:-4,16,64}" \
      --max-new-tokens "${NEW_TOKENS:-256}" --repeats "${REPEATS:-2}" --min-batches "${MIN_BATCHES:-4}" \
      "${specs[@]}" --out "$OUT/$variant-$dataset.json" 2>&1 | grep -E "^specserve|^adaptive" | cut -c1-700 \
      > "$OUT/$variant-$dataset.log"
  done
  swap a
done
# B's adaptive rows judged against A's static rows of the same call
for dataset in ${DATASETS:-mt-bench mixed}; do
  python3 - "$OUT/a-$dataset.json" "$OUT/b-$dataset.json" "$OUT/b+static-$dataset.json" <<'PY'
import json, sys
sys.path.insert(0, "scripts")
from adaptive_targets import is_adaptive
a, b = (json.load(open(p)) for p in sys.argv[1:3])
adaptive = [r for r in b["rows"] if is_adaptive(r["system"])]
for r in adaptive:  # B's rounds ran in another process: no ratio by round against A's
    r["repeat_seconds"] = []
a["rows"] = [r for r in a["rows"] if not is_adaptive(r["system"])] + adaptive
json.dump(a, open(sys.argv[3], "w"))
PY
done
for variant in a b+static; do
  echo "== ${variant%+static}"
  python3 -P scripts/adaptive_targets.py "$OUT"/$variant-*.json 2>&1 | grep -- "-adaptive"
done | tee "$OUT/ab-targets.log"
