"""Running stages past one machine (docs/distributed.md).

``engine.distributed.ray_stage`` runs each stage as Ray actors behind a :class:`~engine.stages.base.StageRunner`
proxy, so the engine's scheduling, batching and cancel stay one code path. Ray is an optional extra
(``pip install 'omni-studio[ray]'``): nothing here is imported unless a Ray address is given.
"""
