"""Multi-LoRA serving (issue 42; S-LoRA / Punica): requests name an adapter (`LoRARequest`,
vLLM's), adapters load from PEFT directories (`peft.load_peft_adapter`), and `LoRAManager` keeps
them in a host cache and in the device slots the model reads (llmjax/model/lora.py), many
adapters in one batch. `LoRAConfig` (llmjax/config/lora.py) sizes it; docs/lora.md.

    request.py  LoRARequest (and its prefix-cache namespace)
    peft.py     load_peft_adapter, LoRAWeights, LoRAError
    manager.py  LoRAManager (registry, host LRU, device slots)
"""

from llmjax.lora.manager import LoRAManager
from llmjax.lora.peft import LoRAError, LoRAWeights, load_peft_adapter
from llmjax.lora.request import LoRARequest

__all__ = ["LoRAError", "LoRAManager", "LoRARequest", "LoRAWeights", "load_peft_adapter"]
