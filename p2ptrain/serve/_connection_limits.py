"""The model server's connection cap, named by ``model serve --max-connections``.

A module without imports, so the CLI can name the default in its help without importing the
server (torch, trio, hypercorn). :mod:`p2ptrain.serve._server` enforces it.
"""

# Connections served at once (--max-connections). Each holds a socket and a few tasks for up to
# server.KEEP_ALIVE_S idle or app.BODY_TIMEOUT_S mid-body; bodies are bounded on their own
# (app.MAX_BODY_BYTES_IN_FLIGHT). 256: four times the bench's 64 clients, and a quarter of the
# 1024 open files a process usually gets, so a flood of idle connections cannot take them all.
# Past the cap a connection waits in the listen backlog (server.BACKLOG) until one ends.
MAX_CONNECTIONS = 256
# --max-connections at most: past this the open-files limit, not the cap, would decide.
MAX_CONNECTIONS_LIMIT = 4096
