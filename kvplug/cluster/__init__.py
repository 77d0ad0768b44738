"""kvplug past one engine: KV events in vLLM's wire format, vLLM-compatible page hashes, metrics.

Nothing here is imported by the core. Each module imports its optional dependency (``msgspec``,
``pyzmq``, ``prometheus-client``: the ``cluster`` extra) only when it is used:

* :mod:`kvplug.cluster.wire`: msgspec structs that encode exactly as vLLM's
  ``vllm.distributed.kv_events`` (``KVEventBatch`` of ``BlockStored`` / ``BlockRemoved`` /
  ``AllBlocksCleared``), and :class:`~kvplug.cluster.wire.EventBatcher`, the cache event sink
  that turns kvplug's events into those structs and cuts one batch per engine step;
* :mod:`kvplug.cluster.publisher`: the ZMQ PUB + replay publisher of those batches;
* :mod:`kvplug.cluster.metrics`: Prometheus metrics named as vLLM's.
"""
