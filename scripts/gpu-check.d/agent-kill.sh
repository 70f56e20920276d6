#!/usr/bin/env bash
# gpu-check step: an engine process whose copy agent copies to CUDA memory
# is killed (SIGKILL) in the middle of its copies, twice (copies held
# unreported; a restore/publish loop killed wherever it is); the manager
# keeps serving, no lease, reserved byte, operation or transfer is left, and
# a new CUDA engine restores the pages exactly. tests/agent_kill.rs, built by
# scripts/gpu-check.sh into target/gpu-check/ with the orbitkv binary it
# starts. Exit 2 when CUDA is unusable here.
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=target/gpu-check
[ -x "$BIN/agent_kill" ] && [ -x "$BIN/orbitkv" ] || {
    echo "agent-kill: $BIN/agent_kill or $BIN/orbitkv missing: run scripts/gpu-check.sh (or --build-only)"
    exit 1
}
exec "$BIN/agent_kill" --cuda --orbitkv "$BIN/orbitkv"
