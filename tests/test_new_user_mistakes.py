"""The mistakes a new user makes on the way from install to a model CID, each one clear line that
says what was meant, before anything is spent: a task's CID given where a model's goes, a task
whose model does not fit its data set, a port another node listens on; and a script of one's own
that waits for members it lacks says so where default logging shows it."""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any
from pathlib import Path

import pytest

from p2ptrain.testing import run_forked

P2PTRAIN = str(Path(sys.executable).with_name("p2ptrain"))

TASK = """name = "iris-mlp"
[model]
name = "mlp"
kwargs = {{ in_features = {width}, hidden = [16], out_features = 3 }}
[dataset]
manifest = "{manifest}"
[optimizer]
name = "adam"
lr = 0.01
[training]
batch_size = 16
total_steps = 20
"""


def _home_with_data(tmp_path: Path) -> tuple[Path, str, str]:
    """A home whose store holds a data set of 4 features (as ``dataset add`` of a table leaves it)
    and a task that trains on it; their CIDs."""
    from p2ptrain.data import Manifest
    from p2ptrain.data._manifest import ShardRef, TensorSpec
    from p2ptrain.ipfs import open_store
    from p2ptrain.task import load_task, task_bytes

    home = tmp_path / "home"
    store = open_store(home)
    shard = store.add_bytes(b"a shard", cid_version=1)
    manifest = Manifest("iris", TensorSpec("float32", (4,)), TensorSpec("int64", ()), {"train": (ShardRef(shard, 4),)})
    manifest_cid = manifest.save(store)
    task_cid = store.add_bytes(task_bytes(load_task(TASK.format(width=4, manifest=manifest_cid))))
    return home, str(manifest_cid), str(task_cid)


def test_model_fetch_of_a_task_or_a_manifest_says_what_it_is_and_what_was_meant(tmp_path, capsys):
    """It said: `is not a p2ptrain model: model file header is not valid: safetensors header of
    7310028760498250363 B is over the 16777216 B limit` (a task's JSON read as a header length)."""
    from p2ptrain.cli.main import main

    home, manifest_cid, task_cid = _home_with_data(tmp_path)
    out = tmp_path / "model.safetensors"
    assert main(["model", "fetch", task_cid, "-o", str(out), "--home", str(home)]) == 1
    err = capsys.readouterr().err.strip()
    assert err == (f"p2ptrain: error: {task_cid} is not a p2ptrain model: it is task 'iris-mlp'; its latest model: "
                   f"p2ptrain model fetch --latest {task_cid} -o {out}")
    assert main(["model", "fetch", manifest_cid, "-o", str(out), "--home", str(home)]) == 1
    err = capsys.readouterr().err.strip()
    assert err == (f"p2ptrain: error: {manifest_cid} is not a p2ptrain model: it is the manifest of dataset 'iris' "
                   f"(p2ptrain dataset info {manifest_cid})")
    assert not out.exists()


def test_task_publish_refuses_a_model_that_does_not_fit_the_homes_data_set(tmp_path, capsys):
    """It published the task (a CID, exit 0), and every member then failed at join with torch's words."""
    from p2ptrain.cli.main import main

    home, manifest_cid, _ = _home_with_data(tmp_path)
    wrong = tmp_path / "wrong.toml"
    wrong.write_text(TASK.format(width=64, manifest=manifest_cid))
    assert main(["task", "publish", str(wrong), "--home", str(home)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"p2ptrain: error: {wrong}: the task's data set and model do not fit: samples of shape (4,) "
                          "do not fit model mlp: ") and err.endswith("; nothing published"), err
    assert "\n" not in err
    right = tmp_path / "right.toml"
    right.write_text(TASK.format(width=4, manifest=manifest_cid))
    assert main(["task", "publish", str(right), "--home", str(home)]) == 1  # checked, then: no node to publish it
    assert "no node is running" in capsys.readouterr().err


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port listened on the way py-libp2p listens (SO_REUSEPORT), as another node would."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    try:
        yield sock.getsockname()[1]
    finally:
        sock.close()


def test_node_start_refuses_a_port_another_node_listens_on(tmp_path, taken_port):
    """It started, "listening" on the port beside the other node (the kernel then deals each
    dialer to one of the two), until killed."""
    home = tmp_path / "home"
    result = run_forked([P2PTRAIN, "node", "start", "--home", str(home), "--listen",
                         f"/ip4/127.0.0.1/tcp/{taken_port}"], capture_output=True, timeout=60, cwd=tmp_path)
    err = result.stderr.decode().strip()
    assert result.returncode == 1, err
    assert err == (f"p2ptrain: error: --listen /ip4/127.0.0.1/tcp/{taken_port}: cannot listen on port {taken_port} of "
                   "127.0.0.1: another node or program listens there (give another port, or 0 for any free one)")


def test_a_background_peer_refuses_a_taken_port_and_quiets_libp2p_unless_told(tmp_path, taken_port, monkeypatch):
    """``p2ptrain.Optimizer``'s peer: the same port check as ``node start``; and py-libp2p's churn
    (``Failed to read DHT message from stream``, at WARNING) stays off a script's terminal unless the
    script chose the ``libp2p`` logger's level itself (py-libp2p sets WARNING at import, with no handler
    and no propagation: Python's last-resort handler printed those lines bare) or set LIBP2P_DEBUG."""
    from p2ptrain.api._background import BackgroundPeer
    from p2ptrain.base import UserError
    from p2ptrain.node import NodeConfig

    libp2p = logging.getLogger("libp2p")
    before = libp2p.level
    monkeypatch.delenv("LIBP2P_DEBUG", raising=False)
    try:
        libp2p.setLevel(logging.WARNING)  # what py-libp2p sets as it is imported
        with pytest.raises(UserError, match=f"^listen=/ip4/127.0.0.1/tcp/{taken_port}: cannot listen"):
            BackgroundPeer(tmp_path / "a", NodeConfig(listen=[f"/ip4/127.0.0.1/tcp/{taken_port}"]))
        peer = BackgroundPeer(tmp_path / "b", NodeConfig(listen=["/ip4/127.0.0.1/tcp/0"]))
        peer.close()
        assert libp2p.level == logging.CRITICAL
        libp2p.setLevel(logging.INFO)  # the script's own choice stays
        peer = BackgroundPeer(tmp_path / "c", NodeConfig(listen=["/ip4/127.0.0.1/tcp/0"]))
        peer.close()
        assert libp2p.level == logging.INFO
    finally:
        libp2p.setLevel(before)


def test_a_member_waiting_for_members_says_so_once_where_default_logging_shows_it(tmp_path, caplog, monkeypatch):
    """A script's member alone in a run of min_peers 2 printed nothing (the wait was logged at INFO):
    a user saw a terminal that hung. Now the first report of the wait is a WARNING naming how many
    are missing and the address they bootstrap from."""
    import torch
    from torch import nn

    import p2ptrain
    from p2ptrain.api import _optimizer

    monkeypatch.setattr(_optimizer, "WAIT_REPORT_S", 0.5)
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = p2ptrain.Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model, run="alone",
                             home=tmp_path / "home", min_peers=2, total_steps=10, join_window_s=0.5)

    def step() -> None:  # returns once the member leaves the run (close)
        opt.zero_grad()
        model(torch.randn(3, 4)).sum().backward()
        opt.step()

    thread = threading.Thread(target=step)
    with caplog.at_level(logging.INFO, logger="p2ptrain.api._optimizer"):
        thread.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and sum("waits for the run" in r.message for r in caplog.records) < 2:
            time.sleep(0.1)
        opt.close()
        thread.join(60)
    assert not thread.is_alive()
    waits = [r for r in caplog.records if "waits for the run" in r.message]
    assert len(waits) >= 2, [r.message for r in caplog.records]
    assert waits[0].levelno == logging.WARNING
    assert "waiting for 1 more peer(s); they bootstrap from /ip4/127.0.0.1/tcp/" in waits[0].message
    assert all(r.levelno == logging.INFO for r in waits[1:])


