"""ucp_store.dist: save, load, verify and async-save DTensor / FSDP2 / TP training state (issue 11; being built)."""

__all__: list[str] = []
