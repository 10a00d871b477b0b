"""Services that run inside a node: the content service and the task service.

This is the node layer's glue: it may import every layer below (training, collective, ipfs, data,
mesh, wire, net); nothing below imports it.
"""
