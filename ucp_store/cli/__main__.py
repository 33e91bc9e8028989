"""``python -m ucp_store.cli``: the ``ucp`` command."""

import sys

from . import main

sys.exit(main())
