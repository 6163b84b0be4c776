#!/usr/bin/env bash
# Builds the wire fuzzers with clang (libFuzzer + ASan + UBSan) and runs each for N seconds,
# starting from the committed seeds in fuzz/corpus/<target>/. Exits non-zero if any fuzzer
# finds a crash, leak, timeout, OOM or oracle failure (see fuzz/fuzz_common.h).
#
#   scripts/fuzz.sh [seconds-per-target]      default 12 s each, 8 targets (~100 s + build)
#
# Env: FUZZ_BUILD_DIR (default build-fuzz), FUZZ_JOBS (build parallelism, default 2).
# New interesting inputs go to fuzz/corpus-work/<target>/ (git-ignored); crash reproducers to
# fuzz/corpus-work/artifacts/. To keep a reproducer as a regression test, copy it into
# fuzz/corpus/<target>/ — ctest replays that directory in every normal build.
set -euo pipefail

secs="${1:-${FUZZ_SECONDS:-12}}"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${FUZZ_BUILD_DIR:-$root/build-fuzz}"
jobs="${FUZZ_JOBS:-2}"
targets=(pull renewal renewal_reply pull_response release release_reply abort_notice peek)

if ! command -v clang++ >/dev/null 2>&1; then
  echo "fuzz.sh: clang++ not found; install clang and libclang-rt-14-dev" >&2
  exit 2
fi

cmake -S "$root" -B "$build" -G Ninja -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DKVFERRY_FUZZ=ON -DKVFERRY_MODULES=wire -DKVFERRY_BENCH=OFF >/dev/null
cmake --build "$build" -j"$jobs" --target "${targets[@]/#/fuzz_wire_}"

work="$root/fuzz/corpus-work"
artifacts="$work/artifacts"
mkdir -p "$artifacts"
failed=()
for t in "${targets[@]}"; do
  mkdir -p "$work/$t"
  echo "=== fuzz_wire_$t for ${secs}s"
  # First dir receives new inputs; the committed seeds are only read.
  if ! "$build/fuzz/fuzz_wire_$t" -max_total_time="$secs" -max_len=4096 -timeout=10 \
      -rss_limit_mb=2048 -print_final_stats=1 -artifact_prefix="$artifacts/$t-" \
      "$work/$t" "$root/fuzz/corpus/$t" 2>"$work/$t.log"; then
    failed+=("$t")
    tail -n 40 "$work/$t.log" >&2
  else
    grep -E "stat::number_of_executed_units|stat::peak_rss_mb|INFO: seed corpus" "$work/$t.log" || true
  fi
done

if [ ${#failed[@]} -ne 0 ]; then
  echo "fuzz.sh: FAILED: ${failed[*]} (reproducers in $artifacts, logs in $work/*.log)" >&2
  exit 1
fi
echo "fuzz.sh: ${#targets[@]} targets x ${secs}s: no crashes"
