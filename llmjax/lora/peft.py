"""Reading a PEFT LoRA adapter directory (`adapter_config.json` + `adapter_model.safetensors`,
as `peft`'s `save_pretrained` writes it) into the arrays the device slots take.

PEFT's LoRA adds `scaling * B(A(x))` to a projection, A [r, in] and B [out, r] (`lora_A.weight`,
`lora_B.weight`), scaling = lora_alpha / r, or lora_alpha / sqrt(r) with `use_rslora`;
`rank_pattern` / `alpha_pattern` give some modules their own r and alpha (keys matched against
the module's name as PEFT matches them: the whole name or a dotted suffix, as a regex). Here
each target becomes (a [L, in, r] = A^T, b [L, r, out] = scaling B^T) by the model's weight name
(llmjax/config/lora.py LORA_TARGETS), zeros for the layers the adapter leaves alone
(`layers_to_transform`, or a module missing from the file).

Refused, each with an error naming the file and the reason (`LoRAError`): a missing directory
or file, a malformed config, a type other than LORA, DoRA, trained biases, `modules_to_save`,
`fan_in_fan_out`, a rank above `max_lora_rank`, a module other than the seven projections of a
Llama-family layer (embeddings, the LM head, experts) or one the engine's slots do not hold, and
a base-model mismatch (a layer the model lacks, a shape other than the model's projection).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re

import numpy as np

from llmjax.config import LORA_TARGETS, ModelConfig, lora_projection_dims

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight
_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?P<module>model\.layers\.(?P<layer>\d+)\.(?:self_attn|mlp)\."
    r"(?P<proj>\w+))\.lora_(?P<ab>[AB])\.weight$"
)


class LoRAError(ValueError):
    """An adapter that cannot be loaded (the message says which file and why)."""


@dataclasses.dataclass
class LoRAWeights:
    """An adapter as the device slots take it: `weights` maps the model's weight name to
    (a [L, in, r], b [L, r, out]) float32 (b scaled); `rank` the largest r; `targets` PEFT's
    names of the projections it changes, in LORA_TARGETS' order."""

    path: str
    rank: int
    targets: tuple[str, ...]
    weights: dict[str, tuple[np.ndarray, np.ndarray]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern lookup: the first key matching `module` as a whole
    or as a dotted suffix (a regex), else `default`."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def read_config(path: str) -> dict:
    if not os.path.isdir(path):
        raise LoRAError(f"LoRA adapter {path!r}: no such directory")
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(file):
        raise LoRAError(f"LoRA adapter {path!r}: no {CONFIG_FILE} (a PEFT adapter directory)")
    try:
        with open(file) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise LoRAError(f"LoRA adapter {file}: cannot read it: {e}") from None
    if not isinstance(config, dict):
        raise LoRAError(f"LoRA adapter {file}: want a JSON object")
    refusals = [
        (config.get("peft_type", "LORA") != "LORA", f"peft_type {config.get('peft_type')!r}"),
        (bool(config.get("use_dora")), "DoRA (use_dora)"),
        (config.get("bias", "none") != "none" or config.get("lora_bias"), "trained biases"),
        (bool(config.get("modules_to_save")), "modules_to_save"),
        (bool(config.get("fan_in_fan_out")), "fan_in_fan_out (Conv1D weights)"),
        (bool(config.get("layer_replication")), "layer_replication"),
    ]
    unsupported = [why for bad, why in refusals if bad]
    if unsupported:
        raise LoRAError(f"LoRA adapter {path!r}: {', '.join(unsupported)} not supported")
    for key in ("r", "lora_alpha"):
        if not isinstance(config.get(key), int | float) or config[key] <= 0:
            raise LoRAError(f"LoRA adapter {file}: {key} must be a positive number")
    return config


def load_peft_adapter(
    path: str,
    model: ModelConfig,
    max_lora_rank: int,
    targets: tuple[str, ...] = tuple(LORA_TARGETS),
) -> LoRAWeights:
    """The adapter at `path` for `model`, checked against `max_lora_rank` and the `targets`
    (PEFT's names) the engine's slots hold. Raises LoRAError."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    config = read_config(path)
    file = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(file):
        raise LoRAError(f"LoRA adapter {path!r}: no {WEIGHTS_FILE}")
    try:
        tensors = load_file(file)
    except (SafetensorError, OSError, ValueError) as e:
        raise LoRAError(f"LoRA adapter {file}: cannot read it: {e}") from None
    modules: dict[str, dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        m = _KEY.match(key)
        if m is None or m["proj"] not in LORA_TARGETS:
            raise LoRAError(
                f"LoRA adapter {path!r}: {key!r} is not a LoRA weight of a supported target "
                f"module ({', '.join(LORA_TARGETS)} of a decoder layer)"
            )
        modules.setdefault(m["module"], {})[m["ab"]] = value
    if not modules:
        raise LoRAError(f"LoRA adapter {path!r}: {WEIGHTS_FILE} holds no LoRA weights")
    dims = lora_projection_dims(model)
    L = model.num_layers
    found: dict[str, dict[int, tuple[np.ndarray, np.ndarray]]] = {}
    rank = 0
    for module, ab in sorted(modules.items()):
        m = _KEY.match(module + ".lora_A.weight")
        layer, proj = int(m["layer"]), m["proj"]
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"LoRA adapter {path!r}: {module} has lora_{set(ab).pop()} alone")
        if proj not in targets:
            raise LoRAError(
                f"LoRA adapter {path!r} changes {proj}, which this engine's LoRA slots do not "
                f"hold (LoRAConfig.target_modules: {', '.join(targets)})"
            )
        if layer >= L:
            raise LoRAError(
                f"LoRA adapter {path!r} is for another base model: it changes layer {layer}, "
                f"the model ({model.name or 'this model'}) has {L}"
            )
        A, B = (np.asarray(ab[x], np.float32) for x in "AB")  # [r, in], [out, r]
        n_in, n_out = dims[LORA_TARGETS[proj]]
        r = A.shape[0]
        if A.ndim != 2 or B.ndim != 2 or A.shape[1] != n_in or B.shape != (n_out, r):
            raise LoRAError(
                f"LoRA adapter {path!r} is for another base model: {module} has A {A.shape}, "
                f"B {B.shape}; this model's {proj} maps {n_in} -> {n_out} (want A [r, {n_in}], "
                f"B [{n_out}, r])"
            )
        if r > max_lora_rank:
            raise LoRAError(
                f"LoRA adapter {path!r}: rank {r} of {module} exceeds max_lora_rank={max_lora_rank}"
            )
        alpha = _pattern_value(config.get("alpha_pattern"), module, config["lora_alpha"])
        r_config = _pattern_value(config.get("rank_pattern"), module, config["r"])
        if r_config != r:
            raise LoRAError(
                f"LoRA adapter {path!r}: {module} has rank {r}, its config says {r_config}"
            )
        scaling = alpha / (math.sqrt(r) if config.get("use_rslora") else r)
        found.setdefault(LORA_TARGETS[proj], {})[layer] = (A.T, (B * scaling).T)
        rank = max(rank, r)
    weights = {}
    for name, layers in found.items():
        r = max(a.shape[1] for a, _ in layers.values())
        n_in, n_out = dims[name]
        a = np.zeros((L, n_in, r), np.float32)
        b = np.zeros((L, r, n_out), np.float32)
        for i, (ai, bi) in layers.items():
            a[i, :, : ai.shape[1]], b[i, : bi.shape[0]] = ai, bi
        weights[name] = (a, b)
    targets = tuple(t for t, name in LORA_TARGETS.items() if name in weights)  # table order
    return LoRAWeights(path, rank, targets, weights)