def test_task_status_of_a_run_before_the_nodes_restart_says_where_its_models_are(tmp_path, capsys):
    """A member's node restarted after its run: `task status` said only that this node has not
    heard of the task, though the home keeps the run's chain and models."""
    from p2ptrain.cli.main import main
    from p2ptrain.run import RunDir
    from p2ptrain.testing import node_processes

    with node_processes(1, tmp_path) as (node,):
        task_cid = "QmbDMHamurT52U7AbRYAzisR9jCiZAxQcd5b5QNEnL1tAW"
        unknown = "QmY8LRy4gaMnDj6HkVPXxFN6Zo9fb1WiDFXyn8XMhBqjfQ"
        run_dir = RunDir.of(node.home, task_cid)
        run_dir.path.mkdir(parents=True)
        run_dir.chain.write_bytes(b"")  # what a member's home keeps of a run
        assert main(["task", "status", task_cid, "--home", str(node.home)]) == 1
        err = capsys.readouterr().err.strip()
        assert err == (f"p2ptrain: error: task.status: this node has not heard of task {task_cid} since it started; "
                       f"this home took part in it before: `p2ptrain model verify --latest {task_cid} --home "
                       f"{node.home}` shows its models (also `task report`; `node start --join` takes part again)")
        assert main(["task", "status", unknown, "--home", str(node.home)]) == 1
        assert capsys.readouterr().err.strip() == (
            f"p2ptrain: error: task.status: this node has not heard of task {unknown}: `p2ptrain task list` shows the "
            f"tasks it has heard of; `p2ptrain task join {unknown}` fetches this one from its peers and takes part")


def _lone_run(home: Path, run: str) -> tuple[Any, Any]:
    """A script's whole run alone: an ``nn.Linear`` through ``p2ptrain.Optimizer`` in ``home``, 2
    steps with a checkpoint after each, to ``RunFinished``; the closed optimizer (its run and model
    CIDs as they were when the member left) and the module. ``max_peers`` 1: nobody else joins, so its
    first term and plan need not wait for more."""
    import torch
    from torch import nn

    import p2ptrain

    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = p2ptrain.Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model, run=run, home=home,
                             min_peers=1, max_peers=1, total_steps=2, checkpoint_every=1, join_window_s=0.5)
    with opt, pytest.raises(p2ptrain.RunFinished):
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(3, 4)).sum().backward()
            opt.step()
    return opt, model


