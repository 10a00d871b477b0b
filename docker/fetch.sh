#!/bin/sh
# The compose's fourth peer (docker/compose.yaml, service "fetcher"): a fresh home that never trained.
# It waits for the publisher to leave the final model's CID in /shared, fetches that model by CID
# through the mesh (a temporary node bootstrapped from the seed peer; every block is checked
# against its CID), evaluates it on the dataset's test split (fetched the same way), and writes
# the result to /shared/result.json. With P2PTRAIN_IPFS (docker/compose.kubo.yaml: the peers keep
# content in one Kubo daemon and serve no Bitswap of their own) it fetches the model from that daemon
# instead (`ipfs get` re-imports the bytes and checks the CID) and does not evaluate it.
set -eu
SHARED="${P2PTRAIN_SHARED:-/shared}"
# Deadline for the publisher's run (seconds); the publisher has its own.
MODEL_WAIT_S="${MODEL_WAIT_S:-1800}"
i=0
while [ ! -s "$SHARED/model" ]; do
    i=$((i + 1))
    if [ "$i" -gt "$MODEL_WAIT_S" ]; then echo "fetcher: no model CID in $SHARED after $MODEL_WAIT_S s" >&2; exit 1; fi
    sleep 1
done
MODEL=$(cat "$SHARED/model")
MANIFEST=$(cat "$SHARED/manifest")
BOOTSTRAP=$(cat "$SHARED/bootstrap")
if [ -n "${P2PTRAIN_IPFS:-}" ]; then
    echo "fetcher: fetching model $MODEL from $P2PTRAIN_IPFS"
    p2ptrain ipfs get "$MODEL" -o "$SHARED/model.safetensors" --ipfs "$P2PTRAIN_IPFS"
    echo "{\"model_cid\": \"$MODEL\", \"bytes\": $(wc -c < "$SHARED/model.safetensors")}" > "$SHARED/result.json"
    echo "fetcher: $(cat "$SHARED/result.json")"
    exit 0
fi
echo "fetcher: fetching model $MODEL through $BOOTSTRAP"
p2ptrain model fetch "$MODEL" -o /tmp/model.safetensors --bootstrap "$BOOTSTRAP"
p2ptrain model eval /tmp/model.safetensors --dataset "$MANIFEST" --bootstrap "$BOOTSTRAP" --json > /tmp/eval.json
python3 - "$MODEL" /tmp/eval.json > "$SHARED/result.json" <<'PY'
import json, sys
print(json.dumps({"model_cid": sys.argv[1], **json.load(open(sys.argv[2]))}))
PY
echo "fetcher: $(cat "$SHARED/result.json")"
