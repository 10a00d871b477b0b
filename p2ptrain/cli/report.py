"""``p2ptrain task report TASK_CID -o report.png|report.html``: a picture of a run.

Drawn from the confirmed chain a member keeps (``<home>/tasks/<task CID>/chain.jsonl``), re-verified
record by record (signatures, versions, parents) before anything is drawn: what the picture shows
is what a quorum of members attested, not what one node says. Each record carries the test metrics
the coordinator measured and its mean round over the span: compute, sync and apply time and bytes
sent (the record's ``round_*`` metrics); records from older versions, without them, leave those
two panels empty.

matplotlib (Agg backend: no display needed) is an optional extra, ``pip install 'p2ptrain[report]'``:
a peer on a server trains without it, and a 40 MB plotting stack has no place in every image.
"""

from __future__ import annotations

import argparse
import base64
import html
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from p2ptrain.cli._home_options import home_help
from p2ptrain.cli.ipfs import cid_arg
from p2ptrain.base import UserError

FORMATS = (".png", ".html")
# Size of the picture: four panels, readable on a laptop screen and in a chat window.
FIGURE_INCHES = (11.0, 7.5)
FIGURE_DPI = 110


@dataclass(frozen=True)
class Point:
    """One confirmed model of the run, as the report draws it."""

    version: int
    step: int
    round: int
    members: int
    train_loss: float | None
    test_loss: float | None
    accuracy: float | None
    compute_s: float | None
    sync_s: float | None
    apply_s: float | None
    bytes_sent: float | None


def add_parser(tsub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``task report`` in the task group."""
    report = tsub.add_parser(
        "report", help="draw a run: loss, accuracy, members, bytes and time per round (PNG or HTML)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    report.add_argument("task_cid", metavar="TASK_CID", type=cid_arg,
                        help="the task whose run to draw (this home must be a member)")
    report.add_argument("-o", "--output", type=Path, required=True, metavar="FILE",
                        help="where to write the report: FILE.png (a picture) or FILE.html (the picture and a table)")
    report.add_argument("--home", type=Path, default=None,
                        help=home_help("a member's home, whose tasks/<task CID>/chain.jsonl is drawn; no node needs to run"))
    report.set_defaults(func=cmd_report)


def cmd_report(args: argparse.Namespace) -> int:
    from p2ptrain.cli._home_options import home_of

    home = home_of(args)
    points = load_points(home, args.task_cid)
    write_report(points, args.task_cid, args.output)
    print(f"wrote {args.output} ({len(points)} confirmed models, step {points[-1].step})")
    return 0


def load_points(home: Path, task_cid: str) -> list[Point]:
    """The run's confirmed records from ``home``, verified; a UserError line when there are none."""
    from p2ptrain.protocol import RecordError, read_chain
    from p2ptrain.run import RunDir

    run_dir = RunDir.of(home, task_cid)
    path = run_dir.chain
    try:
        data = run_dir.read_chain()
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror or exc}") from None
    except RecordError as exc:
        raise UserError(str(exc)) from None
    if data is None:
        raise UserError(f"no confirmed models of task {task_cid} in {home} (a member's home holds "
                        f"{path.relative_to(home)}; pass it with --home)")
    if not data.strip():
        raise UserError(f"{path} holds no confirmed model yet")
    try:
        chain = read_chain(task_cid, data)
    except RecordError as exc:
        raise UserError(f"{path}: {exc}") from None
    return [_point(s.record) for s in chain.records]


def _point(record: Any) -> Point:
    m = record.metrics

    def get(key: str) -> float | None:
        value = m.get(key)
        return None if value is None or value != value else float(value)  # NaN: not measured

    return Point(record.version, record.step, record.round, len(record.members), get("train_loss"), get("loss"),
                 get("accuracy"), get("round_compute_s"), get("round_sync_s"), get("round_apply_s"),
                 get("round_bytes_sent"))


def write_report(points: list[Point], task_cid: str, output: Path) -> None:
    """Write the picture (``.png``) or a page with it and a table (``.html``) to ``output``."""
    suffix = output.suffix.lower()
    if suffix not in FORMATS:
        raise UserError(f"-o {output}: the report is a .png or an .html file")
    png = draw(points, task_cid)
    data = png if suffix == ".png" else _html(points, task_cid, png).encode()
    try:
        output.write_bytes(data)
    except OSError as exc:
        raise UserError(f"cannot write {output}: {exc.strerror or exc}") from None


