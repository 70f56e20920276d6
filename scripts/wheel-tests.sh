#!/usr/bin/env bash
# The wheel as a user installs it: builds it (scripts/wheel.sh, release),
# installs the built file (never the checkout) into a fresh venv with no
# other package, and runs bridge/tests_wheel/check_wheel.py with that
# venv's python: `orbitkv serve` from the venv's bin/, the installed package
# publishing and restoring through it. Prints the wheel's size.
set -euo pipefail
cd "$(dirname "$0")/.."

wheel=$(scripts/wheel.sh)
echo "== wheel $(basename "$wheel"), $(stat -c %s "$wheel") bytes ($(du -h "$wheel" | cut -f1))"
tmp=$(mktemp -d "${TMPDIR:-/tmp}/orbitkv-wheel.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
"${PYTHON:-python3}" -m venv "$tmp/venv"
# --no-index: the wheel needs nothing else to run the manager and Client.
"$tmp/venv/bin/python" -m pip install -q --disable-pip-version-check --no-index "$wheel"
echo "== installed: $(du -sh "$tmp/venv/lib" | cut -f1) under lib/, bin/orbitkv $(stat -c %s "$tmp/venv/bin/orbitkv") bytes"
# Not from the checkout: -I leaves out the current directory and PYTHON*.
env -u ORBITKV_BIN -u PYTHONPATH "$tmp/venv/bin/python" -I bridge/tests_wheel/check_wheel.py
