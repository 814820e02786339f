"""Sparse KV fetching (InfiniGen, ALGORITHMS.md §11): KV in host memory, the next layer's important
tokens predicted ahead of time, only those fetched to the device.

  skew.py   offline attention skewing: per (layer, query head) an orthogonal matrix from the SVD
            of a calibration prefill's queries and keys (post-RoPE), stored with the checkpoint
"""
