"""Where a node's home is when none is named. Its own leaf, apart from the identity key (which
imports libp2p, ~1 s, 20 s on a loaded box): most commands only need to know the folder."""

from __future__ import annotations

import os
from pathlib import Path


def default_home() -> Path:
    """The node home used when ``--home`` is not given: ``$P2PTRAIN_HOME`` or ``~/.p2ptrain``."""
    return Path(os.environ.get("P2PTRAIN_HOME", Path.home() / ".p2ptrain"))