@pytest.mark.usefixtures("quick_timers")  # tests/conftest.py: the in-process member's idle waits shortened
def test_model_fetch_latest_reads_the_chain_a_members_home_keeps_when_no_node_runs(tmp_path, capsys):
    """After a script's run (its in-process node gone), `model fetch --latest RUN_CID --home H` said
    the latest model was 'not in the store of H, and no node is running there', though the home
    keeps the run's chain and the model (`model verify --latest` read them); so also where a killed
    script left its control socket's file."""
    import torch
    from torch import nn

    import p2ptrain
    from p2ptrain.cli.main import main

    home = tmp_path / "member"
    opt, model = _lone_run(home, "kept")
    run_cid, model_cid = opt.run_cid, opt.model_cid  # after close: as the run was when this member left
    assert model_cid is not None and opt.step_count == 2
    from p2ptrain.control import socket_path

    left = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # what a script killed mid-run leaves: a socket
    left.bind(str(socket_path(home)))  # file nobody answers on (it was 'no node is running for home H')
    left.close()
    out = tmp_path / "model.safetensors"
    assert main(["model", "fetch", "--latest", run_cid, "-o", str(out), "--home", str(home)]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith(f"{model_cid} -> {out}")
    assert f"latest model of task {run_cid} in this home's chain: v2 (step 2)" in captured.err
    fresh = nn.Linear(4, 2)
    p2ptrain.load_state(fresh, str(out))
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))


def test_dataset_get_makes_a_data_set_by_cid_local_for_ipfsdataset_on_a_machine_that_did_not_add_it(tmp_path, capsys):
    """A member's script reading shared data (`p2ptrain.train(model, IPFSDataset(CID))`) on a machine
    that did not run `dataset add` raised ContentUnavailable from the constructor, and no command
    fetched a data set's shards (`ipfs get` of the manifest fetches the manifest alone)."""
    from p2ptrain.cli.main import main
    from p2ptrain.data import IPFSDataset
    from p2ptrain.testing import node_processes

    with node_processes(1, tmp_path / "nodes") as (node,):
        assert main(["dataset", "add", "sklearn:iris", "--shards", "3", "--home", str(node.home)]) == 0
        manifest_cid = capsys.readouterr().out.split()[0]
        fresh = tmp_path / "fresh"
        assert main(["dataset", "get", manifest_cid, "--home", str(fresh), "--bootstrap", node.addr]) == 0
        out = capsys.readouterr().out.strip()
    assert out == f"{manifest_cid} (iris): test 30 samples in 1 shards, train 120 samples in 3 shards, held in {fresh}"
    assert len(list(IPFSDataset(manifest_cid, split="train", home=fresh))) == 120  # read with no node, no network
    assert len(list(IPFSDataset(manifest_cid, split="test", home=fresh))) == 30


def test_ipfsdataset_on_a_home_without_the_data_says_how_to_get_it(tmp_path):
    """It said only `block is not held locally in …/blocks, and no network fetcher is attached`."""
    from p2ptrain.data import IPFSDataset
    from p2ptrain.data._ipfs_dataset import ShardUnavailable
    from p2ptrain.ipfs import ContentUnavailable, open_store

    home, manifest_cid, _ = _home_with_data(tmp_path)
    with pytest.raises(ContentUnavailable, match=f"fetch the data set first: p2ptrain dataset get {manifest_cid} "
                                                 "--bootstrap MULTIADDR$"):
        IPFSDataset(manifest_cid, home=tmp_path / "empty")
    shard = IPFSDataset(manifest_cid, home=home).manifest.shards("train")[0].cid
    open_store(home).blocks.delete(shard)  # the manifest held, its shard not
    with pytest.raises(ShardUnavailable, match=f"p2ptrain dataset get {manifest_cid} --bootstrap MULTIADDR$"):
        list(IPFSDataset(manifest_cid, home=home))


def test_a_dataset_add_that_fails_leaves_a_fresh_home_as_it_was(tmp_path):
    """``dataset add`` with more shards than the data has samples (the store already open) says so
    in one line and leaves no empty ``HOME/blocks`` (nor the home, nor its parent) behind on a home
    it created; a home that existed keeps what it held. Red before: ``new/home/blocks`` stayed."""
    fresh = tmp_path / "new" / "home"
    failed = run_forked([P2PTRAIN, "dataset", "add", "sklearn:iris", "--shards", "500", "--home", str(fresh)],
                        capture_output=True, text=True, timeout=120)
    assert failed.returncode == 1
    assert failed.stderr.strip().splitlines() == ["p2ptrain: error: sklearn:iris: 120 training samples cannot fill "
                                                  "500 shards"]
    assert sorted(tmp_path.iterdir()) == []
    used = tmp_path / "used"
    (used / "keep").mkdir(parents=True)
    again = run_forked([P2PTRAIN, "dataset", "add", "sklearn:iris", "--shards", "500", "--home", str(used)],
                       capture_output=True, text=True, timeout=120)
    assert again.returncode == 1 and sorted(p.name for p in used.iterdir()) == ["keep"]


