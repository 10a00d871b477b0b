"""``p2ptrain model …``: fetch a trained model by CID, evaluate, verify and serve it.

Content is taken from the home's store when it is there, else fetched from the mesh: through the
home's running node, or, with ``--bootstrap``, through a short-lived node started for this command.
Every byte is verified against its CID, and the architecture comes from p2ptrain's registry (named
in the model file), never from code in a file.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from p2ptrain.services import ensure_local, split_shards
from p2ptrain.cli._home_options import HOME_HELP, MODEL_HOME_HELP, home_of, model_home, source_options
from p2ptrain.cli.ipfs import cid_arg
from p2ptrain.base import UserError


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    group = sub.add_parser("model", help="fetch, evaluate and serve trained models by CID", description=__doc__)
    msub = group.add_subparsers(dest="command", metavar="COMMAND", required=True)

    fetch = msub.add_parser("fetch", help="fetch a model by CID (verified) into a safetensors file")
    fetch.add_argument("model_cid", nargs="?", metavar="MODEL_CID", type=cid_arg,
                       help="the model's CID (or give --latest TASK_CID)")
    fetch.add_argument("--latest", metavar="TASK_CID", type=cid_arg, help="fetch the latest confirmed model of this task")
    fetch.add_argument("-o", "--output", type=Path, required=True, help="where to write the .safetensors file")
    source_options(fetch, MODEL_HOME_HELP)
    fetch.add_argument("--json", action="store_true", help="print one JSON object (model_cid, path, bytes, model)")
    fetch.set_defaults(func=cmd_fetch)

    evaluate = msub.add_parser("eval", help="accuracy and loss of a model on a dataset split")
    evaluate.add_argument("model", metavar="MODEL_CID|PATH", help="a model by CID, or a .safetensors file")
    evaluate.add_argument("--dataset", required=True, metavar="MANIFEST_CID", type=cid_arg,
                          help="dataset manifest CID (a --standardize dataset is evaluated standardized, as trained)")
    evaluate.add_argument("--split", default="test", help="split to evaluate on (default test)")
    evaluate.add_argument("--batch-size", type=int, default=256)
    source_options(evaluate, MODEL_HOME_HELP)
    evaluate.add_argument("--json", action="store_true", help="print one JSON object (accuracy, loss, samples)")
    evaluate.set_defaults(func=cmd_eval)

    importer = msub.add_parser(
        "import", help="store a local Hugging Face save_pretrained directory as a model CID (to fine-tune)",
        description="Store DIR (config.json + model.safetensors, as transformers' save_pretrained writes them; "
                    "a pickled pytorch_model.bin is never read) as a model of [model] name = \"hf\" in the home's "
                    "store, and print its CID and the task TOML that fine-tunes it (initial_model). Weights are "
                    "stored as float32; the architecture must be one of the installed transformers.")
    importer.add_argument("directory", metavar="DIR", type=Path, help="a save_pretrained directory")
    importer.add_argument("--home", type=Path, default=None, help=HOME_HELP)
    importer.add_argument("--json", action="store_true",
                          help="print one JSON object (model_cid, bytes, parameters, model, toml)")
    importer.set_defaults(func=cmd_import)

    export = msub.add_parser(
        "export", help="write an hf model by CID as a directory transformers loads (from_pretrained)",
        description="Write the model MODEL_CID (of [model] name = \"hf\") as a new directory DIR with config.json "
                    "and model.safetensors, which transformers loads with from_pretrained(DIR); the directory "
                    "appears whole or not at all.")
    export.add_argument("model_cid", metavar="MODEL_CID", type=cid_arg, help="the model's CID")
    export.add_argument("directory", metavar="DIR", type=Path, help="the directory to create (must not exist)")
    source_options(export, MODEL_HOME_HELP)
    export.add_argument("--json", action="store_true", help="print one JSON object (model_cid, path, files)")
    export.set_defaults(func=cmd_export)

    from p2ptrain.cli import builders as builders_cli  # model builders
    from p2ptrain.cli import serve as serve_cli  # model serve, model predict
    from p2ptrain.cli import verify as verify_cli  # model verify

    builders_cli.add_parser(msub)
    serve_cli.add_parsers(msub)
    verify_cli.add_parser(msub, MODEL_HOME_HELP)


def cmd_fetch(args: argparse.Namespace) -> int:
    if (args.model_cid is None) == (args.latest is None):
        raise UserError("give a MODEL_CID or --latest TASK_CID (one of them)")
    home, runs_looked = model_home(args, args.model_cid)
    cids = ensure_local(home, [args.model_cid] if args.model_cid else [], args.bootstrap, args.latest,
                        runs_looked=runs_looked)
    model_cid = cids[-1]
    from p2ptrain.cli.ipfs import progress_bar
    from p2ptrain.base import write_atomic
    from p2ptrain.ipfs import FileTooLarge, open_store
    from p2ptrain.training import describe_model_file, is_manifest, model_file
    from p2ptrain.protocol import RecordError

    store = open_store(home)
    data = store.cat(model_cid)
    assembled = is_manifest(data)
    try:
        if assembled:  # a pipelined run's model: its stage files made one
            data = model_file(store, model_cid)
        card, params = describe_model_file(data)  # refuse to hand over a file that is not a model
    except (RecordError, FileTooLarge) as exc:
        raise UserError(f"{model_cid} is not a p2ptrain model: {_what_else(data, model_cid, args.output) or exc}") \
            from None
    if assembled:
        write_atomic(args.output, data)
    else:
        with progress_bar(f"writing {args.output.name}", len(data)) as progress:
            store.get(model_cid, args.output, progress=progress)
    summary = {"model_cid": model_cid, "path": str(args.output), "bytes": len(data), "model": card,
               "parameters": params}
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"{model_cid} -> {args.output} ({len(data)} bytes, {card['name']} with {params} parameters)")
    return 0


def _what_else(data: bytes, cid: str, output: Path) -> str | None:
    """What ``data`` is when it is not a model but a task or a dataset manifest (a CID copied from
    the wrong line), and the command that was probably meant; None for anything else."""
    from p2ptrain.data import Manifest, ManifestError
    from p2ptrain.task import TaskError, read_task

    try:
        task = read_task(data)
        return f"it is task {task.name!r}; its latest model: p2ptrain model fetch --latest {cid} -o {output}"
    except TaskError:
        pass
    try:
        manifest = Manifest.from_json(data)
        return f"it is the manifest of dataset {manifest.name!r} (p2ptrain dataset info {cid})"
    except ManifestError:
        return None


def cmd_eval(args: argparse.Namespace) -> int:
    is_file = Path(args.model).exists()
    if not is_file:  # a typo is one line at once, before torch is imported (seconds)
        try:
            cid_arg(args.model)
        except argparse.ArgumentTypeError as exc:
            raise UserError(f"{args.model} is not a file, and {exc}") from None
    from p2ptrain.data import IPFSDataset
    from p2ptrain.ipfs import open_store
    from p2ptrain.training import batched, evaluate_batches, load_model

    home, runs_looked = model_home(args, None if is_file else args.model)
    wanted = [args.dataset] + ([] if is_file else [args.model])
    ensure_local(home, wanted, args.bootstrap, then=lambda store: split_shards(store, args.dataset, args.split),
                 runs_looked=runs_looked)
    store = open_store(home)
    module = load_model(args.model, store=store)
    # IPFSDataset applies the manifest's standardization (dataset add --standardize): the model is
    # evaluated on the inputs it was trained on.
    dataset = IPFSDataset(args.dataset, split=args.split, store=store, shuffle=False)
    result = dataclasses.asdict(evaluate_batches(module, batched(dataset, args.batch_size)))
    if args.json:
        print(json.dumps(result))
    else:
        print(f"accuracy {result['accuracy']:.4f}  loss {result['loss']:.4f}  on {result['samples']} samples "
              f"of split {args.split!r}")
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    from p2ptrain.ipfs import open_store
    from p2ptrain.training import config_snippet, import_pretrained

    data, card = import_pretrained(args.directory)
    store = open_store(home_of(args))
    cid = store.add_bytes(data)
    store.pin_add(cid)
    toml = config_snippet(card, cid)
    params = _parameters(data)
    if args.json:
        print(json.dumps({"model_cid": cid, "bytes": len(data), "parameters": params, "model": card, "toml": toml}))
    else:
        print(f"{cid}  ({card['kwargs']['model_type']}, {params:,} parameters, {len(data):,} bytes)")
        print("fine-tune it with a task that has:\n")
        print(toml, end="")
    return 0


def _parameters(data: bytes) -> int:
    from p2ptrain.training import describe_model_file

    return describe_model_file(data)[1]


def cmd_export(args: argparse.Namespace) -> int:
    from p2ptrain.ipfs import open_store
    from p2ptrain.training import export_pretrained, model_file

    home, runs_looked = model_home(args, args.model_cid)
    if args.directory.exists():  # before any fetch
        raise UserError(f"{args.directory}: exists; export writes a new directory")
    ensure_local(home, [args.model_cid], args.bootstrap, runs_looked=runs_looked)
    data = model_file(open_store(home), args.model_cid)
    from p2ptrain.protocol import RecordError

    try:
        path = export_pretrained(data, args.directory)
    except RecordError as exc:  # a task's or a manifest's CID copied from the wrong line
        what = _what_else(data, args.model_cid, Path("model.safetensors"))
        if what is not None and what.startswith("it is task"):
            what = what.split(";")[0] + f"; `p2ptrain task status {args.model_cid}` shows its latest model's CID"
        raise UserError(f"{args.model_cid} is not a p2ptrain model: {what or exc}") from None
    files = sorted(p.name for p in path.iterdir())
    if args.json:
        print(json.dumps({"model_cid": args.model_cid, "path": str(path), "files": files}))
    else:
        print(f"{args.model_cid} -> {path}/ ({', '.join(files)}): transformers loads it with "
              f"AutoModelForCausalLM.from_pretrained({str(path)!r})")
    return 0
