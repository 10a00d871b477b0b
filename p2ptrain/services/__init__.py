"""What a node runs beside its runs: the task service (publish, announcements, joining, one
``TaskRun`` per joined task), answers to head requests, the latest-head finder, the directory of
served models, the Prometheus exporter, ``make_peer`` (a node plus its services: what
``p2ptrain node start`` runs), and content by CID made local (``ensure_local``, ``with_ephemeral_node``: the
fetch paths the CLI's commands and ``p2ptrain.load_state`` share). Imports ``run`` and everything below it.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from p2ptrain.services._fetching import (
        ensure_local as ensure_local,
        EPHEMERAL_MESH_TIMEOUT_S as EPHEMERAL_MESH_TIMEOUT_S,
        fetch_progress as fetch_progress,
        fetch_through as fetch_through,
        find_latest as find_latest,
        home_holding as home_holding,
        node_answers as node_answers,
        NODE_PROBE_TIMEOUT_S as NODE_PROBE_TIMEOUT_S,
        PROGRESS_LINE_S as PROGRESS_LINE_S,
        split_shards as split_shards,
        with_ephemeral_node as with_ephemeral_node,
    )
    from p2ptrain.services._latest import LatestFinder as LatestFinder, MAX_SEEN_HEADS as MAX_SEEN_HEADS
    from p2ptrain.services._metrics import MetricsServer as MetricsServer, parse_address as parse_address
    from p2ptrain.services._peer import Fetcher as Fetcher, make_fetcher as make_fetcher, make_peer as make_peer, Peer as Peer
    from p2ptrain.services._run_roots import run_state_roots as run_state_roots
    from p2ptrain.services._served import check_url as check_url, SERVED_EVERY_S as SERVED_EVERY_S
    from p2ptrain.services._tasks import KnownTask as KnownTask, TaskOptions as TaskOptions
else:
    from p2ptrain._exports import lazy_exports

    __getattr__, __dir__, __all__ = lazy_exports(__name__, __file__)
