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
# No .deb kept, now or by any later apt-get in an image built on this one (Debian's own images do the same): every
# byte of the vLLM image built on it moves several times per test run (registry push, pull, ship to each worker).
rm -f "$rootfs"/var/cache/apt/archives/*.deb
cat >"$rootfs"/etc/apt/apt.conf.d/docker-clean <<'CONF'
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Binary::apt::APT::Keep-Downloaded-Packages "false";
CONF
tar -C "$rootfs" -c . | docker import - "$image"
