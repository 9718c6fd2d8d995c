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
# With the demo linked, so that `stanch demo` is tested too.
cargo test --workspace --locked --features stanch/demo "$@"
# Every benchmark, briefly: they are not otherwise run by CI.
scripts/bench-smoke.sh
# What needs root (mounting a tmpfs): ignored by cargo test, run here when root.
if [ "$(id -u)" = 0 ]; then
    cargo test --locked -p stanch --features demo --test it -- --ignored --exact \
        drill::a_full_filesystem_loses_nothing_acknowledged
else
    echo "not root: drill::a_full_filesystem_loses_nothing_acknowledged stays ignored"
fi
