#!/usr/bin/env bash
# Stage, on this machine (which has network), the wheels bench/gpu_check.sh installs on the GPU machine (no network).
#
# The GPU machine's image (see /work/.library/device/KINDS.md) has Python 3.12, torch 2.11+cu130, nvcc 13.0, ninja,
# numpy, einops, tabulate, click, requests, packaging, nvidia-ml-py and cuda-bindings. What `import flashinfer` and
# FlashInfer's FA2 JIT kernels need beyond that is two wheels:
#   flashinfer-python 0.7.2.post1   pure Python + CUDA sources, 62 MB (59.2 MiB)
#   apache-tvm-ffi 0.1.15.post2     cp312 manylinux, 3.3 MB (FlashInfer's kernel bindings)
# (its other declared deps - cutlass-dsl, cudnn-frontend, nccl4py, cuda-tile, ... - serve other kernels; they are
# imported lazily and are not needed for the paged prefill/decode wrappers.)
#
# The device tool carries at most 64 MiB per call (working tree + carried paths), so:
#   default   re-compress the flashinfer wheel with LZMA (same files, a valid wheel pip installs; 62 -> 48 MB,
#             about 2-3 minutes here) and put both wheels in bench/gpu_wheels/: ONE call carries them
#             (carry=["bench/gpu_wheels"]).
#   --split   keep the original wheel: bench/gpu_wheels/part1/ holds flashinfer (59 MiB, one call on its own),
#             bench/gpu_wheels/part2/ the rest; TWO calls, the second at once while the machine is still warm
#             (see the header of bench/gpu_check.sh).
# bench/gpu_wheels/ is git-ignored.
set -euo pipefail
cd "$(dirname "$0")/.."
FI_VERSION=0.7.2.post1
TVM_FFI_VERSION=0.1.15.post2
DEST=bench/gpu_wheels
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
split=0
[ "${1:-}" = "--split" ] && split=1

rm -rf "$DEST"
mkdir -p "$DEST/download"
$PY -m pip download -q --no-deps --only-binary=:all: -d "$DEST/download" "flashinfer-python==$FI_VERSION"
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    -d "$DEST/download" "apache-tvm-ffi==$TVM_FFI_VERSION"
FI_WHEEL="$DEST/download/flashinfer_python-$FI_VERSION-py3-none-any.whl"

if [ $split = 1 ]; then
    mkdir -p "$DEST/part1" "$DEST/part2"
    mv "$FI_WHEEL" "$DEST/part1/"
    mv "$DEST"/download/*.whl "$DEST/part2/"
else
    echo "re-compressing $(basename "$FI_WHEEL") with LZMA (a few minutes)..."
    $PY - "$FI_WHEEL" "$DEST/$(basename "$FI_WHEEL")" <<'EOF'
import sys
import zipfile

src, dst = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", compression=zipfile.ZIP_LZMA) as zout:
    for info in zin.infolist():  # same names, contents and modes; RECORD hashes stay valid
        out = zipfile.ZipInfo(info.filename, date_time=info.date_time)
        out.external_attr = info.external_attr
        out.compress_type = zipfile.ZIP_LZMA
        zout.writestr(out, zin.read(info))
EOF
    mv "$DEST"/download/apache_tvm_ffi-*.whl "$DEST/"
fi
rm -rf "$DEST/download"

tree_bytes=$(git ls-files -co --exclude-standard -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
echo
find "$DEST" -name '*.whl' -exec du -b {} + | awk '{printf "%8.1f MiB  %s\n", $1 / 1048576, $2}'
awk -v b="$tree_bytes" 'BEGIN { printf "working tree that travels with every call: %.1f MiB (limit: 64 MiB per call, wheels included)\n", b / 1048576 }'
if [ $split = 1 ]; then
    cat <<'EOF'
Two device calls, the second right after the first (a machine idle for 30 s is given back, and a fresh one is bare):
  run(command="ls -la bench/gpu_wheels/part1", carry=["bench/gpu_wheels/part1"], timeout_s=60)
  run(command="bash bench/gpu_check.sh", carry=["bench/gpu_wheels/part2"], timeout_s=600)
EOF
else
    cat <<'EOF'
One device call:
  run(command="bash bench/gpu_check.sh", carry=["bench/gpu_wheels"], timeout_s=600)
EOF
fi
