"""Foreign checkpoint formats in (``Source``) and out (``Sink``), through one interface.

``base`` defines the interface and ``import_source``; ``torch_file`` is the worked example (plain state
dicts); ``dcp/`` and ``hf/`` hold PyTorch DCP and Hugging Face. DeepSpeed has its own package,
:mod:`ucp_store.deepspeed`. This package itself imports nothing.
"""

__all__: list[str] = []
