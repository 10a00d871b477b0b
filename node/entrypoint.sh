#!/bin/sh
# Container entry point for one peer (docker/compose.yaml).
#
# The first peer (SEED=1) writes its bootstrap multiaddr into the shared volume;
# the others wait for that file and bootstrap from it, so no peer ID or key is
# ever baked into an image or committed.
set -eu
LISTEN="/ip4/0.0.0.0/tcp/${P2PTRAIN_PORT:-4001}"
SHARED="${P2PTRAIN_SHARED:-/shared}"
IPFS_ARGS=""
if [ -n "${P2PTRAIN_IPFS:-}" ]; then IPFS_ARGS="--ipfs ${P2PTRAIN_IPFS}"; fi

if [ "${SEED:-0}" = "1" ]; then
    ID=$(p2ptrain node id --home "$P2PTRAIN_HOME")
    echo "/dns4/$(hostname)/tcp/${P2PTRAIN_PORT:-4001}/p2p/$ID" > "$SHARED/bootstrap.tmp"
    mv "$SHARED/bootstrap.tmp" "$SHARED/bootstrap"
    exec p2ptrain node start --home "$P2PTRAIN_HOME" --listen "$LISTEN" $IPFS_ARGS "$@"
fi

i=0
while [ ! -s "$SHARED/bootstrap" ]; do
    i=$((i + 1))
    if [ "$i" -gt 120 ]; then echo "no bootstrap address after 120 s" >&2; exit 1; fi
    sleep 1
done
exec p2ptrain node start --home "$P2PTRAIN_HOME" --listen "$LISTEN" \
    --bootstrap "$(cat "$SHARED/bootstrap")" $IPFS_ARGS "$@"
