#!/usr/bin/env bash
# C unit tests of the pure-logic core (status, table, registry, log, wire, ucxaddr,
# auth, room, plan, heap, peer states, cross-memory readers): no UCX, ZMQ or Python needed (auth needs libcrypto).  Builds tests/c/runner three ways and
# runs it each time:
#   plain   -Wall -Wextra -Werror (also under valgrind memcheck if installed)
#   asan    -fsanitize=address,undefined, leak detection on
#   tsan    -fsanitize=thread
# Also checks that the runner itself reports failures, crashes and hangs.
# Exits non-zero on any failure.
#
#   scripts/ctest.sh                 everything
#   CTEST_MODES="plain asan" scripts/ctest.sh
#   CC=clang scripts/ctest.sh
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
CC=${CC:-gcc}
BUILD=${CTEST_BUILD:-$ROOT/tests/c/build}
MODES=${CTEST_MODES:-plain asan tsan valgrind}
mkdir -p "$BUILD"

SRCS="csrc/status.c csrc/table.c csrc/registry.c csrc/log.c csrc/wire.c csrc/auth.c csrc/room.c csrc/plan.c csrc/stateslice.c csrc/hist.c csrc/ucxaddr.c csrc/heap.c csrc/peerstate.c csrc/pagecopy.c csrc/readers.c"
TESTS=$(ls tests/c/runner.c tests/c/test_*.c)
COMMON="-std=c11 -D_GNU_SOURCE -DKVRECV_DEBUG -g -O1 -Wall -Wextra -Werror -Icsrc -pthread"

failures=()

build() { # name extra-flags...
    local name=$1
    shift
    echo "== build $name: $CC $*"
    # shellcheck disable=SC2086
    if ! $CC $COMMON "$@" -o "$BUILD/runner-$name" $SRCS $TESTS -lcrypto; then
        failures+=("build $name")
        return 1
    fi
}

run() { # name command...
    local name=$1
    shift
    echo "== run $name"
    local log="$BUILD/$name.log"
    "$@" 2>&1 | tee "$log"
    local rc=${PIPESTATUS[0]}
    if [ "$rc" -ne 0 ]; then
        failures+=("run $name (exit $rc)")
    elif ! tail -n 1 "$log" | grep -Eq '^[0-9]+ passed, 0 failed$'; then
        failures+=("run $name (no clean summary line)")
    fi
}

has_mode() { case " $MODES " in *" $1 "*) return 0 ;; esac; return 1; }

if build plain; then
    has_mode plain && run plain "$BUILD/runner-plain"
    # The runner must be able to fail: an assertion, a crash and a hang each
    # count as one failure and make it exit non-zero.
    echo "== runner self-check"
    out=$("$BUILD/runner-plain" _selftest_assert _selftest_crash _selftest_hang 2>&1)
    rc=$?
    # Shown without its summary line: "0 passed, 3 failed" here is success,
    # and must not read as the suite's result.
    echo "$out" | grep -E '^(not ok|ok)' | sed 's/^/  self-check: /'
    if [ $rc -eq 0 ] || [ "$(echo "$out" | tail -n 1)" != "0 passed, 3 failed" ] ||
        ! echo "$out" | grep -q 'test_selftest.c:[0-9]*: assertion failed: two + 2 == 5' ||
        ! echo "$out" | grep -q '_selftest_hang (timed out'; then
        failures+=("runner self-check")
    else
        echo "== runner self-check: the three planted failures were caught"
    fi
    if has_mode valgrind; then
        if command -v valgrind >/dev/null; then
            run valgrind env TEST_TIMEOUT_SCALE=20 \
                valgrind -q --error-exitcode=1 --leak-check=full --errors-for-leak-kinds=definite,indirect \
                --child-silent-after-fork=no "$BUILD/runner-plain"
        else
            echo "== valgrind not installed: skipped"
        fi
    fi
fi

if has_mode asan && build asan -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all; then
    run asan env ASAN_OPTIONS=detect_leaks=1:abort_on_error=1:halt_on_error=1 \
        UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 TEST_TIMEOUT_SCALE=3 "$BUILD/runner-asan"
fi

if has_mode tsan && build tsan -fsanitize=thread -O1; then
    run tsan env TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 TEST_TIMEOUT_SCALE=5 \
        setarch "$(uname -m)" -R "$BUILD/runner-tsan"
fi

echo
if [ ${#failures[@]} -ne 0 ]; then
    echo "ctest: FAILED: ${failures[*]}"
    exit 1
fi
echo "ctest: all passed ($MODES)"
