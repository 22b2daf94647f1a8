#!/bin/sh
# PID 1 of a simulated Spark: authorize the controller's key, then run sshd and dockerd.
set -eu
if [ -n "${SIM_AUTHORIZED_KEY:-}" ]; then
  printf '%s\n' "$SIM_AUTHORIZED_KEY" > /root/.ssh/authorized_keys
  chmod 600 /root/.ssh/authorized_keys
fi
ssh-keygen -A >/dev/null
if [ -n "${SIM_INSECURE_REGISTRY:-}" ]; then
  printf '{"insecure-registries": ["%s"]}\n' "$SIM_INSECURE_REGISTRY" > /etc/docker/daemon.json
fi
/usr/sbin/sshd
exec dockerd --host unix:///var/run/docker.sock >/var/log/dockerd.log 2>&1
