#!/usr/bin/env bash
# Output parity with real transformers models on CPU (bridge/tests_models/):
# builds the `orbitkv` package against the cached torch venv and runs the
# suite in one pytest process.
#
#   scripts/model-tests.sh                 # debug build (what CI runs)
#   PROFILE=release scripts/model-tests.sh
#   scripts/model-tests.sh -k mistral      # extra arguments go to pytest
#
# The torch venv (torch 2.15.0, transformers 5.24.0) is shared and cached by
# scripts/venv.sh; this worktree's package goes into its own overlay venv,
# .venv-models, whose site-packages put the torch venv's after its own (a
# .pth line). So two checkouts never install their builds over each other in
# the shared venv.
set -euo pipefail
cd "$(dirname "$0")/.."

PROFILE=${PROFILE:-debug}
TORCH_VENV=$(scripts/venv.sh torch)
VENV="$PWD/.venv-models"

if [ ! -x "$VENV/bin/python" ]; then
    echo "== creating $VENV over $TORCH_VENV"
    "$TORCH_VENV/bin/python" -m venv "$VENV"
fi
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
torch_site=$("$TORCH_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
echo "$torch_site" >"$site/orbitkv-torch-venv.pth"

echo "== maturin develop ($PROFILE) into $VENV"
release=()
[ "$PROFILE" = release ] && release=(--release)
start=$SECONDS
VIRTUAL_ENV="$VENV" PATH="$VENV/bin:$PATH" \
    "$TORCH_VENV/bin/maturin" develop "${release[@]}" -m bridge/Cargo.toml
echo "maturin develop took $((SECONDS - start))s"

echo "== cargo build --bin orbitkv ($PROFILE): the manager the Client tests start"
cargo build -q --bin orbitkv "${release[@]}"
export ORBITKV_BIN="${ORBITKV_BIN:-${CARGO_TARGET_DIR:-$PWD/target}/$PROFILE/orbitkv}"

echo "== pytest bridge/tests_models"
"$VENV/bin/python" -m pytest -q bridge/tests_models "$@"
