"""The DeepSpeed training harness moved into the package (``ucp_store/demo/ds_train.py``, which
``ucp demo --deepspeed`` runs); this path keeps working for torchrun command lines and the tests::

    DS_ACCELERATOR=cpu torchrun --nproc_per_node=2 tools/ds_train.py --jobs jobs.json
"""

from ucp_store.demo.ds_train import main

if __name__ == "__main__":
    main()
