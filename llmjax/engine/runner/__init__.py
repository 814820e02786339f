"""The device side of the engine: weights, KV pages and the jitted step (forward, greedy ids and
logits; then sampling, its own program, when a row samples), on one device or sharded over a mesh
(llmjax/parallel/).

The only part of `llmjax/engine/` that imports jax. The step is jitted once per shape
bucket (T tokens, S sequences, P pages per sequence), the sampler once per S; the KV pages are
donated, so they are updated in place. `num_compiles` counts step traces (`num_sample_compiles`
the sampler's), so tests can assert that steady-state serving does not recompile; `precompile`
compiles every bucket up front.

    model_runner.py    ModelRunner: weights, KV pages, the step and sampling programs, launch /
                       collect, precompile and compiling ahead
    launched.py        Launched (a dispatched step), the all-greedy sampling inputs
    pages.py           PageTransfer: KV pages gathered and scattered (transfers between
                       instances, prefix fetches, the KV tiers' host copies); transfer_bucket
    pipeline_ticks.py  PipelineTicks: pp > 1, weights and KV per stage, the jitted tick
    sparse_step.py     SparseStep: sparse_kv != 'none', the host KV pool, InfiniGen's step
"""

from llmjax.engine.runner.launched import Launched
from llmjax.engine.runner.model_runner import ModelRunner, enable_compilation_cache
from llmjax.engine.runner.pages import transfer_bucket

__all__ = ["Launched", "ModelRunner", "enable_compilation_cache", "transfer_bucket"]
