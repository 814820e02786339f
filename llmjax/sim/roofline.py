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
- a mixture-of-experts MLP (Mixtral, Qwen-MoE): the router (T x D x E), the FLOPs of each
  token's top-k experts (2 x T x k x 3 x D x Fe), and the weights of the experts the step
  actually touches: `expected_experts_touched`, which grows with the batch (one decode reads k
  experts' weights, a 512-token chunk nearly all E); a shared expert is a dense MLP. With expert
  parallelism (`ep` > 1, ParallelConfig.ep: the experts split into ep groups of tp / ep devices,
  which split each expert's hidden dim; ep = tp: each device holds E / tp whole experts) a device
  computes 1/ep of the pairs and reads its share of the touched experts, and the tokens go to
  their experts' devices and back: two all-to-alls of T x k x D activations, of which
  (ep - 1) / ep leave the device (`expert_skew` makes some experts popular: see
  `expert_inclusion`; the busiest device is not modelled, the average is);
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

import numpy as np

from llmjax.config import (
    LORA_TARGETS,
    SUPPORTED_ARCHITECTURES,
    ModelConfig,
    kv_row_bytes,
    lora_projection_dims,
)
from llmjax.sim.cost import StepFeatures
from llmjax.sim.hardware import Hardware, get_hardware

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# SwiGLU / GeGLU: gate, up and down; OPT and Falcon: up, down
GATED_MLP = SUPPORTED_ARCHITECTURES  # every family the real engine runs


def mlp_matrices(model: ModelConfig) -> int:
    return 3 if model.architecture in GATED_MLP else 2


def expert_inclusion(num_experts: int, top_k: int, skew: float = 0.0) -> np.ndarray:
    """q [E]: the probability that one token's top-k includes expert e, under a Zipf popularity
    p_e ~ (e + 1) ** -skew (skew 0: uniform, q_e = k / E). q_e = min(1, c p_e) with c set so
    that sum(q) = k (each token takes k distinct experts; the capped experts' excess is spread
    over the others)."""
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} of {num_experts} experts")
    if skew < 0:
        raise ValueError(f"expert skew must be >= 0; got {skew}")
    p = (np.arange(1, num_experts + 1, dtype=np.float64)) ** -float(skew)
    p /= p.sum()
    q = np.zeros_like(p)
    capped = np.zeros(num_experts, bool)
    for _ in range(num_experts):  # water-filling: at most E rounds
        free = ~capped
        q[free] = (top_k - capped.sum()) * p[free] / p[free].sum()
        q[capped] = 1.0
        if not (q[free] > 1.0).any():
            break
        capped |= q > 1.0
    return q


def expected_experts_touched(num_experts: int, top_k: int, tokens: int, skew: float = 0.0) -> float:
    """How many distinct experts a batch of `tokens` tokens routes to, in expectation, when each
    token routes independently with inclusion probabilities q (`expert_inclusion`):

        E[touched] = sum_e 1 - (1 - q_e) ** tokens      (uniform: E (1 - (1 - k / E) ** T))

    1 token touches k experts; the count approaches E as the batch grows (Mixtral, 8 experts,
    top-2: 2, 3.5, 5.5, 7.2 and 8.0 experts at 1, 2, 4, 8 and 32 tokens)."""
    if tokens <= 0:
        return 0.0
    q = expert_inclusion(num_experts, top_k, skew)
    return float(np.sum(1.0 - (1.0 - q) ** tokens))


def kv_heads_per_device(model: ModelConfig, tp: int) -> int:
    """KV heads each device of a tp group holds (repeated when fewer than tp)."""
    return math.ceil(model.num_kv_heads / tp)


def mlp_weight_elements(model: ModelConfig) -> int:
    """One layer's MLP weight elements: a dense MLP, or every expert, the router and a shared
    expert (all stored, whichever a step reads)."""
    h = model.hidden_size
    if not model.is_moe:
        return mlp_matrices(model) * h * model.intermediate_size
    experts = model.num_experts * 3 * h * model.expert_intermediate_size
    fs = model.shared_expert_intermediate_size
    shared = 3 * h * fs + h if fs else 0  # its gate's weight [D] too
    return experts + h * model.num_experts + shared


def layer_weight_elements(model: ModelConfig) -> int:
    """Weight elements of one decoder layer's projections (no norms, no biases)."""
    h, hd = model.hidden_size, model.head_dim
    qkv = h * (model.num_heads + 2 * model.num_kv_heads) * hd
    o = model.num_heads * hd * h
    return qkv + o + mlp_weight_elements(model)


def active_layer_weight_elements(model: ModelConfig) -> int:
    """The weight elements one token computes with per layer (its top-k experts, not all E)."""
    if not model.is_moe:
        return layer_weight_elements(model)
    h = model.hidden_size
    routed = model.num_experts_per_tok * 3 * h * model.expert_intermediate_size
    return (
        layer_weight_elements(model)
        - mlp_weight_elements(model)
        + routed
        + h * model.num_experts
        + 3 * h * model.shared_expert_intermediate_size
    )


def model_weight_elements(model: ModelConfig) -> int:
    """All projection and embedding weight elements (the LM head counted once when tied)."""
    embed = model.vocab_size * model.hidden_size
    return model.num_layers * layer_weight_elements(model) + embed * (
        1 if model.tie_word_embeddings else 2
    )


def weight_bytes_per_device(model: ModelConfig, dtype: str, tp: int, pp: int, ep: int = 1) -> float:
    """Weight bytes on each device: layers split over pp stages and tp, embeddings over tp. A
    mixture's experts take 1 / tp of their weights whatever ep (E / ep experts, each split tp /
    ep ways); its router is replicated. `ep` is accepted for symmetry with the cost model."""
    b = DTYPE_BYTES[dtype]
    h, hd = model.hidden_size, model.head_dim
    kvd = kv_heads_per_device(model, tp)
    qkv = h * (model.num_heads // tp + 2 * kvd) * hd  # repeated KV heads are stored per device
    mlp = mlp_weight_elements(model) / tp
    if model.is_moe:  # the router replicated; experts split E / ep ways, each's Fe tp / ep ways
        router = h * model.num_experts
        mlp = router + (mlp_weight_elements(model) - router) / tp
    rest = model.num_heads * hd * h / tp + mlp
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


def kv_page_bytes_per_device(
    model: ModelConfig,
    page_size: int,
    dtype: str,
    tp: int,
    pp: int,
    kv_cache_dtype: str = "auto",
    num_slots: int | None = None,
):
    """One page's K and V bytes on each device (its stage's layers, its tp share of KV heads;
    a quantized cache's one-byte values and float32 scale per row, `kv_row_bytes`).
    `num_slots`: the layers a page holds on each device in the hybrid KV layout
    (`KVGroups.slots_per_device`; None: every layer of the stage)."""
    layers = math.ceil(model.num_layers / pp) if num_slots is None else num_slots
    row = kv_row_bytes(model.head_dim, DTYPE_BYTES[dtype], kv_cache_dtype)
    return 2 * layers * page_size * kv_heads_per_device(model, tp) * row


@dataclasses.dataclass(frozen=True)
class RooflineCostModel:
    """`step_seconds(features)` for `model` in `dtype` on tp x pp devices of `hardware`."""

    model: ModelConfig
    hardware: Hardware
    dtype: str = "bfloat16"
    tp: int = 1
    pp: int = 1
    padded: bool = False
    ep: int = 1
    expert_skew: float = 0.0
    kv_cache_dtype: str = "auto"  # CacheConfig's: the bytes attention reads and writes per row
    # LoRA adapter slots (LoRAConfig): max_loras x max_lora_rank columns on each of the
    # `lora_targets` projections (PEFT's names), computed for every token (llmjax/model/lora.py)
    lora_columns: int = 0
    lora_targets: tuple[str, ...] = ()
    lora_rank: int = 0  # grouped (LoRAConfig.kernel): each token computes this many columns

    def __post_init__(self):
        object.__setattr__(self, "hardware", get_hardware(self.hardware))
        kv_row_bytes(self.model.head_dim, 1, self.kv_cache_dtype)  # checks the name
        if self.ep > 1 and (not self.model.is_moe or self.tp % self.ep):
            raise ValueError(
                f"ep={self.ep} splits a mixture of experts over devices of the tp group "
                f"(tp={self.tp}); {self.model.name or 'this model'} "
                + ("has no experts" if not self.model.is_moe else "is not divisible")
            )
        if self.model.is_moe and self.model.num_experts % self.ep:
            raise ValueError(f"ep={self.ep} must divide the {self.model.num_experts} experts")
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
        }
        if m.is_moe:
            t |= self._moe_seconds(T)
            ffn = m.num_experts_per_tok * m.expert_intermediate_size / tp  # per token, for below
        else:
            t["mlp_up"] = self._matmul(T, h, (mlp_matrices(m) - 1) * ffn)
            t["mlp_down"] = self._matmul(T, ffn, h)
        prefill_tokens = f.tokens - f.decodes
        row = kv_row_bytes(hd, b, self.kv_cache_dtype)  # one K or V row of a kv head, stored
        t["prefill_attention"] = self._op(
            4 * f.prefill_pairs * hd * heads,
            b * 2 * prefill_tokens * heads * hd + 2 * f.prefill_context * kvd * row,
            hw.prefill_attention_efficiency,
            hw.memory_efficiency,
        )
        t["decode_attention"] = self._op(
            4 * f.decode_context * hd * heads,
            b * 2 * f.decodes * heads * hd + 2 * f.decode_context * kvd * row,
            hw.matmul_efficiency,
            hw.decode_attention_efficiency,
        )
        # norms (read + write, x2), residual adds (x2), RoPE on Q and K, the activation (reads
        # gate and up, writes one); then the new K and V written to their pages
        elementwise = T * (8 * h + 2 * (heads + kvd) * hd + mlp_matrices(m) * ffn)
        elementwise_bytes = b * elementwise + T * 2 * kvd * row
        t["elementwise"] = elementwise_bytes / (hw.memory_bandwidth * hw.memory_efficiency)
        reduces = 1 if m.architecture == "falcon" else 2
        t["tp_all_reduce"] = reduces * self._allreduce(b * T * h)
        if self.lora_columns:
            t["lora"] = self._lora_seconds(T)
        return t

    def _lora_seconds(self, T: int) -> float:
        """The LoRA slots' shrink and expand on every target projection of a layer, for T
        tokens (llmjax/model/lora.py: masked, every slot's columns; grouped, `lora_rank` each);
        on tp devices each takes its share as the projection's weight is split (the output of
        q, k, v, gate and up, the input of o and down)."""
        dims, SR, seconds = lora_projection_dims(self.model), self.lora_columns, 0.0
        hw, b = self.hardware, DTYPE_BYTES[self.dtype]
        for target in self.lora_targets:
            n_in, n_out = dims[LORA_TARGETS[target]]
            if target in ("o_proj", "down_proj"):
                n_in /= self.tp
            else:
                n_out /= self.tp
            if not self.lora_rank:  # masked: every slot's columns
                seconds += self._matmul(T, n_in, SR) + self._matmul(T, SR, n_out)
                continue
            # grouped: each token its own adapter's rank; every slot's weights read
            R = self.lora_rank
            seconds += self._op(
                2 * T * (n_in + n_out) * R,
                b * ((n_in + n_out) * SR + 2 * T * (n_in + n_out) + 2 * T * R),
                hw.matmul_efficiency,
                hw.memory_efficiency,
            )
        return seconds

    def lora_slot_seconds(self, rank: int) -> float:
        """Loading one adapter into a slot: its A and B of every target and layer, padded to
        `rank`, from host memory (`Hardware.host_bandwidth`)."""
        dims = lora_projection_dims(self.model)
        per_layer = sum(sum(dims[LORA_TARGETS[t]]) for t in self.lora_targets) * rank
        nbytes = DTYPE_BYTES[self.dtype] * self.model.num_layers * per_layer / self.tp
        return nbytes / self.hardware.host_bandwidth

    def _moe_seconds(self, T: int) -> dict[str, float]:
        """A mixture-of-experts MLP over T tokens on one device (see the module doc)."""
        m, hw, b, tp, ep = self.model, self.hardware, DTYPE_BYTES[self.dtype], self.tp, self.ep
        h, E, k = m.hidden_size, m.num_experts, m.num_experts_per_tok
        fe = m.expert_intermediate_size / (tp // ep)  # each expert's hidden dim on a device
        touched = expected_experts_touched(E, k, T, self.expert_skew) / ep
        pairs = T * k / ep  # (token, expert) pairs this device computes
        t = {"router": self._matmul(T, h, E)}
        t["experts"] = self._op(
            2 * pairs * 3 * h * fe,
            b * (touched * 3 * h * fe + pairs * (2 * h + 3 * fe)),
            hw.matmul_efficiency,
            hw.memory_efficiency,
        )
        if m.shared_expert_intermediate_size:
            fs = m.shared_expert_intermediate_size / tp
            t["shared_expert"] = self._matmul(T, h, 2 * fs) + self._matmul(T, fs, h)
        if ep > 1:
            hw_link = hw.link_bandwidth if tp <= hw.devices_per_node else hw.network_bandwidth
            latency = hw.link_latency_s if tp <= hw.devices_per_node else hw.network_latency_s
            sent = b * T * k * h * (ep - 1) / ep / ep  # this device's tokens' pairs leaving it
            t["ep_all_to_all"] = 2 * (latency + sent / (hw_link * hw.link_efficiency))
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
