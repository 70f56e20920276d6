#!/usr/bin/env bash
# Local Redis for the remote-tier tests and benchmarks, on loopback only.
#
#   scripts/redis.sh start            # a single node and a 3-master cluster;
#                                     # prints the env lines the tests read
#   scripts/redis.sh env              # prints them again
#   scripts/redis.sh stop             # stops everything `start` started
#   scripts/redis.sh node PORT        # one more single node (tests that kill it)
#   scripts/redis.sh cluster P1 P2 P3 # one more 3-master cluster
#   scripts/redis.sh kill PORT        # SIGKILL the node on PORT
#
# Typical use:  eval "$(scripts/redis.sh start)"; cargo test ...; scripts/redis.sh stop
#
# The tests find the servers through ORBITKV_TEST_REDIS (single node URL) and
# ORBITKV_TEST_REDIS_CLUSTER (comma-separated seed URLs); without them they
# are skipped with a loud message. Ports: ORBITKV_REDIS_PORT (default 6391)
# and ORBITKV_REDIS_CLUSTER_PORTS (default "7101 7102 7103"). Data, logs and
# pid files live under ORBITKV_REDIS_DIR (default /tmp/orbitkv-redis).
# Nodes run without persistence (no RDB, no AOF): they hold test data only.
set -euo pipefail

dir=${ORBITKV_REDIS_DIR:-/tmp/orbitkv-redis}
single_port=${ORBITKV_REDIS_PORT:-6391}
cluster_ports=${ORBITKV_REDIS_CLUSTER_PORTS:-"7101 7102 7103"}

need() {
    command -v "$1" >/dev/null || {
        echo "scripts/redis.sh: $1 not found (apt-get install -y redis-server redis-tools)" >&2
        exit 2
    }
}

wait_ping() {
    local port=$1
    for _ in $(seq 1 100); do
        if redis-cli -h 127.0.0.1 -p "$port" ping 2>/dev/null | grep -q PONG; then
            return 0
        fi
        sleep 0.05
    done
    echo "scripts/redis.sh: node on port $port did not answer (log: $dir/$port/redis.log)" >&2
    exit 1
}

# start_node PORT [cluster]
start_node() {
    local port=$1 cluster=${2:-no}
    local d="$dir/$port"
    if redis-cli -h 127.0.0.1 -p "$port" ping 2>/dev/null | grep -q PONG; then
        echo "scripts/redis.sh: port $port already answers; stop it first" >&2
        exit 1
    fi
    rm -rf "$d"
    mkdir -p "$d"
    local args=(
        --port "$port" --bind 127.0.0.1 --protected-mode yes
        --dir "$d" --logfile "$d/redis.log" --pidfile "$d/redis.pid"
        --daemonize yes --save "" --appendonly no
        --enable-debug-command local
        --maxmemory 2gb --maxmemory-policy volatile-lru
    )
    if [ "$cluster" = cluster ]; then
        args+=(--cluster-enabled yes --cluster-config-file "$d/nodes.conf"
            --cluster-node-timeout 2000 --cluster-require-full-coverage no
            --cluster-allow-reads-when-down yes)
    fi
    redis-server "${args[@]}"
    wait_ping "$port"
}

make_cluster() {
    local seeds=()
    for p in "$@"; do
        start_node "$p" cluster
        seeds+=("127.0.0.1:$p")
    done
    redis-cli --cluster create "${seeds[@]}" --cluster-replicas 0 --cluster-yes >"$dir/cluster-create-$1.log" 2>&1 || {
        cat "$dir/cluster-create-$1.log" >&2
        exit 1
    }
    # Wait until every node agrees the cluster is up.
    for p in "$@"; do
        for _ in $(seq 1 200); do
            if redis-cli -h 127.0.0.1 -p "$p" cluster info | grep -q 'cluster_state:ok'; then
                break
            fi
            sleep 0.05
        done
    done
}

print_env() {
    local urls=()
    for p in $cluster_ports; do urls+=("redis://127.0.0.1:$p"); done
    echo "export ORBITKV_TEST_REDIS=redis://127.0.0.1:$single_port"
    echo "export ORBITKV_TEST_REDIS_CLUSTER=$(IFS=,; echo "${urls[*]}")"
}

stop_all() {
    [ -d "$dir" ] || return 0
    for pidfile in "$dir"/*/redis.pid; do
        [ -f "$pidfile" ] || continue
        local pid
        pid=$(cat "$pidfile")
        kill "$pid" 2>/dev/null || true
        for _ in $(seq 1 100); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.05
        done
        kill -9 "$pid" 2>/dev/null || true
        rm -f "$pidfile"
    done
    rm -rf "$dir"
}

cmd=${1:-}
case "$cmd" in
    start)
        need redis-server
        need redis-cli
        mkdir -p "$dir"
        start_node "$single_port" >&2
        # shellcheck disable=SC2086
        make_cluster $cluster_ports >&2
        print_env
        ;;
    env) print_env ;;
    stop) stop_all ;;
    node)
        need redis-server
        mkdir -p "$dir"
        start_node "${2:?usage: scripts/redis.sh node PORT}"
        ;;
    cluster)
        need redis-server
        need redis-cli
        mkdir -p "$dir"
        make_cluster "${2:?port}" "${3:?port}" "${4:?port}"
        ;;
    kill)
        port=${2:?usage: scripts/redis.sh kill PORT}
        pidfile="$dir/$port/redis.pid"
        if [ -f "$pidfile" ]; then
            kill -9 "$(cat "$pidfile")" 2>/dev/null || true
            rm -f "$pidfile"
        fi
        ;;
    *)
        echo "usage: scripts/redis.sh start|env|stop|node PORT|cluster P1 P2 P3|kill PORT" >&2
        exit 2
        ;;
esac
