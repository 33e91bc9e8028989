"""The demo moved into the package: `ucp demo` (ucp_store/demo/). This file runs it, for old command lines:

    .venv/bin/python tools/demo.py [--dir DIR] [--steps N] [--deepspeed]
"""

import sys

from ucp_store.cli import main

if __name__ == "__main__":
    sys.exit(main(["demo", *sys.argv[1:]]))