def test_dataset_add_of_a_path_that_does_not_exist_says_so(tmp_path):
    """It said ``nope.parquet: not a folder, a .parquet/.arrow/.feather/.jsonl file, ...`` of a name
    that ends in .parquet: the typo in the path went unnamed."""
    missing = tmp_path / "nope.parquet"
    result = run_forked([P2PTRAIN, "dataset", "add", str(missing), "--shards", "2", "--label", "y",
                         "--home", str(tmp_path / "home")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [f"p2ptrain: error: {missing}: no such file or folder (check the "
                                                  "path; sklearn: and text: sources take the prefix)"]


def test_task_publish_on_a_node_that_joins_no_tasks_says_why_no_one_trains_here(tmp_path):
    """A node started without --accept-tasks (or restarted with --join CID alone) published, printed
    the CID, and `task status` then showed "announced, 0 members" with no word why."""
    from p2ptrain.testing import node_processes

    with node_processes(1, tmp_path) as (node,):
        added = run_forked([P2PTRAIN, "dataset", "add", "sklearn:iris", "--shards", "2", "--home", str(node.home)],
                           capture_output=True, text=True, timeout=120)
        assert added.returncode == 0, added.stderr
        task = tmp_path / "iris.toml"
        task.write_text(TASK.format(width=4, manifest=added.stdout.split()[-1]))
        published = run_forked([P2PTRAIN, "task", "publish", str(task), "--home", str(node.home)],
                               capture_output=True, text=True, timeout=120)
        assert published.returncode == 0, published.stderr
        assert published.stdout.strip().startswith(("Qm", "bafy"))
        assert published.stderr.strip().splitlines()[-1] == (
            "p2ptrain: this node did not join the task (it runs without --accept-tasks): peers started with "
            f"--accept-tasks join it; `p2ptrain task join {published.stdout.strip()}` makes this node a member too")
        joined = run_forked([P2PTRAIN, "task", "publish", str(task), "--join", "--home", str(node.home)],
                            capture_output=True, text=True, timeout=120)
        assert joined.returncode == 0 and "did not join" not in joined.stderr, joined.stderr


def test_model_export_of_a_task_or_a_manifest_says_what_it_is(tmp_path):
    """It said ``model file header is not valid: not a safetensors file: it begins as JSON text
    (b'{"compression":...')`` of a task's CID, as `model fetch` did before it learned to say."""
    home, manifest_cid, task_cid = _home_with_data(tmp_path)
    for cid, said in [(task_cid, f"it is task 'iris-mlp'; `p2ptrain task status {task_cid}` shows its latest "
                                 "model's CID"),
                      (manifest_cid, f"it is the manifest of dataset 'iris' (p2ptrain dataset info {manifest_cid})")]:
        result = run_forked([P2PTRAIN, "model", "export", cid, str(tmp_path / "out"), "--home", str(home)],
                            capture_output=True, text=True, timeout=120)
        assert result.returncode == 1
        assert result.stderr.strip().splitlines() == [f"p2ptrain: error: {cid} is not a p2ptrain model: {said}"]
        assert not (tmp_path / "out").exists()


def test_a_script_stopped_by_ctrl_c_can_start_again_on_its_home_and_a_live_node_still_refuses(tmp_path):
    """A script's ``p2ptrain.Optimizer`` stopped with Ctrl-C left ``HOME/control.sock`` behind, and
    every later start of the same script said "a p2ptrain node runs on HOME" with no node running."""
    import torch
    from torch import nn

    import p2ptrain
    from p2ptrain.base import UserError
    from p2ptrain.control import socket_path

    home = tmp_path / "home"
    home.mkdir()
    left = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    left.bind(str(socket_path(home)))  # the file a killed process leaves: nobody answers on it
    left.close()
    model = nn.Linear(2, 2)
    opt = p2ptrain.Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model, run="again", home=home,
                             min_peers=1, total_steps=1)
    opt.close()
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    socket_path(home).unlink(missing_ok=True)
    live.bind(str(socket_path(home)))
    live.listen()
    try:
        with pytest.raises(UserError, match=r"^a p2ptrain node runs on .+: each member running at once needs a home "
                                            r"of its own; pass another home=DIR$"):
            p2ptrain.Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model, run="again", home=home)
    finally:
        live.close()


def test_a_script_reads_the_keyword_it_gave_and_a_command_line_the_flag(tmp_path, capsys):
    """The checks below the API are shared by both callers, and their messages named the flag:
    ``p2ptrain.Optimizer(bootstrap=[...])`` said ``--bootstrap '/ip4/...' has no /p2p/<peer id>
    part``, ``load_state`` said ``pass --bootstrap MULTIADDR``, ``read_source`` ``--eos needs a
    --tokenizer``, ``serve()`` ``give a MODEL_CID or --latest TASK_CID``; and ``bootstrap="..."``
    (one string) reached the node as one address per character. Each message is one text: the
    command line still reads the flag."""
    import torch
    from torch import nn

    import p2ptrain
    from p2ptrain.base import UserError
    from p2ptrain.cli.main import main
    from p2ptrain.data import SourceOptions, read_source

    model = nn.Linear(2, 2)
    home = tmp_path / "home"

    def optimizer(**kwargs: object) -> None:
        p2ptrain.Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model, run="r", home=home, **kwargs)

    no_id = "/ip4/127.0.0.1/tcp/1"
    with pytest.raises(UserError) as caught:
        optimizer(bootstrap=[no_id])
    assert str(caught.value).startswith(f"bootstrap={no_id!r} has no /p2p/<peer id> part; copy an address from")
    with pytest.raises(UserError, match="^listen='nonsense' is not a multiaddr: "):
        optimizer(listen=["nonsense"])
    with pytest.raises(TypeError, match=r"^bootstrap= takes a list of addresses, not one string: bootstrap=\['/ip4"):
        optimizer(bootstrap=no_id + "/p2p/12D3KooWFUqNyBmifyPm8ywvnrMACccRGY9BpWj1uyD9fdQLEHW7")
    with pytest.raises(UserError, match=r"or pass bootstrap=MULTIADDR$"):
        p2ptrain.load_state(model, "QmT78zSuBmuS4z925WZfrqQ1qHaJ56DQaTfyMUF7F8ff5o", home=tmp_path / "empty")
    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "a.txt").write_text("some text " * 50)
    with pytest.raises(UserError, match=r"^eos= needs a tokenizer= \(bytes have no end-of-document token\)$"):
        read_source(f"text:{texts}", SourceOptions(eos="<eos>"))
    with pytest.raises(UserError, match=r"^give a model's CID or latest=TASK_CID \(one of them\)$"):
        p2ptrain.serve()

    assert main(["node", "start", "--home", str(tmp_path / "cli"), "--bootstrap", no_id]) == 1
    assert capsys.readouterr().err.startswith(f"p2ptrain: error: --bootstrap {no_id!r} has no /p2p/<peer id> part")
    assert main(["model", "fetch", "QmT78zSuBmuS4z925WZfrqQ1qHaJ56DQaTfyMUF7F8ff5o", "-o", str(tmp_path / "m"),
                 "--home", str(tmp_path / "empty")]) == 1
    assert capsys.readouterr().err.strip().endswith("or pass --bootstrap MULTIADDR")
    assert main(["dataset", "add", f"text:{texts}", "--shards", "2", "--eos", "<eos>", "--home", str(tmp_path / "data")]) == 1
    assert capsys.readouterr().err.strip() == ("p2ptrain: error: --eos needs a --tokenizer (bytes have no "
                                               "end-of-document token)")


