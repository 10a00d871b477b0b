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
# How many recent sequence numbers per sender we remember to refuse replays.
REPLAY_WINDOW = 4096
