#!/usr/bin/env bash
# Builds the libFuzzer targets (clang -fsanitize=fuzzer,address,undefined)
# and runs each for FUZZ_SECONDS (default 30) from its committed corpus
# fuzz/corpus/<target>.  Before fuzzing, the seed_* inputs must all decode
# (FUZZ_EXPECT_VALID) and every committed input (seeds and regression cases)
# is replayed.  New coverage goes to fuzz/build/work/<target>, crashes to
# fuzz/build/crashes/<target>/.  Exits non-zero if any target finds a crash.
#
#   fuzz/run.sh                      the default targets, 30 s each
#   FUZZ_SECONDS=300 fuzz/run.sh fuzz_wire
#
# fuzz_worker_addr takes a peer's UCX worker address through
# kvr_tp_address_check (csrc/ucxaddr.c walks its structure against its
# length) into UCX's ucp_ep_create, on a real worker with UCX_TLS=self: UCX
# 1.13 takes no length and reads as far as the address's fields say.  Its
# corpus keeps, as regression cases, inputs on which UCX read past the end
# before that walk existed (overread_*).
set -uo pipefail
cd "$(dirname "$0")/.."
CLANG=${CLANG:-clang}
SECONDS_EACH=${FUZZ_SECONDS:-30}
JOBS=${FUZZ_JOBS:-1}
BUILD=fuzz/build
TARGETS=${*:-fuzz_wire fuzz_am_header fuzz_auth fuzz_state_rules fuzz_worker_addr}
mkdir -p "$BUILD"
if ! command -v "$CLANG" >/dev/null; then
    echo "clang not found (apt-get install -y clang libclang-rt-14-dev)" >&2
    exit 2
fi
SRCS="csrc/wire.c csrc/auth.c csrc/table.c csrc/stateslice.c"
FLAGS="-g -O1 -Wall -Werror -fno-omit-frame-pointer -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all -Icsrc"
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
status=0
for t in $TARGETS; do
    echo "== $t: build"
    srcs="$SRCS" libs="-lcrypto" asan=$ASAN_OPTIONS
    if [ "$t" = fuzz_worker_addr ]; then
        # a real UCX worker; UCX's own allocations outlive the process
        srcs="csrc/transport.c csrc/tplane.c csrc/lane.c csrc/lanelisten.c csrc/registry.c csrc/table.c csrc/pagecopy.c csrc/ucxaddr.c csrc/log.c csrc/ucxlog.c csrc/ucxtune.c" libs="-lucp -luct -lucs -lucm -pthread"
        asan=detect_leaks=0:abort_on_error=1
    fi
    # shellcheck disable=SC2086
    if ! $CLANG $FLAGS -o "$BUILD/$t" "fuzz/$t.c" $srcs $libs; then
        echo "== $t: BUILD FAILED"
        status=1
        continue
    fi
    corpus=fuzz/corpus/$t
    work=$BUILD/work/$t
    crashes=$BUILD/crashes/$t
    mkdir -p "$work" "$crashes"
    echo "== $t: seeds must decode"
    seeds=$(ls "$corpus"/seed_* 2>/dev/null)
    if [ -n "$seeds" ]; then
        # shellcheck disable=SC2086
        if ! FUZZ_EXPECT_VALID=1 ASAN_OPTIONS=$asan "$BUILD/$t" -runs=1 $seeds >"$BUILD/$t.seeds.log" 2>&1; then
            tail -n 30 "$BUILD/$t.seeds.log"
            echo "== $t: a seed does not decode"
            status=1
        fi
    fi
    echo "== $t: fuzz ${SECONDS_EACH}s"
    par=()
    if [ "$JOBS" -gt 1 ]; then
        # parallel workers write fuzz-N.log into the current directory
        par=(-jobs="$JOBS" -workers="$JOBS")
    fi
    ASAN_OPTIONS=$asan "$BUILD/$t" -max_total_time="$SECONDS_EACH" "${par[@]}" \
        -artifact_prefix="$crashes/" -print_final_stats=1 -timeout=10 -rss_limit_mb=2048 \
        "$work" "$corpus" >"$BUILD/$t.log" 2>&1
    rc=$?
    grep -E '^(#[0-9]+.*DONE|stat::number_of_executed_units|INFO: Seed|==[0-9]+==ERROR|SUMMARY)' "$BUILD/$t.log" | tail -n 6
    if [ $rc -ne 0 ]; then
        echo "== $t: CRASH FOUND (exit $rc); log $BUILD/$t.log; inputs:"
        ls -l "$crashes"
        grep -A 40 -E '==[0-9]+==ERROR|check failed|runtime error' "$BUILD/$t.log" | head -n 60
        status=1
    else
        echo "== $t: no crash"
    fi
done
exit $status
