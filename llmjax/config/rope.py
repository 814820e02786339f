"""RoPE frequency scaling (`ModelConfig.rope_scaling`)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from llmjax.config.checks import _check_positive


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling.

    `llama3`: Llama 3.1's wavelength-dependent scaling (long wavelengths divided by `factor`, short
    ones kept, a smooth ramp between `high_freq_factor` and `low_freq_factor`).
    `linear`: every frequency divided by `factor` (position interpolation).
    `freq_factors`: frequency i divided by `freq_factors[i]` (head_dim / 2 of them): llama.cpp's
    `rope_freqs` tensor, which GGUF files of Llama 3.1+ carry instead of the llama3 parameters
    (`factor` is then their largest, for information).
    """

    rope_type: Literal["llama3", "linear", "freq_factors"]
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    freq_factors: tuple[float, ...] = ()

    def __post_init__(self):
        if self.rope_type not in ("llama3", "linear", "freq_factors"):
            raise ValueError(
                f"unsupported {self.rope_type=}; llmjax implements 'llama3', 'linear' and "
                "'freq_factors'"
            )
        object.__setattr__(self, "freq_factors", tuple(float(f) for f in self.freq_factors))
        if (self.rope_type == "freq_factors") != bool(self.freq_factors):
            raise ValueError(
                f"freq_factors go with rope_type='freq_factors' (and it needs them): "
                f"{self.rope_type=}, {len(self.freq_factors)} factors"
            )
        if any(not f > 0 for f in self.freq_factors):
            raise ValueError(f"freq_factors must be positive: {self.freq_factors}")
        _check_positive(self, "factor", "original_max_position_embeddings")
        if self.rope_type == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(
                f"llama3 rope scaling needs {self.high_freq_factor=} > {self.low_freq_factor=}"
            )

    @classmethod
    def from_hf(cls, d: dict | None) -> RopeScaling | None:
        if not d:
            return None
        rope_type = d.get("rope_type", d.get("type"))
        if rope_type in ("default", None):
            return None
        if rope_type not in ("llama3", "linear"):
            raise ValueError(
                f"unsupported rope_scaling type {rope_type!r} in {d}; llmjax implements 'llama3' "
                "and 'linear'"
            )
        kwargs = {"rope_type": rope_type, "factor": float(d["factor"])}
        if rope_type == "llama3":
            kwargs |= {
                "low_freq_factor": float(d["low_freq_factor"]),
                "high_freq_factor": float(d["high_freq_factor"]),
                "original_max_position_embeddings": int(d["original_max_position_embeddings"]),
            }
        return cls(**kwargs)
