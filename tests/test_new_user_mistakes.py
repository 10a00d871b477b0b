"""The mistakes a new user makes on the way from install to a model CID, each one clear line that
says what was meant, before anything is spent: a task's CID given where a model's goes, a task
whose model does not fit its data set."""

from __future__ import annotations

from pathlib import Path

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
