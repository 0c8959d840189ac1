#!/usr/bin/env bash
# Installs what the benchmarks need and runs them:
#   bash scripts/bench.sh [--quick]
# Debian's UCX utilities (ucx_perftest, ucx_info; as root), matplotlib, and
# the two peers compared against, NIXL (nixl-cu12) and Mooncake's transfer
# engine (mooncake-transfer-engine-non-cuda), with --no-deps: their declared
# dependencies are GPU stacks that the host-memory benchmarks never import.
# Then the throughput suite (benchmarks/run.py) and the fault scenarios
# (benchmarks/faults.py).  A part that still cannot run says so in one line
# and the rest goes on.  The kvrecv extension must be built first (README).
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! command -v ucx_perftest >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        apt-get update -q >/dev/null && apt-get install -y -q ucx-utils >/dev/null \
            || echo "ucx-utils: not installed (apt-get failed); ucx_perftest is left out"
    else
        echo "ucx-utils: not installed (needs root and apt-get); ucx_perftest is left out"
    fi
fi
$PY -c "import matplotlib" 2>/dev/null || $PY -m pip install -q matplotlib \
    || echo "matplotlib: not installed; the figures are left out"
for pkg in nixl-cu12 mooncake-transfer-engine-non-cuda; do
    $PY -m pip show -q "$pkg" >/dev/null 2>&1 || $PY -m pip install -q --no-deps "$pkg" \
        || echo "$pkg: not installed; its columns say why"
done
$PY -c "import kvrecv._core" 2>/dev/null || { echo "kvrecv._core is not built: python3 setup.py build_ext --inplace"; exit 2; }
$PY benchmarks/run.py "$@"
rc=$?
$PY benchmarks/faults.py "$@" || rc=$?
exit $rc
