"""Phases of DeepSpeed jobs on ranks forked from one preloaded interpreter (``ucp_store/demo/fork_ranks.py``)::

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 python tools/fork_ranks.py --phases phases.json
"""

import sys

from ucp_store.demo.fork_ranks import main

if __name__ == "__main__":
    sys.exit(main())
