"""Content by CID: Kubo-compatible CIDs and importer, the on-disk block store, and the store backends.

Start from :func:`p2ptrain.ipfs.store.open_store`; the modules below it each hold one piece.
"""
