"""Multi-LoRA serving (`LoRAConfig`; vLLM's names): many adapters over one base model in one
batch (llmjax/lora/, docs/lora.md)."""

from __future__ import annotations

import dataclasses

from llmjax.config.checks import _check_positive
from llmjax.config.model import ModelConfig

# PEFT's module names (HF Llama-family projections) -> the model's weight names
# (llmjax/model/params.py).
LORA_TARGETS = {
    "q_proj": "wq",
    "k_proj": "wk",
    "v_proj": "wv",
    "o_proj": "wo",
    "gate_proj": "w_gate",
    "up_proj": "w_up",
    "down_proj": "w_down",
}
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
# How a step computes its adapters' deltas (llmjax/model/lora.py): every slot's columns, masked,
# or each token's own adapter, tokens grouped by slot. 'auto' is masked: end to end on a 2-core
# CPU it was ahead at 1 to 64 adapters (SmolLM2, scripts/bench_lora.py: 0.908 / 0.407 of the
# base model's throughput against grouped's 0.632 / 0.362), though one projection alone groups
# faster above 128 slot columns (docs/lora.md); not yet measured on a GPU or TPU.
LORA_KERNELS = ("auto", "masked", "grouped")


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """`max_loras` adapter slots on the device, each of rank up to `max_lora_rank` (an adapter
    of smaller rank is zero-padded), filled from a host cache of `max_cpu_loras` loaded adapters
    (None: max_loras), least recently used first. A step's tokens carry their request's slot
    (the base model: none), and each projection of `target_modules` (PEFT's names; None: every
    projection the model has, the attention ones for a mixture of experts) adds x A B of the
    token's adapter, for the whole ragged batch at once (llmjax/model/lora.py). The scheduler
    runs at most `max_loras` distinct adapters at a time (vLLM's rule): a request whose adapter
    would be one more waits, and, as for pages, stops admission behind it (no overtaking, so no
    adapter starves). `kernel` (LORA_KERNELS): how a step computes the deltas, 'masked' (every
    slot's columns for every token, the other slots' zeroed: one matmul pair, cost growing with
    the slots), 'grouped' (Punica's SGMV: tokens sorted by slot, each group times its own
    adapter by the platform's grouped matmul, cost growing with the rank only) or 'auto'
    (masked: what measured faster end to end; see LORA_KERNELS)."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    target_modules: tuple[str, ...] | None = None
    kernel: str = "auto"

    def __post_init__(self):
        _check_positive(self, "max_loras", "max_lora_rank", "max_cpu_loras")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras={self.max_cpu_loras} must be >= max_loras={self.max_loras}"
            )
        if self.kernel not in LORA_KERNELS:
            raise ValueError(f"unknown LoRA {self.kernel=}; choose one of {LORA_KERNELS}")
        if self.target_modules is not None:
            object.__setattr__(self, "target_modules", tuple(self.target_modules))
            unknown = sorted(set(self.target_modules) - set(LORA_TARGETS))
            if unknown or not self.target_modules:
                raise ValueError(
                    f"LoRA target_modules {unknown or '()'}: choose from {list(LORA_TARGETS)}"
                )

    def grouped(self, tp: int = 1) -> bool:
        """Whether steps compute the deltas grouped by slot (`kernel`, 'auto' resolved: masked,
        and always under tensor parallelism, `tp` > 1)."""
        return self.kernel == "grouped" and tp == 1

    @property
    def num_cpu_loras(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras

    def targets_for(self, mixture_of_experts: bool) -> tuple[str, ...]:
        """The target modules the device slots hold, in LORA_TARGETS' order."""
        if self.target_modules is not None:
            wanted = set(self.target_modules)
        else:
            wanted = set(ATTENTION_TARGETS if mixture_of_experts else LORA_TARGETS)
        return tuple(t for t in LORA_TARGETS if t in wanted)


def lora_projection_dims(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """The model's weight name -> (in, out) of each LoRA-able projection, flattened as the
    model's `linear` flattens them (wq [D, N, H]: D -> N H)."""
    D, H, F = config.hidden_size, config.head_dim, config.intermediate_size
    N, K = config.num_heads, config.num_kv_heads
    return {
        "wq": (D, N * H),
        "wk": (D, K * H),
        "wv": (D, K * H),
        "wo": (N * H, D),
        "w_gate": (D, F),
        "w_up": (D, F),
        "w_down": (F, D),
    }
