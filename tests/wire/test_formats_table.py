"""docs/mesh.md's table of wire formats names every pubsub type, control op, collective frame and
gather part that the code declares, so a format added without its row fails here."""

from __future__ import annotations

from pathlib import Path

from p2ptrain.control import ops as control_ops
from p2ptrain import wire
from p2ptrain.wire import Kind, MESSAGES
from p2ptrain.wire import activations

DOC = (Path(__file__).resolve().parents[2] / "docs" / "mesh.md").read_text()


def test_every_pubsub_type_has_a_row() -> None:
    for name in MESSAGES.names():
        assert f"| `{name}` | `{MESSAGES.get(name).__name__}` |" in DOC, name


def test_every_control_op_has_a_row_with_its_constant() -> None:
    constants = {value: key for key, value in vars(control_ops).items() if key.isupper() and isinstance(value, str)}
    assert set(constants) == set(control_ops.ALL)
    for op in control_ops.ALL:
        assert f"| `{op}` | `{constants[op]}` |" in DOC, op


def test_every_frame_kind_has_a_row() -> None:
    for kind in Kind:
        assert f"| `{kind.name}` ({kind.value}) |" in DOC, kind


def test_every_pipeline_frame_kind_has_a_row() -> None:
    for kind in activations.Kind:
        assert f"| `{kind.name}` ({kind.value}) |" in DOC, kind


def test_every_gather_part_has_a_row_naming_its_module() -> None:
    for build, read in [(wire.summary_entry_bytes, wire.read_summary_entry), (wire.statement_bytes, wire.read_statement)]:
        module = build.__module__.removeprefix("p2ptrain.").replace(".", "/") + ".py"
        assert read.__module__ == build.__module__
        assert f"| `{module}` | `{build.__name__}` / `{read.__name__}` |" in DOC, module
