#!/usr/bin/env bash
# Reproduces docs/benchmarks.md: builds release binaries, installs nginx for the
# gateway comparison when missing, and runs both benchmarks. Loopback only; every
# load loop is bounded in count and time.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v nginx >/dev/null 2>&1 && [ ! -x /usr/sbin/nginx ]; then
  sudo=""; [ "$(id -u)" -ne 0 ] && sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends nginx-light >/dev/null
fi
cargo build --release -p stanch -p stanch-gateway -p stanch-mock -p stanch-bench
target/release/stanch-bench controller --stanch target/release/stanch --fanout-rounds 100
target/release/stanch-bench gateway --gateway-threads 1
