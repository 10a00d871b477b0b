"""When a silent peer counts as gone. A leaf: the node's settings (:mod:`p2ptrain.node._node_config`, read
by the CLI before libp2p is imported) take the default from here, and the membership view
(:mod:`p2ptrain.mesh._membership`) applies it."""

# Five missed heartbeats: on a busy shared machine three were missed now and then by live peers.
DEFAULT_SILENCE_HEARTBEATS = 5
