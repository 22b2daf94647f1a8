#!/usr/bin/env bash
# Make the Debian base image every simulated image starts from, without any container registry:
# debootstrap a minimal bookworm and import it. Needs root (debootstrap) the first time only.
set -euo pipefail
image=${1:-glm53-sim/base:bookworm}
if docker image inspect "$image" >/dev/null 2>&1; then
  echo "$image already present"; exit 0
fi
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
rootfs=$(mktemp -d)
trap 'rm -rf "$rootfs"' EXIT
echo "debootstrap bookworm into $rootfs (about a minute)"
debootstrap --variant=minbase --include=python3,openssh-server,rsync,ca-certificates bookworm "$rootfs" "$mirror" >/dev/null
tar -C "$rootfs" -c . | docker import - "$image"
