"""One running peer's node: libp2p host, pubsub, membership, discovery, control socket, and its
content service (block store + Bitswap); ``NodeConfig``, every node setting declared once; and
``NodeProcess``, a ``p2ptrain node start`` child. Imports ``base``, ``wire``, ``net``, ``control``,
``mesh`` and ``ipfs``; nothing of the training.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from p2ptrain.node._content import ContentService as ContentService, DEFAULT_MAX_FETCH_BYTES as DEFAULT_MAX_FETCH_BYTES
    from p2ptrain.node._node import Node as Node
    from p2ptrain.node._node_config import (
        CONFIG_FILE as CONFIG_FILE,
        env_variable as env_variable,
        NodeConfig as NodeConfig,
        settings as settings,
    )
    from p2ptrain.node._node_process import (
        free_port as free_port,
        NODE_ARGS as NODE_ARGS,
        NodeProcess as NodeProcess,
        port_range as port_range,
        port_slice as port_slice,
        READY_TIMEOUT_S as READY_TIMEOUT_S,
    )
else:
    from p2ptrain._exports import lazy_exports

    __getattr__, __dir__, __all__ = lazy_exports(__name__, __file__)
