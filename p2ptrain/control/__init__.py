"""The owner's interface to a running node: the control socket (server and client), the names of
its ops (:mod:`p2ptrain.control.ops`, a public submodule), and the typed status a node reports
(``NodeStatus``, ``TaskStatus``, ``Phase``). The node and its services serve it, the CLI and
``p2ptrain.testing`` call it; it imports only ``base`` (and no torch nor libp2p).
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from p2ptrain.control import ops as ops
    from p2ptrain.control._socket import (
        ControlClient as ControlClient,
        ControlError as ControlError,
        ControlServer as ControlServer,
        is_live as is_live,
        socket_path as socket_path,
    )
    from p2ptrain.control._status import (
        ChainEntry as ChainEntry,
        FINISHED as FINISHED,
        NodeStatus as NodeStatus,
        Phase as Phase,
        TaskStatus as TaskStatus,
    )
else:
    from p2ptrain._exports import lazy_exports

    __getattr__, __dir__, __all__ = lazy_exports(__name__, __file__)
