#!/usr/bin/env bash
# The test command: installs what the tests need, then runs every test.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-test-deps.sh
# The Python with the OpenAI SDK, for the gateway's SDK test.
export STANCH_TEST_PYTHON="$PWD/target/test-venv/bin/python"
# The alerting rules: syntax, and their unit tests.
promtool check rules rules/stanch.rules.yml
promtool test rules rules/tests/*.test.yml
cargo test --workspace --locked "$@"
