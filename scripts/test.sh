#!/usr/bin/env bash
# Every test: the Rust workspace, then the Python package against it.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo test --workspace --locked
scripts/python-tests.sh
