"""Make a node a full p2ptrain peer (the content service and the task service on top of the mesh), or
a fetcher (the content service alone), for a temporary node that only fetches."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from p2ptrain.node import ContentService, Node
from p2ptrain.services._served import ServedModels
from p2ptrain.services._tasks import TaskOptions, TaskService


@dataclass
class Fetcher:
    """A node and its content service: what fetching by CID and finding a task's latest chain need."""

    node: Node
    content: ContentService


@dataclass
class Peer(Fetcher):
    """A full peer: a fetcher that also takes part in tasks and lists served models."""

    tasks: TaskService
    served: ServedModels


def warm_up_torch() -> None:
    """Pay torch's lazy imports now, before the event loop has heartbeats to answer.

    The first optimizer a process builds imports ``torch._dynamo``: seconds of work that hold the
    GIL, even from a worker thread. Done while a task starts, it silenced nodes long enough for
    their peers to mark them gone; done here, before the node runs, it costs only start-up time.
    """
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)


def make_peer(node: Node, options: TaskOptions | None = None, ipfs_api: str | None = None) -> Peer:
    """Install the services into ``node`` (before it runs); they start once the mesh is up.

    ``ipfs_api``: a Kubo daemon's RPC address to keep content in, instead of the embedded store.
    """
    warm_up_torch()
    content = ContentService(node, ipfs_api)
    tasks = TaskService(node, content, options or TaskOptions())
    served = ServedModels(node)  # the directory of served models (model serve / model predict)
    node.add_service(content.run, name="content")
    node.add_service(tasks.run, name="tasks")
    return Peer(node, content, tasks, served)


def make_fetcher(node: Node) -> Fetcher:
    """Install only the content service into ``node`` (before it runs): what a temporary node
    needs that fetches by CID and finds a task's latest chain (``model fetch --bootstrap``, ``model
    verify``, ``model serve --latest``). It takes no task, so it pays neither torch's warm-up (4 s
    of CPU here) nor the task service's start (the builders of installed packages)."""
    content = ContentService(node)
    node.add_service(content.run, name="content")
    return Fetcher(node, content)
