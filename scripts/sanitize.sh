#!/usr/bin/env bash
# The test suite once more, under AddressSanitizer + UndefinedBehaviorSanitizer.
# The extension is rebuilt with the sanitizers; the ASan runtime is preloaded
# into the (uninstrumented) interpreter.  Leak detection is off here: CPython
# keeps memory for its lifetime on purpose.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
build() {
    # A failed build must fail the pass: the tests would otherwise run the
    # previous, uninstrumented extension.
    local log
    log=$(mktemp)
    if ! env "$@" $PY setup.py -q build_ext --inplace --force >"$log" 2>&1; then
        cat "$log" >&2
        rm -f "$log"
        echo "sanitize: build failed" >&2
        exit 1
    fi
    grep -v -i warn "$log" || true
    rm -f "$log"
}
build KVRECV_SANITIZE=address,undefined
ASAN_LIB=$(gcc -print-file-name=libasan.so)
UBSAN_LIB=$(gcc -print-file-name=libubsan.so)
status=0
env LD_PRELOAD="$ASAN_LIB $UBSAN_LIB" PYTHONMALLOC=malloc \
    ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:halt_on_error=1 \
    UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    $PY -m pytest tests -q -p no:cacheprovider "$@" || status=$?
# Leave a normal build behind.
build KVRECV_SANITIZE=
exit $status
