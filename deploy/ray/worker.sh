#!/usr/bin/env bash
# Join a node to the fedpool Ray cluster: it then runs CPU stages (data loading, scoring, the verifier)
# and may host engines started with `fedpool serve`.
#
#   deploy/ray/worker.sh HEAD_IP:6379
#
# Needs on this node: fedpool installed in the Python that Ray uses (same version as the head), the head's
# Ray token file when it has one (~/.ray/auth_token); for the verifier, the GGUF it loads (default:
# Gemma 3 270M from PyPI, assembled on first use).
# Checked with: shellcheck, and run for real by tests/test_cluster_files.py (joins the head started there).
set -euo pipefail
if [ $# -ne 1 ]; then
  echo "usage: $0 HEAD_IP:PORT" >&2
  exit 2
fi
NUM_CPUS="${RAY_NUM_CPUS:-$(nproc)}"
RAY="${RAY:-ray}"
# Ray 2.60's head turns token authentication on by itself when it has a token (~/.ray/auth_token), but a
# joining node only sends one with RAY_AUTH_MODE=token: copy the head's token file here and it is used.
if [ -z "${RAY_AUTH_MODE:-}" ] && { [ -n "${RAY_AUTH_TOKEN:-}" ] || [ -f "${RAY_AUTH_TOKEN_PATH:-$HOME/.ray/auth_token}" ]; }; then
  export RAY_AUTH_MODE=token
fi
"$RAY" start --address "$1" --num-cpus "$NUM_CPUS" --disable-usage-stats
