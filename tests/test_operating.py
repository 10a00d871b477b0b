"""Watching a run: one real run of two in-process peers, scraped over HTTP by Prometheus' own parser
while it trains, then drawn by ``task report`` from the confirmed records on a member's disk."""

from __future__ import annotations

import json
import logging
import urllib.request
from pathlib import Path

import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from p2ptrain.cli.report import load_points, write_report
from p2ptrain.services import MetricsServer
from p2ptrain.testing import local_peers, publish_digits_task

pytestmark = pytest.mark.usefixtures("quick_timers")  # tests/conftest.py: the protocol's idle waits shortened

DEADLINE_S = 120.0
SCRAPE_TIMEOUT_S = 10.0


def _scrape(port: int) -> dict[str, list[tuple[dict[str, str], float]]]:
    """GET /metrics and parse it: sample name -> [(labels, value)]."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=SCRAPE_TIMEOUT_S) as reply:
        text = reply.read().decode()
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, []).append((s.labels, s.value))
    return samples


def _one(samples: dict, name: str, **labels: str) -> float:
    [value] = [v for lab, v in samples[name] if all(lab.get(k) == want for k, want in labels.items())]
    return value


async def test_a_run_is_scraped_while_it_trains_and_drawn_after(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="p2ptrain")
    with trio.fail_after(DEADLINE_S):
        async with local_peers(2, tmp_path) as peers, trio.open_nursery() as nursery:
            server = MetricsServer(peers[1], "127.0.0.1", 0)  # the joiner: it fetched from peer 0
            await nursery.start(server.run)
            publisher = MetricsServer(peers[0], "127.0.0.1", 0)  # served the task's blocks to peer 1
            await nursery.start(publisher.run)
            task_cid = await publish_digits_task(peers[0], total_steps=8, checkpoint_interval=4, max_peers=2)
            await peers.join_all(task_cid)
            await peers.wait_until(lambda: peers.status(1, task_cid).get("version", 0) >= 1, 60,
                                   what="model v1 confirmed on the scraped peer")
            samples = await trio.to_thread.run_sync(_scrape, server.bound_port)

            assert _one(samples, "p2ptrain_peers", state="alive") == 1
            assert _one(samples, "p2ptrain_task_confirmed_models", task=task_cid) >= 1
            rounds = _one(samples, "p2ptrain_task_rounds_total", task=task_cid)
            assert rounds >= 4
            for phase in ("compute", "sync", "apply"):
                assert _one(samples, "p2ptrain_task_round_seconds_count", task=task_cid, phase=phase) == rounds
                assert _one(samples, "p2ptrain_task_round_seconds_bucket", task=task_cid, phase=phase, le="+Inf") == rounds
            assert _one(samples, "p2ptrain_bytes_total", protocol="collective", direction="sent") > 0
            assert _one(samples, "p2ptrain_bytes_total", protocol="collective", direction="received") > 0
            assert _one(samples, "p2ptrain_bytes_total", protocol="pubsub", direction="received") > 0
            assert _one(samples, "p2ptrain_task_coordinator_term", task=task_cid) >= 1
            # peer 1 fetched the task, the manifest and its shards from peer 0 by Bitswap
            assert _one(samples, "p2ptrain_fetches_total", result="ok") >= 2
            assert _one(samples, "p2ptrain_bytes_total", protocol="bitswap", direction="received") > 0
            assert _one(samples, "p2ptrain_fetch_seconds_total") > 0
            # ... which peer 0's exporter counts as served; peer 0 received peer 1's gradient frames
            served = await trio.to_thread.run_sync(_scrape, publisher.bound_port)
            assert _one(served, "p2ptrain_bytes_total", protocol="bitswap", direction="sent") > 0
            assert _one(served, "p2ptrain_bytes_total", protocol="collective", direction="received") > 0

            await peers.wait_until(lambda: peers.status(0, task_cid).get("state") == "done", 60, what="the run done")
            nursery.cancel_scope.cancel()

    # the report: from the member's verified chain on disk; the records carry the round split
    points = load_points(peers[0].node.home, task_cid)
    assert [p.step for p in points] == [4, 8]
    assert all(p.members == 2 and p.accuracy is not None and p.train_loss is not None for p in points)
    assert all(p.compute_s and p.sync_s and p.apply_s and p.bytes_sent for p in points)
    write_report(points, task_cid, tmp_path / "report.png")
    assert (tmp_path / "report.png").read_bytes().startswith(b"\x89PNG")
    write_report(points, task_cid, tmp_path / "report.html")
    assert "data:image/png;base64," in (tmp_path / "report.html").read_text()

    # INFO tells the story of the run per span, not per round (those lines are DEBUG)
    info = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and r.name.startswith("p2ptrain.run.")]
    assert any("span of rounds 0-3 (steps 1-4) done with 2 peers" in line for line in info), info
    assert not [line for line in info if " done with 2 peers: compute " in line]


def test_metrics_address_is_loopback_unless_a_host_is_named(tmp_path: Path, capsys, monkeypatch) -> None:
    from p2ptrain.base import ArgumentError
    from p2ptrain.cli.main import main
    from p2ptrain.services import parse_address

    assert parse_address("9464") == ("127.0.0.1", 9464)
    assert parse_address("0.0.0.0:9464") == ("0.0.0.0", 9464)
    assert parse_address("[::1]:9464") == ("::1", 9464)
    assert main(["node", "start", "--home", str(tmp_path), "--metrics", "localhost:http"]) == 1
    assert capsys.readouterr().err.strip() == (
        "p2ptrain: error: --metrics 'localhost:http': expected HOST:PORT or PORT, e.g. 127.0.0.1:9464")
    with pytest.raises(ArgumentError) as raised:  # from Python, the keyword the caller wrote
        parse_address("localhost:http")
    assert str(raised.value) == "metrics='localhost:http': expected HOST:PORT or PORT, e.g. 127.0.0.1:9464"
    assert isinstance(raised.value, ValueError)
    monkeypatch.setenv("P2PTRAIN_METRICS", "nine")  # from the environment, the variable it came from
    assert main(["node", "start", "--home", str(tmp_path)]) == 1
    assert capsys.readouterr().err.strip() == (
        "p2ptrain: error: $P2PTRAIN_METRICS 'nine': expected HOST:PORT or PORT, e.g. 127.0.0.1:9464")


def test_json_log_lines_are_one_object_each() -> None:
    from p2ptrain.base import formatter

    record = logging.LogRecord("p2ptrain.x", logging.WARNING, __file__, 1, "model v%d: loss %.4f", (3, 0.123456), None)
    line = formatter("json").format(record)
    assert "\n" not in line
    parsed = json.loads(line)
    assert (parsed["level"], parsed["logger"], parsed["msg"]) == ("WARNING", "p2ptrain.x", "model v3: loss 0.1235")
    assert parsed["ts"].endswith("Z")


def test_config_show_names_where_each_setting_came_from(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    from p2ptrain.cli.main import main

    (tmp_path / "config.toml").write_text('[node]\nmdns = true\nlisten = ["/ip4/127.0.0.1/tcp/4001"]\n')
    monkeypatch.setenv("P2PTRAIN_DHT", "false")
    monkeypatch.setenv("P2PTRAIN_LISTEN", "/ip4/127.0.0.1/tcp/5001, /ip4/127.0.0.1/tcp/5002")
    assert main(["config", "show", "--home", str(tmp_path), "--listen", "/ip4/127.0.0.1/tcp/6001", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["listen"] == {"value": ["/ip4/127.0.0.1/tcp/6001"], "source": "flag --listen"}  # flag over env
    assert shown["dht"] == {"value": False, "source": "env P2PTRAIN_DHT"}
    assert shown["mdns"] == {"value": True, "source": f"file {tmp_path / 'config.toml'}"}
    assert shown["heartbeat_interval"] == {"value": 1.0, "source": "default"}
    assert main(["config", "show", "--home", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["listen"]["value"] == ["/ip4/127.0.0.1/tcp/5001", "/ip4/127.0.0.1/tcp/5002"]

    monkeypatch.setenv("P2PTRAIN_SILENCE_HEARTBEATS", "0")
    assert main(["config", "show", "--home", str(tmp_path)]) == 1
    assert capsys.readouterr().err.strip() == (
        "p2ptrain: error: $P2PTRAIN_SILENCE_HEARTBEATS: silence_heartbeats must be a whole number from 1 to 1000")
