"""The save side of one process: the checkpoint writer (arrays, objects, the catalog commit).

:mod:`ucp_store.save.writer` holds :class:`~ucp_store.save.writer.CheckpointWriter`, the public face; its
collaborators, one per concern, see the store only as a :class:`~ucp_store.registry.context.StoreContext`:
:mod:`~ucp_store.save.arrays` (whole arrays: copy, hash, dedup, the window of writes),
:mod:`~ucp_store.save.shards` (``write_shard`` / ``write_region``), :mod:`~ucp_store.save.objects`,
:mod:`~ucp_store.save.rows` (the catalog rows, commit and abort), :mod:`~ucp_store.save.dedup`,
:mod:`~ucp_store.save.durable` and :mod:`~ucp_store.save.checks`.
Many ranks saving one version use it through :mod:`ucp_store.distributed.commit`.
"""

__all__: list[str] = []
