"""The machines a plan is for: GPUs per node, nodes, and each GPU's memory, peak FLOP/s and links.

The presets hold the vendors' data-sheet figures (dense peaks; one direction of a link), so
every assumption is one the user can read and replace: any field given on the command line
overrides the preset's.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from ..errors import UsageError
from ..observe.metrics import PEAK_TFLOPS

GIB = 2**30


@dataclass(frozen=True)
class Gpu:
    """One GPU kind: its memory as torch reports it (GiB), dense peaks by precision
    (TFLOP/s), and per-GPU bandwidth in one direction (GB/s) within a node (NVLink) and
    between nodes (the GPU's network card), with each link's latency (microseconds)."""

    name: str
    memory_gib: float
    peak_tflops: dict[str, float]
    intra_gbps: float
    inter_gbps: float
    intra_latency_us: float = 5.0
    inter_latency_us: float = 10.0
    # Where set (a CPU measured here, `calibrate`): each operation at the longer of its FLOPs and
    # its bytes at memory_gbps, plus op_overhead_us (more on DTensors: dtensor_op_overhead_us,
    # by the layout's kind, "fsdp" or "tp"), all over the efficiency; and no collective beside
    # the compute.
    memory_gbps: float = 0.0
    op_overhead_us: float = 0.0
    dtensor_op_overhead_us: dict[str, float] = field(default_factory=dict)
    attention_tflops: float = 0.0  # its fused attention kernel's rate, where measured (0: the peak's)
    overlap: bool = True
    device: str = "cuda"  # as `ddpkit train --device` names it


def _peaks(key: str, fp32: float) -> dict[str, float]:
    """ddpkit's MFU table (whose fp32 is TF32's peak: cuDNN runs fp32 convolutions as TF32 by
    default), and `fp32` without TF32: torch's matrix products in fp32 do not use it unless
    asked (`torch.backends.cuda.matmul.allow_tf32`), and ddpkit does not ask."""
    table = dict(next(table for name, table in PEAK_TFLOPS if name == key))
    return {**table, "tf32": table["fp32"], "fp32": fp32}


# Memory: H100 SXM 80 GB and A100 80 GB report about 79.2 GiB to torch, H200 139.8, A100 40 GB
# 39.4. Links: NVLink 4 is 900 GB/s both ways per H100/H200 (450 one way), NVLink 3 600 per
# A100; across nodes one 400 Gb/s NDR card per H100/H200 GPU (50 GB/s), 200 Gb/s HDR per A100.
GPUS: dict[str, Gpu] = {
    "h100": Gpu("H100 SXM 80GB", 79.2, _peaks("H100", 66.9), 450.0, 50.0),
    "h200": Gpu("H200 SXM 141GB", 139.8, _peaks("H200", 66.9), 450.0, 50.0),
    "a100-80gb": Gpu("A100 SXM 80GB", 79.2, _peaks("A100", 19.5), 300.0, 25.0),
    "a100-40gb": Gpu("A100 SXM 40GB", 39.4, _peaks("A100", 19.5), 300.0, 25.0),
}


@dataclass(frozen=True)
class Cluster:
    """`nodes` machines of `gpus_per_node` GPUs of one kind, and the share of the peak that
    the matrix products reach (`efficiency`: an assumption, stated in every plan)."""

    gpu: Gpu
    gpus_per_node: int
    nodes: int = 1
    efficiency: float = 0.4

    def __post_init__(self) -> None:
        for name in ("gpus_per_node", "nodes"):
            if getattr(self, name) < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if not 0.001 <= self.efficiency <= 1:
            raise UsageError(f"--efficiency must be in [0.001, 1], got {self.efficiency}")
        # within what any machine has: an infinite, zero or absurd figure would divide by zero
        limits = {
            "memory_gib": 1e6,
            "intra_gbps": 1e6,
            "inter_gbps": 1e6,
            "intra_latency_us": 1e6,
            "inter_latency_us": 1e6,
        }
        for name, most in limits.items():
            value, least = getattr(self.gpu, name), 0.0 if name.endswith("latency_us") else 1e-6
            if not least <= value <= most:
                raise UsageError(f"--{name.replace('_', '-')} must be in [{least:g}, {most:g}], got {value}")
        for precision, peak in self.gpu.peak_tflops.items():
            if not 1e-6 <= peak <= 1e6:
                raise UsageError(f"--peak-tflops must be in [1e-06, 1e+06], got {peak} ({precision})")

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def peak_flops(self, precision: str, convolutions: bool = False) -> float:
        """The dense peak per GPU for `precision`, in FLOP/s (fp32: TF32's for a model of
        convolutions, which cuDNN runs as TF32; plain fp32's for matrix products)."""
        key = "tf32" if precision == "fp32" and convolutions else precision
        peak = self.gpu.peak_tflops.get(key) or self.gpu.peak_tflops.get("fp32")
        if not peak:
            raise UsageError(f"no peak FLOP/s for {precision} on {self.gpu.name}: give --peak-tflops")
        return peak * 1e12

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "world_size": self.world_size}


def cluster(
    gpu: str = "h100",
    gpus_per_node: int = 8,
    nodes: int = 1,
    efficiency: float = 0.4,
    **overrides: Any,
) -> Cluster:
    """A `Cluster` of the preset `gpu`, with any of `Gpu`'s fields overridden (`memory_gib=...`,
    `peak_tflops=...` for every precision at once, `intra_gbps=...`); None leaves a field as
    the preset has it."""
    if gpu not in GPUS:
        raise UsageError(
            f"--gpu {gpu!r}: not a preset; choose one of {', '.join(GPUS)} (and override its figures), or cpu"
        )
    given = {k: v for k, v in overrides.items() if v is not None}
    if "peak_tflops" in given:
        peak = float(given["peak_tflops"])
        given["peak_tflops"] = {"fp32": peak, "tf32": peak, "bf16": peak, "fp16": peak}
    unknown = set(given) - set(Gpu.__dataclass_fields__)
    if unknown:
        raise TypeError(f"unknown GPU figures: {sorted(unknown)}")
    return Cluster(replace(GPUS[gpu], **given), gpus_per_node, nodes, efficiency)
