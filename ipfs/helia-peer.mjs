// A Helia node (JS IPFS on js-libp2p 3) on 127.0.0.1 over TCP + Noise + yamux, driven by JSON lines on
// stdin, one JSON answer per line on stdout. Used by tests/ipfs/test_helia.py to check that p2ptrain's
// Bitswap works with Helia in both directions. Nothing but Bitswap: no DHT, no HTTP routing or
// gateways, so it only ever talks to the peers it is told to dial.
//
//   {"op": "add", "path": FILE, "cid_version": 0|1}  -> {"cid": CID}   (Kubo's defaults for that version)
//   {"op": "dial", "addr": MULTIADDR}                 -> {"ok": true}
//   {"op": "cat", "cid": CID, "timeout_ms": N}        -> {"bytes": N, "sha256": HEX}
// At start it prints {"peer_id": ID, "addrs": [MULTIADDR, ...]}. An error answers {"error": MESSAGE}.
import { createHash } from 'node:crypto'
import { createReadStream } from 'node:fs'
import { createInterface } from 'node:readline'
import { withBitswap } from '@helia/bitswap'
import { withLibp2pLight } from '@helia/libp2p'
import { unixfs } from '@helia/unixfs'
import { identify } from '@libp2p/identify'
import { noise } from '@libp2p/noise'
import { tcp } from '@libp2p/tcp'
import { yamux } from '@libp2p/yamux'
import { multiaddr } from '@multiformats/multiaddr'
import { createHeliaLight } from 'helia'
import { fixedSize } from 'ipfs-unixfs-importer/chunker'
import { balanced } from 'ipfs-unixfs-importer/layout'

// Helia 7 is assembled from mixins; the "light" ones add nothing we did not ask for (the defaults would
// add HTTP routers, gateways and a DHT that reach for the Internet).
const helia = withBitswap(withLibp2pLight(await createHeliaLight(), {
  addresses: { listen: ['/ip4/127.0.0.1/tcp/0'] },
  transports: [tcp()],
  connectionEncrypters: [noise()],
  streamMuxers: [yamux()],
  services: { identify: identify() }
}))
await helia.start()
const libp2p = helia.libp2p
const fs = unixfs(helia)

const say = (obj) => process.stdout.write(JSON.stringify(obj) + '\n')

async function handle (req) {
  if (req.op === 'add') {
    // Kubo's defaults (256 KiB chunks, at most 174 links a node; raw leaves with CIDv1), not
    // @helia/unixfs's own (1 MiB chunks, 1,024 links): a file then has the same CID on every node.
    const v0 = req.cid_version === 0
    const cid = await fs.addByteStream(createReadStream(req.path), {
      cidVersion: v0 ? 0 : 1,
      rawLeaves: !v0,
      chunker: fixedSize({ chunkSize: 262144 }),
      layout: balanced({ maxChildrenPerNode: 174 })
    })
    return { cid: cid.toString() }
  }
  if (req.op === 'dial') {
    await libp2p.dial(multiaddr(req.addr))
    return { ok: true }
  }
  if (req.op === 'cat') {
    const hash = createHash('sha256')
    let bytes = 0
    for await (const chunk of fs.cat(req.cid, { signal: AbortSignal.timeout(req.timeout_ms ?? 60000) })) {
      hash.update(chunk)
      bytes += chunk.byteLength
    }
    return { bytes, sha256: hash.digest('hex') }
  }
  throw new Error(`unknown op ${req.op}`)
}

say({ peer_id: libp2p.peerId.toString(), addrs: libp2p.getMultiaddrs().map(String) })
// One request at a time, in order: the test waits for each answer before the next.
for await (const line of createInterface({ input: process.stdin })) {
  if (!line.trim()) continue
  try {
    say(await handle(JSON.parse(line)))
  } catch (err) {
    say({ error: String(err?.stack ?? err) })
  }
}
await helia.stop()
process.exit(0)
