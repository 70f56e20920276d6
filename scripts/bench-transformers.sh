#!/usr/bin/env bash
# TTFT of a Llama-shaped transformers model with the prompt's prefix restored
# from OrbitKV, against full recompute and the floor, in one run
# (bridge/bench/transformers_ttft.py; arguments go to it).
#
#   scripts/bench-transformers.sh
#   scripts/bench-transformers.sh --prompt 2048 --layers 8 --json out.json
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=$(PROFILE=release scripts/models-venv.sh)
exec "$VENV/bin/python" bridge/bench/transformers_ttft.py "$@"
