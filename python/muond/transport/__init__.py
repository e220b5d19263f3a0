"""The step transports of the Python client: how one step's tensors travel to a daemon and back.

Internal plumbing under ``RemoteOptimizer``; nothing here is public API. Importing this package
imports nothing else (``client.py`` uses ``framing`` from here, and the transports use
``client.Connection``).
"""
