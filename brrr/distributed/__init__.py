"""Serving one model across several GPUs (or CPU processes): tensor-parallel shards (sharding.py), the worker
processes (tp_worker.py), and rank 0's runner and loader (tp_runner.py). docs/tensor-parallel.md explains them."""
