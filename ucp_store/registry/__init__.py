"""The registry's read side and its lifecycle: a committed version (``checkpoint``), retention and gc.

The facade that opens a store and begins saves is :mod:`ucp_store.store`; it sits above this package and
:mod:`ucp_store.save`.
"""

__all__: list[str] = []
