#!/usr/bin/env bash
# What `make demo` and `make test` need on a Debian/Ubuntu machine beyond a checkout: the system packages
# (Docker, debootstrap for the simulated images' base, rsync and ssh for the simulated fabric, python3-venv
# for the virtualenvs, make, git, promtool and shellcheck for `make check`) and a running dockerd.
# Run once as root; `make` and `.ci/run` call it.
#   tools/bootstrap-host.sh           install what is missing, start dockerd when none answers (root)
#   tools/bootstrap-host.sh --check   only say what is missing (exit 1 when something is)
set -euo pipefail

# package:command that proves it is installed
packages=(docker.io:dockerd debootstrap:debootstrap rsync:rsync openssh-client:ssh make:make git:git
          python3-venv:- ca-certificates:- prometheus:promtool shellcheck:shellcheck)

missing=()
for entry in "${packages[@]}"; do
  pkg=${entry%%:*} cmd=${entry#*:}
  if [ "$cmd" = - ]; then
    dpkg-query -W -f '${Status}' "$pkg" 2>/dev/null | grep -q 'ok installed' || missing+=("$pkg")
  else
    command -v "$cmd" >/dev/null 2>&1 || PATH=$PATH:/usr/sbin:/sbin command -v "$cmd" >/dev/null 2>&1 || missing+=("$pkg")
  fi
done
docker_up() { docker info >/dev/null 2>&1; }

if [ "${1:-}" = --check ]; then
  ok=0
  [ ${#missing[@]} -eq 0 ] || { echo "missing packages: ${missing[*]}"; ok=1; }
  if ! docker_up; then
    ok=1
    if [ "$(id -u)" != 0 ] && [ -S /var/run/docker.sock ]; then
      echo "dockerd runs but $(id -un) may not use it: sudo usermod -aG docker $(id -un), then log in again"
    else
      echo "no docker daemon answers (docker info)"
    fi
  fi
  exit $ok
fi

if [ "$(id -u)" != 0 ]; then
  echo "tools/bootstrap-host.sh installs packages and starts dockerd: run it as root (sudo $0)" >&2
  exit 1
fi
if [ ${#missing[@]} -gt 0 ]; then
  command -v apt-get >/dev/null || { echo "not a Debian/Ubuntu machine: install ${missing[*]} yourself" >&2; exit 1; }
  echo "apt-get install ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
if ! docker_up; then
  # systemd where it runs (a normal machine), else dockerd in the background (containers, CI runners).
  if [ -d /run/systemd/system ]; then
    systemctl enable --now docker >/dev/null
  else
    echo "starting dockerd (log: /var/log/dockerd.log)"
    (dockerd >/var/log/dockerd.log 2>&1 &)
  fi
  for _ in $(seq 60); do docker_up && break; sleep 1; done
  docker_up || { echo "dockerd did not come up:" >&2; tail -20 /var/log/dockerd.log >&2 2>/dev/null || true; exit 1; }
fi
echo "host ready: $(docker version --format 'docker {{.Server.Version}}')"
