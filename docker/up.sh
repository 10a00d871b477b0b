#!/bin/sh
# Run docker/compose.yaml with podman-compose (1.6.0 from PyPI ran it; Debian bookworm's 1.0.3 adds a bridge
# network to network_mode: host and podman refuses the container) and report: three peers train the demo task, the
# fetcher fetches the final model by CID and evaluates it. Prints the publisher's and the fetcher's
# logs and the fetcher's result, then takes the stack down (volumes included) unless KEEP=1.
#   docker/build.sh && docker/up.sh
set -eu
REPO=$(cd "$(dirname "$0")/.." && pwd)
export CONTAINERS_CONF="$REPO/docker/containers.conf"
PROJECT="${PROJECT:-p2ptrain}"
# Deadline for the whole run: start, mesh, 150 steps on 3 peers, fetch and eval (about 2 minutes on
# a 2-core machine; generous for a loaded one).
UP_WAIT_S="${UP_WAIT_S:-1200}"
PODMAN_COMPOSE="${PODMAN_COMPOSE:-podman-compose}"
case "$($PODMAN_COMPOSE --version 2>/dev/null)" in
    *"version 1.0."*|*"version  1.0."*|"")
        echo "up.sh: needs a podman-compose newer than Debian bookworm's 1.0.3, which cannot run network_mode: host (1.6.0 from PyPI ran it):" >&2
        echo "  python3 -m venv /var/tmp/p2ptrain-build/compose-venv && /var/tmp/p2ptrain-build/compose-venv/bin/pip install podman-compose" >&2
        echo "  PODMAN_COMPOSE=/var/tmp/p2ptrain-build/compose-venv/bin/podman-compose docker/up.sh" >&2
        exit 2 ;;
esac
compose() { $PODMAN_COMPOSE -p "$PROJECT" -f "$REPO/docker/compose.yaml" "$@"; }
container() {  # container SERVICE: the name of that service's container in this project
    podman ps -a --format '{{.Names}}' --filter "label=io.podman.compose.project=$PROJECT" \
        --filter "label=com.docker.compose.service=$1" | head -n 1
}

compose down -v >/dev/null 2>&1 || true   # a previous run's containers and volumes
start=$(date +%s)
compose up -d
rc=0
fetcher=$(container fetcher)
timeout "$UP_WAIT_S" podman wait "$fetcher" >/dev/null || rc=$?
end=$(date +%s)
echo "---- publish"; podman logs "$(container publish)" 2>&1 | tail -n 30
echo "---- fetcher"; podman logs "$fetcher" 2>&1 | tail -n 20
status=$(podman inspect --format '{{.State.ExitCode}}' "$fetcher")
echo "---- up.sh: fetcher exited with $status after $((end - start)) s (wait rc $rc)"
if [ "${KEEP:-0}" != 1 ]; then compose down -v >/dev/null 2>&1; fi
[ "$rc" = 0 ] && [ "$status" = 0 ]
