#!/usr/bin/env bash
# Start the Ray head node of a fedpool cluster and the registry on it.
#
#   deploy/ray/head.sh                 # Ray on port 6379, registry state in ~/.fedpool/registry
#   RAY_PORT=6380 FEDPOOL_STATE_DIR=/srv/fedpool deploy/ray/head.sh
#
# Needs on this node: fedpool installed in the Python that Ray uses (scripts/bootstrap.sh or
# `pip install .`), ports RAY_PORT (GCS), 8265 (dashboard) and FEDPOOL_METRICS_PORT reachable from the
# other nodes and from Prometheus. The registry token is written to STATE_DIR/registry.token (0600):
# copy it to the nodes that run `fedpool serve`.
# Checked with: shellcheck, and run for real by tests/test_cluster_files.py (one head on this machine,
# registry started on it, status read back, then stopped).
set -euo pipefail
RAY_PORT="${RAY_PORT:-6379}"
STATE_DIR="${FEDPOOL_STATE_DIR:-$HOME/.fedpool/registry}"
METRICS_PORT="${FEDPOOL_METRICS_PORT:-9108}"
METRICS_HOST="${FEDPOOL_METRICS_HOST:-0.0.0.0}"
NUM_CPUS="${RAY_NUM_CPUS:-$(nproc)}"
RAY="${RAY:-ray}"
FEDPOOL="${FEDPOOL:-fedpool}"
EXTRA=()
if [ -n "${RAY_TEMP_DIR:-}" ]; then EXTRA+=(--temp-dir "$RAY_TEMP_DIR"); fi

"$RAY" start --head --port "$RAY_PORT" --num-cpus "$NUM_CPUS" --resources '{"fedpool-head": 1}' \
  --dashboard-host 0.0.0.0 --disable-usage-stats "${EXTRA[@]}"
"$FEDPOOL" registry start --address "127.0.0.1:$RAY_PORT" --state-dir "$STATE_DIR" --pin-resource fedpool-head \
  --metrics-port "$METRICS_PORT" --metrics-host "$METRICS_HOST"
echo "head ready: workers join with  deploy/ray/worker.sh $(hostname -I 2>/dev/null | cut -d' ' -f1):$RAY_PORT"
