"""The I/O edge: the on-disk format and every byte the store reads or writes.

``location`` (a folder or an S3 prefix), ``format`` (one chunked Zarr v3 array per tensor-state, through
TensorStore), ``chunking`` (where chunk and shard boundaries fall), ``read`` (executes read plans),
``localread``/``localwrite`` (the store's own shard files without TensorStore), ``window``/``pools``/``crc``
(bounded in-flight bytes, thread pools, CRC32C). This package itself imports nothing: ``ucp ls`` needs
``location`` without torch.
"""

__all__: list[str] = []
