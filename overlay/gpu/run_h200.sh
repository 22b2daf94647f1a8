#!/usr/bin/env bash
# On a CUDA machine with no network: install carried wheels (.whl/), build or reuse exllamav3's
# extension, build ours (mcg4_moe.cu), then run the GPU checks, the vector generator, the tuner and the
# benchmarks. Results land in $OUT (default ./gpu-out). STEPS picks what runs (default: all).
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
STEPS=${STEPS:-"check method selfcheck vectors breakdown tune kernels bench"}
SITE=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl || exit 1
export PYTHONPATH="$SITE:$PWD/overlay/src" PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=${MAX_JOBS:-16}
# A carried prebuilt extension (exllamav3_ext.so.gz from an earlier run) skips the ~4 min JIT build.
if [ -f .whl/exllamav3_ext.so.gz ]; then gunzip -c .whl/exllamav3_ext.so.gz > "$SITE/exllamav3_ext.so"; fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
start=$(date +%s)
python3 -c "import torch, exllamav3.ext as e; print('exllamav3_ext', e.exllamav3_ext.__file__)" 2>&1 | tail -5 || exit 1
echo "extension ready in $(( $(date +%s) - start )) s"
start=$(date +%s)
python3 -c "from glm53_overlay.exl3 import mcg4_moe; print('mcg4 extension', mcg4_moe.load_extension().__file__)" 2>&1 | tail -20 || exit 1
echo "mcg4 extension ready in $(( $(date +%s) - start )) s"
so=$(ls ~/.cache/torch_extensions/*/exllamav3_ext/exllamav3_ext.so 2>/dev/null | head -1)
[ -n "$so" ] && gzip -c "$so" > "$OUT/exllamav3_ext.so.gz"
for step in $STEPS; do
  echo "== $step"
  case $step in
    check) python3 overlay/gpu/check_cuda_moe.py --out "$OUT" 2>&1 | tee "$OUT/check.log" ;;
    # The CUDA MoE method's test (tests/unit/test_exl3_moe_method.py) with the real kernels: vLLM is not installed
    # here, so its vLLM-layer cases skip and the experts_from_packed -> apply cases run on the GPU.
    method) (cd overlay && python3 -m pytest -q -s -rs -p no:cacheprovider tests/unit/test_exl3_moe_method.py) 2>&1 | tee "$OUT/method.log" ;;
    # The selfcheck's GPU checks, without vLLM (the image runs them through `glm53-overlay selfcheck`).
    selfcheck) python3 -c "
import json
from glm53_overlay import selfcheck as s
checks = [s.run_check(c) for c in (s.check_exl3_cuda_kernels, s.check_exl3_gemm_k4_mcg, s.check_exl3_moe_apply, s.check_exl3_moe_cuda_graph)]
print(json.dumps([c.__dict__ for c in checks], indent=2))" 2>&1 | tee "$OUT/selfcheck_gpu.json" ;;
    vectors) python3 overlay/gpu/make_vectors.py --out "$OUT" 2>&1 | tee "$OUT/vectors.log" ;;
    breakdown) (cd overlay/benchmarks && python3 breakdown.py --out "$OUT") 2>&1 | tee "$OUT/breakdown.log" ;;
    tune) (cd overlay/benchmarks && python3 tune_mcg4.py --out "$OUT") 2>&1 | tee "$OUT/tune.log" ;;
    kernels) (cd overlay/benchmarks && python3 kernel_times.py --out "$OUT") 2>&1 | tee "$OUT/kernel_times.log" ;;
    bench) python3 overlay/benchmarks/bench_moe.py --out "$OUT" ${BENCH_TOKENS:+--tokens $BENCH_TOKENS} 2>&1 | tee "$OUT/bench.log" ;;
  esac
done
