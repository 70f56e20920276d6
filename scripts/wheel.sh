#!/usr/bin/env bash
# Builds the one wheel an engine's venv needs: the Python package `orbitkv`
# (adapters, Session, Client; abi3, CPython >= 3.9) and the `orbitkv`
# command (the manager and every CLI verb), so `pip install` gives both
# with no Rust toolchain on the target. Prints the wheel's path on stdout.
#
#   scripts/wheel.sh              # release build into target/wheels/
#   PROFILE=debug scripts/wheel.sh  # faster, for a quick local check
#
# The binary rides in the wheel's data directory (maturin `data`,
# bridge/wheel-data/scripts/orbitkv): pip installs `scripts/` into the
# venv's bin/. The directory exists only while this script runs, so
# `maturin develop` never installs a stale binary.
set -euo pipefail
cd "$(dirname "$0")/.."

PROFILE=${PROFILE:-release}
PYTHON=${PYTHON:-python3}
VENV="$PWD/.venv"
if [ ! -x "$VENV/bin/maturin" ]; then
    echo "== maturin into $VENV" >&2
    [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV" >&2
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check "maturin>=1.9,<2" >&2
fi

flags=()
[ "$PROFILE" = release ] && flags=(--release)
echo "== cargo build --bin orbitkv ($PROFILE)" >&2
cargo build -q --locked --bin orbitkv "${flags[@]}" >&2
bin="${CARGO_TARGET_DIR:-$PWD/target}/$PROFILE/orbitkv"

data=bridge/wheel-data
trap 'rm -rf "$data/scripts"' EXIT
rm -rf "$data/scripts"
mkdir -p "$data/scripts"
cp "$bin" "$data/scripts/orbitkv"
# Debug info is not shipped: the wheel is what every engine host downloads.
strip "$data/scripts/orbitkv" 2>/dev/null || true

out="${CARGO_TARGET_DIR:-$PWD/target}/wheels"
mkdir -p "$out"
echo "== maturin build ($PROFILE, abi3) into $out" >&2
# `linux`: the binary and the extension link the build machine's glibc;
# the tag says so rather than claiming a manylinux baseline.
"$VENV/bin/maturin" build "${flags[@]}" --locked -m bridge/Cargo.toml --out "$out" \
    --compatibility linux --auditwheel skip >"$out/maturin.log" 2>&1 || {
    tail -n 30 "$out/maturin.log" >&2
    exit 1
}
wheel=$(grep -o '[^ ]*\.whl' "$out/maturin.log" | tail -n 1)
[ -f "$wheel" ] || { echo "scripts/wheel.sh: no wheel in $out/maturin.log" >&2; exit 1; }
echo "== $(basename "$wheel"): $(du -h "$wheel" | cut -f1)" >&2
echo "$wheel"
