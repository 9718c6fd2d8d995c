#!/usr/bin/env bash
# Reproduces docs/benchmarks.md: builds release binaries, installs nginx (the gateway
# comparison) and valgrind (instructions per request) when missing, and runs the
# benchmarks. Loopback only; every load loop is bounded in count and time.
set -euo pipefail
cd "$(dirname "$0")/.."
missing=()
if ! command -v nginx >/dev/null 2>&1 && [ ! -x /usr/sbin/nginx ]; then missing+=(nginx-light); fi
if ! command -v valgrind >/dev/null 2>&1; then missing+=(valgrind); fi
if [ "${#missing[@]}" -gt 0 ]; then
  sudo=""; [ "$(id -u)" -ne 0 ] && sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
cargo build --release -p stanch -p stanch-gateway -p stanch-mock -p stanch-bench
target/release/stanch-bench controller --stanch target/release/stanch --fanout-rounds 100
target/release/stanch-bench gateway --rounds 7
target/release/stanch-bench gateway --throughput-only --rounds 20
target/release/stanch-bench gateway --gateway-threads 1
target/release/stanch-bench gateway --stream
scripts/bench-instructions.sh
scripts/bench-instructions.sh bare
STREAM=1 scripts/bench-instructions.sh
STREAM=1 scripts/bench-instructions.sh bare
