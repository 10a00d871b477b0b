"""``p2ptrain model verify``: check a model's lineage from its task down, as someone who took no part.

A model CID only proves which bytes it names. What makes it *the trained model of a task* is the
chain of confirmed records above it; this command checks that chain with nothing taken on trust:

- the task, by its CID: the rules every record must follow (how many members a span has, who may
  be one) come from it, never from the chain;
- the initial model, rebuilt from the task (its registry builder and seed, or its ``initial_model``)
  and hashed: the first record's parent must be it;
- every record up to the model's: signed by a coordinator that a quorum of the record's members
  elected (the votes it carries), attested by a quorum of them, the child of the record before it
  (:func:`p2ptrain.protocol.audit`);
- the model and its optimizer state, hashed again byte for byte, and the model loaded into the
  task's architecture;
- with ``--eval``, the record's test loss and accuracy recomputed on the task's test split.

It prints one line per break and exits 1 on any; a clean lineage exits 0. The chain comes from the
home (a member keeps ``tasks/<task CID>/chain.jsonl``), or else from the mesh through the home's
running node or ``--bootstrap`` (the longest chain that verifies, as ``model fetch --latest``).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from p2ptrain.cli._home_options import model_home
from p2ptrain.cli.ipfs import cid_arg
from p2ptrain.base import UserError
from p2ptrain.control import ops as control_ops

if TYPE_CHECKING:
    from p2ptrain.services import Fetcher

# --eval: a recomputed metric may differ from the recorded one by float rounding (another thread
# count sums a batch in another order), no more.
EVAL_TOLERANCE = 1e-3


def add_parser(msub: argparse._SubParsersAction[argparse.ArgumentParser], home_help: str) -> None:
    verify = msub.add_parser(
        "verify", help="check a model's lineage from its task down: signatures, elections, quorums, bytes",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    verify.add_argument("model_cid", nargs="?", metavar="MODEL_CID", type=cid_arg,
                        help="the model to verify (a record of a chain in the home names it; else give --task)")
    verify.add_argument("--latest", metavar="TASK_CID", type=cid_arg,
                        help="verify the latest confirmed model of this task instead")
    verify.add_argument("--task", metavar="TASK_CID", type=cid_arg,
                        help="the task whose chain names MODEL_CID, when no chain in the home does")
    verify.add_argument("--eval", action="store_true",
                        help="also recompute the record's test loss and accuracy on the task's test split")
    verify.add_argument("--home", type=Path, default=None, help=home_help)
    verify.add_argument("--bootstrap", nargs="+", default=[], metavar="MULTIADDR",
                        help="with no node running for --home: a temporary node joins the mesh here to fetch")
    verify.add_argument("--json", action="store_true",
                        help="print one JSON object (ok, task_cid, model_cid, version, records, problems, eval)")
    verify.set_defaults(func=cmd_verify)


@dataclass
class Report:
    """What ``model verify`` found: ``problems`` holds one line per break."""

    task_cid: str
    model_cid: str | None = None
    version: int = 0
    records: int = 0
    chain_source: str = ""
    problems: list[str] = field(default_factory=list)
    checked: list[str] = field(default_factory=list)
    eval: dict[str, Any] | None = None
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"ok": not self.problems, "task_cid": self.task_cid, "model_cid": self.model_cid,
                "version": self.version, "records": self.records, "chain": self.chain_source,
                "problems": self.problems, "checked": self.checked, "eval": self.eval,
                "seconds": round(self.seconds, 3)}


def cmd_verify(args: argparse.Namespace) -> int:

    if (args.model_cid is None) == (args.latest is None):
        raise UserError("give a MODEL_CID or --latest TASK_CID (one of them)")
    if args.latest is not None and args.task is not None:
        raise UserError("--task goes with a MODEL_CID; --latest names the task already")
    started = time.perf_counter()
    home, runs_looked = model_home(args, args.model_cid)
    report = verify(home, model_cid=args.model_cid, task_cid=args.latest or args.task,
                    bootstrap=args.bootstrap, evaluate=args.eval, runs_looked=runs_looked)
    report.seconds = time.perf_counter() - started
    if args.json:
        print(json.dumps(report.to_json()))
    else:
        print(f"task {report.task_cid}: model v{report.version} {report.model_cid} "
              f"({report.records} records, chain from {report.chain_source})")
        for line in report.checked:
            print(f"ok    {line}")
        for line in report.problems:
            print(f"BREAK {line}")
        print("lineage verified" if not report.problems else f"{len(report.problems)} break(s) in the lineage")
    return 0 if not report.problems else 1


def verify(home: Path, *, model_cid: str | None, task_cid: str | None, bootstrap: list[str],
           evaluate: bool = False, runs_looked: bool = False) -> Report:
    """Check ``model_cid`` (or the latest model of ``task_cid``) from its task down; see the module.
    ``runs_looked``: no home was given, and no run home under ``home`` holds ``model_cid`` either
    (:func:`~p2ptrain.cli._home_options.model_home`)."""
    from p2ptrain.services import ensure_local, split_shards
    from p2ptrain.ipfs import open_store
    from p2ptrain.protocol import ChainRules, RecordError, audit, chain_lines, parse_entry
    from p2ptrain.task import MAX_TASK_BYTES, read_task

    store = open_store(home)
    if task_cid is None:
        assert model_cid is not None
        task_cid = _task_naming(home, model_cid, runs_looked)
    report = Report(task_cid)
    data, report.chain_source = _chain_and_task(home, task_cid, bootstrap)
    task = read_task(store.cat(task_cid, max_bytes=MAX_TASK_BYTES + 1))
    report.checked.append(f"task {task.name} read by its CID (admission {task.peers.admission or 'open'}, "
                          f"{task.peers.min} to {task.peers.max} members a span)")
    try:
        lines = chain_lines(data)
        if model_cid is not None:
            lines = _up_to(lines, model_cid)
        last = parse_entry(lines[-1]).signed.record if lines else None
    except RecordError as exc:
        report.problems.append(f"chain: {exc}")
        return report
    if last is None:
        report.problems.append(f"the chain of task {task_cid} names no record"
                               + (f" of model {model_cid}" if model_cid else ""))
        report.model_cid = model_cid
        return report
    # Everything still to fetch, in one go (one temporary node with --bootstrap, not one per file).
    dataset = task.dataset if evaluate else None
    ensure_local(home, [last.model_cid, last.optimizer_cid, *([task.initial_model] if task.initial_model else []),
                        *([dataset.manifest] if dataset is not None else [])], bootstrap,
                 then=(lambda st: split_shards(st, dataset.manifest, dataset.test_split)) if dataset is not None else None)
    initial_cid = _initial_cid(store, task)
    entries, problems = audit(ChainRules.of(task, task_cid), initial_cid, b"\n".join(lines))
    report.problems += problems
    report.records = len(lines)
    report.model_cid, report.version = last.model_cid, last.version
    if not problems:
        report.checked.append(f"{len(entries)} records: each signed by its elected coordinator, attested by a "
                              f"quorum of its members, linked to the one before; initial model {initial_cid} rebuilt")
    report.problems += _check_bytes(store, task, last, report)
    if evaluate and task.dataset is not None and not task.model.user:
        report.problems += _check_metrics(store, task, last, report)
    elif evaluate:
        report.checked.append("no test metrics recomputed: the run's members evaluate on their own data")
    return report


def _task_naming(home: Path, model_cid: str, runs_looked: bool) -> str:
    """The task whose chain in this home names ``model_cid`` (a member's home keeps them);
    ``runs_looked``: no run home under ``home`` holds the model either, and the error says so."""
    from p2ptrain.run import record_naming

    entry = record_naming(home, model_cid)
    if entry is None:
        also = " (nor does any run home under it hold the model)" if runs_looked else ""
        raise UserError(f"no chain in {home} names model {model_cid}{also}: give the task with --task TASK_CID")
    return entry.signed.record.task_cid


def _up_to(lines: list[bytes], model_cid: str) -> list[bytes]:
    """The chain's lines up to the record of ``model_cid`` (none if no line names it)."""
    from p2ptrain.protocol import RecordError, parse_entry

    for i, line in enumerate(lines):
        try:
            if parse_entry(line).signed.record.model_cid == model_cid:
                return lines[: i + 1]
        except RecordError:
            continue
    return []


def _chain_and_task(home: Path, task_cid: str, bootstrap: list[str]) -> tuple[bytes, str]:
    """The task's chain, and the task made local: this home's ``chain.jsonl`` when it keeps one,
    else the latest chain that verifies, from the mesh (the home's running node, or a temporary one
    through ``bootstrap``). Returns the chain's bytes and where they came from."""
    from p2ptrain.services import ensure_local
    from p2ptrain.ipfs import open_store
    from p2ptrain.control import ControlClient, ControlError, socket_path
    from p2ptrain.protocol import MAX_CHAIN_BYTES
    from p2ptrain.run import RunDir

    run_dir = RunDir.of(home, task_cid)
    store = open_store(home)
    if run_dir.chain.is_file():
        ensure_local(home, [task_cid], bootstrap)
        with open(run_dir.chain, "rb") as f:
            return f.read(MAX_CHAIN_BYTES + 1), str(run_dir.chain)
    if socket_path(home).exists():
        try:
            status = ControlClient(home, timeout=120.0).call(control_ops.TASK_STATUS, task_cid=task_cid, timeout=30.0)
        except ControlError as exc:
            raise UserError(str(exc)) from None
        chain_cid = status.get("chain_cid")
        if not chain_cid and not status.get("version"):  # as model fetch --latest says it, not "no chain"
            raise UserError(f"task {task_cid} has no confirmed model yet (state: {status.get('state')}): nothing "
                            f"to verify until the first checkpoint (p2ptrain task status {task_cid})")
        if not chain_cid:
            raise UserError(f"no chain of task {task_cid} verified through the node of {home}")
        ensure_local(home, [task_cid], bootstrap)
        return store.cat(chain_cid, max_bytes=MAX_CHAIN_BYTES), f"the mesh (chain {chain_cid})"
    if not bootstrap:
        raise UserError(f"{home} keeps no chain of task {task_cid}, and no node is running there: "
                        "start one or pass --bootstrap MULTIADDR")
    from p2ptrain.services import fetch_through, find_latest, with_ephemeral_node

    found: list[str] = []

    async def work(peer: Fetcher) -> None:
        head, _ = await find_latest(peer, task_cid)
        found.append(head.chain_cid)
        await fetch_through(peer, task_cid)

    with_ephemeral_node(home, bootstrap, work)
    return store.cat(found[0], max_bytes=MAX_CHAIN_BYTES), f"the mesh (chain {found[0]})"


def _initial_cid(store: Any, task: Any) -> str:
    """The CID of the run's initial model, rebuilt here from the task as every member builds it
    (a run of the members' own module names its initial weights instead: nothing here builds it;
    a pipelined run's is the manifest of its stages' initial files, made one stage at a time)."""
    from p2ptrain.training import new_trainer
    from p2ptrain.protocol import load_model_bytes

    if task.model.user:
        return str(task.initial_model)
    if task.pipeline is not None:
        from p2ptrain.run import initial_manifest, StagedTrainer

        initial = store.cat(task.initial_model) if task.initial_model else None
        return initial_manifest(store, StagedTrainer(task, total_steps=1, device="cpu"), initial, only_hash=True)
    trainer = new_trainer(task, total_steps=1, device="cpu")
    if task.initial_model:
        load_model_bytes(trainer.model, store.cat(task.initial_model))
    return str(store.add_bytes(trainer.model_bytes(), only_hash=True))


def _check_bytes(store: Any, task: Any, record: Any, report: Report) -> list[str]:
    """Hash the model and optimizer bytes of ``record`` again and load the model into the task's
    architecture (a pipelined run's: each stage's files signed by a quorum of its replicas first)."""
    from p2ptrain.models import meta_model, model_file_limit
    from p2ptrain.protocol import RecordError, load_model_bytes, model_tensors
    from p2ptrain.training import (check_stage_signatures, is_manifest, ManifestError, MAX_MANIFEST_BYTES, model_file,
                                   read_manifest, Trainer)

    model_cid, optimizer_cid = record.model_cid, record.optimizer_cid
    problems: list[str] = []
    sizes = []
    if task.model.user:
        return problems + _check_user_model(store, task, model_cid, optimizer_cid, report)
    for what, cid in (("model", model_cid), ("optimizer state", optimizer_cid)):
        data = store.cat(cid)
        sizes.append(len(data))
        if store.add_bytes(data, only_hash=True) != cid:
            problems.append(f"{what} {cid}: its bytes in the store do not hash to its CID")
    manifest = is_manifest(store.cat(model_cid, max_bytes=sizes[0]))
    if manifest:  # its stage entries are only what a quorum of each stage's replicas signed
        try:
            check_stage_signatures(read_manifest(store.cat(model_cid, max_bytes=sizes[0])), record)
        except ManifestError as exc:
            return problems + [f"model {model_cid}: {exc}"]
    try:
        if manifest:
            # A pipelined run's model CID names a manifest: its stage files, each hashed as it is read,
            # assemble into the whole model's file (training/_stage_files.py), checked against the
            # architecture on the meta device (the model may be larger than one process may build).
            bound = model_file_limit(task.model.name, task.model.arguments) + MAX_MANIFEST_BYTES
            model_tensors(meta_model(task.model.name, task.model.arguments), model_file(store, model_cid, bound))
        else:
            load_model_bytes(Trainer(task, total_steps=1, device="cpu").model, model_file(store, model_cid))
    except RecordError as exc:
        problems.append(f"model {model_cid} does not fit the task's architecture: {exc}")
    if not problems:
        what = (f"the stage manifest hashed again ({sizes[0]} bytes), each stage's files signed by a quorum of its "
                "replicas, and its stages' model files assembled (their optimizer files are not fetched here)"
                if manifest else f"model and optimizer state hashed again ({sizes[0]} + {sizes[1]} bytes)")
        report.checked.append(f"{what}; the model loads into the task's {task.model.name}")
    return problems


def _check_user_model(store: Any, task: Any, model_cid: str, optimizer_cid: str, report: Report) -> list[str]:
    """A run of the members' own module: the model's tensors against the architecture card the
    task names (nothing here can build the module itself)."""
    from p2ptrain.models import CardError, card_from_bytes
    from p2ptrain.protocol import RecordError, read_tensors

    problems = []
    for what, cid in (("model", model_cid), ("optimizer state", optimizer_cid)):
        if store.add_bytes(store.cat(cid), only_hash=True) != cid:
            problems.append(f"{what} {cid}: its bytes in the store do not hash to its CID")
    try:
        card = card_from_bytes(store.cat(task.model.architecture))
        tensors = read_tensors(store.cat(model_cid))
    except (CardError, RecordError) as exc:
        return problems + [f"model {model_cid}: {exc}"]
    want = {name: (tuple(shape), dtype) for name, shape, dtype, _ in card["tensors"]}
    got = {name: (tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in tensors.items()}
    if want != got:
        first = next((n for n in sorted(set(want) | set(got)) if want.get(n) != got.get(n)), "?")
        problems.append(f"model {model_cid}: tensor {first} is {got.get(first)}, the architecture card says {want.get(first)}")
    if not problems:
        report.checked.append(f"model and optimizer state hashed again; the model's {len(got)} tensors are the "
                              f"architecture card's ({task.model.architecture})")
    return problems


def _check_metrics(store: Any, task: Any, record: Any, report: Report) -> list[str]:
    """Recompute the record's test loss and accuracy on the task's test split."""
    from p2ptrain.data import IPFSDataset
    from p2ptrain.training import batched, model_file, new_trainer
    from p2ptrain.protocol import load_model_bytes

    split = task.dataset.test_split
    trainer = new_trainer(task, total_steps=1, device="cpu")
    load_model_bytes(trainer.model, model_file(store, record.model_cid))
    dataset = IPFSDataset(task.dataset.manifest, split=split, store=store, shuffle=False)
    metrics = trainer.evaluate(batched(dataset, task.training.eval_batch_size))
    got = {"accuracy": metrics.accuracy, "loss": metrics.loss}
    report.eval = {"split": split, "recomputed": got, "recorded": {k: record.metrics.get(k) for k in got}}
    problems: list[str] = []
    if task.pipeline is not None and not any(name in record.metrics for name in got):
        # A pipelined record of before protocol 1.3.0 (no evaluation through the stages) has none, as
        # has one whose evaluation failed or passed its deadline (docs/pipeline.md, "Test metrics").
        report.checked.append(f"test metrics computed on split {split!r}: accuracy {got['accuracy']:.4f}, loss "
                              f"{got['loss']:.4f} (the pipelined record has none to compare)")
        return problems
    for name, value in got.items():
        recorded = record.metrics.get(name)
        if recorded is None:
            problems.append(f"record v{record.version} records no {name} to check")
        elif not math.isclose(value, recorded, abs_tol=EVAL_TOLERANCE):
            problems.append(f"record v{record.version} says {name} {recorded:.4f}, recomputed on split {split!r}: "
                            f"{value:.4f}")
    if not problems:
        report.checked.append(f"test metrics recomputed on split {split!r}: accuracy {got['accuracy']:.4f}, "
                              f"loss {got['loss']:.4f} (as recorded)")
    return problems
