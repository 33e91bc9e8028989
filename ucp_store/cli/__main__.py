"""``python -m ucp_store.cli``: the ``ucp`` command."""

import sys

from ucp_store.cli import main

__all__: list[str] = []

sys.exit(main())
