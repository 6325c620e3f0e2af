#!/usr/bin/env bash
# Third-party tools the comparison benchmarks run (benchmarks/gateway_capacity.py, benchmarks/clients.py), each
# in a venv of its own under ~/.cache/fedpool/tools so their pins never move fedpool's: LiteLLM's proxy, inspect_ai,
# lmms-eval, OpenCompass and evalscope from PyPI, HAProxy from Debian. Idempotent; prints what it did.
#
# The eval tools are pinned to the versions docs/researchers.md's recipes were checked with, and carry the fixes
# a new user needs (each said where it is installed):
# - torch==2.13.0: lmms-eval and OpenCompass pull torch; pinned, pip takes the CPU build from this machine's wheel
#   folder (as scripts/install_vllm_cpu.sh does) instead of PyPI's CUDA build and its ~3 GB of CUDA libraries.
# - lmms-eval without torchvision: PyPI's torchvision is built for another torch ("operator torchvision::nms does
#   not exist" at import); text tasks need none of it.
# - lmms-eval with filelock<4: lmms-eval 0.7.3 imports filelock._api, which filelock 4 removed; with filelock 4
#   every run stops with "No module named 'filelock._api'" and still exits 0.
# - OpenCompass with pyarrow<21: its pinned datasets (3.6) does not work with newer pyarrow.
# - evalscope[perf]: `evalscope perf` needs the perf extra.
# - a tokenizer directory ($TOOLS/tokenizer, the tiny model of deploy/tiny_hf_model.py, built offline): what
#   OpenCompass's OpenAISDK (tokenizer_path) and evalscope perf (--tokenizer-path) are given in the benchmark.
set -euo pipefail
TOOLS="${FEDPOOL_TOOLS_HOME:-$HOME/.cache/fedpool/tools}"
HERE="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PYTHON:-$HERE/.venv/bin/python}"
[ -x "$PY" ] || PY="$(command -v python3.11 || command -v python3)"
LMMS_EVAL_VERSION=0.7.3
OPENCOMPASS_VERSION=0.5.4
EVALSCOPE_VERSION=1.14.1
TORCH_VERSION=2.13.0
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
venv_with lmms "lmms-eval==$LMMS_EVAL_VERSION" "torch==$TORCH_VERSION" "filelock<4"
"$TOOLS/lmms/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
venv_with opencompass "opencompass==$OPENCOMPASS_VERSION" "torch==$TORCH_VERSION" "pyarrow<21"
venv_with evalscope "evalscope[perf]==$EVALSCOPE_VERSION"
if [ ! -f "$TOOLS/tokenizer/tokenizer.json" ]; then
  echo "[tools] building the tiny tokenizer in $TOOLS/tokenizer"
  LOG="$TOOLS/tokenizer.log"
  if ! "$TOOLS/opencompass/bin/python" "$HERE/deploy/tiny_hf_model.py" "$TOOLS/tokenizer" >"$LOG" 2>&1; then
    tail -n 20 "$LOG"; echo "[tools] building the tokenizer failed; full log: $LOG"; exit 1
  fi
fi

if ! command -v haproxy >/dev/null 2>&1; then
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  echo "[tools] apt-get install haproxy"
  $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq haproxy >/dev/null
fi
version_in() { "$TOOLS/$1/bin/python" -c "from importlib.metadata import version; print(version('$2'))"; }
echo "[tools] ready: litellm $(version_in litellm litellm), inspect_ai $(version_in inspect inspect_ai), \
lmms-eval $(version_in lmms lmms_eval), opencompass $(version_in opencompass opencompass), \
evalscope $(version_in evalscope evalscope), $(haproxy -v | head -1)"
