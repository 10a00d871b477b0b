"""Prometheus metrics of a running peer: ``p2ptrain node start --metrics 127.0.0.1:9464``.

Nothing is counted twice for the exporter: the node and its services already keep counters for
``node status`` and ``task status``; :class:`PeerCollector` reads them at scrape time and turns them
into metric families (docs/operating.md lists the names). The only state kept for metrics alone is
the bucketed round times of each run (:mod:`p2ptrain.base._round_histograms`), which no status holds.

Threads: prometheus-client serves HTTP from its own thread (a ``ThreadingWSGIServer``), beside trio.
That is safe here because a scrape never touches the node's objects from that thread: it asks the
trio thread to take the snapshot (``trio.from_thread.run_sync``), so every counter is read between
two trio steps, never while a coroutine is half-way through an update. Serving HTTP from a trio task
instead would mean a second HTTP stack for one plain GET; the client's server is the one Prometheus
users know. Its threads are bounded in time (:data:`REQUEST_TIMEOUT_S`) and in work
(:data:`MAX_CONCURRENT_SCRAPES` snapshots at once). Loopback is the default address: the numbers
name peers, tasks and traffic, which is no one else's business unless the operator says so with an
explicit address.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

import trio
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import ThreadingWSGIServer, make_wsgi_app
from prometheus_client.registry import Collector, CollectorRegistry

from p2ptrain.base import AddressError, ArgumentError, UserError, parse_host_port, short_id
from p2ptrain.services._peer import Peer
from p2ptrain.control import NodeStatus, TaskStatus

logger = logging.getLogger(__name__)

DEFAULT_METRICS_HOST = "127.0.0.1"
# A scrape's request must arrive within this, or its connection is closed: a client that opens a
# connection and sends nothing holds one server thread for this long, not forever. Prometheus sends
# its GET at once; 10 s is its default scrape timeout.
REQUEST_TIMEOUT_S = 10.0
# Scrapes answered at once; one more while these run gets an empty answer (it does not wait).
# Each takes a snapshot in the trio thread (about a millisecond, longer with many tasks): one
# Prometheus and a curl or two need no more, and a loop of requests cannot keep trio busy.
MAX_CONCURRENT_SCRAPES = 4
LOOPBACK_HOSTS = ("127.0.0.1", "::1", "localhost")
PREFIX = "p2ptrain"


def parse_address(text: str, flag: str = "--metrics") -> tuple[str, int]:
    """``HOST:PORT`` or ``PORT`` (on loopback) → (host, port); an :class:`ArgumentError` otherwise,
    which names ``metrics=`` to Python code and ``flag`` on the command line (``--metrics``, or
    ``$P2PTRAIN_METRICS`` where the value came from the environment)."""
    try:
        return parse_host_port(text, default_host=DEFAULT_METRICS_HOST)
    except AddressError:
        raise ArgumentError("{metrics:{text!r}}: expected HOST:PORT or PORT, e.g. 127.0.0.1:9464",
                            flags={"metrics": flag}, text=text) from None


@dataclass(frozen=True)
class Snapshot:
    """Everything a scrape reports, taken at once."""

    node: NodeStatus
    fetch: dict[str, float]  # the content service's fetch totals
    runs: list[TaskStatus]


def snapshot(peer: Peer) -> Snapshot:
    """Everything a scrape reports. Runs in the trio thread (see the module doc)."""
    return Snapshot(peer.node.status(), dict(peer.content.fetch_totals),
                    [run.status() for run in list(peer.tasks.runs.values())])


class PeerCollector(Collector):
    """Reads a running peer's counters at each scrape (from prometheus-client's HTTP thread)."""

    def __init__(self, peer: Peer, token: trio.lowlevel.TrioToken) -> None:
        self.peer = peer
        self.token = token
        self._gate = threading.BoundedSemaphore(MAX_CONCURRENT_SCRAPES)
        self.refused = 0  # scrapes over MAX_CONCURRENT_SCRAPES, answered empty

    def collect(self) -> Iterator[Metric]:
        if not self._gate.acquire(blocking=False):
            self.refused += 1
            return
        try:
            snap = trio.from_thread.run_sync(snapshot, self.peer, trio_token=self.token)
        except trio.RunFinishedError:
            return  # the node has stopped: an empty scrape, not an error page
        finally:
            self._gate.release()
        yield from families(snap)
        yield _counter("scrapes_refused", f"Scrapes answered empty: over {MAX_CONCURRENT_SCRAPES} at once.", [],
                       [([], self.refused)])


def _counter(name: str, doc: str, labels: list[str], rows: list[tuple[list[str], float]]) -> CounterMetricFamily:
    family = CounterMetricFamily(f"{PREFIX}_{name}", doc, labels=labels)
    for values, value in rows:
        family.add_metric(values, value)
    return family


def _gauge(name: str, doc: str, labels: list[str], rows: list[tuple[list[str], float]]) -> GaugeMetricFamily:
    family = GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=labels)
    for values, value in rows:
        family.add_metric(values, value)
    return family


def families(snap: Snapshot) -> Iterator[Metric]:
    """The metric families of one snapshot (names and labels: docs/operating.md)."""
    node = snap.node
    messages = node.messages
    yield _gauge("info", "This peer: its peer ID and p2ptrain version (always 1).", ["peer_id", "version"],
                 [([node.peer_id, node.version], 1)])
    yield _gauge("peers", "Peers this node hears heartbeats from (alive) and peers it saw go (gone).", ["state"],
                 [(["alive"], node.peers_total), (["gone"], node.gone_total)])
    yield _gauge("connected_peers", "Peers with an open libp2p connection.", [], [([], len(node.connected))])
    membership = node.membership
    yield _counter("peer_records_dropped", "Peer records the membership view let go: forgotten (gone longer "
                   "than its 10 min memory) or evicted (the view was full).", ["reason"],
                   [(["forgotten"], membership.get("expired", 0)), (["evicted"], membership.get("evicted", 0))])
    yield _counter("messages_received", "Valid pubsub messages delivered to handlers, by type.", ["type"],
                   [([t], n) for t, n in sorted((messages.get("delivered") or {}).items())])
    yield _counter("messages_rejected", "Input refused, by where it was refused (source) and why (reason).",
                   ["source", "reason"], list(_rejections(node, snap.runs)))
    collective_sent = sum(r.bytes_sent for r in snap.runs)
    collective_received = sum(r.bytes_received for r in snap.runs)
    fetch = snap.fetch
    bitswap = (node.services.get("content") or {}).get("bitswap") or {}
    yield _counter("bytes", "Payload bytes by protocol and direction: pubsub (signed messages we published / "
                   "received), collective (gradient frames sent / received), bitswap (blocks fetched / "
                   "served to peers).",
                   ["protocol", "direction"],
                   [(["pubsub", "sent"], messages.get("bytes_published", 0)),
                    (["pubsub", "received"], messages.get("bytes_received", 0)),
                    (["collective", "sent"], collective_sent),
                    (["collective", "received"], collective_received),
                    (["bitswap", "received"], fetch.get("bytes", 0)),
                    (["bitswap", "sent"], bitswap.get("served_bytes", 0))])
    yield _counter("fetches", "Bitswap fetches of a DAG, by result.", ["result"],
                   [(["ok"], fetch.get("ok", 0)), (["failed"], fetch.get("failed", 0))])
    yield _counter("fetch_seconds", "Time spent in successful fetches; rate(bytes{protocol=\"bitswap\"}) / "
                   "rate(fetch_seconds) is the fetch throughput.", [], [([], fetch.get("seconds", 0.0))])
    yield from _task_families(snap.runs)


def _rejections(node: NodeStatus, runs: list[TaskStatus]) -> Iterator[tuple[list[str], float]]:
    messages = node.messages
    sources: list[tuple[str, dict[str, Any]]] = [
        ("pubsub", messages.get("dropped") or {}),
        ("pubsub_wire", messages.get("dropped_below_router") or {}),
        ("control", node.control.get("rejected") or {}),
    ]
    services = node.services
    bitswap = (services.get("content") or {}).get("bitswap") or {}
    sources.append(("bitswap", {k.removeprefix("rejected_"): v for k, v in bitswap.items() if k.startswith("rejected_")}))
    tasks = services.get("tasks") or {}
    sources.append(("joins", (tasks.get("joins") or {}).get("rejected") or {}))
    collective = tasks.get("collective") or {}
    sources.append(("collective", {k.removeprefix("refused_"): v for k, v in collective.items() if k.startswith("refused_")}))
    task_rejected: dict[str, int] = {}
    for run in runs:
        for reason, n in run.rejected.items():
            task_rejected[reason] = task_rejected.get(reason, 0) + n
    sources.append(("task", task_rejected))
    for source, reasons in sources:
        for reason, n in sorted(reasons.items()):
            if isinstance(n, (int, float)):
                yield [source, reason], n


def _task_families(runs: list[TaskStatus]) -> Iterator[Metric]:
    """Per joined task (label ``task``: the task CID): progress, election, model, round times."""
    def rows(key: str) -> list[tuple[list[str], float]]:
        values = [(r.task_cid, getattr(r, key)) for r in runs]
        return [([cid], float(value)) for cid, value in values if value is not None]

    yield _counter("task_rounds", "Rounds this member completed.", ["task"], rows("rounds_done"))
    yield _gauge("task_step", "Optimizer steps this member's model has taken.", ["task"], rows("step"))
    yield _gauge("task_total_steps", "Steps the task trains for.", ["task"], rows("total_steps"))
    yield _gauge("task_confirmed_models", "Models of the run confirmed by a quorum of attestations (the chain's length).",
                 ["task"], rows("version"))
    yield _gauge("task_coordinator_term", "The election term of the run's current coordinator.", ["task"], rows("term"))
    yield _gauge("task_is_coordinator", "1 while this peer is the run's coordinator.", ["task"],
                 [([r.task_cid], 1.0 if r.is_coordinator else 0.0) for r in runs])
    yield _gauge("task_members", "Members of the last round plan.", ["task"],
                 [([r.task_cid], len(r.members)) for r in runs])
    yield _gauge("task_train_loss", "This member's training loss in its last round.", ["task"], rows("loss"))
    yield _gauge("task_test_accuracy", "Test accuracy of the latest confirmed model.", ["task"], rows("accuracy"))
    yield _gauge("task_test_loss", "Test loss of the latest confirmed model.", ["task"], rows("test_loss"))
    yield _gauge("task_state", "1 for the run's state (starting, fetching data, training, resyncing, done, "
                 "cancelled, failed, stopped).", ["task", "state"], [([r.task_cid, str(r.state)], 1) for r in runs])
    hist = HistogramMetricFamily(f"{PREFIX}_task_round_seconds",
                                 "Time of each completed round by phase: compute (local gradient), sync "
                                 "(all-reduce), apply (optimizer step).", labels=["task", "phase"])
    for r in runs:
        for phase, h in (r.round_seconds or {}).items():
            buckets = [(_le(b), n) for b, n in zip(h.bounds, h.cumulative)] + [("+Inf", h.count)]
            hist.add_metric([r.task_cid, phase], buckets, sum_value=h.total)
    yield hist


def _le(bound: float) -> str:
    return f"{bound:g}"


class MetricsServer:
    """A node service: serves the peer's metrics over HTTP at ``address`` while the node runs."""

    def __init__(self, peer: Peer, host: str, port: int) -> None:
        self.peer = peer
        self.host = host
        self.port = port
        self.bound_port: int | None = None  # the port in use (``port`` 0 picks a free one)

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(PeerCollector(self.peer, trio.lowlevel.current_trio_token()))
        try:
            server = _server(self.host, self.port, registry)
        except OSError as exc:
            raise UserError(f"cannot serve metrics on {self.host}:{self.port}: {exc.strerror or exc}") from None
        thread = threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True)
        thread.start()
        self.bound_port = server.server_port
        if self.host not in LOOPBACK_HOSTS:
            logger.warning("metrics are served on %s, beyond this machine: anyone who reaches it sees this "
                           "node's peers, tasks and traffic", self.host)
        logger.info("node %s serves Prometheus metrics at http://%s:%d/metrics", short_id(self.peer.node.peer_id),
                    self.host, self.bound_port)
        task_status.started()
        try:
            await trio.sleep_forever()
        finally:
            # shutdown() waits for the serving thread's poll loop (0.5 s at most); in a thread, so
            # that a scrape waiting on this trio thread for its snapshot is still answered.
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(_close, server, thread)


class _Handler(WSGIRequestHandler):
    """prometheus-client's handler, with a deadline on reading the request and no access log."""

    timeout = REQUEST_TIMEOUT_S

    def log_message(self, format: str, *args: Any) -> None:
        pass


def _server(host: str, port: int, registry: CollectorRegistry) -> Any:
    """prometheus-client's threading WSGI server for ``registry``, bound to ``host`` (IPv4 or IPv6)."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]

    class Server(ThreadingWSGIServer):
        address_family = family

    return make_server(host, port, make_wsgi_app(registry), Server, handler_class=_Handler)


def _close(server: Any, thread: threading.Thread) -> None:
    server.shutdown()
    server.server_close()
    thread.join()
