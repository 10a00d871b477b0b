#!/usr/bin/env bash
# Start a js-ipfs daemon on loopback and print its RPC API address (`API http://127.0.0.1:PORT`).
#
#   ipfs/start-jsipfs.sh [REPO]        REPO defaults to ipfs/.jsipfs/repo (created on first use)
#
# Environment: JSIPFS_API_PORT (default 5101; 0 picks a free port), JSIPFS_GATEWAY_PORT and
# JSIPFS_RPC_PORT (default 0). The daemon runs in the foreground of this script; stop it with Ctrl-C or
# by signalling this script (it stops the daemon with it).
#
# The repo is made with js-ipfs' `test` profile (no bootstrap peers, no mDNS, swarm on 127.0.0.1) and
# every listener is pinned to 127.0.0.1 before the daemon first starts, so it never reaches beyond the
# machine. It stands in for Kubo in tests: same RPC API for add/cat/block/refs/pin.
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
DEST="${JSIPFS_DIR:-$HERE/.jsipfs}"
REPO="${1:-$DEST/repo}"
API_PORT="${JSIPFS_API_PORT:-5101}"
GATEWAY_PORT="${JSIPFS_GATEWAY_PORT:-0}"
RPC_PORT="${JSIPFS_RPC_PORT:-0}"

[ -f "$DEST/.installed" ] || { echo "start-jsipfs: js-ipfs is not installed; run ipfs/install-jsipfs.sh" >&2; exit 1; }
export IPFS_PATH="$REPO"
jsipfs() { node --require "$DEST/polyfill.cjs" "$DEST/node_modules/ipfs/src/cli.js" "$@"; }

if [ ! -f "$REPO/config" ]; then
    mkdir -p "$REPO"
    jsipfs init --profile=test >/dev/null
fi
# Loopback only, no discovery: applied on every start, so an edited config cannot widen it.
API_PORT="$API_PORT" GATEWAY_PORT="$GATEWAY_PORT" RPC_PORT="$RPC_PORT" node -e '
const fs = require("fs")
const path = process.env.IPFS_PATH + "/config"
const c = JSON.parse(fs.readFileSync(path, "utf8"))
c.Addresses.API = "/ip4/127.0.0.1/tcp/" + process.env.API_PORT
c.Addresses.Gateway = "/ip4/127.0.0.1/tcp/" + process.env.GATEWAY_PORT
c.Addresses.RPC = "/ip4/127.0.0.1/tcp/" + process.env.RPC_PORT
c.Addresses.Swarm = ["/ip4/127.0.0.1/tcp/0"]
c.Addresses.Announce = []
c.Bootstrap = []
c.Discovery = { MDNS: { Enabled: false, Interval: 10 }, webRTCStar: { Enabled: false } }
fs.writeFileSync(path + ".tmp", JSON.stringify(c, null, 2))
fs.renameSync(path + ".tmp", path)
'
rm -f "$REPO/api"
# A daemon killed hard leaves repo.lock behind, and js-ipfs then refuses the repo. The lock is ours to
# clear only when the daemon this script last started (daemon.pid) is gone.
if [ -e "$REPO/repo.lock" ]; then
    if [ -s "$REPO/daemon.pid" ] && kill -0 "$(cat "$REPO/daemon.pid")" 2>/dev/null; then
        echo "start-jsipfs: a daemon (pid $(cat "$REPO/daemon.pid")) already runs on $REPO" >&2; exit 1
    fi
    rm -rf "$REPO/repo.lock"
fi

node --require "$DEST/polyfill.cjs" "$DEST/node_modules/ipfs/src/cli.js" daemon >"$REPO/daemon.log" 2>&1 &
DAEMON=$!
echo "$DAEMON" > "$REPO/daemon.pid"
trap 'kill "$DAEMON" 2>/dev/null; wait "$DAEMON" 2>/dev/null; rm -f "$REPO/daemon.pid"' EXIT INT TERM

# The daemon writes its API multiaddr to $REPO/api once it listens.
for _ in $(seq 1 240); do
    if [ -s "$REPO/api" ] && grep -q "Daemon is ready" "$REPO/daemon.log"; then break; fi
    if ! kill -0 "$DAEMON" 2>/dev/null; then
        echo "start-jsipfs: the daemon exited; its log:" >&2; cat "$REPO/daemon.log" >&2; exit 1
    fi
    sleep 0.5
done
[ -s "$REPO/api" ] || { echo "start-jsipfs: no API after 120 s; log in $REPO/daemon.log" >&2; exit 1; }
# /ip4/127.0.0.1/tcp/PORT/http -> http://127.0.0.1:PORT
IFS=/ read -r _ _ ADDR _ PORT _ < "$REPO/api" || true  # the file has no final newline
echo "API http://$ADDR:$PORT"
wait "$DAEMON"
