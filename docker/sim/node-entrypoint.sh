#!/bin/sh
# PID 1 of a simulated Spark: authorize the controller's key (for the owner, spark, and for root), then run
# sshd and dockerd.
set -eu
# Added, not overwritten: a restart of this node is its reboot, and a reboot keeps the keys others
# authorized (the head's, which preflight adds for its ssh to the workers).
if [ -n "${SIM_AUTHORIZED_KEY:-}" ]; then
  for home in /root /home/spark; do
    touch "$home/.ssh/authorized_keys"
    grep -qxF "$SIM_AUTHORIZED_KEY" "$home/.ssh/authorized_keys" \
      || printf '%s\n' "$SIM_AUTHORIZED_KEY" >> "$home/.ssh/authorized_keys"
    chmod 600 "$home/.ssh/authorized_keys"
  done
  chown spark:spark /home/spark/.ssh/authorized_keys
fi
ssh-keygen -A >/dev/null
if [ -n "${SIM_INSECURE_REGISTRY:-}" ]; then
  printf '{"insecure-registries": ["%s"]}\n' "$SIM_INSECURE_REGISTRY" > /etc/docker/daemon.json
fi
# `docker restart` of this node is its reboot. On a real Spark /run is a tmpfs, so a reboot starts without
# the daemons' pid files, sockets and runtime state; here /run survives, and the stale docker.pid makes
# dockerd exit 1. Remove them as a boot would; containers and images in /var/lib/docker stay, as on a disk.
find /run -xdev \( -name '*.pid' -o -type s \) -delete
rm -rf /run/docker /run/containerd
mkdir -p /run/sshd
/usr/sbin/sshd
exec dockerd --host unix:///var/run/docker.sock >/var/log/dockerd.log 2>&1
