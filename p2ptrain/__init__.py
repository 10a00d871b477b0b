"""p2ptrain: peer-to-peer training of PyTorch models over libp2p and IPFS."""

__version__ = "0.1.0"
