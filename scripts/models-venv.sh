#!/usr/bin/env bash
# Builds the `orbitkv` package of this checkout into .venv-models, an overlay
# venv over the cached torch venv (torch 2.15.0, transformers 5.24.0), and
# prints its path on stdout. Progress goes to stderr.
#
#   scripts/models-venv.sh                  # debug build
#   PROFILE=release scripts/models-venv.sh  # for benchmarks
#
# The torch venv is shared and cached by scripts/venv.sh; this checkout's
# build goes into its own .venv-models, whose site-packages put the torch
# venv's after its own (a .pth line), so two checkouts never install their
# builds over each other in the shared venv.
set -euo pipefail
cd "$(dirname "$0")/.."

PROFILE=${PROFILE:-debug}
TORCH_VENV=$(scripts/venv.sh torch)
VENV="$PWD/.venv-models"

if [ ! -x "$VENV/bin/python" ]; then
    echo "== creating $VENV over $TORCH_VENV" >&2
    "$TORCH_VENV/bin/python" -m venv "$VENV" >&2
fi
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
torch_site=$("$TORCH_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
echo "$torch_site" >"$site/orbitkv-torch-venv.pth"

echo "== maturin develop ($PROFILE) into $VENV" >&2
start=$SECONDS
MATURIN="$TORCH_VENV/bin/maturin" scripts/develop.sh "$VENV" "$PROFILE" >&2
echo "maturin develop took $((SECONDS - start))s" >&2
echo "$VENV"
