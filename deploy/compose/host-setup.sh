#!/usr/bin/env bash
# Make this host ready for `make compose-test`: a Docker engine that answers, `docker compose` (v2)
# and debootstrap. Installs only what is missing, from Debian's packages (as root), and starts dockerd
# when none answers (log: /tmp/dockerd.log). On a host with Docker set up it only checks.
set -euo pipefail

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
apt_updated=0
apt_install() {
    if [ "$apt_updated" = 0 ]; then as_root apt-get update -qq; apt_updated=1; fi
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

command -v debootstrap >/dev/null || { echo "host-setup: installing debootstrap"; apt_install debootstrap; }

if ! docker info >/dev/null 2>&1; then
    if ! command -v docker >/dev/null || ! command -v dockerd >/dev/null; then
        echo "host-setup: installing docker.io"
        apt_install docker.io
    fi
    echo "host-setup: starting dockerd (log: /tmp/dockerd.log)"
    as_root sh -c 'nohup dockerd > /tmp/dockerd.log 2>&1 &'
    for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
    docker info >/dev/null 2>&1 || { echo "host-setup: dockerd did not start; see /tmp/dockerd.log" >&2; exit 1; }
fi

if ! docker compose version >/dev/null 2>&1; then
    if apt-cache show docker-compose-plugin >/dev/null 2>&1; then
        echo "host-setup: installing docker-compose-plugin"
        apt_install docker-compose-plugin
    else
        # Debian bookworm has only Compose v1; trixie's docker-compose package is Compose v2 as a
        # CLI plugin, a static Go binary that runs on bookworm. Fetched with a private apt state, so
        # the host's sources stay as they are.
        echo "host-setup: installing Debian trixie's docker-compose (Compose v2)"
        state=$(mktemp -d)
        trap 'rm -rf "$state"' EXIT
        mkdir -p "$state/lists/partial" "$state/archives/partial"
        echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] ${DEBIAN_MIRROR:-http://deb.debian.org/debian} trixie main" \
            > "$state/sources.list"
        opts=(-o "Dir::Etc::sourcelist=$state/sources.list" -o Dir::Etc::sourceparts=/nonexistent
              -o "Dir::State::Lists=$state/lists" -o "Dir::Cache::archives=$state/archives")
        as_root apt-get "${opts[@]}" update -qq
        (cd "$state" && as_root apt-get "${opts[@]}" -qq download docker-compose)
        as_root dpkg -i "$state"/docker-compose_*.deb >/dev/null
    fi
fi
echo "host-setup: $(docker compose version), engine $(docker version --format '{{.Server.Version}}')"
