"""Make a node a full p2ptrain peer: the content service and the task service on top of the mesh."""

from __future__ import annotations

from dataclasses import dataclass

from p2ptrain.node import Node
from p2ptrain.runtime.content import ContentService
from p2ptrain.runtime.tasks import TaskOptions, TaskService


@dataclass
class Peer:
    node: Node
    content: ContentService
    tasks: TaskService


def make_peer(node: Node, options: TaskOptions | None = None) -> Peer:
    """Install the services into ``node`` (before it runs); they start once the mesh is up."""
    content = ContentService(node)
    tasks = TaskService(node, content, options or TaskOptions())
    node.add_service(content.run, name="content")
    node.add_service(tasks.run, name="tasks")
    return Peer(node, content, tasks)
