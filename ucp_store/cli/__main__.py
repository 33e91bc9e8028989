"""``python -m ucp_store.cli``: the ``ucp`` command."""

import sys

from . import main

__all__: list[str] = []

sys.exit(main())
