#!/usr/bin/env bash
# Builds the Python package `orbitkv` (bridge/) into .venv and runs its tests.
# Idempotent: reuses .venv and the cargo target directory.
#
#   scripts/python-tests.sh            # debug build (what CI runs)
#   PROFILE=release scripts/python-tests.sh
#   scripts/python-tests.sh -k contract   # extra arguments go to pytest
#
# The serve tests (bridge/tests/test_serve.py) run `orbitkv serve`: the
# binary of the same profile, built here (ORBITKV_BIN overrides it).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
PROFILE=${PROFILE:-debug}
VENV="$PWD/.venv"

if [ ! -x "$VENV/bin/python" ]; then
    echo "== creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi

echo "== installing maturin, pytest, numpy, huggingface_hub (the model-source rule reads its cache layout), pyzmq and msgspec (the KV event subscriber)"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check "maturin>=1.9,<2" pytest numpy huggingface_hub pyzmq msgspec

echo "== maturin develop ($PROFILE)"
start=$SECONDS
scripts/develop.sh "$VENV" "$PROFILE"
echo "maturin develop took $((SECONDS - start))s"

release=()
[ "$PROFILE" = release ] && release=(--release)
echo "== cargo build --bin orbitkv ($PROFILE): the manager test_serve.py starts"
cargo build -q --bin orbitkv "${release[@]}"
export ORBITKV_BIN="${ORBITKV_BIN:-${CARGO_TARGET_DIR:-$PWD/target}/$PROFILE/orbitkv}"

echo "== pytest"
"$VENV/bin/python" -m pytest -q bridge/tests "$@"
