"""``p2ptrain dataset …``: publish a dataset as shards plus a manifest, and describe one by its CID."""

from __future__ import annotations

import argparse
import json
import sys

from p2ptrain.cli.ipfs import add_store_options, cid_arg, content_errors, store_from_args
from p2ptrain.data.manifest import Manifest, ManifestError
from p2ptrain.errors import UserError


def cmd_add(args: argparse.Namespace) -> int:
    from p2ptrain.data.build import build_dataset
    from p2ptrain.data.builtin import load_source

    name, features, labels = load_source(args.source)
    store = store_from_args(args)
    with content_errors():
        try:
            cid, manifest = build_dataset(
                store, args.name or name, features, labels, args.shards, args.test_fraction, args.seed,
                standardize=args.standardize,
            )
        except (ValueError, ManifestError) as exc:
            raise UserError(f"{args.source}: {exc}") from None
        for ref in (ref for shards in manifest.splits.values() for ref in shards):
            store.pin_add(ref.cid)  # pinned like any ipfs add: kept by repo gc
        store.pin_add(cid)
    for split, shards in manifest.splits.items():
        print(f"{split}: {manifest.num_samples(split)} samples in {len(shards)} shards",
              file=sys.stderr)
    print(cid)
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    with content_errors():
        try:
            manifest = Manifest.load(store_from_args(args), args.cid)
        except ManifestError as exc:
            raise UserError(f"{args.cid}: {exc}") from None
    if args.json:
        print(json.dumps(manifest.to_dict(), indent=2))
        return 0
    print(f"dataset  {manifest.name}  ({args.cid})")
    for key, spec in (("features", manifest.features), ("labels", manifest.labels)):
        print(f"{key:<9}{spec.dtype} {list(spec.shape)}")
    if manifest.standardize is not None:
        print(f"standardized: per-feature mean and std of the train split ({len(manifest.standardize.mean)} "
              "features), applied by IPFSDataset and model eval")
    for split, shards in manifest.splits.items():
        print(f"{split}: {manifest.num_samples(split)} samples, {len(shards)} shards")
        for i, shard in enumerate(shards):
            print(f"  {i:>4}  {shard.cid}  {shard.num_samples}")
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    group = sub.add_parser("dataset", help="publish datasets as shards by CID and inspect them")
    cmds = group.add_subparsers(dest="dataset_command", metavar="SUBCOMMAND", required=True)

    p = cmds.add_parser("add", help="split a dataset into shards, store them, print the manifest CID")
    p.add_argument("source", metavar="SOURCE",
                   help="a folder (features.npy+labels.npy, .npz or .csv files), sklearn:digits (iris, wine, "
                   "breast_cancer) or text:python-stdlib (Python's own sources as bytes, for a language model)")
    p.add_argument("--shards", type=int, required=True, metavar="N", help="shards in the train split")
    p.add_argument("--test-fraction", type=float, default=0.2, metavar="F",
                   help="fraction of samples held out as the test split (default 0.2)")
    p.add_argument("--seed", type=int, default=0, help="seed of the train/test split (default 0)")
    p.add_argument("--name", default=None, help="dataset name (default: from the source)")
    p.add_argument("--standardize", action="store_true",
                   help="store the train split's per-feature mean and std in the manifest; readers "
                   "(training, model eval, IPFSDataset) then see (x - mean) / std. For raw tabular "
                   "features on different scales")
    add_store_options(p)
    p.set_defaults(func=cmd_add)

    p = cmds.add_parser("info", help="describe the dataset a manifest CID names")
    p.add_argument("cid", metavar="CID", type=cid_arg, help="the dataset's manifest CID")
    p.add_argument("--json", action="store_true", help="print the manifest as JSON")
    add_store_options(p)
    p.set_defaults(func=cmd_info)
