"""Content by CID: Kubo-compatible CIDs and importer, the on-disk block store, the store backends
(embedded, Kubo) and Bitswap. Start from :func:`open_store`. Imports ``base`` and ``net``.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from p2ptrain.ipfs._bitswap_wire import MAX_MESSAGE_SIZE as MAX_MESSAGE_SIZE, PROTOCOLS as PROTOCOLS
    from p2ptrain.ipfs._blockstore import (
        BlockStore as BlockStore,
        CorruptBlock as CorruptBlock,
        DIRECT as DIRECT,
        PinFileError as PinFileError,
    )
    from p2ptrain.ipfs._cid import (
        BlockMismatch as BlockMismatch,
        CID as CID,
        cid_from_digest as cid_from_digest,
        cid_str as cid_str,
        DAG_PB as DAG_PB,
        InvalidCID as InvalidCID,
        make_cid as make_cid,
        not_a_cid as not_a_cid,
        parse_cid as parse_cid,
        RAW as RAW,
        requested_cid as requested_cid,
    )
    from p2ptrain.ipfs._dagpb import (
        decode_node as decode_node,
        decode_unixfs as decode_unixfs,
        DecodeError as DecodeError,
        encode_file_leaf as encode_file_leaf,
        encode_file_node as encode_file_node,
        PBNode as PBNode,
        UnixFSData as UnixFSData,
        varint as varint,
    )
    from p2ptrain.ipfs._embedded import EmbeddedStore as EmbeddedStore
    from p2ptrain.ipfs._exchange import BlockExchange as BlockExchange, FetchError as FetchError, FetchStats as FetchStats
    from p2ptrain.ipfs._store import (
        ContentStore as ContentStore,
        ContentUnavailable as ContentUnavailable,
        open_store as open_store,
    )
    from p2ptrain.ipfs._unixfs import (
        CHUNK_SIZE as CHUNK_SIZE,
        dag_bytes_limit as dag_bytes_limit,
        DagError as DagError,
        FileTooLarge as FileTooLarge,
        import_stream as import_stream,
        MAX_LINKS as MAX_LINKS,
        read_file as read_file,
        walk_dag as walk_dag,
    )
else:
    from p2ptrain._exports import lazy_exports

    __getattr__, __dir__, __all__ = lazy_exports(__name__, __file__)