def test_no_message_below_the_command_line_names_a_flag():
    """What p2ptrain/ raises outside cli/ reaches Python callers too: a flag in it (``"--bootstrap
    ..."``) is written as an ArgumentError field instead (p2ptrain/base/_errors.py), so each caller
    reads its own name. A command a message suggests (``p2ptrain node start --home H``) is no flag
    of the caller's. On main this listed 24 messages."""
    import ast
    import re

    flag = re.compile(r"(?<![\w-])--[a-z][a-z-]*")
    command = re.compile(r"p2ptrain [a-z]+[^;)`]*")
    root = Path(__file__).resolve().parents[1] / "p2ptrain"
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root).parts[0] == "cli":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and node.exc is not None:
                text = "".join(n.value for n in ast.walk(node.exc) if isinstance(n, ast.Constant) and isinstance(n.value, str))
                if flag.search(command.sub("", text)):
                    found.append(f"{path.relative_to(root)}:{node.lineno}: {text[:80]}")
    assert found == []


GOOD_CID = "QmT78zSuBmuS4z925WZfrqQ1qHaJ56DQaTfyMUF7F8ff5o"
TYPO = "bafybeigdyrzt5sfp7udm7hu76uh7y26nf3efuylqabf3oclgtqy55fbzdX"  # the last of 59 characters mistyped


@pytest.mark.parametrize("args", [
    ["model", "fetch", "--latest", TYPO, "-o", "m.safetensors"],
    ["model", "fetch", TYPO, "-o", "m.safetensors"],
    ["model", "verify", TYPO],
    ["model", "verify", "--latest", TYPO],
    ["model", "export", TYPO, "out"],
    ["model", "eval", GOOD_CID, "--dataset", TYPO],
    ["model", "serve", "--latest", TYPO],
    ["task", "status", TYPO],
    ["task", "cancel", TYPO],
    ["task", "report", TYPO],
    ["node", "start", "--join", TYPO],
    ["dataset", "info", TYPO],
    ["dataset", "get", TYPO],
])
def test_a_mistyped_cid_is_one_line_saying_what_a_cid_looks_like(args, tmp_path, capsys):
    """`model fetch --latest` of a CID with one character wrong printed the command's usage (five
    lines) and then the multibase decoder's reason, ``(Pad bits must be zero.)``; every command's
    CID argument goes through cli/ipfs.cid_arg, and the parser prints a refused value alone."""
    from p2ptrain.cli.main import main

    with pytest.raises(SystemExit) as exited:
        main([*args, "--home", str(tmp_path / "home")])
    assert exited.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1, err
    assert err[0].endswith(f": {TYPO!r} is not a valid CID: expected Qm... (46 characters) or b... (59, base32), as "
                           "p2ptrain prints them; 'X' is no character of one (base32: a to z, 2 to 7)"), err
    assert err[0].startswith(f"p2ptrain {args[0]} {args[1]}: error: argument ")
    assert not (tmp_path / "home").exists()


def test_task_publish_of_the_example_task_as_it_comes_names_the_placeholder(tmp_path, capsys):
    """node/tasks/digits-mlp.toml holds a placeholder for the manifest's CID; publishing it before
    putting the CID there said ``(Invalid character 'l' encountered for alphabet StringAlphabet(
    '123456789ABC...'))``, the decoder's words."""
    from p2ptrain.cli.main import main

    example = Path(__file__).resolve().parents[1] / "node" / "tasks" / "digits-mlp.toml"
    assert main(["task", "publish", str(example), "--home", str(tmp_path / "home")]) == 1
    assert capsys.readouterr().err.strip() == (
        "p2ptrain: error: dataset.manifest: 'QmReplaceWithTheManifestCidPrintedByDatasetAdd' is not a valid CID: "
        "expected Qm... (46 characters) or b... (59, base32), as p2ptrain prints them; 'l' is no character of one "
        "(base58: no 0, O, I or l)")


