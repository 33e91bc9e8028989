"""Adapters: foreign checkpoint layouts in (``Source``) and out (``Sink``), through one interface.

``base`` defines the interface and ``import_source``; ``torch_file`` is the worked example (plain state
dicts); ``deepspeed*`` read DeepSpeed tag folders and universal folders and export universal folders.
Submodules load on import (they need torch); this package itself imports nothing.
"""

__all__: list[str] = []
