"""Make a node a full p2ptrain peer (the content service and the task service on top of the mesh), or
a fetcher (the content service alone), for a temporary node that only fetches."""

from __future__ import annotations

from dataclasses import dataclass

from p2ptrain.node import ContentService, Node
from p2ptrain.services._served import ServedModels
from p2ptrain.services._task_control import TaskControl
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
    control: TaskControl  # the task.* ops of its control socket (`p2ptrain task ...`)


def make_peer(node: Node, options: TaskOptions | None = None, ipfs_api: str | None = None) -> Peer:
    """Install the services into ``node`` (before it runs); they start once the mesh is up.

    ``ipfs_api``: a Kubo daemon's RPC address to keep content in, instead of the embedded store.
    Torch's warm-up waits for the first task this node runs (``TaskRun``), since many never do.
    """
    content = ContentService(node, ipfs_api)
    tasks = TaskService(node, content, options or TaskOptions())
    served = ServedModels(node)  # the directory of served models (model serve / model predict)
    node.add_service(content.run, name="content")
    node.add_service(tasks.run, name="tasks")
    return Peer(node, content, tasks, served, TaskControl(tasks))


def make_fetcher(node: Node) -> Fetcher:
    """Install only the content service into ``node`` (before it runs): what a temporary node
    needs that fetches by CID and finds a task's latest chain (``model fetch --bootstrap``, ``model
    verify``, ``model serve --latest``). It takes no task, so it pays no task service's start (the
    builders of installed packages)."""
    content = ContentService(node)
    node.add_service(content.run, name="content")
    return Fetcher(node, content)
