#!/usr/bin/env bash
# Runs the benchmarks behind OrbitKV's performance goals and prints each
# one's ratios against its baseline measured in the same run (what they
# measure, and the latest numbers: docs/performance.md). The full output of
# each goes to target/bench/<UTC time>/<name>.log.
#
#   scripts/bench.sh                        # all of them (~25 min on 2 cores)
#   scripts/bench.sh throughput lmcache     # some of them
#   REPEAT=2 scripts/bench.sh               # each one twice, as goals are reported
#
# Benchmarks:
#   throughput  publish + restore through the runtime vs one-thread memcpy
#               (world/benches/throughput.rs)
#   query       discovery + validation vs FxHash lookups (world/benches/query.rs)
#   ssd         the SSD tier vs raw io_uring O_DIRECT (io/benches/ssd.rs)
#   remote      the Redis tier vs raw redis-rs and LMCache's RedisConnector
#               (io/benches/remote.rs; starts Redis with scripts/redis.sh)
#   lmcache     save + retrieve of 2 GiB vs LMCache 0.5.6 in-process and its
#               multi-process server, 256 KiB and 2 MiB pages
#               (bridge/bench/lmcache_peer.py)
#   vllm        vLLM 0.33's scheduler loop with the connector vs without it
#               and vs vLLM's OffloadingConnector
#               (bridge/bench/vllm_scheduler_overhead.py)
#   roundtrip   a lookup through orbitkv serve from Python vs raw iceoryx2
#               (bridge/bench/query_roundtrip.py)
#
# Everything is a release build: the benches, the manager, and the
# extension installed into each venv used (scripts/develop.sh VENV release),
# which replaces a debug build the test scripts put there; the venvs are
# built on first use (scripts/venv.sh). Timings are only comparable within
# one run: the ratios are what to read.
set -euo pipefail
cd "$(dirname "$0")/.."

all=(throughput query ssd remote lmcache vllm roundtrip)
picked=("$@")
[ ${#picked[@]} -gt 0 ] || picked=("${all[@]}")
for b in "${picked[@]}"; do
    case " ${all[*]} " in
    *" $b "*) ;;
    *) echo "scripts/bench.sh: unknown benchmark '$b' (one of: ${all[*]})" >&2; exit 2 ;;
    esac
done
repeat=${REPEAT:-1}
out=target/bench/$(date -u +%Y%m%dT%H%M%SZ)
mkdir -p "$out"
start=$SECONDS

say() { echo "== $* ($((SECONDS - start)) s)" >&2; }

# use_venv NAME: V is the NAME venv, with the release extension installed
# (once per run).
declare -A ready=()
use_venv() {
    V=$(scripts/venv.sh "$1")
    if [ -z "${ready[$1]:-}" ]; then
        say "release extension into the $1 venv"
        scripts/develop.sh "$V" release -q >"$out/develop-$1.log" 2>&1 ||
            { cat "$out/develop-$1.log" >&2; exit 1; }
        ready[$1]=1
    fi
}

# The bench executable cargo builds for `cargo bench -p CRATE --bench NAME`.
bench_bin() {
    local bin
    bin=$(cargo bench -p "$1" --bench "$2" --no-run --message-format=json 2>"$out/build-$2.log" |
        sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | tail -1) || true
    if [ -z "$bin" ] || [ ! -x "$bin" ]; then
        echo "scripts/bench.sh: building the $2 bench failed; see $out/build-$2.log" >&2
        return 1
    fi
    echo "$bin"
}

say "release builds"
cargo build --release -q --bin orbitkv
cargo build --release -q --example query_roundtrip

redis_up=
stop_redis() { [ -z "$redis_up" ] || scripts/redis.sh stop >/dev/null 2>&1 || true; }
trap stop_redis EXIT

# run NAME PATTERN COMMAND...: the output to NAME.log (appended, one run
# after another), the lines matching PATTERN to the summary.
summary="$out/summary.txt"
run() {
    local name=$1 pattern=$2 log="$out/$1.log"
    shift 2
    local n
    for ((n = 1; n <= repeat; n++)); do
        say "$name, run $n of $repeat"
        echo "### run $n" >>"$log"
        if ! "$@" >>"$log" 2>&1; then
            echo "scripts/bench.sh: $name failed; the end of $log:" >&2
            tail -20 "$log" >&2
            exit 1
        fi
        {
            echo "-- $name, run $n"
            awk -v run="### run $n" '$0 == run {f=1; next} /^### run /{f=0} f' "$log" | grep -E "$pattern" || true
        } >>"$summary"
    done
}

for b in "${picked[@]}"; do
    case "$b" in
    throughput)
        bin=$(bench_bin orbitkv-world throughput)
        run throughput '^ratio' "$bin"
        ;;
    query)
        bin=$(bench_bin orbitkv-world query)
        run query 'query tick / |KeyMap lookups' "$bin" --bench
        ;;
    ssd)
        bin=$(bench_bin orbitkv-io ssd)
        run ssd '^(read|write) .*ratio' "$bin" --bench
        ;;
    remote)
        bin=$(bench_bin orbitkv-io remote)
        use_venv lmcache
        eval "$(scripts/redis.sh start)"
        redis_up=1
        run remote ' vs ' "$bin" --lmcache "$V/bin/python"
        stop_redis
        redis_up=
        ;;
    lmcache)
        use_venv lmcache
        for size in 256KiB 2MiB; do
            run "lmcache-$size" '^(lmcache|orbitkv|vs |[0-9.]+ GiB| +save)' \
                "$V/bin/python" bridge/bench/lmcache_peer.py --total 2GiB --page-bytes "$size" --repeat 3
        done
        ;;
    vllm)
        use_venv vllm
        run vllm '^median ratio|^OrbitKV.s added|^vLLM.s OffloadingConnector' \
            "$V/bin/python" bridge/bench/vllm_scheduler_overhead.py --load-mode layerwise --rounds 3
        ;;
    roundtrip)
        use_venv vllm
        run roundtrip '/ raw iceoryx2' "$V/bin/python" bridge/bench/query_roundtrip.py --iterations 10000
        ;;
    esac
done

say "done; full output in $out"
cat "$summary"