def draw(points: list[Point], task_cid: str) -> bytes:
    """The four panels as PNG bytes."""
    try:
        import matplotlib
    except ImportError:
        raise UserError("the report needs matplotlib: pip install 'p2ptrain[report]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [p.step for p in points]
    fig, axes = plt.subplots(2, 2, figsize=FIGURE_INCHES, dpi=FIGURE_DPI, sharex=True)
    fig.suptitle(f"task {task_cid}: {len(points)} confirmed models, step {steps[-1]}", fontsize=11)

    ax = axes[0][0]
    _line(ax, steps, [p.train_loss for p in points], "training loss (coordinator, last round)", "C0")
    _line(ax, steps, [p.test_loss for p in points], "test loss", "C1")
    ax.set_ylabel("loss")
    acc = ax.twinx()
    _line(acc, steps, [p.accuracy for p in points], "test accuracy", "C2")
    acc.set_ylim(0, 1)
    acc.set_ylabel("test accuracy")
    handles = ax.get_legend_handles_labels()[0] + acc.get_legend_handles_labels()[0]
    ax.legend(handles=handles, fontsize=8, loc="lower left")  # loss starts high, accuracy mid-way: free
    ax.set_title("loss and accuracy of each confirmed model", fontsize=10)

    ax = axes[0][1]
    # the members of a span, from its first step to the checkpoint that ends it
    ax.step([0] + steps, [points[0].members] + [p.members for p in points], where="pre", color="C4")
    ax.plot(steps, [p.members for p in points], "o", color="C4")
    ax.set_ylim(0, max(p.members for p in points) + 1)
    ax.set_ylabel("members")
    ax.set_title("members of each span", fontsize=10)

    # A span's bar covers the span: from the step after the last checkpoint to its own.
    starts = [0] + steps[:-1]
    widths = [0.9 * max(b - a, 1) for a, b in zip(starts, steps)]
    ax = axes[1][0]
    sent = [p.bytes_sent for p in points]
    if any(v is not None for v in sent):
        ax.bar(starts, [(v or 0) / 1024 for v in sent], width=widths, align="edge", color="C5")
    else:
        _no_data(ax)
    ax.set_ylabel("KiB")
    ax.set_title("bytes sent per round (coordinator's mean over each span)", fontsize=10)

    ax = axes[1][1]
    parts = [("compute", [p.compute_s for p in points], "C0"), ("sync", [p.sync_s for p in points], "C3"),
             ("apply", [p.apply_s for p in points], "C2")]
    if any(v is not None for _, values, _ in parts for v in values):
        bottom = [0.0] * len(points)
        for label, values, color in parts:
            ms = [1e3 * (v or 0.0) for v in values]
            ax.bar(starts, ms, width=widths, bottom=bottom, align="edge", label=label, color=color)
            bottom = [b + v for b, v in zip(bottom, ms)]
        ax.set_ylim(0, 1.25 * max(bottom))  # headroom for the legend above the bars
        ax.legend(fontsize=8, loc="upper center", ncol=3)
    else:
        _no_data(ax)
    ax.set_ylabel("ms")
    ax.set_title("time of a round (coordinator's mean over each span)", fontsize=10)

    for row in axes:
        for ax in row:
            ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("step")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def _line(ax: Any, steps: list[int], values: list[float | None], label: str, color: str) -> None:
    xs = [s for s, v in zip(steps, values) if v is not None]
    ys = [v for v in values if v is not None]
    if ys:
        ax.plot(xs, ys, marker="o", label=label, color=color)


def _no_data(ax: Any) -> None:
    ax.text(0.5, 0.5, "not in these records", ha="center", va="center", transform=ax.transAxes, color="grey")
    ax.set_yticks([])


def _html(points: list[Point], task_cid: str, png: bytes) -> str:
    def cell(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    rows = "\n".join(
        f"<tr><td>{p.version}</td><td>{p.step}</td><td>{p.members}</td><td>{cell(p.train_loss, '.4f')}</td>"
        f"<td>{cell(p.test_loss, '.4f')}</td><td>{cell(p.accuracy, '.3f')}</td>"
        f"<td>{cell(p.compute_s and 1e3 * p.compute_s, '.1f')}</td><td>{cell(p.sync_s and 1e3 * p.sync_s, '.1f')}</td>"
        f"<td>{cell(p.apply_s and 1e3 * p.apply_s, '.1f')}</td><td>{cell(p.bytes_sent, '.0f')}</td></tr>"
        for p in points
    )
    title = html.escape(f"p2ptrain run of task {task_cid}")
    image = base64.b64encode(png).decode()
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{title}</title>
<style>body{{font-family:sans-serif;margin:2em}} table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:2px 8px;text-align:right}}</style></head>
<body><h1>{title}</h1>
<img alt="loss, accuracy, members, bytes and time per round" src="data:image/png;base64,{image}">
<h2>Confirmed models</h2>
<table><tr><th>version</th><th>step</th><th>members</th><th>training loss</th><th>test loss</th>
<th>test accuracy</th><th>compute ms</th><th>sync ms</th><th>apply ms</th><th>bytes sent per round</th></tr>
{rows}
</table></body></html>
"""
