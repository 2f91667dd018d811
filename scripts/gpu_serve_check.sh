#!/usr/bin/env bash
# On the lent GPU machine (2 GPUs for STEP=tp/serve): install the carried wheels (.whl/ and the staged ray wheel), put the staged
# model and the carried MT-Bench file where `specserve.assets.pull` looks, then
#   STEP=tp    scripts/tp_check.py: TP=2 over NCCL against TP=1 in-process (agreement, tok/s, draft share)
#   STEP=serve scripts/serve_check.py: TP=2 and TP=1 replicas through Ray Serve, HTTP vs in-process tok/s
#   STEP=online `specserve serve` (SERVE_ARGS), then `specserve bench online` at concurrency ONLINE_LOADS
# Logs and JSON land in $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/specserve-out}
mkdir -p "$OUT"
if [ ! -d /tmp/site/ray ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    ${WHEELS:-.whl}/*.whl ~/staged/*.whl || exit 1
fi
# The checkout must stay off sys.path (its kernels/ would shadow the PyPI package transformers probes for).
rm -rf /tmp/site/specserve /tmp/site/specserve_kernels
cp -r specserve /tmp/site/specserve && cp -r kernels /tmp/site/specserve_kernels
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH SPECSERVE_CACHE=$HOME/spcache PYTHONUNBUFFERED=1
mkdir -p "$SPECSERVE_CACHE/assets/smollm2-135m-instruct" "$SPECSERVE_CACHE/assets/mt-bench"
cp -n ~/staged/SmolLM2-135M-Instruct.Q4_1.gguf "$SPECSERVE_CACHE/assets/smollm2-135m-instruct/"
cp -n .devcarry/question.jsonl "$SPECSERVE_CACHE/assets/mt-bench/"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
case "${STEP:-tp}" in
  tp) python3 -P scripts/tp_check.py --out "$OUT" 2>&1 | grep -v "it/s" | tee "$OUT/tp_check.log" ;;
  serve) python3 -P scripts/serve_check.py --out "$OUT" ${SERVE_ARGS:-} 2>&1 | grep -v "it/s" | tee "$OUT/serve_check.log" ;;
  online)
    python3 -P -m specserve.cli serve --port 8000 ${SERVE_ARGS:-} > "$OUT/serve.log" 2>&1 &
    server=$!
    python3 - <<'PY' || { tail -30 "$OUT/serve.log"; kill $server; exit 1; }
import time, urllib.request
for _ in range(300):
    try:
        urllib.request.urlopen("http://127.0.0.1:8000/health", timeout=2)
        break
    except Exception:
        time.sleep(1)
else:
    raise SystemExit("the server did not come up")
PY
    for c in ${ONLINE_LOADS:-1 16 64}; do
      python3 -P -m specserve.cli bench online --url http://127.0.0.1:8000 --endpoint generate --concurrency "$c" \
        --num-requests $((c < 4 ? 8 : 4 * c)) --max-seconds 150 --max-new-tokens 256 --ignore-eos \
        --out "$OUT/online-c$c.json" 2>&1 | grep -v "it/s" | tee -a "$OUT/online.log"
    done
    kill -INT $server; wait $server ;;
esac