def test_the_readmes_task_file_outside_a_checkout_points_to_task_example_which_writes_it(tmp_path, monkeypatch,
                                                                                         capsys):
    """Installed from a wheel, there is no node/tasks/: `task publish node/tasks/digits-mlp.toml`, as the
    README has it, said only "No such file or directory", and nothing gave the example task files."""
    from p2ptrain.cli.main import main

    monkeypatch.chdir(tmp_path)
    home = ["--home", str(tmp_path / "home")]
    assert main(["task", "publish", "node/tasks/digits-mlp.toml", *home]) == 1
    assert capsys.readouterr().err.strip() == (
        "p2ptrain: error: cannot read node/tasks/digits-mlp.toml: no such file (`p2ptrain task example` lists "
        "the example task files and writes one)")
    assert main(["task", "example"]) == 0
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()] == [
        "digits-mlp", "llama-pipeline", "stdlib-lm"]
    shipped = (Path(__file__).resolve().parents[1] / "node" / "tasks" / "digits-mlp.toml").read_text()
    assert main(["task", "example", "digits-mlp", "-o", "digits-mlp.toml"]) == 0
    assert (tmp_path / "digits-mlp.toml").read_text() == shipped
    (tmp_path / "digits-mlp.toml").write_text("# edited\n")
    assert main(["task", "example", "digits-mlp", "-o", "digits-mlp.toml"]) == 1  # never over an edited file
    assert (tmp_path / "digits-mlp.toml").read_text() == "# edited\n"
    assert main(["task", "example", "digits"]) == 1
    assert capsys.readouterr().err.splitlines()[-2:] == [
        "p2ptrain: error: digits-mlp.toml exists: nothing written",
        "p2ptrain: error: no example task 'digits': the examples are digits-mlp, llama-pipeline, stdlib-lm"]
    assert main(["task", "example", "digits-mlp"]) == 0
    assert capsys.readouterr().out == shipped


def test_task_status_of_a_task_this_node_did_not_join_says_so_and_task_join_joins_it(tmp_path, capsys):
    """A task published on a node that joins no tasks showed ``progress step 0/?`` and ``members 0:``,
    a run of no one with no end, though the node holds the task's definition; no command joined a
    task with the node running (docs/training.md named a ``task join``), and ``model verify
    --latest`` of the run said "no chain of task ... verified" before its first checkpoint."""
    import json

    from p2ptrain.cli.main import main
    from p2ptrain.testing import node_processes

    with node_processes(1, tmp_path) as (node,):
        home = ["--home", str(node.home)]
        assert main(["dataset", "add", "sklearn:iris", "--shards", "2", *home]) == 0
        task = tmp_path / "iris.toml"
        task.write_text(TASK.format(width=4, manifest=capsys.readouterr().out.split()[-1]))
        assert main(["task", "publish", str(task), *home]) == 0
        task_cid = capsys.readouterr().out.strip()
        assert main(["task", "status", task_cid, *home]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert lines[2:5] == ["progress   no member has reported a step yet (the task runs 20 steps)",
                              "members    0",
                              f"not joined this node is not a member: `p2ptrain task join {task_cid}` makes it one"]
        assert main(["task", "status", task_cid, "--json", *home]) == 0
        assert json.loads(capsys.readouterr().out)["total_steps"] == 20
        assert main(["task", "join", task_cid, *home]) == 0
        assert capsys.readouterr().out.strip() == f"joined task iris-mlp ({task_cid})"
        assert main(["task", "status", task_cid, "--json", *home]) == 0
        assert json.loads(capsys.readouterr().out)["member"] is True
        assert main(["model", "verify", "--latest", task_cid, *home]) == 1
        err = capsys.readouterr().err.strip()  # (state: fetching data, or training: as far as the run got)
        assert err.startswith(f"p2ptrain: error: task {task_cid} has no confirmed model yet (state: "), err
        assert err.endswith(f"): nothing to verify until the first checkpoint (p2ptrain task status {task_cid})"), err


def test_examples_members_on_one_machine_each_get_a_home_of_their_own(monkeypatch, tmp_path):
    """The examples' own commands (``--member 0 --listen ...`` then ``--member 1 --bootstrap ...``
    on one machine) gave both members Optimizer's default home for the run, and the second died
    with a traceback: ``a p2ptrain node runs on ~/.p2ptrain/runs/digits-cnn``."""
    examples = Path(__file__).resolve().parents[1] / "examples"
    monkeypatch.syspath_prepend(str(examples))
    monkeypatch.setenv("P2PTRAIN_HOME", str(tmp_path))
    from _common import parse_args

    homes = set()
    for member in ("0", "1"):
        monkeypatch.setattr(sys, "argv", ["custom_loop.py", "--member", member, "--members", "2"])
        args = parse_args("doc", steps=10, run="digits-cnn")
        assert args.run == "digits-cnn"
        homes.add(args.home)
    assert homes == {str(tmp_path / "runs" / "digits-cnn-member0"), str(tmp_path / "runs" / "digits-cnn-member1")}
    monkeypatch.setattr(sys, "argv", ["custom_loop.py", "--home", str(tmp_path / "mine")])
    assert parse_args("doc", steps=10, run="digits-cnn").home == str(tmp_path / "mine")


def test_model_fetch_latest_on_the_default_home_names_the_run_home_that_keeps_the_chain(tmp_path, capsys):
    """After a script's run (Optimizer's default home, HOME/runs/<run>), `model fetch --latest
    RUN_CID` on HOME said only 'not in the store of HOME, and no node is running there'."""
    from p2ptrain.cli.main import main
    from p2ptrain.run import RunDir

    run_cid = "QmT78zSuBmuS4z925WZfrqQ1qHaJ56DQaTfyMUF7F8ff5o"
    kept = tmp_path / "home" / "runs" / "digits-cnn-member0"
    chain = RunDir.of(kept, run_cid).chain
    chain.parent.mkdir(parents=True)
    chain.write_bytes(b"")
    (tmp_path / "home" / "runs" / "other").mkdir()
    assert main(["model", "fetch", "--latest", run_cid, "-o", str(tmp_path / "m"), "--home",
                 str(tmp_path / "home")]) == 1
    assert capsys.readouterr().err.strip().endswith(
        f"or pass --bootstrap MULTIADDR; a run's home on this machine keeps its chain: --home {kept}")


def test_load_model_of_a_cid_the_home_lacks_says_how_to_fetch_it(tmp_path):
    """It said ``fetch it first: p2ptrain model fetch CID``: that command needs ``-o`` and a way to
    the mesh, and load_model itself fetches with ``bootstrap=``."""
    import p2ptrain
    from p2ptrain.ipfs import ContentUnavailable

    with pytest.raises(ContentUnavailable) as caught:
        p2ptrain.load_model(GOOD_CID, home=tmp_path / "home")
    assert str(caught.value) == (
        f"{GOOD_CID}: not in the local store: p2ptrain.load_model(cid, bootstrap=[MULTIADDR]) fetches it through a "
        f"peer of the mesh (p2ptrain model fetch {GOOD_CID} -o FILE --bootstrap MULTIADDR on the command line)")


@pytest.mark.usefixtures("quick_timers")  # tests/conftest.py: the in-process member's idle waits shortened
def test_model_fetch_latest_through_a_node_started_after_the_task_was_announced(tmp_path, capsys):
    """A home whose node started after a run's announcement: `model fetch --latest RUN_CID` asked
    that node, which said 'task.status: this node has not heard of task ...', where a fresh home
    with no node (--bootstrap) finds the run's chain by asking the mesh. The node now asks the mesh
    too: it fetches the task by CID and looks its latest chain up, as a fresh home does."""
    from p2ptrain.cli.main import main
    from p2ptrain.testing import free_port, NodeProcess, run_node_processes

    member = tmp_path / "member"
    opt, _ = _lone_run(member, "late")
    # The member's home, now a node's (it keeps the chain and answers for it), and a node started since.
    nodes = [NodeProcess(member, free_port()), NodeProcess(tmp_path / "late", free_port())]
    with run_node_processes(nodes) as (_, late):
        out = tmp_path / "model.safetensors"
        assert main(["model", "fetch", "--latest", opt.run_cid, "-o", str(out), "--home", str(late.home)]) == 0, \
            capsys.readouterr().err
    assert capsys.readouterr().out.startswith(f"{opt.model_cid} -> {out}")


def test_an_address_given_as_host_port_is_shown_as_the_multiaddr_it_means(tmp_path, capsys):
    """``--listen 0.0.0.0:4001`` said py-libp2p's "Invalid MultiAddr '0.0.0.0:4001': unknown protocol:
    0.0.0.0:4001 (string: 0.0.0.0:4001)" and left a new home behind (blocks/, logs/)."""
    import torch
    from torch import nn

    import p2ptrain
    from p2ptrain.base import UserError
    from p2ptrain.cli.main import main

    home = tmp_path / "home"
    assert main(["node", "start", "--home", str(home), "--listen", "0.0.0.0:4001"]) == 1
    assert capsys.readouterr().err.strip() == ("p2ptrain: error: --listen '0.0.0.0:4001' is not a multiaddr: as a "
                                               "multiaddr it is /ip4/0.0.0.0/tcp/4001")
    assert not home.exists()
    model = nn.Linear(2, 2)
    with pytest.raises(UserError) as caught:
        p2ptrain.Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model, run="r", home=home,
                           bootstrap=["10.0.0.1:4001"])
    assert str(caught.value) == ("bootstrap='10.0.0.1:4001' is not a multiaddr: as a multiaddr it is "
                                 "/ip4/10.0.0.1/tcp/4001/p2p/<peer id>")
    with pytest.raises(UserError, match=r"^listen='/ip4/1\.2\.3/tcp/1' is not a multiaddr: write it as /ip4/HOST/tcp/PORT, "
                                        r"e\.g\. /ip4/127\.0\.0\.1/tcp/4001 \(.+\)$"):
        p2ptrain.Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model, run="r", home=home,
                           listen=["/ip4/1.2.3/tcp/1"])


