#!/usr/bin/env bash
# Installs what stanch's tests run against, when missing: from Debian's packages a
# real Alertmanager, Prometheus (for promtool), openssl, curl and Python; from PyPI,
# pinned, in a virtual environment under target/: the OpenAI Python SDK, and
# kubernetes-validate and jsonschema (the CRDs against Kubernetes' own schemas, and
# example resources against the CRDs').
# Safe to run repeatedly; needs root (or sudo) only when something is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

# The OpenAI SDK the gateway is tested with (crates/stanch-gateway/tests/sdk), and the
# validators of stanch-kube's CRDs (crates/stanch-kube/tests).
PY_PACKAGES=(openai==3.57.0 kubernetes-validate==1.37.0 jsonschema==4.26.0)
VENV=target/test-venv

install_python() {
  if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" - "${PY_PACKAGES[@]}" 2>/dev/null <<'PY'
import importlib.metadata as m, sys
for pin in sys.argv[1:]:
    name, version = pin.split("==")
    if m.version(name) != version:
        sys.exit(1)
PY
  then
    return
  fi
  echo "install-test-deps: installing ${PY_PACKAGES[*]} in $VENV" >&2
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --disable-pip-version-check "${PY_PACKAGES[@]}"
}

need=()
command -v python3 >/dev/null 2>&1 && python3 -m venv --help >/dev/null 2>&1 || need+=(python3 python3-venv)
command -v prometheus-alertmanager >/dev/null 2>&1 || command -v alertmanager >/dev/null 2>&1 || need+=(prometheus-alertmanager)
command -v curl >/dev/null 2>&1 || need+=(curl)
command -v openssl >/dev/null 2>&1 || need+=(openssl)
command -v promtool >/dev/null 2>&1 || need+=(prometheus)

if [ ${#need[@]} -eq 0 ]; then
  install_python
  exit 0
fi

sudo=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null 2>&1 || { echo "install-test-deps: need root to install: ${need[*]}" >&2; exit 1; }
  sudo="sudo"
fi

echo "install-test-deps: installing ${need[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
# Packages' post-install scripts must not start system services on a test machine.
if [ ! -e /usr/sbin/policy-rc.d ]; then
  printf '#!/bin/sh\nexit 101\n' | $sudo tee /usr/sbin/policy-rc.d >/dev/null
  $sudo chmod +x /usr/sbin/policy-rc.d
fi
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
install_python
