"""Named accelerators for the analytic (`roofline`) cost model: peak rates, memory, links, and
the fraction of each peak that real kernels reach.

Peaks are the vendors' datasheet figures (dense, no sparsity) for 16-bit matmuls. The
efficiencies are defaults to be replaced by one's own measurements (`dataclasses.replace`, or
`SimConfig(hardware=...)` with a `Hardware`); where they come from:

- `matmul_efficiency` 0.7: large bf16 GEMMs in cuBLAS reach roughly 70-80 % of the A100's and
  H100's dense peak, the projection GEMMs of a serving step (a few hundred to a few thousand rows)
  less; 0.7 is the middle of that range. TPU: XLA's MXU matmuls at these sizes, same figure.
- `memory_efficiency` 0.85: the fastest measured A100-80GB read kernels reach 88-90 % of its 2.04
  TB/s (NVIDIA developer forum, "Trouble to reach peak bandwidth of A100", Nsight Compute: 1.80
  TB/s); a streaming weight read in a real step a little less.
- `prefill_attention_efficiency` 0.5: FlashAttention-2's forward pass reaches 50-73 % of the
  A100's peak (Dao, 2023, "reaching 50-73% of the theoretical maximum FLOPs/s"); 0.35 on H100 and
  H200, where FlashAttention-2 reaches about 35 % (FlashAttention-3 paper, 2024: FA2 at ~350 of
  989 TFLOPS), as the FlashInfer/FA2 kernels of the engines compared here.
- `decode_attention_efficiency` 0.7 of the memory bandwidth: paged decode attention gathers
  16-token pages, below a streaming read (vLLM's PagedAttention paper reports its kernel 20-26 %
  slower than FasterTransformer's contiguous one).
- `link_efficiency` 0.75: NCCL all-reduce bus bandwidth on 8 x A100 NVLink measures about 230 of
  300 GB/s per direction (nccl-tests); `link_latency_s` 10 us per collective or send plus Vidur's
  20 us NCCL launch overhead on the host.
- `host_bandwidth` 25 GB/s: host memory to the device per direction (PCIe 4.0 x16's 32 GB/s,
  about 80 % achieved by pinned copies), what loading a LoRA adapter into a slot costs.
- `step_overhead_s` 2 ms: per engine step on the host (scheduling, input preparation, launches,
  sampling), an assumption of this model: Vidur models these CPU overheads separately and leaves
  them off by default. Set it from a profile of your own engine.

`cpu_from_profile(path)` makes the host CPU a `Hardware` from the rooflines that
`scripts/profile_step.py --roofline` measured (efficiencies 1: the measured rates are achieved
ones) and the engine's measured host time per step as the overhead.
"""

from __future__ import annotations

import dataclasses
import json

