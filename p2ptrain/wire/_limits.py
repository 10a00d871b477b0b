"""Size and time limits of the wire format.

Pubsub silently drops messages near 1 MiB and carries control messages only, so our cap is far
below it: anything bigger travels on a stream or by CID.
"""

WIRE_VERSION = 1
MAX_MESSAGE_BYTES = 64 * 1024
MAX_STR_LEN = 4096
MAX_LIST_LEN = 1024
MAX_DICT_LEN = 256
# How far a message's timestamp may sit from our clock before it is dropped as stale or forged.
MAX_CLOCK_SKEW_S = 300.0
# How many recent sequence numbers per sender we remember to refuse replays: a message may arrive up
# to this many places out of order (gossip reorders a handful) and still be accepted.
REPLAY_WINDOW = 1024
# How many sequence numbers the replay guard remembers over all senders (~100 B each, so ~25 MB at
# most), whatever number of throwaway identities writes to us; least recently heard senders go first.
REPLAY_MAX_ENTRIES = 262_144
# A heartbeat's listen address: a real multiaddr is well under 100 characters.
MAX_ADDR_LEN = 256
# The model builders a heartbeat advertises (Capabilities.builders): names like "torchvision:resnet18".
MAX_BUILDERS = 64
MAX_BUILDER_NAME_LEN = 64
