"""``p2ptrain task …``: publish a task to the mesh, list tasks, follow one.

These commands talk to the running node of ``--home`` over its control socket: publishing needs the
mesh (the task is announced to the other peers), and status is what the node has seen of the run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from p2ptrain.cli import report
from p2ptrain.cli._home_options import RUNNING_NODE_HOME_HELP
from p2ptrain.cli.ipfs import cid_arg
from p2ptrain.base import UserError, short_id
from p2ptrain.control import TaskStatus, ops as control_ops

if TYPE_CHECKING:
    from p2ptrain.task import Task


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    group = sub.add_parser("task", help="publish and follow training tasks", description=__doc__)
    tsub = group.add_subparsers(dest="command", metavar="COMMAND", required=True)

    publish = tsub.add_parser(
        "publish", help="validate a task file, store it by CID and announce it",
        description="Validate TASK.toml (errors name the field), check that its dataset can be had, "
        "store it by CID, sign and announce it on the tasks topic, and print the task CID. Peers that "
        "accept tasks and meet its requirements join it.",
    )
    publish.add_argument("task_file", type=Path, metavar="TASK.toml", help="the task file (TOML; `p2ptrain docs training`)")
    publish.add_argument("--home", type=Path, default=None, help=RUNNING_NODE_HOME_HELP)
    publish.add_argument("--join", action="store_true", help="this node joins the task too")
    publish.add_argument("--json", action="store_true", help="print one JSON object (task_cid, name, joined)")
    publish.set_defaults(func=cmd_publish)

    status = tsub.add_parser("status", help="state, round, members, coordinator and latest model of a task")
    status.add_argument("task_cid", metavar="TASK_CID", type=cid_arg, help="the task's CID (from task publish or task list)")
    status.add_argument("--home", type=Path, default=None, help=RUNNING_NODE_HOME_HELP)
    status.add_argument("--json", action="store_true", help="print one JSON object")
    status.set_defaults(func=cmd_status)

    join = tsub.add_parser(
        "join", help="this node takes part in a task published without it",
        description="Ask the running node of --home to become a member of TASK_CID: it fetches the task by CID "
        "from its peers if its store lacks it, checks that it can take part (requirements, builders, allowlist) "
        "and trains with the other members. A node joins on its own only the tasks it publishes with --join, "
        "the ones named by `node start --join`, and, started with --accept-tasks, the ones announced.",
    )
    join.add_argument("task_cid", metavar="TASK_CID", type=cid_arg, help="the task's CID (from task publish or task list)")
    join.add_argument("--home", type=Path, default=None, help=RUNNING_NODE_HOME_HELP)
    join.add_argument("--json", action="store_true", help="print one JSON object (task_cid, name)")
    join.set_defaults(func=cmd_join)

    cancel = tsub.add_parser(
        "cancel", help="stop a task this node published",
        description="Announce, signed by this node's key, that the task is cancelled. Members obey it "
        "only from the task's publisher (the node that ran `task publish`, named in the task file): "
        "they finish the span under way, keep the last confirmed model and report the state "
        "'cancelled'. A cancel from any other peer is refused and counted (`task status`, rejected). "
        "`task resume` continues the run from its last confirmed model.",
    )
    cancel.add_argument("task_cid", metavar="TASK_CID", type=cid_arg, help="the CID of a task this node published")
    cancel.add_argument("--reason", default="", help="a short note the members log (at most 256 characters)")
    cancel.add_argument("--home", type=Path, default=None, help=RUNNING_NODE_HOME_HELP)
    cancel.add_argument("--json", action="store_true", help="print one JSON object (task_cid, cancelled)")
    cancel.set_defaults(func=cmd_cancel)

    resume = tsub.add_parser(
        "resume", help="continue a task this node published and cancelled",
        description="Announce, signed by this node's key, that the cancelled task goes on. Members "
        "obey it only from the task's publisher: each forgets the cancel and resumes the run from the "
        "last confirmed model on its home (`task status` shows resumed_from). A resume from any other "
        "peer is refused and counted. Safe to repeat (e.g. once a member that was down is up again).",
    )
    resume.add_argument("task_cid", metavar="TASK_CID", type=cid_arg, help="the CID of a task this node published")
    resume.add_argument("--home", type=Path, default=None, help=RUNNING_NODE_HOME_HELP)
    resume.add_argument("--json", action="store_true", help="print one JSON object (task_cid, resumed)")
    resume.set_defaults(func=cmd_resume)

    listing = tsub.add_parser("list", help="tasks this node has heard of or takes part in")
    listing.add_argument("--home", type=Path, default=None, help=RUNNING_NODE_HOME_HELP)
    listing.add_argument("--json", action="store_true", help="print one JSON object {tasks: [...], joins: {...}}")
    listing.set_defaults(func=cmd_list)

    report.add_parser(tsub)

    example = tsub.add_parser(
        "example", help="print or write one of the example task files",
        description="The example task files that come with p2ptrain (a checkout has them in node/tasks/): "
        "with no NAME, their names and what each trains; with NAME, the file, to edit (its dataset's "
        "manifest CID first) and publish with `task publish`. Needs no node.",
    )
    example.add_argument("name", nargs="?", metavar="NAME", help="the example's name, e.g. digits-mlp")
    example.add_argument("-o", "--output", type=Path, metavar="FILE",
                         help="write it to FILE, which must not exist yet (default: print it)")
    example.set_defaults(func=cmd_example)


def _client(args: argparse.Namespace) -> Any:
    from p2ptrain.cli._home_options import home_of
    from p2ptrain.control import ControlClient

    return ControlClient(home_of(args), timeout=120.0)


def cmd_publish(args: argparse.Namespace) -> int:
    try:
        data = args.task_file.read_bytes()
    except FileNotFoundError:
        # The README's node/tasks/ paths exist only in a checkout; a wheel has the same files inside.
        raise UserError(f"cannot read {args.task_file}: no such file (`p2ptrain task example` lists the "
                        "example task files and writes one)") from None
    except OSError as exc:
        raise UserError(f"cannot read {args.task_file}: {exc.strerror}") from None
    from p2ptrain.cli._home_options import home_of
    from p2ptrain.task import load_task

    task = load_task(data)  # the same validation the node runs, before a node is needed (and UTF-8 checked)
    problem = _fit_problem(home_of(args), task)
    if problem is not None:
        raise UserError(f"{args.task_file}: the task's data set and model do not fit: {problem.rstrip('.')}; "
                        "nothing published")
    text = data.decode()
    reply = _client(args).call(control_ops.TASK_PUBLISH, text=text, join=args.join)
    print(json.dumps(reply) if args.json else reply["task_cid"])
    if not args.json and not reply.get("joined", True):
        # Otherwise `task status` shows "announced, 0 members" with no word why (a node restarted
        # with --join CID alone, or started without --accept-tasks, joins no new task).
        print("p2ptrain: this node did not join the task (it runs without --accept-tasks): peers started with "
              f"--accept-tasks join it; `p2ptrain task join {reply['task_cid']}` makes this node a member too",
              file=sys.stderr)
    return 0


def _fit_problem(home: Path, task: Task) -> str | None:
    """Why the task's data set does not fit its model, when this home's store holds the manifest
    (it does after ``dataset add`` on this home): each member would otherwise find out only after
    joining, and the task's CID would be spent on a run that fails everywhere. None when it fits,
    or when this cannot be told here (no local manifest, a builder the check does not cover)."""
    from p2ptrain.models import CHECKED_BUILDERS, input_problem

    if task.dataset is None or task.model.name not in CHECKED_BUILDERS or not (home / "blocks").is_dir():
        return None
    from p2ptrain.data import Manifest, ManifestError
    from p2ptrain.ipfs import open_store

    store = open_store(home)
    if not store.has(task.dataset.manifest):
        return None
    try:
        manifest = Manifest.load(store, task.dataset.manifest)
    except ManifestError:
        return None  # the node's own checks say what is wrong with it
    return input_problem(task.model.name, task.model.arguments, manifest.features.shape)


def cmd_status(args: argparse.Namespace) -> int:
    from p2ptrain.cli._home_options import home_of
    from p2ptrain.control import ControlError

    try:
        status = TaskStatus.from_json(_client(args).call(control_ops.TASK_STATUS, task_cid=args.task_cid))
    except ControlError as exc:
        from p2ptrain.run import RunDir

        home, cid = home_of(args), args.task_cid
        if not RunDir.of(home, cid).chain.is_file():  # it said only that: no word of where tasks are listed
            raise UserError(f"{exc}: `p2ptrain task list` shows the tasks it has heard of; `p2ptrain task join "
                            f"{cid}` fetches this one from its peers and takes part") from None
        # A run this home took part in, before its node (re)started: a node hears of tasks anew.
        raise UserError(f"{exc} since it started; this home took part in it before: `p2ptrain model verify --latest "
                        f"{cid} --home {home}` shows its models (also `task report`; `node start --join` takes part "
                        "again)") from None
    print(json.dumps(status.to_json(), indent=None) if args.json else render_status(status))
    return 0


def cmd_join(args: argparse.Namespace) -> int:
    reply = _client(args).call(control_ops.TASK_JOIN, task_cid=args.task_cid)
    print(json.dumps(reply) if args.json else f"joined task {reply['name']} ({reply['task_cid']})")
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    reply = _client(args).call(control_ops.TASK_CANCEL, task_cid=args.task_cid, reason=args.reason[:256])
    print(json.dumps(reply) if args.json else f"cancelled task {reply['task_cid']}")
    return 0


def cmd_resume(args: argparse.Namespace) -> int:
    reply = _client(args).call(control_ops.TASK_RESUME, task_cid=args.task_cid)
    print(json.dumps(reply) if args.json else f"resumed task {reply['task_cid']}")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    reply = _client(args).call(control_ops.TASK_LIST)
    tasks = [TaskStatus.from_json(t) for t in reply["tasks"]]
    if args.json:  # "joins": announcements not joined, by why (busy, recently_failed, refused, ...)
        print(json.dumps({"tasks": [t.to_json() for t in tasks], "joins": reply.get("joins")}))
        return 0
    if not tasks:
        print("no tasks heard of yet")
    for t in tasks:
        print(render_row(t))
    return 0


def cmd_example(args: argparse.Namespace) -> int:
    from p2ptrain.task import example_names, example_task

    if args.name is None:
        if args.output is not None:
            raise UserError("task example: -o needs NAME (one of " + ", ".join(example_names()) + ")")
        for name in example_names():
            print(f"{name:16}{_summary(example_task(name))}")
        return 0
    text = example_task(args.name)
    if args.output is None:
        sys.stdout.write(text)
        return 0
    if args.output.exists():  # never over a task file someone edited
        raise UserError(f"{args.output} exists: nothing written")
    from p2ptrain.base import write_atomic

    try:
        write_atomic(args.output, text.encode())  # whole or not at all, as every file p2ptrain writes
    except OSError as exc:
        raise UserError(f"cannot write {args.output}: {exc.strerror}") from None
    print(f"wrote {args.output} (example {args.name}): put its dataset's manifest CID in, then "
          f"`p2ptrain task publish {args.output}`", file=sys.stderr)
    return 0


def _summary(text: str) -> str:
    """An example's first comment line (what it trains), with "..." where its sentence goes on."""
    first = (text.splitlines() or [""])[0].removeprefix("#").strip()
    return first if first.endswith(".") else first + " ..."


