#!/usr/bin/env bash
# The SGLang storage backend's tests (bridge/tests_sglang): the real
# SGLang 0.5.23 classes on CPU against a real `orbitkv serve`, in one pytest
# process (importing SGLang takes ~20 s).
#
#   scripts/sglang-tests.sh              # what scripts/test.sh runs
#   scripts/sglang-tests.sh -k tree      # extra arguments go to pytest
#
# The venv comes from scripts/venv.sh sglang (cached; ~10 minutes and ~11 GB
# the first time). The `orbitkv` package is built into it with maturin; the
# manager binary is target/debug/orbitkv (ORBITKV_BIN overrides it).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=$(scripts/venv.sh sglang)
# SGLang's page hashing JIT-compiles a C++ extension with ninja.
export PATH="$VENV/bin:$PATH"

echo "== maturin develop into $VENV"
start=$SECONDS
scripts/develop.sh "$VENV" debug -q
echo "maturin develop took $((SECONDS - start))s"

echo "== cargo build --bin orbitkv"
cargo build -q --bin orbitkv
export ORBITKV_BIN="${ORBITKV_BIN:-${CARGO_TARGET_DIR:-$PWD/target}/debug/orbitkv}"

echo "== pytest bridge/tests_sglang"
# A private base for tmp_path: pytest prunes old numbered bases of the
# same user, which another pytest run could do under our feet.
base=$(mktemp -d "${TMPDIR:-/tmp}/orbitkv-sglang-tests.XXXXXX")
trap 'rm -rf "$base"' EXIT
cd bridge/tests_sglang
"$VENV/bin/python" -m pytest -q --basetemp "$base/t" . "$@"
