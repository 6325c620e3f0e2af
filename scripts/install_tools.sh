#!/usr/bin/env bash
# Third-party tools the comparison benchmarks run (benchmarks/gateway_capacity.py, benchmarks/clients.py), each
# in a venv of its own under ~/.cache/fedpool/tools so their pins never move fedpool's: LiteLLM's proxy and
# inspect_ai from PyPI, HAProxy from Debian. Idempotent; prints what it did.
set -euo pipefail
TOOLS="${FEDPOOL_TOOLS_HOME:-$HOME/.cache/fedpool/tools}"
HERE="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PYTHON:-$HERE/.venv/bin/python}"
[ -x "$PY" ] || PY="$(command -v python3.11 || command -v python3)"
mkdir -p "$TOOLS"

venv_with() {
  local name=$1; shift
  if [ ! -x "$TOOLS/$name/bin/python" ]; then
    echo "[tools] creating $TOOLS/$name"
    "$PY" -m venv "$TOOLS/$name"
  fi
  echo "[tools] $name: pip install $*"
  "$TOOLS/$name/bin/python" -m pip install -q --disable-pip-version-check "$@"
}

venv_with litellm "litellm[proxy]"
venv_with inspect inspect_ai openai

if ! command -v haproxy >/dev/null 2>&1; then
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  echo "[tools] apt-get install haproxy"
  $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq haproxy >/dev/null
fi
echo "[tools] ready: $("$TOOLS/litellm/bin/litellm" --version 2>/dev/null | tail -1 || echo litellm), \
inspect_ai $("$TOOLS/inspect/bin/python" -c 'import inspect_ai; print(inspect_ai.__version__)'), \
$(haproxy -v | head -1)"
