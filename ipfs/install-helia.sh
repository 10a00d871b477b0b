#!/usr/bin/env bash
# Install Helia (JS IPFS on js-libp2p 3) and a Node 22 binary into ipfs/.helia, for the Bitswap interop
# test (tests/ipfs/test_helia.py, driving ipfs/helia-peer.mjs).
#
# Helia 7 needs Node >= 22; `npm install node@22` puts a Node 22 binary under node_modules/.bin, so any
# machine with npm can run it whatever its own node is. Idempotent: a finished install leaves
# ipfs/.helia/.installed and is not repeated.
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
DEST="${HELIA_DIR:-$HERE/.helia}"

if [ -f "$DEST/.installed" ]; then
    echo "Helia already installed in $DEST"
    exit 0
fi
command -v npm >/dev/null || { echo "install-helia: npm is not installed" >&2; exit 1; }

mkdir -p "$DEST"
cat > "$DEST/package.json" <<'JSON'
{ "name": "p2ptrain-helia", "private": true, "type": "module" }
JSON
( cd "$DEST" && npm install --no-audit --no-fund --loglevel=error \
    node@22 helia @helia/unixfs @helia/bitswap@4 @helia/libp2p @libp2p/tcp @libp2p/noise @libp2p/yamux \
    @libp2p/identify @multiformats/multiaddr ipfs-unixfs-importer )
"$DEST/node_modules/.bin/node" --version
# ES modules resolve packages from the script's own folder: run helia-peer.mjs through a link in DEST
# (with node --preserve-symlinks-main).
ln -sf "$HERE/helia-peer.mjs" "$DEST/helia-peer.mjs"
touch "$DEST/.installed"
echo "Helia installed in $DEST"
