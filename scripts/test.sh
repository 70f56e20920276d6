#!/usr/bin/env bash
# Every test: the Rust workspace, then the Python package against it, then
# output parity with real transformers models (creates or reuses the cached
# torch venv through scripts/venv.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo test --workspace --locked
scripts/python-tests.sh
scripts/model-tests.sh
