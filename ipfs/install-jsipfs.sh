#!/usr/bin/env bash
# Install js-ipfs (npm `ipfs@0.66.1`) into ipfs/.jsipfs: a real IPFS RPC daemon that installs from npm,
# used by the Kubo-backend tests (tests/ipfs/test_kubo.py) and by anyone without a Kubo binary.
#
# js-ipfs is deprecated; it is here because no Kubo binary installs from the registries this project can
# reach. Two things make it run on Node 20: npm overrides that pin three transitive packages to versions
# that still load, and a Promise.withResolvers polyfill loaded with `node --require`.
# Idempotent: a finished install leaves ipfs/.jsipfs/.installed and is not repeated.
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
DEST="${JSIPFS_DIR:-$HERE/.jsipfs}"

if [ -f "$DEST/.installed" ]; then
    echo "js-ipfs already installed in $DEST"
    exit 0
fi
command -v node >/dev/null || { echo "install-jsipfs: node is not installed" >&2; exit 1; }
command -v npm >/dev/null || { echo "install-jsipfs: npm is not installed" >&2; exit 1; }

mkdir -p "$DEST"
cat > "$DEST/package.json" <<'JSON'
{
  "name": "p2ptrain-jsipfs",
  "private": true,
  "dependencies": { "ipfs": "0.66.1" },
  "overrides": {
    "@libp2p/tcp": "6.1.0",
    "@libp2p/websockets": "5.0.3",
    "@multiformats/mafmt": { "@multiformats/multiaddr": "11.6.1" }
  }
}
JSON
# Node 20 lacks Promise.withResolvers (Node 22 has it); a dependency of js-ipfs calls it.
cat > "$DEST/polyfill.cjs" <<'JS'
if (typeof Promise.withResolvers !== 'function') {
  Promise.withResolvers = function withResolvers () {
    let resolve, reject
    const promise = new Promise((res, rej) => { resolve = res; reject = rej })
    return { promise, resolve, reject }
  }
}
JS
( cd "$DEST" && npm install --no-audit --no-fund --loglevel=error )
touch "$DEST/.installed"
echo "js-ipfs installed in $DEST"
