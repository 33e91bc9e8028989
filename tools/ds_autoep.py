"""Tiny DeepSpeed AutoEP training, saving and resuming (``ucp_store/demo/ds_autoep.py``) for torchrun and the tests::

    DS_ACCELERATOR=cpu torchrun --nproc_per_node=2 tools/ds_autoep.py --jobs jobs.json
"""

from ucp_store.demo.ds_autoep import main

if __name__ == "__main__":
    main()
