#!/usr/bin/env bash
# The GPU check of issue 5, in one go, on an H200 machine with NO network (under 10 minutes):
#   1. install FlashInfer from the wheels beside this script (bench/gpu_wheels/, into /tmp/kvllm_site: nothing
#      system-wide; the image's own torch 2.11+cu130 / nvcc 13.0 / ninja are used),
#   2. JIT-compile the two FlashInfer modules kvllm uses (batch prefill - also tensor-core decode - and batch
#      decode; bf16, head_dim 128) in parallel, once, so the timings below never include compilation,
#   3. GPU tests: pytest tests/test_flashinfer_backend.py (+ tests/test_attention_selection.py),
#   4. bench/gpu_decode_bench.py: decode TPOT and tok/s at batch 1/16/64/256 on a Llama-3-8B-shaped model with random
#      bf16 weights and 4k-token contexts, achieved HBM bandwidth against a measured copy bandwidth, and Kara's
#      compression time per round (|W| = 512).
# Everything printed also goes to $OUT/gpu_check.log, the benchmark table to $OUT/gpu_bench.md (when $OUT is set, as
# it is on the device machine). Copy the table into docs/benchmarks.md with the date and card.
#
# HOW THE WHEELS GET THERE. The device machine cannot download; the device tool carries at most 64 MiB per call
# (working tree + carried paths), and the flashinfer-python wheel alone is 62 MB. So, on the machine with network:
#     bash bench/stage_gpu_wheels.sh
# downloads flashinfer-python 0.7.2.post1 + apache-tvm-ffi 0.1.15.post2 (cp312) into bench/gpu_wheels/ (git-ignored)
# and re-compresses the flashinfer wheel with LZMA (same files, 48 MB), so ONE call carries everything:
#     run(command="bash bench/gpu_check.sh", carry=["bench/gpu_wheels"], timeout_s=600)
# If the tree grows past what fits beside them (the stage script prints the sizes), stage with --split instead:
# bench/gpu_wheels/part1 (the original flashinfer wheel) and part2 (the rest) go over TWO calls; an ignored path
# carried by one call stays on the machine while it is warm (30 s idle), so make the second call at once:
#     run(command="ls -la bench/gpu_wheels/part1", carry=["bench/gpu_wheels/part1"], timeout_s=60)
#     run(command="bash bench/gpu_check.sh", carry=["bench/gpu_wheels/part2"], timeout_s=600)
# (If the machine went back in between, the second call finds no part1 and stops at step 1: start over.)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/kvllm_gpu_out}"
mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1
SITE=/tmp/kvllm_site
BUDGET=${BUDGET:-570}  # seconds for the whole script (the device tool's limit is 600 per call)
start=$SECONDS
phase() { echo; echo "=== [$((SECONDS - start)) s] $*"; }
left() { local t=$((BUDGET - (SECONDS - start))); echo $((t > 1 ? t : 1)); }

main() {
phase "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name(0))" || exit 1
(nvcc --version | tail -2) || echo "no nvcc on PATH: FlashInfer's JIT will fail"

phase "install FlashInfer from bench/gpu_wheels"
mapfile -t WHEELS < <(find bench/gpu_wheels -name '*.whl' 2>/dev/null | sort)
if [ ${#WHEELS[@]} -lt 2 ]; then
    echo "expected the flashinfer-python and apache-tvm-ffi wheels under bench/gpu_wheels, found: ${WHEELS[*]:-none}"
    echo "stage them with bench/stage_gpu_wheels.sh and carry bench/gpu_wheels (see this script's header)"
    exit 2
fi
printf '  %s\n' "${WHEELS[@]}"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${WHEELS[@]}" \
    || exit 3
export PYTHONPATH="$SITE:$PWD"
python3 -c "import flashinfer, tvm_ffi; print('flashinfer', flashinfer.__version__, '| tvm_ffi', tvm_ffi.__version__)" \
    || exit 4

phase "JIT-compile FlashInfer batch prefill + batch decode (bf16, head_dim 128), in parallel"
cat > /tmp/kvllm_jit_warm.py <<'EOF'
import sys, time
import torch
from engine.attention.base import build_metadata
from engine.attention.flashinfer import FlashInferBackend

kind = sys.argv[1]  # "prefill": paged prefill (also the tensor-core decode kernel); "decode": CUDA-core decode
t0 = time.time()
fi = FlashInferBackend("cuda")
hq, hkv, d = 8, 2, 128
q_len = 5 if kind == "prefill" else 1
cache = torch.zeros(4, 2, 16, hkv, d, dtype=torch.bfloat16, device="cuda")
meta = build_metadata([[2, 0]], [q_len], [20], 16, "cuda")
fi.plan(meta, hq, hkv, d, torch.bfloat16)
q, k, v = (torch.randn(q_len, h, d, dtype=torch.bfloat16, device="cuda") for h in (hq, hkv, hkv))
fi.forward(q, k, v, cache, meta, d ** -0.5)
torch.cuda.synchronize()
print(f"  {kind} module ready in {time.time() - t0:.0f} s")
EOF
timeout "$(left)" python3 /tmp/kvllm_jit_warm.py prefill &
p1=$!
timeout "$(left)" python3 /tmp/kvllm_jit_warm.py decode &
p2=$!
wait $p1; r1=$?
wait $p2; r2=$?
if [ $r1 != 0 ] || [ $r2 != 0 ]; then
    echo "JIT compilation failed (prefill rc=$r1, decode rc=$r2); see ~/.cache/flashinfer/*/flashinfer_jit.log"
    tail -50 ~/.cache/flashinfer/*/flashinfer_jit.log 2>/dev/null
    exit 5
fi

phase "GPU tests"
t=$(left); [ "$t" -gt 240 ] && t=240
timeout "$t" python3 -m pytest -q -p no:cacheprovider -rs tests/test_flashinfer_backend.py tests/test_attention_selection.py
tests_rc=$?
echo "pytest exit code: $tests_rc"

phase "decode + Kara benchmark"
timeout "$(left)" python3 bench/gpu_decode_bench.py
bench_rc=$?
echo "benchmark exit code: $bench_rc"

phase "done (tests rc=$tests_rc, bench rc=$bench_rc)"
[ $tests_rc = 0 ] && [ $bench_rc = 0 ]
}

main 2>&1 | tee "$OUT/gpu_check.log"
exit "${PIPESTATUS[0]}"