def test_a_scripts_model_by_cid_is_found_in_its_run_home_by_model_fetch_and_load_model(monkeypatch, tmp_path, capsys):
    """After the examples' run (homes ``~/.p2ptrain/runs/<run>-member<i>``), ``load_state(model, CID)``
    found the model, but ``p2ptrain model fetch CID -o FILE`` (as docs/api.md says) and
    ``load_model(CID)`` looked in ``~/.p2ptrain`` alone: 'not in the store of ~/.p2ptrain, and no node
    is running there'. Fails before: exit 1 and ContentUnavailable."""
    import p2ptrain
    from p2ptrain.cli.main import main
    from p2ptrain.ipfs import open_store
    from p2ptrain.models import build_model
    from p2ptrain.protocol import model_bytes

    monkeypatch.setenv("P2PTRAIN_HOME", str(tmp_path / "home"))
    data = model_bytes(build_model("mlp", {}, 0), {"name": "mlp", "kwargs": {}})
    (tmp_path / "home" / "runs" / "digits-cnn-member0").mkdir(parents=True)  # a run home without the model
    cid = open_store(tmp_path / "home" / "runs" / "digits-cnn-member1").add_bytes(data)
    out = tmp_path / "model.safetensors"
    assert main(["model", "fetch", cid, "-o", str(out)]) == 0, capsys.readouterr().err
    assert out.read_bytes() == data
    assert p2ptrain.load_model(cid).state_dict().keys() == build_model("mlp", {}, 0).state_dict().keys()


