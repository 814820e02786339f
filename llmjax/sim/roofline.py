"""The analytic cost model (`roofline`): a step's time from the model's shape, the hardware's
peaks and the step's features, operator by operator, with tensor and pipeline parallelism.

Per decoder layer on one device of a tp group (heads and MLP columns split over tp; KV heads
fewer than tp are repeated, as the engine does), each operator takes

    max(FLOPs / (peak x efficiency), bytes / (bandwidth x efficiency))

(ALGORITHMS.md §12: Vidur's operators; §7.2 DistServe's prefill and decode terms):

- the projections (QKV, output, the MLP: gate+up and down for Llama, up and down for OPT and
  Falcon): 2 x tokens x weight elements FLOPs; weights + activations in and out in bytes;
- prefill attention: 4 x causal (query, key) pairs x head_dim x heads FLOPs, at
  `prefill_attention_efficiency`; bytes of Q, O and the keys and values the chunks read;
- decode attention: reading every decode's keys and values (bytes / (bandwidth x
  `decode_attention_efficiency`)), 4 x context x head_dim x heads FLOPs;
- a sliding-window layer (Gemma's local layers, Mistral's): both attention terms over the keys
  within its window only (`StepFeatures.in_window`);
- the element-wise rest (norms, residual adds, RoPE, the activation, the KV write) as bytes;
- tp > 1: the all-reduces of the layer's output (two per layer; one for Falcon, whose attention
  and MLP run in parallel and are summed before one reduce, as vLLM does), each a ring:
  latency + 2 (tp - 1) / tp x bytes / (link bandwidth x efficiency).

`padded=True` charges the projections, the element-wise work and the LM head at the step's
padded bucket shape (T tokens, S rows: llmjax's jitted steps run at their bucket; attention
kernels skip the padding), as llmjax itself runs; False (the default) at the real token count,
as an unpadded GPU engine (vLLM, Sarathi-Serve) runs. A step also runs the LM head over its
sequences' last rows (on the last stage) and, with pp > 1,
sends the activations between stages (over the node's links while the tp x pp devices fit in one
node, else the network). `stage_seconds` gives each stage's time for one micro-batch;
`step_seconds` their sum plus the per-step host overhead.
"""

from __future__ import annotations

import dataclasses
import math

from llmjax.config import ModelConfig
from llmjax.sim.cost import StepFeatures
from llmjax.sim.hardware import Hardware, get_hardware

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# SwiGLU / GeGLU: gate, up and down; OPT and Falcon: up, down
GATED_MLP = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3")


def mlp_matrices(model: ModelConfig) -> int:
    return 3 if model.architecture in GATED_MLP else 2


def kv_heads_per_device(model: ModelConfig, tp: int) -> int:
    """KV heads each device of a tp group holds (repeated when fewer than tp)."""
    return math.ceil(model.num_kv_heads / tp)


def layer_weight_elements(model: ModelConfig) -> int:
    """Weight elements of one decoder layer's projections (no norms, no biases)."""
    h, hd = model.hidden_size, model.head_dim
    qkv = h * (model.num_heads + 2 * model.num_kv_heads) * hd
    o = model.num_heads * hd * h
    return qkv + o + mlp_matrices(model) * h * model.intermediate_size


def model_weight_elements(model: ModelConfig) -> int:
    """All projection and embedding weight elements (the LM head counted once when tied)."""
    embed = model.vocab_size * model.hidden_size
    return model.num_layers * layer_weight_elements(model) + embed * (
        1 if model.tie_word_embeddings else 2
    )


