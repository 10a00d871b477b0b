#!/bin/sh
# The compose's one-shot publisher (docker/compose.yaml, service "publish"). It shares peer1's home
# volume, so the p2ptrain commands below reach peer1's running node through its control socket
# (same uid, the socket's 0600 mode is the access control). It adds scikit-learn's digits as 8
# shards to peer1's store, publishes the demo task (p2ptrain.task._demo_task's template, the task
# `p2ptrain demo` trains), follows it until every member is done, and leaves the task, dataset and
# final model CIDs in /shared for the fetcher. Environment: PEERS (members, default 3), STEPS
# (default 150), CHECKPOINT (default 25), DENSITY (default 0.01), P2PTRAIN_IPFS (the Kubo RPC API
# peer1's node keeps content in, docker/compose.kubo.yaml: the dataset goes there too).
set -eu
SHARED="${P2PTRAIN_SHARED:-/shared}"
PEERS="${PEERS:-3}"
# Deadlines of this script's waits (seconds): the node's control socket, the mesh, the run.
NODE_WAIT_S=120
MESH_WAIT_S=120
RUN_WAIT_S="${RUN_WAIT_S:-1800}"

wait_for() {  # wait_for SECONDS WHAT COMMAND...: run COMMAND once a second until it succeeds
    limit=$1 what=$2; shift 2; i=0
    until "$@" >/dev/null 2>&1; do
        i=$((i + 1))
        if [ "$i" -gt "$limit" ]; then echo "publish: gave up waiting for $what after $limit s" >&2; exit 1; fi
        sleep 1
    done
}
peers_seen() {  # peers_seen N: the node hears at least N other peers
    p2ptrain node status --json | python3 -c "import json,sys; sys.exit(len(json.load(sys.stdin)['peers']) < $1)"
}

wait_for "$NODE_WAIT_S" "peer1's node" p2ptrain node status
wait_for "$MESH_WAIT_S" "the mesh ($PEERS peers)" peers_seen $((PEERS - 1))
echo "publish: peer1 hears the other $((PEERS - 1)) peers"

if [ -n "${P2PTRAIN_IPFS:-}" ]; then set -- --ipfs "$P2PTRAIN_IPFS"; else set --; fi
MANIFEST=$(p2ptrain dataset add sklearn:digits --shards 8 "$@")
echo "publish: dataset manifest $MANIFEST"
python3 - "$MANIFEST" "$PEERS" > /tmp/task.toml <<'PY'
import os, sys
from p2ptrain.task import TASK_TEMPLATE
print(TASK_TEMPLATE.format(manifest=sys.argv[1], peers=sys.argv[2], steps=os.environ.get("STEPS", "150"),
                           checkpoint=os.environ.get("CHECKPOINT", "25"), density=os.environ.get("DENSITY", "0.01")))
PY
TASK=$(p2ptrain task publish /tmp/task.toml)
echo "publish: task $TASK"
echo "$MANIFEST" > "$SHARED/manifest"

started=$(date +%s)
last=""
while :; do
    line=$(p2ptrain task status "$TASK" --json | python3 -c '
import json, sys
s = json.load(sys.stdin)
done = s.get("state") == "done" and s.get("version", 0) > 0
print(("done" if done else "run"), s.get("state"), s.get("step", 0), s.get("version", 0),
      len(s.get("members") or []), s.get("latest_model_cid") or "-")')
    set -- $line
    if [ "$1 $3" != "$last" ]; then echo "publish: $2 step $3, model v$4, $5 members"; last="$1 $3"; fi
    if [ "$1" = done ]; then break; fi
    if [ "$2" = failed ]; then p2ptrain task status "$TASK" >&2; exit 1; fi
    if [ $(( $(date +%s) - started )) -gt "$RUN_WAIT_S" ]; then echo "publish: the run did not finish in $RUN_WAIT_S s" >&2; exit 1; fi
    sleep 2
done
echo "publish: trained in $(( $(date +%s) - started )) s; final model $6"
p2ptrain task status "$TASK"
echo "$TASK" > "$SHARED/task"
echo "$6" > "$SHARED/model.tmp" && mv "$SHARED/model.tmp" "$SHARED/model"
