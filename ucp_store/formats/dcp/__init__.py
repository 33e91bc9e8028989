"""PyTorch Distributed Checkpoint (DCP): folder import and export (``adapter``, ``cli``, ``perrank``), and
ucp_store as a DCP storage backend (``storage``: ``UcpStorageWriter``/``UcpStorageReader``)."""

__all__: list[str] = []
