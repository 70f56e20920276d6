#!/usr/bin/env bash
# Every test: the Rust workspace, the Python package against it, then the
# vLLM connector suites (each in its cached engine venv, scripts/venv.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo test --workspace --locked
scripts/python-tests.sh
scripts/vllm-tests.sh
