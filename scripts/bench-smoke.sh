#!/usr/bin/env bash
# Every benchmark, run briefly against debug builds: a benchmark that no longer runs
# (a request the controller now refuses, a phase that measures nothing) fails here,
# not in the hands of the next person to measure. The figures mean nothing at these
# sizes; docs/benchmarks.md has the real runs. Needs nginx (scripts/install-test-deps.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --locked -p stanch -p stanch-gateway -p stanch-mock -p stanch-bench
bin="${CARGO_TARGET_DIR:-target}/debug"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT

run() {
    local name="$1"
    shift
    echo "bench-smoke: $name"
    if ! timeout 300 "$bin/stanch-bench" "$name" "$@" >"$out/$name.log" 2>&1; then
        cat "$out/$name.log"
        echo "bench-smoke: $name failed" >&2
        exit 1
    fi
    # A round whose watchers never got the version, or arrivals cut short.
    if grep -E "only [0-9]+ of [0-9]+ watchers|; [1-9][0-9]* short\)" "$out/$name.log"; then
        echo "bench-smoke: $name measured nothing in a round" >&2
        exit 1
    fi
}

run controller --stanch "$bin/stanch" --latency-rounds 5 --throughput-secs 1 \
    --senders 2 --sse 5 --long-poll 5 --fanout-rounds 3
run fleet --stanch "$bin/stanch" --grpc 10 --sse 10 --long-poll 10 --rounds 2 --slow 5
run cluster --stanch "$bin/stanch" --latency-rounds 5 --storm-alerts 100 --storm-secs 1
run gateway --gateway "$bin/stanch-gateway" --mock "$bin/stanch-mock" --rounds 1 \
    --seconds 1 --throughput-only
run rescue --gateway "$bin/stanch-gateway" --mock "$bin/stanch-mock" --requests 20 \
    --dead-seconds 2 --slow-requests 3
echo "bench-smoke: every benchmark runs"