def render_row(t: TaskStatus) -> str:
    """A `task list` row: CID, name, state, progress, membership. The progress says only what is
    known, as `task status` does: a task heard of whose run no member has reported yet is "not
    started" (with its length where this node read the task's definition), and a total this node
    does not know is left out rather than shown as "step 0/?"."""
    if not t.member and t.state == "announced":
        progress = "not started" + (f", {t.total_steps} steps" if t.total_steps else "")
    else:
        progress = _step_of(t.step, t.total_steps)
    return f"{t.task_cid}  {t.name:<20} {t.state:<10} {progress}  {'member' if t.member else ''}"


def render_status(s: TaskStatus) -> str:
    """Human-readable task status: progress as the last *completed* round and step, the latest
    confirmed model with its test metrics, and what the run waits for before its first round."""
    lines = [
        f"task       {s.name} ({s.task_cid})",
        f"state      {s.state}" + (f" ({s.error})" if s.error else ""),
        f"progress   {_progress(s)}",
        f"members    {len(s.members)}" + "".join(f"{', ' if i else ': '}{short_id(m)}" for i, m in enumerate(s.members)),
    ]
    if s.refused:
        lines.append(f"not joined {s.refused}")
    elif not s.member:  # else it read as a run of no one, at "step 0/?"
        lines.append(f"not joined this node is not a member: `p2ptrain task join {s.task_cid}` makes it one")
    if s.member:
        lines.append(f"coordinator {short_id(s.coordinator or '-')} (term {s.term})")
        if s.loss is not None:
            lines.append(f"training   loss {_num(s.loss, '.4g')} (this peer's last round)")
        lines.append(f"sent       {s.bytes_sent} bytes over {s.rounds_done} rounds")
        if s.stages:
            served = "-" if s.stage is None else s.stage
            lines.append(f"stages     {len(s.stages)}, this peer serves stage {served}: " + "; ".join(
                f"{e['stage']}: {len(e['replicas'])} replica{'s' if len(e['replicas']) != 1 else ''}, "
                f"{e['parameters']:,} parameters" + (f", {e['microseconds'] / 1000:.1f} ms a microbatch"
                                                     if "microseconds" in e else "") for e in s.stages))
        for e in s.stage_suspects or ():
            lines.append(f"suspect    {short_id(e['peer'])}, stage {e['stage']}: sent altered activations or gradients "
                         f"({e['times']} time{'s' if e['times'] != 1 else ''}, last at step {e['step']}); left out of plans"
                         + (f" for {e['out_s']:.0f} s more" if e.get("out_s") else ""))
        for e in s.stage_disagreements or ():
            a, b = e["peers"]
            lines.append(f"disagree   stage {e['stage']}: {short_id(a)} and {short_id(b)}, {e['times']} "
                         f"time{'s' if e['times'] != 1 else ''}; no third replica decided, nobody left out")
        if s.stage_recovery:
            r = s.stage_recovery
            moved = ", ".join(f"{short_id(m['peer'])} moved from stage {m['from']} to {m['to']}" for m in r["moved"])
            steps = f"{r['redone']} step{'' if r['redone'] == 1 else 's'}"
            lines.append(f"recovered  stage {', '.join(map(str, r['stages']))} lost every replica: {moved or 'none moved'}; "
                         f"back to model v{r['version']} (step {r['step']}), {steps} redone")
    for e in s.arithmetic_left_out:
        own = e["arithmetic"] or "an arithmetic it does not advertise"
        lines.append(f"left out   {short_id(e['peer'])}: computes with {own}, the run with {s.arithmetic_run}; "
                     "other bits (`p2ptrain docs deploy`)")
    for e in s.arithmetic_barred:
        lapses = f"{e['lapses']} lapse{'' if e['lapses'] == 1 else 's'}"
        lines.append(f"barred     {e['class']}: its candidates failed to lead this fresh run ({lapses}); "
                     "its peers count for nothing until a plan is taken")
    if s.resumed_from:
        lines.append(f"resumed    from model v{s.resumed_from['version']} at step {s.resumed_from['step']}")
    lines.append(f"model      {_model(s)}")
    return "\n".join(lines)


