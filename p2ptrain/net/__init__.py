"""libp2p transport: hosts that speak Noise only, pubsub settings, stream helpers."""
