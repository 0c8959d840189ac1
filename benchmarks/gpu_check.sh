#!/usr/bin/env bash
# GPU check for kvrecv on one GPU host: builds, runs the GPU tests (the fake
# runtime's and the real-GPU ones), then the GPU throughput benchmark.
# Every step has a timeout; the whole script stays under 5 minutes.
#   bash benchmarks/gpu_check.sh            (from the repository root)
# Environment: KVRECV_CUDART (path of libcudart.so, if not on the loader
# path), UCX_HOME (a CUDA-enabled UCX install to compare against),
# BENCH_SECONDS (per throughput figure, default 5).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SECS=${BENCH_SECONDS:-5}
fail=0
step() { echo; echo "=== $* ==="; }
die() { echo "gpu_check: FAILED: $*" >&2; exit 1; }

step "environment"
command -v nvidia-smi >/dev/null && timeout 20 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || echo "nvidia-smi not found"
if [ -n "${UCX_HOME:-}" ]; then
    export LD_LIBRARY_PATH="$UCX_HOME/lib:${LD_LIBRARY_PATH:-}"
    export PKG_CONFIG_PATH="$UCX_HOME/lib/pkgconfig:${PKG_CONFIG_PATH:-}"
    echo "using UCX from $UCX_HOME"
fi
$PY -c "import numpy, pytest" 2>/dev/null || die "numpy and pytest are needed (pip install numpy pytest pytest-timeout)"

step "build"
timeout 180 env KVRECV_WERROR=1 $PY setup.py -q build_ext --inplace || die "build failed"

step "doctor"
PYTHONPATH=. timeout 60 $PY -m kvrecv doctor || echo "(doctor reported a failed check)"
PYTHONPATH=. timeout 60 $PY -c "
from kvrecv import _core
i = _core.cuda_info()
print('CUDA runtime:', i)
raise SystemExit(0 if i['loaded'] and i['devices'] > 0 else 1)" || die "no usable CUDA runtime/GPU (set KVRECV_CUDART?)"

step "GPU tests (fake runtime and real GPU)"
PYTHONPATH=. timeout 240 $PY -m pytest tests/test_gpu.py -q -rs -p no:cacheprovider || fail=1

step "throughput (each kvrecv figure ~${SECS} s)"
PYTHONPATH=. timeout 150 $PY benchmarks/gpu_bench.py bench --seconds "$SECS" --json benchmarks/results/gpu.json || fail=1

echo
if [ $fail -ne 0 ]; then
    echo "gpu_check: FAILED (see above)"
    exit 1
fi
echo "gpu_check: OK"
