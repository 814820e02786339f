"""The absl flags that scripts/generate.py and scripts/benchmark.py share for choosing how the
step computes: --attention_backend, --flash_prefill, --pallas_kernel, --kernel_options and
--layer_loop (EngineConfig's fields of the same names)."""

from __future__ import annotations

from absl import flags

from llmjax.config import ATTENTION_BACKENDS, FLASH_PREFILL_MODES, LAYER_LOOPS, PALLAS_KERNELS


def define_flags() -> None:
    flags.DEFINE_enum(
        "attention_backend",
        "auto",
        list(ATTENTION_BACKENDS),
        "Attention: 'pallas' kernels (compiled on GPU/TPU, interpreted on the CPU: slow), "
        "'reference' (plain jnp), 'auto' (pallas on GPU/TPU, reference on the CPU).",
    )
    flags.DEFINE_enum(
        "flash_prefill",
        "auto",
        list(FLASH_PREFILL_MODES),
        "With the pallas backend, attend a step that is one fresh prompt with the flash prefill "
        "kernel: 'auto' where measured faster (GPU, >= 2048-token buckets), 'on' always, 'off' "
        "never.",
    )
    flags.DEFINE_enum(
        "pallas_kernel",
        "auto",
        list(PALLAS_KERNELS),
        "With the pallas backend, the attention kernels (ragged paged attention and flash "
        "prefill): 'auto' (the platform's: "
        "gpu on CUDA, tpu on TPU and on the CPU), 'tpu' (Mosaic TPU), 'gpu' (Triton), 'mgpu' "
        "(Mosaic GPU for Hopper; needs --dtype bfloat16 or float16).",
    )

    flags.DEFINE_string(
        "kernel_options",
        "",
        "With a named --pallas_kernel, that ragged paged attention kernel's arguments as "
        "key=value,... (integers or true/false), e.g. 'warp_specialized=true,num_consumers=2' "
        "or 'num_stages=2' for mgpu; see EngineConfig.kernel_options.",
    )
    flags.DEFINE_enum(
        "layer_loop",
        "auto",
        list(LAYER_LOOPS),
        "How the step runs the decoder layers: 'scan' (lax.scan over stacked weights: compile "
        "time independent of depth), 'unroll' (one copy of the layer per layer in the program), "
        "'auto' (scan, except with a sparse KV mode); see EngineConfig.layer_loop.",
    )


def llm_kwargs(values) -> dict:
    """The LLM(...) keyword arguments the flags set."""
    return dict(
        attention_backend=values.attention_backend,
        flash_prefill=values.flash_prefill,
        pallas_kernel=values.pallas_kernel,
        kernel_options=values.kernel_options,
        layer_loop=values.layer_loop,
    )
