#!/usr/bin/env bash
# `maturin develop` of the `orbitkv` package into a venv: the one way the
# test and bench scripts install the extension they test.
#
#   scripts/develop.sh VENV [debug|release] [maturin flags...]
#
# MATURIN names another venv's maturin (default: VENV's own). The package
# declares a wheel data directory (bridge/wheel-data, filled only while
# scripts/wheel.sh builds the wheel), which maturin requires to exist; an
# empty one installs nothing, so a develop build never ships a binary.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${1:?usage: scripts/develop.sh VENV [debug|release] [maturin flags...]}
PROFILE=${2:-debug}
shift $(($# < 2 ? $# : 2))
flags=()
case "$PROFILE" in
release) flags=(--release) ;;
debug) ;;
*) echo "scripts/develop.sh: profile must be debug or release, not $PROFILE" >&2; exit 2 ;;
esac
MATURIN=${MATURIN:-$VENV/bin/maturin}
mkdir -p bridge/wheel-data
rm -rf bridge/wheel-data/scripts # a wheel build's leftover is never installed
VIRTUAL_ENV="$VENV" PATH="$VENV/bin:$PATH" \
    "$MATURIN" develop "${flags[@]}" "$@" -m bridge/Cargo.toml
