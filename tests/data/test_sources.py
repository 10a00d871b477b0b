"""Dataset sources: scikit-learn's bundled sets and folders of .npy/.npz/CSV, never unpickled."""

import numpy as np
import pytest

from p2ptrain.data import load_source
from p2ptrain.base import UserError


def test_sklearn_digits():
    name, x, y = load_source("sklearn:digits")
    assert name == "digits" and x.shape == (1797, 64) and x.dtype == np.float32
    assert y.dtype == np.int64 and set(y.tolist()) == set(range(10))


def test_npy_pair(tmp_path):
    np.save(tmp_path / "features.npy", np.ones((5, 3), np.float32))
    np.save(tmp_path / "labels.npy", np.arange(5))
    name, x, y = load_source(str(tmp_path))
    assert name == tmp_path.name and x.shape == (5, 3) and y.tolist() == [0, 1, 2, 3, 4]


def test_npz_files_are_concatenated_in_name_order(tmp_path):
    np.savez(tmp_path / "b.npz", features=np.full((2, 2), 2.0), labels=np.array([2, 2]))
    np.savez(tmp_path / "a.npz", features=np.full((1, 2), 1.0), labels=np.array([1]))
    _, x, y = load_source(str(tmp_path))
    assert y.tolist() == [1, 2, 2] and x[:, 0].tolist() == [1.0, 2.0, 2.0]


def test_csv_with_header_last_column_is_label(tmp_path):
    (tmp_path / "d.csv").write_text("a,b,label\n0.5,1.5,3\n2.5,3.5,4\n")
    _, x, y = load_source(str(tmp_path))
    assert x.tolist() == [[0.5, 1.5], [2.5, 3.5]] and y.tolist() == [3, 4]


def test_pickled_arrays_are_refused(tmp_path):
    np.save(tmp_path / "features.npy", np.array([{"evil": 1}], dtype=object), allow_pickle=True)
    np.save(tmp_path / "labels.npy", np.arange(1))
    with pytest.raises(UserError, match="without pickle"):
        load_source(str(tmp_path))


def test_bad_sources(tmp_path):
    with pytest.raises(UserError, match="no features.npy"):
        load_source(str(tmp_path))
    with pytest.raises(UserError, match="unknown built-in"):
        load_source("sklearn:imagenet")
    np.save(tmp_path / "features.npy", np.ones((5, 3)))
    with pytest.raises(UserError, match="labels.npy: missing"):
        load_source(str(tmp_path))
