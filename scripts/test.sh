#!/usr/bin/env bash
# Every test: the Rust workspace, the Python package against it, output
# parity with real transformers models, then the engine adapter suites. Each
# Python suite runs in its cached venv (scripts/venv.sh creates or reuses it).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo test --workspace --locked
scripts/python-tests.sh
scripts/model-tests.sh
scripts/vllm-tests.sh
scripts/sglang-tests.sh
