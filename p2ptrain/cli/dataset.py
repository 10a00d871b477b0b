"""``p2ptrain dataset …``: publish a dataset as shards plus a manifest, and describe one by its CID."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from p2ptrain.cli.ipfs import add_store_options, cid_arg, content_errors, store_from_args
from p2ptrain.data import Manifest, ManifestError, Pixels
from p2ptrain.base import UserError, command_line_words, default_home
from p2ptrain.cli._home_options import source_options

if TYPE_CHECKING:
    from p2ptrain.ipfs import ContentStore


def cmd_add(args: argparse.Namespace) -> int:
    from p2ptrain.data import SourceOptions, TEXT_CONTEXT, build_source, dataset_cids, parse_size, read_source

    options = SourceOptions(
        image_size=parse_size(args.image_size) if args.image_size else None,
        features=tuple(c for c in args.features.split(",") if c) if args.features else None,
        label=args.label, text=args.text, tokenizer=args.tokenizer, context=args.context or TEXT_CONTEXT, eos=args.eos,
    )
    normalize = _normalize(args.normalize)
    with _counter(f"read {args.source}") as progress:
        source = read_source(args.source, options, progress)
    # Everything is decoded and checked: only now is the store opened and written.
    with _fresh_home_undone(args), content_errors():
        store = store_from_args(args)
        try:
            cid, manifest = build_source(store, source, args.shards, args.test_fraction, args.seed, name=args.name,
                                         standardize=args.standardize, normalize=normalize)
        except (ValueError, ManifestError) as exc:
            raise UserError(f"{args.source}: {command_line_words(exc)}") from None
        for part in dataset_cids(cid, manifest):
            store.pin_add(part)  # pinned like any ipfs add: kept by repo gc
    for split, shards in manifest.splits.items():
        print(f"{split}: {manifest.num_samples(split)} samples in {len(shards)} shards",
              file=sys.stderr)
    print(cid)
    return 0


@contextmanager
def _fresh_home_undone(args: argparse.Namespace) -> Iterator[None]:
    """A ``dataset add`` that fails (too many shards for the data, a source the manifest refuses,
    Ctrl-C) leaves the home as it found it where it made it: opening the store creates
    ``HOME/blocks`` (and the home), which a new user then finds empty, or holding half a data set.
    Only what did not exist before this command is removed (the outermost folder of ``HOME/blocks``
    it creates); a home in use keeps what it held. A Kubo backend (``--ipfs``) writes no folder."""
    made = None
    if not getattr(args, "ipfs", None):
        blocks = Path(args.home if args.home is not None else default_home()) / "blocks"
        for folder in [blocks, *blocks.parents]:
            if folder.exists():
                break
            made = folder
    try:
        yield
    except BaseException:
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)
        raise


def _normalize(value: str | None) -> Pixels | Literal["train"] | None:
    """``--normalize``: ``train`` (the train split's statistics) or ``MEAN,…/STD,…`` per channel."""
    if value is None:
        return None
    if value == "train":
        return "train"
    try:
        mean, std = ([float(v) for v in part.split(",")] for part in value.split("/"))
    except ValueError:
        raise UserError(f"--normalize {value}: give nothing (the train split's statistics) or MEAN,.../STD,... "
                        "per channel, e.g. 0.485,0.456,0.406/0.229,0.224,0.225") from None
    if len(mean) != len(std):
        raise UserError(f"--normalize {value}: as many means as standard deviations, one per channel")
    return Pixels(tuple(mean), tuple(std))


@contextmanager
def _counter(desc: str) -> Iterator[Callable[[int], None] | None]:
    """A live count of the files (images, documents) read, when someone watches stderr."""
    if not sys.stderr.isatty():
        yield None
        return
    from tqdm import tqdm

    with tqdm(desc=desc, unit=" files", leave=False, file=sys.stderr) as bar:
        yield bar.update


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
    if manifest.classes is not None:
        shown = ", ".join(manifest.classes[:10]) + (", ..." if len(manifest.classes) > 10 else "")
        print(f"classes: {len(manifest.classes)} ({shown})")
    if manifest.pixels is not None:
        print(f"pixels: uint8 images, read as (x/255 - mean) / std with mean {list(manifest.pixels.mean)} "
              f"std {list(manifest.pixels.std)}")
    if manifest.tokens is not None:
        made = f"tokenizer {manifest.tokens.tokenizer}" if manifest.tokens.tokenizer else "bytes"
        print(f"tokens: vocabulary of {manifest.tokens.vocab_size} ({made})")
    for split, shards in manifest.splits.items():
        print(f"{split}: {manifest.num_samples(split)} samples, {len(shards)} shards")
        for i, shard in enumerate(shards):
            print(f"  {i:>4}  {shard.cid}  {shard.num_samples}")
    return 0


def cmd_get(args: argparse.Namespace) -> int:
    """The manifest, every shard of the splits asked for and the tokenizer file it names, made local
    (verified by CID) through the home's node or a temporary one: what a machine that did not run
    ``dataset add`` needs before ``IPFSDataset`` (or ``p2ptrain.train``) reads the data set."""
    from p2ptrain.services import ensure_local, split_shards
    from p2ptrain.cli._home_options import home_of

    home = home_of(args)

    def parts(store: ContentStore) -> list[str]:
        try:
            manifest = Manifest.load(store, args.cid)
        except ManifestError as exc:
            raise UserError(f"{args.cid}: {exc}") from None
        splits = args.split or list(manifest.splits)
        tokenizer = [manifest.tokens.tokenizer] if manifest.tokens is not None and manifest.tokens.tokenizer else []
        return [cid for split in splits for cid in split_shards(store, args.cid, split)] + tokenizer

    with content_errors():
        cids = ensure_local(home, [args.cid], args.bootstrap, then=parts)
        manifest = Manifest.load(store_from_args(args), args.cid)
    held = {split: {"samples": manifest.num_samples(split), "shards": len(manifest.splits[split])}
            for split in args.split or list(manifest.splits)}
    if args.json:
        print(json.dumps({"manifest": cids[0], "home": str(home), "splits": held}))
    else:
        print(f"{args.cid} ({manifest.name}): " + ", ".join(
            f"{split} {v['samples']} samples in {v['shards']} shards" for split, v in held.items()) + f", held in {home}")
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    group = sub.add_parser("dataset", help="publish datasets as shards by CID and inspect them")
    cmds = group.add_subparsers(dest="dataset_command", metavar="SUBCOMMAND", required=True)

    p = cmds.add_parser("add", help="split a dataset into shards, store them, print the manifest CID")
    p.add_argument("source", metavar="SOURCE",
                   help="sklearn:digits (iris, wine, breast_cancer); a folder of arrays (features.npy+labels.npy, "
                   ".npz or .csv files); an image folder (ROOT/CLASS/*.png|jpg); a table (.parquet, .arrow/.feather, "
                   ".jsonl) with --label or --text; text:PATH (a text file, a folder or a glob of them) or "
                   "text:python-stdlib (Python's own sources), for a language model")
    p.add_argument("--shards", type=int, required=True, metavar="N", help="shards in the train split")
    p.add_argument("--test-fraction", type=float, default=0.2, metavar="F",
                   help="fraction of samples held out as the test split (default 0.2)")
    p.add_argument("--seed", type=int, default=0, help="seed of the train/test split (default 0)")
    p.add_argument("--name", default=None, help="dataset name (default: from the source)")
    p.add_argument("--standardize", action="store_true",
                   help="store the train split's per-feature mean and std in the manifest; readers "
                   "(training, model eval, IPFSDataset) then see (x - mean) / std. For raw tabular "
                   "features on different scales")
    images = p.add_argument_group("image folders (pip install 'p2ptrain[data]')")
    images.add_argument("--image-size", metavar="N|WxH",
                        help="scale every image to cover N x N (or W x H) pixels and crop the centre "
                        "(default: the images' own size, when they all share one)")
    images.add_argument("--normalize", nargs="?", const="train", default=None, metavar="MEAN,.../STD,...",
                        help="readers see (x/255 - mean) / std per channel: the train split's statistics, or the "
                        "given ones (e.g. ImageNet's 0.485,0.456,0.406/0.229,0.224,0.225). Without it: x/255. "
                        "Pixels are stored as uint8 either way")
    tables = p.add_argument_group("tables: .parquet, .arrow/.feather, .jsonl (pip install 'p2ptrain[data]')")
    tables.add_argument("--label", metavar="COL", help="the label column: integers from 0, or strings (the "
                        "sorted distinct values become the manifest's classes)")
    tables.add_argument("--features", metavar="COL,...", help="feature columns (numbers or lists of numbers), "
                        "in order (default: every other numeric column)")
    tables.add_argument("--text", metavar="COL", help="a text column to tokenize for a language model "
                        "(instead of --label)")
    text = p.add_argument_group("text (text:PATH, text:python-stdlib, a table's --text column)")
    text.add_argument("--tokenizer", type=Path, metavar="FILE",
                      help="a tokenizer.json of the tokenizers library, stored by CID and named in the "
                      "manifest (default: bytes, a vocabulary of 256)")
    text.add_argument("--context", type=int, default=None, metavar="T",
                      help="tokens per sample (default 128, as text:python-stdlib has always had); windows of "
                      "T+1 tokens give the next token at every position as labels")
    text.add_argument("--eos", metavar="TOKEN", help="a token of the tokenizer put after every document "
                      "(file, row), e.g. '<|endoftext|>'")
    add_store_options(p)
    p.set_defaults(func=cmd_add)

    p = cmds.add_parser("info", help="describe the dataset a manifest CID names")
    p.add_argument("cid", metavar="CID", type=cid_arg, help="the dataset's manifest CID")
    p.add_argument("--json", action="store_true", help="print the manifest as JSON")
    add_store_options(p)
    p.set_defaults(func=cmd_info)

    p = cmds.add_parser(
        "get", help="fetch a dataset by its manifest CID (every shard, verified) into this home",
        description="Make the dataset MANIFEST_CID local: its manifest, the shards of every split (or of "
        "--split), and the tokenizer file it names, each verified against its CID, through the home's running "
        "node or, with --bootstrap, a temporary node. Then IPFSDataset(CID, home=...) and p2ptrain.train read it "
        "on this machine.")
    p.add_argument("cid", metavar="MANIFEST_CID", type=cid_arg, help="the dataset's manifest CID")
    p.add_argument("--split", action="append", metavar="NAME", help="only this split (repeatable; default: all)")
    source_options(p)
    p.add_argument("--json", action="store_true", help="print one JSON object (manifest, home, splits)")
    p.set_defaults(func=cmd_get)
