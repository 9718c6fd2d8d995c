#!/usr/bin/env bash
# The test command: installs what the tests need, then runs every test.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-test-deps.sh
cargo test --workspace --locked "$@"