GB = 1e9
TFLOPS = 1e12


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One accelerator (and how it connects to its peers): rates in bytes/s and FLOP/s."""

    name: str
    peak_flops: float  # dense 16-bit matmul FLOP/s (float32 on a CPU profile)
    memory_bandwidth: float  # device memory, bytes/s
    memory_bytes: float  # device memory capacity
    link_bandwidth: float  # per device, per direction, to peers in its node (NVLink, ICI, PCIe)
    network_bandwidth: float  # per device, per direction, to other nodes
    devices_per_node: int = 8
    matmul_efficiency: float = 0.7
    memory_efficiency: float = 0.85
    prefill_attention_efficiency: float = 0.5
    decode_attention_efficiency: float = 0.7
    link_efficiency: float = 0.75
    link_latency_s: float = 30e-6
    network_latency_s: float = 50e-6
    step_overhead_s: float = 2e-3
    host_bandwidth: float = 25 * GB  # host memory -> device, per direction (PCIe)
    source: str = ""

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, float | int) and not isinstance(v, bool) and not v >= 0:
                raise ValueError(f"Hardware.{f.name}={v!r} must be >= 0")
        for name in (
            "peak_flops",
            "memory_bandwidth",
            "memory_bytes",
            "link_bandwidth",
            "network_bandwidth",
            "devices_per_node",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"Hardware.{name} must be positive")
        for name in (
            "matmul_efficiency",
            "memory_efficiency",
            "prefill_attention_efficiency",
            "decode_attention_efficiency",
            "link_efficiency",
        ):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"Hardware.{name}={getattr(self, name)} must be in (0, 1]")

    def replace(self, **changes) -> Hardware:
        return dataclasses.replace(self, **changes)


A100_80GB = Hardware(
    name="a100-80gb",
    peak_flops=312 * TFLOPS,
    memory_bandwidth=2039 * GB,
    memory_bytes=80 * 2**30,
    link_bandwidth=300 * GB,  # NVLink 3: 600 GB/s both directions
    network_bandwidth=25 * GB,  # DGX A100: one 200 Gb/s HDR InfiniBand port per GPU
    source="NVIDIA A100 datasheet (SXM4 80GB): 312 TFLOPS bf16, 2,039 GB/s HBM2e, NVLink 600 GB/s",
)

A100_80GB_PCIE = A100_80GB.replace(
    name="a100-80gb-pcie",
    memory_bandwidth=1935 * GB,
    # Sarathi-Serve's Yi-34B pairs: an NVLink bridge between two PCIe cards (600 GB/s both ways)
    link_bandwidth=300 * GB,
    network_bandwidth=12.5 * GB,  # Sarathi-Serve's Falcon-180B: two nodes over 100 GbE
    devices_per_node=4,
    source="NVIDIA A100 datasheet (PCIe 80GB): 312 TFLOPS bf16, 1,935 GB/s; NVLink bridge for "
    "2 GPUs 600 GB/s; Sarathi-Serve's 2-node runs over 100 Gb Ethernet",
)

A40 = Hardware(
    name="a40",
    peak_flops=149.7 * TFLOPS,
    memory_bandwidth=696 * GB,
    memory_bytes=48 * 2**30,
    link_bandwidth=56.25 * GB,  # NVLink bridge for pairs: 112.5 GB/s both directions
    network_bandwidth=12.5 * GB,
    source="NVIDIA A40 datasheet: 149.7 TFLOPS bf16 (dense), 696 GB/s GDDR6, 48 GB, NVLink "
    "112.5 GB/s (pairs)",
)

H100_SXM = Hardware(
    name="h100-sxm",
    peak_flops=989 * TFLOPS,
    memory_bandwidth=3350 * GB,
    memory_bytes=80 * 2**30,
    link_bandwidth=450 * GB,  # NVLink 4: 900 GB/s both directions
    network_bandwidth=50 * GB,  # DGX H100: one 400 Gb/s NDR port per GPU
    prefill_attention_efficiency=0.35,
    source="NVIDIA H100 datasheet (SXM5): 989 TFLOPS bf16 dense, 3.35 TB/s HBM3, NVLink 900 GB/s",
)

H200 = H100_SXM.replace(
    name="h200",
    memory_bandwidth=4800 * GB,
    memory_bytes=141 * 1e9,
    source="NVIDIA H200 datasheet (SXM): 989 TFLOPS bf16 dense, 4.8 TB/s HBM3e, 141 GB, NVLink "
    "900 GB/s",
)

TPU_V5E = Hardware(
    name="tpu-v5e",
    peak_flops=197 * TFLOPS,
    memory_bandwidth=819 * GB,
    memory_bytes=16 * 2**30,
    link_bandwidth=100 * GB,  # ICI 1,600 Gb/s per chip (200 GB/s), both directions
    network_bandwidth=12.5 * GB,  # data-center network between slices
    devices_per_node=256,  # a v5e pod slice: ICI up to 256 chips
    source="Google Cloud TPU v5e docs: 197 TFLOPS bf16, 819 GB/s HBM2, 16 GB, ICI 1,600 Gbps",
)

TPU_V5P = Hardware(
    name="tpu-v5p",
    peak_flops=459 * TFLOPS,
    memory_bandwidth=2765 * GB,
    memory_bytes=95 * 2**30,
    link_bandwidth=300 * GB,  # ICI 4,800 Gb/s per chip (600 GB/s), both directions
    network_bandwidth=25 * GB,
    devices_per_node=8960,  # a v5p pod
    source="Google Cloud TPU v5p docs: 459 TFLOPS bf16, 2,765 GB/s HBM2e, 95 GB, ICI 4,800 Gbps",
)

HARDWARE: dict[str, Hardware] = {
    h.name: h for h in (A100_80GB, A100_80GB_PCIE, A40, H100_SXM, H200, TPU_V5E, TPU_V5P)
}


def get_hardware(name_or_hardware) -> Hardware:
    """A `Hardware`, a preset name (HARDWARE) or a profile JSON path (`cpu_from_profile`)."""
    if isinstance(name_or_hardware, Hardware):
        return name_or_hardware
    name = str(name_or_hardware)
    if name in HARDWARE:
        return HARDWARE[name]
    if name.endswith(".json"):
        return cpu_from_profile(name)
    raise ValueError(
        f"unknown hardware {name!r}; choose one of {sorted(HARDWARE)} or a profile JSON of "
        "scripts/profile_step.py --roofline (this CPU)"
    )


def cpu_from_profile(path: str) -> Hardware:
    """The CPU that `scripts/profile_step.py --roofline` ran on, from the read bandwidth and
    matmul rate it measured ("roofline" in its JSON); efficiencies 1 (measured rates are
    achieved ones) and the engine's measured host seconds per step as the overhead."""
    try:
        with open(path) as f:
            profile = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    roof = profile.get("roofline")
    if not isinstance(roof, dict) or not {"read_bytes_per_s", "matmul_flops"} <= set(roof):
        raise ValueError(
            f"{path} has no measured roofline (read_bytes_per_s, matmul_flops): run "
            "scripts/profile_step.py --roofline"
        )
    return Hardware(
        name=f"cpu:{path}",
        peak_flops=float(roof["matmul_flops"]),
        memory_bandwidth=float(roof["read_bytes_per_s"]),
        memory_bytes=float(roof.get("memory_bytes", 16 * 2**30)),
        link_bandwidth=float(roof.get("read_bytes_per_s")),
        network_bandwidth=1.25 * GB,
        devices_per_node=1,
        matmul_efficiency=1.0,
        memory_efficiency=1.0,
        prefill_attention_efficiency=float(roof.get("attention_efficiency", 1.0)),
        decode_attention_efficiency=1.0,
        link_efficiency=1.0,
        step_overhead_s=float(roof.get("step_overhead_s", 0.0)),
        source=f"measured by scripts/profile_step.py --roofline ({path})",
    )
