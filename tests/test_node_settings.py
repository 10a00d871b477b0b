"""One declaration per node setting: every field of NodeConfig is a flag of `node start` (and of
`config show`), a P2PTRAIN_* variable, a config.toml key, a `config show` row and a row of the
settings table in docs/operating.md, with its bounds checked on each path. A new setting is one
field in p2ptrain/node/_node_config.py; this test fails until every one of those works for it.
"""

from __future__ import annotations

import json
import typing
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest

from p2ptrain.cli.main import build_parser, main
from p2ptrain.base import UserError
from p2ptrain.node import CONFIG_FILE, NodeConfig, env_variable, settings

ROOT = Path(__file__).resolve().parents[1]
KINDS = typing.get_type_hints(NodeConfig)
NAMES = [f.name for f in fields(NodeConfig)]
# A value other than the default, in each setting's bounds, per type.
OTHER = {bool: lambda d: not d, int: lambda d: d + 1, float: lambda d: d * 2,
         list[str]: lambda d: ["/ip4/127.0.0.1/tcp/4321/p2p/12D3KooWHvR8X3jRtHWqSw8GvMJy1GUaRfCp7vhWr3X2zHqr9cTG"]}


def _as_text(value: Any) -> str:
    """A value as a user types it in a variable."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return ",".join(value) if isinstance(value, list) else str(value)


def _as_flag(flag: str, value: Any) -> list[str]:
    if isinstance(value, bool):
        return [flag]  # --x turns it on, --no-x off: the value OTHER picked is the flag's
    return [flag, *value] if isinstance(value, list) else [flag, str(value)]


def _shown(capsys: pytest.CaptureFixture[str], home: Path, *args: str) -> dict[str, Any]:
    assert main(["config", "show", "--home", str(home), "--json", *args]) == 0
    shown: dict[str, Any] = json.loads(capsys.readouterr().out)
    return shown


@pytest.mark.parametrize("name", NAMES)
def test_every_setting_has_a_flag_a_variable_a_file_key_a_row_and_bounds(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    how = settings()[name]
    default = getattr(NodeConfig(), name)
    other = OTHER[KINDS[name]](default)
    for var in (env_variable(n) for n in NAMES):
        monkeypatch.delenv(var, raising=False)

    # The flag, on node start and config show alike.
    start = build_parser().parse_args(["node", "start", *_as_flag(how.flag, other)])
    assert getattr(start, name) == other
    assert _shown(capsys, tmp_path, *_as_flag(how.flag, other))[name] == {"value": other, "source": f"flag {how.flag}"}

    # The variable.
    monkeypatch.setenv(env_variable(name), _as_text(other))
    assert _shown(capsys, tmp_path)[name] == {"value": other, "source": f"env {env_variable(name)}"}
    monkeypatch.delenv(env_variable(name))

    # The config.toml key, written by to_toml and read back.
    (tmp_path / CONFIG_FILE).write_text(NodeConfig(**{name: other}).to_toml())
    assert getattr(NodeConfig.parse(tmp_path / CONFIG_FILE), name) == other
    assert _shown(capsys, tmp_path)[name] == {"value": other, "source": f"file {tmp_path / CONFIG_FILE}"}
    (tmp_path / CONFIG_FILE).unlink()
    assert _shown(capsys, tmp_path)[name] == {"value": default, "source": "default"}

    # The bounds: a value of the wrong kind is one line naming the setting, on each path.
    assert how.check("nonsense") is not None
    (tmp_path / CONFIG_FILE).write_text(f'[node]\n{name} = "nonsense"\n')
    assert main(["config", "show", "--home", str(tmp_path)]) == 1
    assert f"{name} " in capsys.readouterr().err
    with pytest.raises(UserError, match=name):
        NodeConfig(**{name: "nonsense"}).check()

    # The docs' table of settings has its row: flag, variable, key.
    row = next((line for line in (ROOT / "docs" / "operating.md").read_text().splitlines()
                if line.startswith(f"| {name} |")), "")
    assert f"`{how.flag}`" in row and f"`{env_variable(name)}`" in row and f"`{name}`" in row, row
