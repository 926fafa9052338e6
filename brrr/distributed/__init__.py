"""Serving one model across several GPUs (or CPU processes): tensor-parallel shards (sharding.py), the worker
processes (tp_worker.py), rank 0's handle on them through which the engine's one ModelRunner runs every step on
every rank (tp_group.py), and the loader (tp_loader.py). docs/tensor-parallel.md explains them."""
