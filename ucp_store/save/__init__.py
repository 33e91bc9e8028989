"""The save side of one process: the checkpoint writer (arrays, objects, the catalog commit).

Many ranks saving one version use it through :mod:`ucp_store.distributed.commit`.
"""

__all__: list[str] = []
