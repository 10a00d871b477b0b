"""Datasets by CID: manifests, shards, sources (``dataset add``'s bounded readers), and the
``IPFSDataset`` PyTorch loader. Imports ``base`` and ``ipfs``.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from p2ptrain.data._build import build_dataset as build_dataset, build_source as build_source, dataset_cids as dataset_cids
    from p2ptrain.data._builtin import load_source as load_source, TEXT_CONTEXT as TEXT_CONTEXT
    from p2ptrain.data._images import parse_size as parse_size
    from p2ptrain.data._ipfs_dataset import IPFSDataset as IPFSDataset
    from p2ptrain.data._manifest import (
        Manifest as Manifest,
        ManifestError as ManifestError,
        MAX_MANIFEST_BYTES as MAX_MANIFEST_BYTES,
        Pixels as Pixels,
    )
    from p2ptrain.data._read_source import read_source as read_source, SourceOptions as SourceOptions
    from p2ptrain.base import read_header as read_header, TensorFileError as TensorFileError  # moved to base: the old home kept
else:
    from p2ptrain._exports import lazy_exports

    __getattr__, __dir__, __all__ = lazy_exports(__name__, __file__)