def weight_bytes_per_device(model: ModelConfig, dtype: str, tp: int, pp: int) -> float:
    """Weight bytes on each device: layers split over pp stages and tp, embeddings over tp."""
    b = DTYPE_BYTES[dtype]
    h, hd = model.hidden_size, model.head_dim
    kvd = kv_heads_per_device(model, tp)
    qkv = h * (model.num_heads // tp + 2 * kvd) * hd  # repeated KV heads are stored per device
    rest = (model.num_heads * hd * h + mlp_matrices(model) * h * model.intermediate_size) / tp
    layers = math.ceil(model.num_layers / pp) * (qkv + rest)
    embed = model.vocab_size * h / tp * (1 if model.tie_word_embeddings else 2)
    return b * (layers + embed)


def window_kv_needed(model: ModelConfig, context_len: int, page_size: int = 16) -> float:
    """The share of a sequence's KV pages its layers read at `context_len` tokens: llmjax keeps
    one page table for every layer, so a sliding-window layer holds all `context_len` tokens'
    pages though it reads only the last `window` (rounded out to whole pages); 1.0 for a model
    without sliding layers. 1 - this is the KV memory the shared table holds beyond need."""
    pages = -(-context_len // page_size)
    read = 0
    for i in range(model.num_layers):
        w = model.layer_window(i)
        # a window of w tokens ending anywhere in a page spans at most ceil((w - 1) / G) + 1 pages
        read += pages if w is None else min(pages, -(-(w - 1) // page_size) + 1)
    return read / (model.num_layers * pages)


def kv_page_bytes_per_device(model: ModelConfig, page_size: int, dtype: str, tp: int, pp: int):
    """One page's K and V bytes on each device (its stage's layers, its tp share of KV heads)."""
    layers = math.ceil(model.num_layers / pp)
    return (
        2
        * layers
        * page_size
        * kv_heads_per_device(model, tp)
        * model.head_dim
        * (DTYPE_BYTES[dtype])
    )


@dataclasses.dataclass(frozen=True)
class RooflineCostModel:
    """`step_seconds(features)` for `model` in `dtype` on tp x pp devices of `hardware`."""

    model: ModelConfig
    hardware: Hardware
    dtype: str = "bfloat16"
    tp: int = 1
    pp: int = 1
    padded: bool = False

    def __post_init__(self):
        object.__setattr__(self, "hardware", get_hardware(self.hardware))
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose one of {sorted(DTYPE_BYTES)}")
        if self.tp < 1 or self.pp < 1 or self.pp > self.model.num_layers:
            raise ValueError(f"need tp >= 1 and 1 <= pp <= layers; got {self.tp=} {self.pp=}")
        if self.model.num_heads % self.tp:
            raise ValueError(f"tp={self.tp} must divide the {self.model.num_heads} heads")

    # -- one operator ----------------------------------------------------------------------------

    def _op(self, flops: float, nbytes: float, flop_eff: float, byte_eff: float) -> float:
        hw = self.hardware
        return max(flops / (hw.peak_flops * flop_eff), nbytes / (hw.memory_bandwidth * byte_eff))

    def _matmul(self, tokens: int, k: float, n: float) -> float:
        hw, b = self.hardware, DTYPE_BYTES[self.dtype]
        return self._op(
            2 * tokens * k * n,
            b * (k * n + tokens * (k + n)),
            hw.matmul_efficiency,
            hw.memory_efficiency,
        )

    def _allreduce(self, nbytes: float) -> float:
        if self.tp == 1:
            return 0.0
        hw = self.hardware
        link = hw.link_bandwidth if self.tp <= hw.devices_per_node else hw.network_bandwidth
        latency = hw.link_latency_s if self.tp <= hw.devices_per_node else hw.network_latency_s
        return latency + 2 * (self.tp - 1) / self.tp * nbytes / (link * hw.link_efficiency)

    # -- a layer, a stage, a step ----------------------------------------------------------------

    def layer_seconds(self, f: StepFeatures) -> dict[str, float]:
        """One decoder layer's time on one device, by operator."""
        m, hw, tp, b = self.model, self.hardware, self.tp, DTYPE_BYTES[self.dtype]
        if f.tokens == 0:
            return {}
        T = max(f.tokens, f.padded_tokens) if self.padded else f.tokens
        h, hd, ffn = m.hidden_size, m.head_dim, m.intermediate_size / tp
        heads, kvd = m.num_heads / tp, kv_heads_per_device(m, tp)
        t = {
            "qkv": self._matmul(T, h, (heads + 2 * kvd) * hd),
            "attn_out": self._matmul(T, heads * hd, h),
            "mlp_up": self._matmul(T, h, (mlp_matrices(m) - 1) * ffn),
            "mlp_down": self._matmul(T, ffn, h),
        }
        prefill_tokens = f.tokens - f.decodes
        t["prefill_attention"] = self._op(
            4 * f.prefill_pairs * hd * heads,
            b * (2 * prefill_tokens * heads * hd + 2 * f.prefill_context * kvd * hd),
            hw.prefill_attention_efficiency,
            hw.memory_efficiency,
        )
        t["decode_attention"] = self._op(
            4 * f.decode_context * hd * heads,
            b * (2 * f.decodes * heads * hd + 2 * f.decode_context * kvd * hd),
            hw.matmul_efficiency,
            hw.decode_attention_efficiency,
        )
        # norms (read + write, x2), residual adds (x2), RoPE on Q and K, the activation (reads
        # gate and up, writes one), the new K and V written to their pages
        elementwise = T * (8 * h + 2 * (heads + kvd) * hd + mlp_matrices(m) * ffn + 2 * kvd * hd)
        t["elementwise"] = b * elementwise / (hw.memory_bandwidth * hw.memory_efficiency)
        reduces = 1 if m.architecture == "falcon" else 2
        t["tp_all_reduce"] = reduces * self._allreduce(b * T * h)
        return t

    def _layers_seconds(self, f: StepFeatures) -> list[float]:
        """Each layer's time: a sliding-window layer's attention sees its window only."""
        by_window = {}
        out = []
        for i in range(self.model.num_layers):
            w = self.model.layer_window(i)
            if w not in by_window:
                by_window[w] = sum(self.layer_seconds(f.in_window(w)).values())
            out.append(by_window[w])
        return out

    def stage_seconds(self, f: StepFeatures) -> list[float]:
        """Each pipeline stage's time for one micro-batch with these features (no host
        overhead): its layers, the LM head on the last, the activation send after the others."""
        if f.tokens == 0:
            return [0.0] * self.pp
        m, hw, b = self.model, self.hardware, DTYPE_BYTES[self.dtype]
        layers = self._layers_seconds(f)
        base, extra = divmod(m.num_layers, self.pp)
        rows = f.seqs or f.decodes or 1
        if self.padded:
            rows = max(rows, f.padded_seqs)
        lm_head = self._matmul(rows, m.hidden_size, m.vocab_size / self.tp)
        lm_head += self._allreduce(b * rows * m.vocab_size / self.tp)  # gather of the logits
        across_nodes = self.tp * self.pp > hw.devices_per_node
        link = hw.network_bandwidth if across_nodes else hw.link_bandwidth
        latency = hw.network_latency_s if across_nodes else hw.link_latency_s
        send = latency + b * f.tokens * m.hidden_size / (link * hw.link_efficiency)
        stages, first = [], 0
        for s in range(self.pp):
            n = base + (s < extra)
            t = sum(layers[first : first + n])
            first += n
            t += lm_head if s == self.pp - 1 else send
            stages.append(t)
        return stages

    def step_seconds(self, f: StepFeatures) -> float:
        """The whole step on one engine (every stage in turn, then the host's overhead)."""
        return sum(self.stage_seconds(f)) + self.hardware.step_overhead_s

    @property
    def host_overhead_s(self) -> float:
        """The host's share of `step_seconds` (what async scheduling can hide)."""
        return self.hardware.step_overhead_s

    @property
    def tick_overhead_s(self) -> float:
        """The host's share of one pipeline tick (pp > 1): the per-step overhead."""
        return self.hardware.step_overhead_s

    def breakdown(self, f: StepFeatures) -> dict[str, float]:
        """Seconds by operator over the whole model (every layer, summed over the stages)."""
        out = {}
        for i in range(self.model.num_layers):
            for k, v in self.layer_seconds(f.in_window(self.model.layer_window(i))).items():
                out[k] = out.get(k, 0.0) + v
        out["host_overhead"] = self.hardware.step_overhead_s
        return out
