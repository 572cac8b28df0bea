#!/usr/bin/env bash
# Build and run the fuzz targets of fuzz/ (docs/fuzzing.md) with plain cargo: the libFuzzer targets are
# compiled with the flags `cargo fuzz build` uses (sancov coverage, trace-compares, AddressSanitizer,
# debug assertions and overflow checks, `--cfg fuzzing`), so cargo-fuzz need not be installed (CI saves
# its ~3 min install); `cargo fuzz run TARGET` in fuzz/ works as well for whoever has it.
# -Zsanitizer is unstable: RUSTC_BOOTSTRAP=1 lets the stable toolchain take it.
#
#   fuzz/fuzz.sh build                  build every target
#   fuzz/fuzz.sh run TARGET SECONDS [libFuzzer args...]   fuzz one target (corpus fuzz/corpus/TARGET + seeds)
#   fuzz/fuzz.sh all SECONDS            build, then run every target for SECONDS, one after the other
#   fuzz/fuzz.sh repro TARGET FILE...   run the target once on each FILE (a crash input, a seed)
#
# Environment: FUZZ_TARGET_DIR (default fuzz/target), FUZZ_TARGETS (default: all four), FUZZ_RECORD=1
# appends one line per run to fuzz/runs.tsv (end date, commit checked out at the start, target, seconds,
# executions, result).
# Runs are nice 19, one process (the machines are shared), and bounded: -max_total_time, -rss_limit_mb=2048,
# -malloc_limit_mb=1024 (one allocation over 1 GiB is a finding), -timeout=10 (one input over 10 s is one).
# Exit status: 0 when every run ended without a finding, else the first failing run's status.
set -euo pipefail
CALLER_DIR=$PWD
cd "$(dirname "$0")"
TRIPLE=$(rustc -vV | sed -n 's/^host: //p')
TARGET_DIR=${FUZZ_TARGET_DIR:-$PWD/target}
TARGETS=${FUZZ_TARGETS:-safetensors manifest prompts chat}
BIN=$TARGET_DIR/$TRIPLE/release

dict_of() {
    case $1 in
        manifest) echo dicts/toml.dict ;;
        *) echo dicts/json.dict ;;
    esac
}

build() {
    local flags="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4"
    flags+=" -Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table"
    flags+=" -Cllvm-args=-sanitizer-coverage-trace-compares -Cllvm-args=-sanitizer-coverage-stack-depth"
    flags+=" -Cllvm-args=-simplifycfg-branch-fold-threshold=0"
    flags+=" --cfg fuzzing -Zsanitizer=address -Cdebug-assertions -Coverflow-checks -Ccodegen-units=1"
    RUSTC_BOOTSTRAP=1 RUSTFLAGS="$flags" RUSTDOCFLAGS="" nice -n 19 cargo build --release --locked \
        --manifest-path Cargo.toml --target "$TRIPLE" --target-dir "$TARGET_DIR" --bins
}

run() {
    local t=$1 secs=$2
    shift 2
    mkdir -p "corpus/$t" "artifacts/$t"
    local log commit
    log=$(mktemp)
    commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
    local rc=0
    ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=0} nice -n 19 "$BIN/$t" "corpus/$t" "seeds/$t" \
        -dict="$(dict_of "$t")" -max_total_time="$secs" -rss_limit_mb=2048 -malloc_limit_mb=1024 \
        -timeout=10 -print_final_stats=1 -artifact_prefix="artifacts/$t/" "$@" 2>"$log" || rc=$?
    local execs
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
    grep -E "^(INFO: seed corpus|#[0-9]+ *DONE|==[0-9]+==|SUMMARY|thread '|Done [0-9]+ runs)" "$log" | tail -5 || true
    if [ "$rc" != 0 ]; then
        tail -60 "$log"
    fi
    echo "fuzz: $t: ${execs:-?} executions in ${secs}s, exit $rc"
    if [ "${FUZZ_RECORD:-0}" = 1 ]; then
        printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$(date -u +%Y-%m-%dT%H:%MZ)" "$commit" "$t" \
            "$secs" "${execs:-?}" "$([ "$rc" = 0 ] && echo ok || echo "exit $rc")" >>runs.tsv
    fi
    rm -f "$log"
    return "$rc"
}

case ${1:-} in
    build) build ;;
    run)
        [ $# -ge 3 ] || { echo "usage: $0 run TARGET SECONDS [libFuzzer args...]" >&2; exit 2; }
        t=$2 secs=$3
        shift 3
        run "$t" "$secs" "$@"
        ;;
    all)
        [ $# -eq 2 ] || { echo "usage: $0 all SECONDS" >&2; exit 2; }
        build
        status=0
        for t in $TARGETS; do
            rc=0
            run "$t" "$2" || rc=$?
            [ "$status" != 0 ] || status=$rc
        done
        exit "$status"
        ;;
    repro)
        [ $# -ge 3 ] || { echo "usage: $0 repro TARGET FILE..." >&2; exit 2; }
        t=$2
        shift 2
        files=()
        for f in "$@"; do
            case $f in
                /*) files+=("$f") ;;
                *) files+=("$CALLER_DIR/$f") ;;
            esac
        done
        ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=0} "$BIN/$t" -runs=1 "${files[@]}"
        ;;
    *)
        echo "usage: $0 build | run TARGET SECONDS [args...] | all SECONDS | repro TARGET FILE..." >&2
        exit 2
        ;;
esac
