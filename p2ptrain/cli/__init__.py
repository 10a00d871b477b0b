"""The ``p2ptrain`` command line: one module per command group."""
