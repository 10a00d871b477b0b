#!/bin/sh
# Container entry point for one peer: `p2ptrain node start` with the container's arguments (e.g.
# --accept-tasks, --bootstrap ...), listening on P2PTRAIN_IP:P2PTRAIN_PORT.
#
# For a cluster started together (docker/compose.yaml) the peers find each other through a shared
# volume, so no peer ID or key is ever baked into an image or committed: the peer with SEED=1
# writes its bootstrap multiaddr into $P2PTRAIN_SHARED/bootstrap, and the peers with SEED=follow
# wait for that file and bootstrap from it. Without SEED the peer just starts.
# Environment:
#   P2PTRAIN_PORT          TCP port to listen on (default 4001)
#   P2PTRAIN_IP            the IPv4 address to listen on (default: the container's own address,
#                          `hostname -i`; 127.0.0.1 with network_mode: host on one machine). Not
#                          0.0.0.0: a node's heartbeats tell the other peers its listen addresses,
#                          and they dial those (docs/deploy.md).
#   SEED                   1 (write the bootstrap file), follow (wait for it), or unset
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

case "${SEED:-}" in
    1)
        ID=$(p2ptrain node id --home "$P2PTRAIN_HOME")
        echo "$LISTEN/p2p/$ID" > "$SHARED/bootstrap.tmp"
        mv "$SHARED/bootstrap.tmp" "$SHARED/bootstrap"
        exec p2ptrain node start "$@" ;;
    follow)
        i=0
        while [ ! -s "$SHARED/bootstrap" ]; do
            i=$((i + 1))
            if [ "$i" -gt "$BOOTSTRAP_WAIT_S" ]; then echo "no bootstrap address in $SHARED after $BOOTSTRAP_WAIT_S s" >&2; exit 1; fi
            sleep 1
        done
        exec p2ptrain node start "$@" --bootstrap "$(cat "$SHARED/bootstrap")" ;;
    "")
        exec p2ptrain node start "$@" ;;
    *)
        echo "SEED must be 1, follow or unset, not '$SEED'" >&2; exit 2 ;;
esac
