"""What the training tests of the emulated WAN share."""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable
from pathlib import Path

import pytest

from p2ptrain.cli.main import main as cli_main


@pytest.fixture
def add_digits() -> Callable[[Path, int], str]:
    """``add_digits(home, shards)``: ``p2ptrain dataset add sklearn:digits --shards N --home HOME``,
    run in this process (the command writes into a running node's home as it would from a shell);
    returns the manifest CID. A process of its own would import torch and scikit-learn again:
    seconds of CPU that the node processes beside it need on a loaded 2-core machine."""

    def add(home: Path, shards: int) -> str:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert cli_main(["dataset", "add", "sklearn:digits", "--shards", str(shards), "--home", str(home)]) == 0
        return out.getvalue().split()[-1]

    return add
