"""The step transports of the Python client: how one step's tensors travel to a daemon and back.

Internal plumbing under ``RemoteOptimizer`` (nothing here is public API):

- ``base.py``: ``StepTransport``, the one interface (``name``, ``viable``, ``open``, ``step``,
  ``close``), and what it works from (``TransportContext``, ``Facts``, ``Here``);
- ``choice.py``: ``TRANSPORTS``, the one order "auto" tries them in, and the choice;
- ``daemon_session.py``: ``DaemonSession``, one daemon's session, stepping through its transport;
- the transports: ``grpc_transport.py``, ``shm_transport.py``, ``cuda_ipc_transport.py``,
  ``nccl_transport.py``; and what they build on: ``framing.py`` (the Step stream's chunks),
  ``shm.py`` (memfd regions), ``slots.py`` (the slot layout shm and CUDA IPC share),
  ``cuda_runtime.py`` and ``nccl.py`` (ctypes bindings, loaded on first use).

A new transport ``x``: a ``StepTransport`` subclass in ``x_transport.py`` (``reasons_against`` from
the daemon's ``ServerInfo`` and ``Here``; ``open``/``step``/``close``; the RPCs it calls go in
``client.Connection``), its place in ``choice.TRANSPORTS``, and its tests in
``tests/python/test_gpu_transports.py`` (the decision table) and beside the others.

Importing this package imports nothing else (``client.py`` uses ``framing`` from here, and the
transports use ``client.Connection``).
"""
