#!/usr/bin/env bash
# Make a Python 3.11 base image from Debian bookworm's own packages, for hosts that cannot pull
# python:3.11-slim from a registry: debootstrap a minimal root file system and `docker import` it.
#
#   deploy/compose/base-image.sh [TAG]      # default tandem-base:bookworm; does nothing if TAG exists
#   docker build --build-arg BASE_IMAGE=tandem-base:bookworm -t tandem:latest .
#
# Needs root, debootstrap and a Debian mirror (DEBIAN_MIRROR, default deb.debian.org).
set -euo pipefail

tag=${1:-tandem-base:bookworm}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}

if docker image inspect "$tag" >/dev/null 2>&1; then
    echo "base image $tag exists"
    exit 0
fi
command -v debootstrap >/dev/null || { echo "debootstrap not found: apt-get install debootstrap" >&2; exit 1; }

root=$(mktemp -d /tmp/tandem-base.XXXXXX)
trap 'rm -rf "$root"' EXIT
echo "debootstrap bookworm into $root (a few minutes)"
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$root" "$mirror" \
    > "$root.log" 2>&1 || { tail -20 "$root.log" >&2; exit 1; }
rm -f "$root.log"
# Package caches and lists are not needed to run Python.
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root"/usr/share/doc/* "$root"/usr/share/man/*
chroot "$root" python3 --version
tar -C "$root" --numeric-owner -c . \
    | docker import -c 'ENV LANG=C.UTF-8' -c 'CMD ["python3"]' -m "debootstrap --variant=minbase bookworm + python3" - "$tag"
echo "base image $tag made"
