#!/bin/sh
# Container entry point for one peer (docker/compose.yaml): `p2ptrain node start` with the
# arguments the container was given (e.g. --accept-tasks).
#
# The first peer (SEED=1) writes its bootstrap multiaddr into the shared volume; the others wait
# for that file and bootstrap from it, so no peer ID or key is ever baked into an image or
# committed. Environment:
#   P2PTRAIN_PORT          TCP port to listen on (default 4001)
#   P2PTRAIN_IP            the IPv4 address to listen on (default: the container's own address,
#                          `hostname -i`; 127.0.0.1 with network_mode: host on one machine). Not
#                          0.0.0.0: a node's heartbeats tell the other peers its listen addresses,
#                          and they dial those (docs/deploy.md).
#   P2PTRAIN_SHARED        the shared folder (default /shared)
#   P2PTRAIN_IPFS          a Kubo RPC API to keep content in instead of the embedded store
set -eu
PORT="${P2PTRAIN_PORT:-4001}"
IP="${P2PTRAIN_IP:-$(hostname -i | cut -d' ' -f1)}"
LISTEN="/ip4/$IP/tcp/$PORT"
SHARED="${P2PTRAIN_SHARED:-/shared}"
# How long a peer waits for the seed's address: the seed needs a few seconds to create its identity.
BOOTSTRAP_WAIT_S=120
set --  --home "$P2PTRAIN_HOME" --listen "$LISTEN" "$@"
if [ -n "${P2PTRAIN_IPFS:-}" ]; then set -- "$@" --ipfs "$P2PTRAIN_IPFS"; fi

if [ "${SEED:-0}" = "1" ]; then
    ID=$(p2ptrain node id --home "$P2PTRAIN_HOME")
    echo "$LISTEN/p2p/$ID" > "$SHARED/bootstrap.tmp"
    mv "$SHARED/bootstrap.tmp" "$SHARED/bootstrap"
    exec p2ptrain node start "$@"
fi

i=0
while [ ! -s "$SHARED/bootstrap" ]; do
    i=$((i + 1))
    if [ "$i" -gt "$BOOTSTRAP_WAIT_S" ]; then echo "no bootstrap address in $SHARED after $BOOTSTRAP_WAIT_S s" >&2; exit 1; fi
    sleep 1
done
exec p2ptrain node start "$@" --bootstrap "$(cat "$SHARED/bootstrap")"
