#!/usr/bin/env bash
# Every test: the Rust workspace, the Python package against it, then the
# SGLang storage backend on the real SGLang classes (its venv is cached).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo test --workspace --locked
scripts/python-tests.sh
scripts/sglang-tests.sh
