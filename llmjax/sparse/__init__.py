"""Sparse KV fetching (InfiniGen, ALGORITHMS.md §11): KV in host memory, the next layer's important
tokens predicted ahead of time, only those fetched to the device. Switched on with
`EngineConfig.sparse_kv` (`SparseKVConfig`: 'none' | 'offload' | 'infinigen').

  skew.py        offline attention skewing: per (layer, kv head) an orthogonal matrix from the
                 SVD of a calibration prefill's post-RoPE queries and keys, and the energy of each
                 skewed column (which ones the speculation keeps); stored beside a checkpoint
  infinigen.py   the model step over a host-memory KV pool: full fetches ('offload'), or
                 speculation of layer i+1's tokens from layer i's input against a device-resident
                 partial key cache, a gather of only those rows, attention over them ('infinigen')
  host_pool.py   InfiniGen's pool bound: each request keeps `capacity` of its pages, evicting
                 (counter / LRU / FIFO) among its older half, never prefix-cached shared pages
  evaluate.py    accuracy against full attention: teacher-forced perplexity and greedy agreement,
                 with the rows fetched (scripts/eval_sparse.py)
"""
