"""The names of the control socket's operations, declared once for both ends.

A name is a contract: the CLI, scripts and ``p2ptrain.testing`` send it (client side) and the node
and its services register a handler under it (server side), so the strings never change. This
module imports nothing, so every layer can use it: ``net.control`` serves the built-in ops, the
node and ``runtime`` register theirs, and clients name them without importing the servers.
docs/mesh.md lists each with what it answers.
"""

from __future__ import annotations

# Built into every control server (control/_socket.py).
OPS = "ops"  # the ops this node answers, sorted
CONTROL_STATS = "control.stats"  # the control socket's own counters
# The node (node.py).
STATUS = "status"  # `node status`: identity, peers, membership, counters of every layer
PING = "ping"  # cheap liveness: {"peer_id", "started"}
# The content service (node/_content.py).
IPFS_ADD = "ipfs.add"  # store a small text payload, answer its CID
IPFS_FETCH = "ipfs.fetch"  # fetch a DAG from peers into the block store
IPFS_PROGRESS = "ipfs.progress"  # bytes fetched so far by an ipfs.fetch in flight
# The task service (services/_tasks.py).
TASK_PUBLISH = "task.publish"  # publish a task file (and optionally join it)
TASK_JOIN = "task.join"  # join an announced task
TASK_LIST = "task.list"  # tasks known here
TASK_STATUS = "task.status"  # one task's state, round, members and latest model
TASK_CANCEL = "task.cancel"  # the publisher stops a task's run (TaskCancel on the tasks topic)
TASK_RESUME = "task.resume"  # the publisher continues a run it cancelled (TaskResume on the tasks topic)
# The directory of served models (services/_served.py).
SERVE_ANNOUNCE = "serve.announce"  # `model serve`: announce that this home serves a model CID at a URL
SERVE_FIND = "serve.find"  # `model predict`: the URLs at which peers announced a model CID

ALL: tuple[str, ...] = (OPS, CONTROL_STATS, STATUS, PING, IPFS_ADD, IPFS_FETCH, IPFS_PROGRESS, TASK_PUBLISH, TASK_JOIN,
                        TASK_LIST, TASK_STATUS, TASK_CANCEL, TASK_RESUME, SERVE_ANNOUNCE, SERVE_FIND)
"""Every op a full peer (node + content + tasks) answers; a test holds a running peer to exactly these."""
