"""A test that needs a tool `make test` installs fails under CI=true when the tool is missing, and
skips with the reason elsewhere (tests/conftest.py); one that needs root only ever skips without it.

The tools are made missing for real: PATH names an empty folder.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("p2ptrain_test_conftest", Path(__file__).with_name("conftest.py"))
assert _spec is not None and _spec.loader is not None
tools = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tools)


def test_the_installable_tools_are_the_makefiles() -> None:
    installable = tools.installed_by_make()
    assert installable["iptables"] == "apt-get install iptables"
    assert installable["ip"] == installable["tc"] == "apt-get install iproute2"
    assert "node" not in installable  # make test does not install Node: its tests skip, also in CI


def test_a_missing_installable_tool_fails_in_ci_and_skips_elsewhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing on PATH
    assert shutil.which("iptables") is None
    kind, why = tools.missing_tool_verdict(("ip", "iptables"), root=True, ci=True, euid=0)
    assert kind == "fail" and "iptables" in why and "apt-get install iptables" in why, why
    kind, why = tools.missing_tool_verdict(("ip", "iptables"), root=True, ci=False, euid=0)
    assert kind == "skip" and "run make test" in why, why
    # Not root: make test installed nothing, so even CI skips (and says why).
    kind, why = tools.missing_tool_verdict(("iptables",), root=False, ci=True, euid=1000)
    assert kind == "skip" and "not root" in why, why
    kind, why = tools.missing_tool_verdict(("iptables",), root=True, ci=True, euid=1000)
    assert kind == "skip" and "needs root" in why, why
    # A tool make test does not install skips in CI too.
    kind, why = tools.missing_tool_verdict(("node",), root=False, ci=True, euid=0)
    assert kind == "skip" and "node" in why, why


def test_a_present_tool_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "iptables"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert tools.missing_tool_verdict(("iptables",), root=False, ci=True, euid=1000) is None