def _num(value: float | None, spec: str = ".3f") -> str:
    """A metric for people: fixed digits, '-' when there is none."""
    return "-" if value is None else format(float(value), spec)


def _step_of(step: int, total: int | None) -> str:
    """Progress in words: "step 3/300", or "step 3" where the total is not known yet (a member
    counts it once it has read the data set), rather than a "/?" that reads as a fault."""
    return f"step {step}" + (f"/{total}" if total else "")


def _progress(s: TaskStatus) -> str:
    if not s.member and s.state == "announced":  # no member's head heard: no step to show
        return "no member has reported a step yet" + (f" (the task runs {s.total_steps} steps)" if s.total_steps else "")
    if not s.member:  # what the run's head says: its step, not a round this node saw complete
        return _step_of(s.step, s.total_steps)
    if s.last_round is None:
        text = f"no round completed yet ({_step_of(s.step, s.total_steps)})" + _inner(s)
        waiting = s.waiting_for_peers
        if waiting:
            text += f"; waiting for {waiting} more peer{'s' if waiting > 1 else ''}"
        return text
    text = f"round {s.last_round} completed, {_step_of(s.step if s.last_step is None else s.last_step, s.total_steps)}"
    return text + _inner(s)


def _inner(s: TaskStatus) -> str:
    """Local-SGD mode: where this member is in its inner loop (a round there takes H local steps)."""
    if s.inner_step is None:
        return ""
    return f"; inner step {s.inner_step}/{s.inner_steps or '?'}"


def _model(s: TaskStatus) -> str:
    """The latest confirmed model: version, CID and the test metrics its record carries."""
    if not s.version:
        return "none confirmed yet" + (f" (initial model {s.latest_model_cid})" if s.latest_model_cid else "")
    text = f"v{s.version} {s.latest_model_cid or '-'}"
    metrics = s.chain[-1].metrics if s.chain else {}
    if "accuracy" in metrics or "loss" in metrics:
        text += f"\n           test accuracy {_num(metrics.get('accuracy'))}, test loss {_num(metrics.get('loss'))}"
        text += f" (round {s.chain[-1].round}, step {s.chain[-1].step})"
    return text
