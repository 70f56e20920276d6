#!/usr/bin/env bash
# The GPU check of the CUDA copy engine (docs/gpu.md, "GPU check"): builds
# the engine's GPU tests and bandwidth benchmark (release), says whether a
# GPU is usable, runs the CUDA tests, every extra check in
# scripts/gpu-check.d/, and the benchmark, then prints a summary. Finishes
# in well under 5 minutes on one GPU once built.
#
#   scripts/gpu-check.sh               build (if cargo is here), then check
#   scripts/gpu-check.sh --build-only  build into target/gpu-check/ and stop:
#                                      carry that folder to a GPU machine
#                                      without Rust and run the script there
#
# Exit status: 0 every step passed; 1 a step failed; 2 no usable GPU here
# (nothing was run); 4 nothing to run (no cargo and no prebuilt binaries).
#
# Extra checks: every executable scripts/gpu-check.d/*.sh runs as one step
# (from the repository root, 150 s each; non-zero fails the check):
# agent-kill.sh, an engine process with a CUDA agent region killed mid-copy
# (tests/agent_kill.rs --cuda against a real `orbitkv serve`).
set -uo pipefail
cd "$(dirname "$0")/.."

BIN=target/gpu-check
SUMMARY=()
FAILED=0
START=$(date +%s)

# The test binary cargo built for `$1` (package args before it), from the
# `--no-run` log.
test_binary() {
    local name=$1 log exe
    shift
    log=$(cargo test --release --locked "$@" --test "$name" --no-run 2>&1) ||
        { echo "$log" >&2; return 1; }
    exe=$(echo "$log" | sed -n "s/.*Executable .*(\(.*$name-[0-9a-f]*\)).*/\1/p" | tail -n1)
    [ -n "$exe" ] || { echo "$log" >&2; echo "could not find the $name test binary" >&2; return 1; }
    echo "$exe"
}

build() {
    echo "== build (release): orbitkv-gpu examples, the cuda_gpu tests, orbitkv and agent_kill"
    cargo build --release --locked -p orbitkv-gpu --example cuda_probe --example cuda_bandwidth ||
        return 1
    cargo build --release --locked --bin orbitkv || return 1
    local gpu kill
    gpu=$(test_binary cuda_gpu -p orbitkv-gpu) || return 1
    kill=$(test_binary agent_kill) || return 1
    mkdir -p "$BIN"
    cp target/release/examples/cuda_probe target/release/examples/cuda_bandwidth "$BIN"/
    cp "$gpu" "$BIN"/cuda_gpu
    cp "$kill" "$BIN"/agent_kill
    cp target/release/orbitkv "$BIN"/orbitkv
}

# No NVIDIA device node and no driver library: no GPU, whatever is built.
# Says so before spending minutes on a build.
no_gpu_here() {
    ls /dev/nvidia[0-9]* >/dev/null 2>&1 && return 1
    ldconfig -p 2>/dev/null | grep -q 'libcuda\.so' && return 1
    return 0
}

# Runs one step under a time limit and records PASS/FAIL with its seconds.
step() {
    local name=$1 limit=$2 t0 rc
    shift 2
    echo
    echo "== $name"
    t0=$(date +%s)
    timeout --kill-after=10 "$limit" "$@"
    rc=$?
    local secs=$(($(date +%s) - t0))
    if [ $rc -eq 0 ]; then
        SUMMARY+=("PASS  $name (${secs} s)")
    else
        [ $rc -eq 124 ] && echo "$name: timed out after ${limit} s"
        SUMMARY+=("FAIL  $name (exit $rc, ${secs} s)")
        FAILED=1
    fi
    return $rc
}

if [ "${1:-}" != "--build-only" ] && no_gpu_here; then
    echo "gpu-check: NO GPU: no /dev/nvidia* device and no libcuda here; nothing was built or run"
    exit 2
fi

if command -v cargo >/dev/null 2>&1; then
    build || { echo "gpu-check: build failed"; exit 1; }
elif [ -x "$BIN/cuda_probe" ]; then
    echo "== no cargo here: using the prebuilt binaries in $BIN"
else
    echo "gpu-check: no cargo and no prebuilt binaries in $BIN."
    echo "Build them where Rust is (scripts/gpu-check.sh --build-only) and carry $BIN."
    exit 4
fi
[ "${1:-}" = "--build-only" ] && { echo "built into $BIN"; exit 0; }

echo
echo "== GPU"
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L
probe=$("$BIN"/cuda_probe 2>&1)
rc=$?
echo "$probe"
if [ $rc -eq 3 ]; then
    echo "gpu-check: NO GPU: nothing was run (${probe#no CUDA: })"
    exit 2
elif [ $rc -ne 0 ]; then
    echo "gpu-check: the probe itself failed (exit $rc); rebuild on this machine if the binaries do not run here"
    exit 1
fi

step "cuda tests (exact bytes 1/64/4096 pages, fencing, per-layer tokens, region checks)" 150 \
    "$BIN"/cuda_gpu --ignored --test-threads=1

extra=0
for check in scripts/gpu-check.d/*.sh; do
    [ -x "$check" ] || continue
    extra=1
    step "extra check $(basename "$check")" 150 "$check"
done
[ $extra -eq 1 ] ||
    SUMMARY+=("SKIP  extra checks (no executable scripts/gpu-check.d/*.sh)")

bench_log=$(mktemp)
step "cuda_bandwidth" 150 bash -c "set -o pipefail; '$BIN'/cuda_bandwidth | tee '$bench_log'"

echo
echo "== summary ($(($(date +%s) - START)) s)"
echo "$probe"
printf '%s\n' "${SUMMARY[@]}"
grep -E '^(baseline|H2D|D2H|worst)' "$bench_log" || true
rm -f "$bench_log"
exit $FAILED
