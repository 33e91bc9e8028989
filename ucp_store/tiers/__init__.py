"""Tiers of one store (issue 38): a node-local fast tier beside the durable location.

- :mod:`ucp_store.tiers.node`: which node this process is on, and where that node's fast tier is;
- :mod:`ucp_store.tiers.placement`: the catalog's ``placements`` rows (where each object of a version has a
  complete copy) and a version's safety level (``local`` < ``replicated`` < ``durable``);
- :mod:`ucp_store.tiers.objects`: a tier folder's objects (keys relative to a store root), copied and checked.

A fast tier folder holds the same object keys as the durable location (``arrays/<ckpt>/<id>.zarr/...``), so a
node's folder is itself readable as a store root for the objects it holds.
"""
