#!/bin/sh
# The simulated registry requires a login, as a private registry does: the htpasswd file (bcrypt, the only
# hash the registry accepts) is written from the credentials roles/sim_cluster passes in.
set -eu
if [ -z "${SIM_REGISTRY_USERNAME:-}" ] || [ -z "${SIM_REGISTRY_PASSWORD:-}" ]; then
  echo "SIM_REGISTRY_USERNAME and SIM_REGISTRY_PASSWORD must be set" >&2
  exit 2
fi
htpasswd -Bbc /etc/docker/registry/htpasswd "$SIM_REGISTRY_USERNAME" "$SIM_REGISTRY_PASSWORD" 2>/dev/null
exec /usr/bin/docker-registry serve /etc/docker/registry/config.yml
