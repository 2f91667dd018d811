#!/usr/bin/env bash
# On the lent GPU machine (see the device tool's README): install the carried wheels (.whl/), put the
# staged model and the carried MT-Bench file where `specserve.assets.pull` looks, then run the GPU
# tests and `specserve bench` beside HF transformers. Logs and JSON land in $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/specserve-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
# Install by copying (the package maps kernels/ to specserve_kernels); the checkout itself must stay off
# sys.path, hence `python3 -P` below, or its kernels/ would shadow the PyPI package transformers probes for.
rm -rf /tmp/site/specserve /tmp/site/specserve_kernels
cp -r specserve /tmp/site/specserve && cp -r kernels /tmp/site/specserve_kernels
export PYTHONPATH=/tmp/site SPECSERVE_CACHE=$HOME/spcache SPECSERVE_REPORT_DIR=$OUT PYTHONUNBUFFERED=1
mkdir -p "$SPECSERVE_CACHE/assets/smollm2-135m-instruct" "$SPECSERVE_CACHE/assets/mt-bench"
cp ~/staged/SmolLM2-135M-Instruct.Q4_1.gguf "$SPECSERVE_CACHE/assets/smollm2-135m-instruct/"
cp .devcarry/question.jsonl "$SPECSERVE_CACHE/assets/mt-bench/"
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv | tee "$OUT/gpu.txt"
[ -n "${PROFILE:-}" ] && python3 -P scripts/profile_step.py 2>&1 | tee "$OUT/profile.log"
# PROFILE_SPEC="eagle3:5x8x32:.devcarry/heads/eagle3" (--spec strings, ";" between several): where a
# speculative step's time goes.
IFS=';' read -ra PROFILE_SPECS <<< "${PROFILE_SPEC:-}"
for spec in "${PROFILE_SPECS[@]}"; do
  SPEC="$spec" python3 -P scripts/profile_spec.py 2>&1 | tee -a "$OUT/profile_spec.log"
done
[ -z "${SKIP_GPU_TESTS:-}" ] && python3 -P -m pytest -m gpu -s -q -p no:cacheprovider tests/test_gpu.py tests/test_sampler.py tests/test_hybrid.py tests/test_host_copy.py 2>&1 | tee "$OUT/gpu_tests.log"
# The Triton kernels natively (and the CUDA graphs against eager steps), against their torch references on fresh random inputs; the Triton
# attention backend against the torch one (tiny model and SmolLM2), the optional flash backend against it
# (skipped with the reason where vllm-flash-attn does not import); then the kernel micro-benchmarks.
if [ -z "${SKIP_KERNELS:-}" ]; then
  # KERNEL_TESTS narrows the set (e.g. to tests/test_cuda_graphs.py); SKIP_KERNEL_BENCH skips the micro-benchmarks.
  python3 -P -m pytest -q -s -p no:cacheprovider ${KERNEL_TESTS:-tests/test_kernel_*.py tests/test_triton_backend.py tests/test_flash_backend.py tests/test_cuda_graphs.py} \
    --ignore=tests/test_kernel_bench.py 2>&1 | tee "$OUT/kernel_tests.log"
  [ -z "${SKIP_KERNEL_BENCH:-}" ] && python3 -P -m pytest -q -s -p no:cacheprovider -m gpu tests/test_kernel_bench.py 2>&1 | tee "$OUT/kernel_bench.log"
fi
# The offline bench: plain and n-gram engines over one load of the model, HF generate beside them;
# bench.json, bench.png (tok/s vs batch size) and the log land in $OUT. BENCH_ARGS adds flags
# (e.g. "--spec ngram:2 --dataset sharegpt"); SPECSERVE_COMMIT names the commit (this copy has no git).
[ -z "${SKIP_BENCH:-}" ] && python3 -P -m specserve.cli bench offline --batch-sizes "${BENCH_BATCHES:-1,16,80}" \
  --max-new-tokens 256 --peer hf --spec ngram:4 ${BENCH_ARGS:-} --out "$OUT/bench.json" 2>&1 \
  | grep -v "it/s" | tee "$OUT/bench.log"
