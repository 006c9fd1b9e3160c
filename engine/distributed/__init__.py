"""Stages outside the engine's process (docs/distributed.md, docs/batching.md).

``engine.distributed.ray_stage`` runs each stage as Ray actors, ``engine.distributed.process_stage`` runs a
stage with ``own_process: true`` in a child process on this machine; both are
:class:`~engine.distributed.wire.RemoteStageRunner` proxies speaking the protocol of
``engine.distributed.wire``, so the engine's scheduling, batching and cancel stay one code path. Ray is an
optional extra (``pip install 'omni-studio[ray]'``): ``ray_stage`` is imported only when a Ray address is
given.
"""
