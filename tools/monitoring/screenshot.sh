#!/usr/bin/env bash
# Screenshot of Prometheus' graph page with headless Chromium (apt-get install chromium), for docs/img/.
#   tools/monitoring/screenshot.sh PROMETHEUS_URL OUT.png [RANGE]
# e.g. tools/monitoring/screenshot.sh http://172.31.253.10:9090 docs/img/monitoring-prometheus.png 15m
# Draws, one panel each: tokens generated per second (the recording rule), the rank containers' state, KV cache
# use; the range defaults to the last 15 minutes.
set -euo pipefail

if [ $# -lt 2 ]; then
  echo "usage: $0 PROMETHEUS_URL OUT.png [RANGE]" >&2
  exit 2
fi
prom=${1%/} out=$2 range=${3:-15m}
exprs=(
  'glm53:generation_tokens:rate1m'
  'glm53_rank_container_running'
  'vllm:kv_cache_usage_perc'
)
query=""
for i in "${!exprs[@]}"; do
  encoded=$(python3 -c 'import sys, urllib.parse; print(urllib.parse.quote(sys.argv[1], safe=""))' "${exprs[$i]}")
  query+="${query:+&}g$i.expr=$encoded&g$i.tab=0&g$i.range_input=$range"
done
curl -fsS "$prom/-/ready" >/dev/null || { echo "Prometheus at $prom is not ready" >&2; exit 1; }
# /graph with tab=0: the Graph tab of Prometheus 2 (the simulation runs Debian's 2.42); Prometheus 3 redirects /graph
# to its new UI, which reads the same g<N>.expr parameters.
curl -fsS -o /dev/null "$prom/graph" || { echo "Prometheus at $prom has no graph page at /graph" >&2; exit 1; }
# --virtual-time-budget lets the page's scripts fetch and draw before the capture; the window is tall enough for
# every panel, so the page does not scroll to the focused last one.
chromium --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=1400,2250 \
  --virtual-time-budget=15000 --screenshot="$out" "$prom/graph?$query" 2>/dev/null
[ -s "$out" ] || { echo "no screenshot written to $out" >&2; exit 1; }
echo "wrote $out from $prom/graph?$query"