def test_the_resnet_example_without_a_working_torchvision_says_what_to_install_at_once(tmp_path):
    """It read the images and stored the data set (a minute), then died with a 20-line traceback
    ending in MissingBuilder. A torchvision that does not import stands in here, installed or not.
    Fails before: a traceback."""
    import subprocess

    fake = tmp_path / "path" / "torchvision"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('raise ImportError("torchvision was built for another torch")\n')
    example = Path(__file__).resolve().parents[1] / "examples" / "resnet_image_folder.py"
    done = subprocess.run([sys.executable, str(example), "--home", str(tmp_path / "home"), "--steps", "1"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(tmp_path / "path")})
    assert done.returncode == 1
    assert done.stderr.strip() == ("resnet_image_folder.py: needs torchvision beside this torch (torchvision was built "
                                   "for another torch): pip install torch==2.14.1 torchvision==0.29.1")
    assert not (tmp_path / "home" / "blocks").exists()  # nothing stored before saying so


def test_a_dataset_or_model_of_the_wrong_kind_is_one_line_saying_what_to_pass_before_a_node_starts(tmp_path):
    """``train(model, loader)`` said ``'DataLoader' object is not subscriptable``, a tensor or a CSV
    path ``too many values to unpack``, numpy arrays ``stack expects each tensor to be equal size``
    (each after a node had started), an empty dataset ``num_samples should be a positive integer
    value``; ``Optimizer(model=model.state_dict())`` ``'OrderedDict' object has no attribute
    'parameters'``; ``run=5`` ``name: must be a non-empty string``. Fails before: those errors."""
    import numpy as np
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import p2ptrain

    model = nn.Linear(4, 3)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    home = tmp_path / "home"

    def train(data: object, **kwargs: object) -> None:
        p2ptrain.train(model, data, steps=1, run="r", home=home, **kwargs)  # type: ignore[arg-type]

    dataset = "^train_data= takes a torch Dataset of \\(features, label\\), not a "
    with pytest.raises(TypeError, match=dataset + r"DataLoader: pass train_data=loader\.dataset \(train batches"):
        train(DataLoader(TensorDataset(x, y), batch_size=4))
    for data in (x, (x.numpy(), y.numpy()), np.zeros((8, 4))):
        with pytest.raises(TypeError, match=dataset + r"\w+: pair features with labels: torch\.utils\.data\.TensorDataset"):
            train(data)
    with pytest.raises(TypeError, match=dataset + r"str: a file is read by `p2ptrain dataset add PATH`, then p2ptrain"):
        train("data.csv")
    with pytest.raises(ValueError, match=r"^train_data= is empty: it has no \(features, label\)"):
        train(TensorDataset(x[:0], y[:0]))
    with pytest.raises(TypeError, match="^test_data= takes a torch Dataset of .*not a tuple"):
        train(TensorDataset(x, y), test_data=(x, y))
    module = r"^model= takes your torch\.nn\.Module \(the one whose parameters the optimizer holds\), not a "
    with pytest.raises(TypeError, match=module + "function$"):
        p2ptrain.train(lambda t: t, TensorDataset(x, y), steps=1, run="r", home=home)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=module + "OrderedDict$"):
        p2ptrain.Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model.state_dict(), run="r",  # type: ignore[arg-type]
                           home=home)
    with pytest.raises(TypeError, match=r"^run= takes the run's name, a string \(the same on every member\), not 5$"):
        p2ptrain.Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model, run=5, home=home)  # type: ignore[arg-type]
    assert not home.exists()  # refused before a home or a node was made


def test_an_examples_member_on_a_home_in_use_or_with_a_bad_bootstrap_says_one_line_not_a_traceback(tmp_path):
    """Two members started with the same ``--home``, or ``--bootstrap`` without the /p2p/ part:
    p2ptrain's one-line UserError came at the end of a 15-line traceback. Fails before: a traceback.
    The line names the example's flags, what the user typed: it said ``give
    p2ptrain.Optimizer(home=...) another home`` and ``bootstrap='...'`` (fails on 6d977b5)."""
    import subprocess

    from p2ptrain.control import socket_path

    example = Path(__file__).resolve().parents[1] / "examples" / "custom_loop.py"

    def member(*args: str) -> subprocess.CompletedProcess[str]:  # forked: torch is imported already
        return run_forked([sys.executable, str(example), "--steps", "1", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "P2PTRAIN_HOME": str(tmp_path / "default")})

    done = member("--bootstrap", "/ip4/127.0.0.1/tcp/4001", "--home", str(tmp_path / "a"))
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith("custom_loop.py: error: --bootstrap '/ip4/127.0.0.1/tcp/4001' has no /p2p/<peer "
                                  "id> part") and done.stderr.count("\n") == 1, done.stderr
    home = tmp_path / "b"
    home.mkdir()
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # a node that runs on this home and answers
    live.bind(str(socket_path(home)))
    live.listen()
    try:
        done = member("--home", str(home))
    finally:
        live.close()
    assert done.returncode == 1 and done.stderr == (f"custom_loop.py: error: a p2ptrain node runs on {home}: each member "
                                                    "running at once needs a home of its own; pass another --home DIR\n"), \
        done.stderr


def test_output_into_a_pipe_its_reader_closed_ends_without_a_traceback(tmp_path):
    """`p2ptrain node status --json | head -c 600` ended in a 10-line BrokenPipeError traceback once
    head had what it wanted. The reader's end is closed before the command writes, so the command
    meets the closed pipe every time (`task example` needs no node and imports no torch)."""
    import subprocess

    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run([str(Path(sys.executable).with_name("p2ptrain")), "task", "example", "digits-mlp"],
                              stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=60, cwd=tmp_path)
    finally:
        os.close(write_end)
    assert done.stderr == "" and done.returncode == 141
