"""The node's home: layout, permissions, config written once and read back, bad settings refused."""

from __future__ import annotations

import os
import stat
from dataclasses import replace

import pytest
import trio

from p2ptrain.base import UserError
from p2ptrain.control import ControlClient, NodeStatus, ops as control_ops
from p2ptrain.node import Node, NodeConfig


NODE_KEYS = {"peer_id", "addrs", "reachability", "autonat", "relay", "home", "version", "listening_at", "started_at",
             "connected", "topics", "mesh_topic", "heartbeat_interval_s", "caps", "peers", "gone", "peers_total",
             "gone_total", "membership", "discovery", "control", "messages", "services"}


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


async def test_home_layout_permissions_and_a_control_op_from_another_layer(tmp_path):
    home = tmp_path / "home"
    home.mkdir(mode=0o755)  # too open: the node tightens it
    node = Node(home, NodeConfig(listen=["/ip4/127.0.0.1/tcp/0"], relay_service=True, relay_max_reservations=4))

    async def answer(request):
        return {"answer": request.get("x", 0) + 1}

    node.control.register("answer", answer)
    async with trio.open_nursery() as nursery:
        await nursery.start(node.run)
        assert mode(home) == 0o700
        assert mode(home / "identity.key") == 0o600
        assert mode(home / "control.sock") == 0o600
        assert (home / "blocks").is_dir() and (home / "logs").is_dir()
        client = ControlClient(home)
        with trio.fail_after(10):
            assert await trio.to_thread.run_sync(lambda: client.call("answer", x=41)) == {"answer": 42}
            status = await trio.to_thread.run_sync(lambda: client.call(control_ops.STATUS))
        assert status["peer_id"] == node.peer_id.to_base58()
        assert status["addrs"] == node.addrs
        assert status["relay"]["limits"]["max_reservations"] == 4  # what the relay it serves enforces
        assert set(status) == NODE_KEYS  # `node status --json`: every key, pinned (a contract)
        assert NodeStatus.from_json(status).to_json() == status  # what the CLI rebuilds is what it prints
        with pytest.raises(UserError, match="already running"):
            await Node(home).run()  # a second node on the same home is refused
        node.stop()
    assert not (home / "control.sock").exists()


async def test_config_is_written_on_first_start_and_fills_in_what_the_command_line_leaves_out(tmp_path):
    home = tmp_path / "h"
    Node(home, NodeConfig(listen=["/ip4/127.0.0.1/tcp/0"], heartbeat_interval=0.5, dht=False))
    stored = NodeConfig.load(home)
    assert stored is not None and stored.heartbeat_interval == 0.5 and stored.dht is False
    assert mode(home / "config.toml") == 0o600
    again = Node(home)
    assert again.config == stored
    override = Node(home, replace(NodeConfig.of_home(home), heartbeat_interval=2.0))  # what a flag does
    assert override.config.heartbeat_interval == 2.0
    assert NodeConfig.load(home).heartbeat_interval == 0.5, "the stored config is not rewritten"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"bootstrap": ["/ip4/127.0.0.1/tcp/4001"]}, "no /p2p/<peer id> part"),
        ({"bootstrap": ["not an address"]}, "is not a multiaddr"),
        ({"listen": ["nonsense"]}, "is not a multiaddr"),
    ],
)
def test_bad_addresses_are_user_errors(tmp_path, kwargs, message):
    with pytest.raises(UserError, match=message):
        Node(tmp_path / "h", NodeConfig(**kwargs))


def test_unknown_config_setting_is_a_user_error(tmp_path):
    home = tmp_path / "h"
    home.mkdir(mode=0o700)
    (home / "config.toml").write_text("[node]\nlisten = []\nheartbeat = 1\n")
    with pytest.raises(UserError, match="unknown setting"):
        Node(home)


