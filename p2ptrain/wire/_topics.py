"""The gossipsub topics p2ptrain publishes on: their names are part of the wire format.

Peers of other versions subscribe by these exact strings, so they never change; a new format gets
a new topic (the version in the name).
"""

from __future__ import annotations

MESH_TOPIC = "p2ptrain/mesh/1"  # heartbeats (membership, discovery)
TASKS_TOPIC = "p2ptrain/tasks/v1"  # task announcements and the heads of runs


def task_topic(task_cid: str) -> str:
    """The topic of one task's run: elections, plans, failure reports, records, attestations."""
    return f"p2ptrain/task/{task_cid}"
