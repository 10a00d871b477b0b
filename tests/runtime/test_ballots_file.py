"""The file where a member keeps the latest term it may have voted in (run/_ballots_file.py):
real files in a temporary run folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from p2ptrain.run import RunDir
from p2ptrain.run._ballots_file import load_voted_through, save_voted_through


def test_a_term_kept_is_read_back_and_a_first_run_has_none(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path / "tasks" / "Qm-task")
    assert load_voted_through(run_dir) == -1
    save_voted_through(run_dir, 7)  # makes the run's folder
    assert load_voted_through(run_dir) == 7
    save_voted_through(run_dir, 2**63 - 1)  # the largest term the wire carries
    assert load_voted_through(run_dir) == 2**63 - 1
    assert list(run_dir.path.iterdir()) == [run_dir.voted]  # no temporary file left
    assert run_dir.voted.stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize("data", [b"", b"seven", b"7 ", b" 7", b"-2", b"+7", b"1_000", b"7\n\n", b"\xff\xfe",
                                  str(2**63).encode(), b"9" * 30, b"7" * 10_000_000],
                         ids=["empty", "word", "trailing space", "leading space", "below -1", "plus sign",
                              "underscore", "two newlines", "not utf-8", "beyond 64 bits", "30 digits", "10 MB"])
def test_a_damaged_file_means_no_vote_and_is_kept_as_it_was(tmp_path: Path, data: bytes,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    RunDir(tmp_path).voted.write_bytes(data)
    assert load_voted_through(RunDir(tmp_path)) is None
    assert RunDir(tmp_path).voted.read_bytes() == data
    [record] = caplog.records
    assert "holds no term number" in record.getMessage() and len(record.getMessage()) < 300


def test_a_hand_written_term_with_a_newline_is_read(tmp_path: Path) -> None:
    RunDir(tmp_path).voted.write_bytes(b"12\n")
    assert load_voted_through(RunDir(tmp_path)) == 12


def test_an_unreadable_file_means_no_vote(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    RunDir(tmp_path).voted.mkdir()  # reading it fails (IsADirectoryError), as a broken disk's would
    assert load_voted_through(RunDir(tmp_path)) is None
    assert "unreadable" in caplog.text
