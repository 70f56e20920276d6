#!/usr/bin/env bash
# Output parity with real transformers models on CPU (bridge/tests_models/):
# builds the `orbitkv` package against the cached torch venv
# (scripts/models-venv.sh) and runs the suite in one pytest process.
#
#   scripts/model-tests.sh                 # debug build (what CI runs)
#   PROFILE=release scripts/model-tests.sh
#   scripts/model-tests.sh -k mistral      # extra arguments go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."

PROFILE=${PROFILE:-debug}
VENV=$(scripts/models-venv.sh)

echo "== cargo build --bin orbitkv ($PROFILE): the manager the Client tests start"
release=()
[ "$PROFILE" = release ] && release=(--release)
cargo build -q --bin orbitkv "${release[@]}"
export ORBITKV_BIN="${ORBITKV_BIN:-${CARGO_TARGET_DIR:-$PWD/target}/$PROFILE/orbitkv}"

echo "== pytest bridge/tests_models"
"$VENV/bin/python" -m pytest -q bridge/tests_models "$@"