async def test_a_port_in_use_is_a_user_error_not_a_silent_node(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        node = Node(tmp_path / "h", NodeConfig(listen=[f"/ip4/127.0.0.1/tcp/{port}"]))
        with trio.fail_after(30), pytest.raises(UserError, match=f"tcp/{port}: cannot listen on port"):
            await node.run()
    assert not (tmp_path / "h" / "control.sock").exists()


@pytest.mark.parametrize(
    "text, message",
    [
        ("[node]\nheartbeat_interval = \"fast\"\n", "heartbeat_interval must be a number"),
        ("[node]\nheartbeat_interval = 1e400\n", "heartbeat_interval must be a number"),
        ("[node]\nheartbeat_interval = nan\n", "heartbeat_interval must be a number"),
        ("[node]\nsilence_heartbeats = 10000000000000000000\n", "not valid TOML|silence_heartbeats"),
        ("[node]\nlisten = \"/ip4/127.0.0.1/tcp/0\"\n", "listen must be a list"),
        ("[node]\nbootstrap = [1, 2]\n", "bootstrap must be a list"),
        ("[node]\nmdns = \"yes\"\n", "mdns must be true or false"),
        ("node = 5\n", r"\[node\] must be a table"),
        ("[node]\nlisten = " + "[" * 5000 + "]" * 5000 + "\n", "not valid TOML|listen must be"),
        ("# " + "x" * 70_000 + "\n", "over 65536 bytes"),
        ("\xff\xfe[node]\n", "not valid TOML"),
    ],
    ids=["type", "huge-float", "nan", "huge-int", "not-list", "not-strings", "not-bool", "not-table", "deep", "huge", "not-utf8"],
)
def test_a_bad_config_file_is_one_user_error_line(tmp_path, text, message):
    home = tmp_path / "h"
    home.mkdir(mode=0o700)
    (home / "config.toml").write_bytes(text.encode("latin-1") if text.startswith("\xff") else text.encode())
    with pytest.raises(UserError, match=message):
        Node(home)


def test_relay_limits_come_from_flags_environment_or_file_within_bounds(tmp_path, monkeypatch, capsys):
    """node start's --relay-max-* (config show resolves what it would run with): flag over
    P2PTRAIN_* over config.toml over the defaults of p2ptrain.net._relay; out of bounds is one line."""
    import json

    from p2ptrain.cli.main import main
    from p2ptrain.net import RELAY_MAX_CIRCUIT_BYTES

    (tmp_path / "config.toml").write_text("[node]\nrelay_max_circuit_duration = 600\n")
    monkeypatch.setenv("P2PTRAIN_RELAY_MAX_CIRCUIT_BYTES", str(64 * 1024**2))
    assert main(["config", "show", "--home", str(tmp_path), "--relay-max-reservations", "4", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["relay_max_reservations"] == {"value": 4, "source": "flag --relay-max-reservations"}
    assert shown["relay_max_circuit_bytes"] == {"value": 64 * 1024**2, "source": "env P2PTRAIN_RELAY_MAX_CIRCUIT_BYTES"}
    assert shown["relay_max_circuit_duration"] == {"value": 600, "source": f"file {tmp_path / 'config.toml'}"}
    monkeypatch.delenv("P2PTRAIN_RELAY_MAX_CIRCUIT_BYTES")
    assert main(["config", "show", "--home", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["relay_max_circuit_bytes"]["value"] == RELAY_MAX_CIRCUIT_BYTES

    for args, error in [
        (["--relay-max-reservations", "0"],
         "--relay-max-reservations: relay_max_reservations must be a whole number from 1 to 4096"),
        (["--relay-max-circuit-bytes", "1000"],
         "--relay-max-circuit-bytes: relay_max_circuit_bytes must be a whole number from 1048576 to 1099511627776"),
    ]:
        assert main(["config", "show", "--home", str(tmp_path), *args]) == 1
        assert capsys.readouterr().err.strip() == f"p2ptrain: error: {error}"
    (tmp_path / "config.toml").write_text("[node]\nrelay_max_circuit_duration = 1\n")
    with pytest.raises(UserError, match="relay_max_circuit_duration must be a whole number from 10 to 604800"):
        Node(tmp_path)
