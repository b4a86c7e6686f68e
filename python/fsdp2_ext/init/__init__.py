"""Meta to sharded FSDP2, exact to the bit: the pipeline's state (``sharded_init``:
``PreparedModel``, ``prepare_sharded``, ``fill_sharded``, ``init_sharded``), the model built on
meta (``meta_build``), the load plans of a full state (``state_load``) and of a checkpoint
directory (``model_checkpoint_load``), HSDP's replicas (``replica_broadcast``), and Transformers'
hub kernels once the weights are real (``hub_kernels``).

May import: ``common``, ``model``, ``checkpoint``, ``tables``.
"""
