"""Sparse KV fetching (InfiniGen, ALGORITHMS.md §11): KV in host memory, the next layer's important
tokens predicted ahead of time, only those fetched to the device; and its alternatives on the
same pool at the same budget. Switched on with `EngineConfig.sparse_kv` (`SparseKVConfig`:
'none' | 'offload' | 'infinigen' | 'oracle' | 'quest' | 'h2o').

  skew.py        offline attention skewing: per (layer, kv head) an orthogonal matrix from the
                 SVD of a calibration prefill's post-RoPE queries and keys, and the energy of each
                 skewed column (which ones the speculation keeps); stored beside a checkpoint
  infinigen.py   the model step over a host-memory KV pool: full fetches ('offload'), or
                 speculation of layer i+1's tokens from layer i's input against a device-resident
                 partial key cache, a gather of only those rows, attention over them ('infinigen';
                 its variants: per-page bounds of the cut columns, the layer's own query);
                 the exact top-k by each layer's own logits ('oracle', reads every key) and
                 Quest's page bounds from per-page key min/max ('quest'), chosen in the layer;
                 its parts: pool.py (the host pool, the partial keys, the gathers and writes)
                 and attend.py (speculation, the scores, attention over the selected rows)
  select.py      the selection they share: of each decode token's resident rows, the sinks, the
                 recent window and the best scored up to the cap (tokens or pages)
  h2o.py         H2O: accumulated attention per token on the device, heavy hitters kept and the
                 rest evicted for good ('h2o')
  host_pool.py   InfiniGen's pool bound: each request keeps `capacity` of its pages, evicting
                 (counter / LRU / FIFO) among its older half, never prefix-cached shared pages
  evaluate.py    accuracy against full attention: teacher-forced perplexity and greedy agreement,
                 free-running agreement, with the rows fetched (scripts/eval_sparse.py)
"""
