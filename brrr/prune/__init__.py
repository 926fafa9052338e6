"""Pruning: zero a fraction of each projection's weights (magnitude, Wanda, SparseGPT), per row or in an N:M
pattern, and run 2:4 weights through PyTorch's semi-structured sparse kernels on CUDA."""
