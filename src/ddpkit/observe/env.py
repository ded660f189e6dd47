"""This machine and its software: the `ddpkit env` report (what it offers for training, and what
`ddpkit train` would pick), and `metadata`, the record every benchmark and batch-size search
keeps beside its numbers (hardware, versions, date, git commit)."""

from __future__ import annotations

import datetime
import os
import platform
import socket
import subprocess
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import torch
import torch.distributed as tdist

from ..core import dist, threads
from ..core.device import auto_nproc, cpu_count
from ..version import __version__


def _gpus() -> list[dict[str, Any]]:
    out = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        out.append(
            {
                "index": i,
                "name": p.name,
                "memory_gib": round(p.total_memory / 2**30, 2),
                "compute_capability": f"{p.major}.{p.minor}",
                "multiprocessors": p.multi_processor_count,
            }
        )
    return out


def report() -> dict[str, Any]:
    cuda = torch.cuda.is_available()
    backends = {
        name: bool(getattr(tdist, f"is_{name}_available", lambda: False)()) for name in ("gloo", "nccl", "mpi", "ucc")
    }
    nccl = None
    if cuda and backends["nccl"]:
        nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
    device = "cuda" if cuda else "cpu"
    denv = dist.detect_env()
    return {
        "ddpkit_version": __version__,
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": {
            "version": torch.__version__,
            "git_version": getattr(torch.version, "git_version", None),
            "debug_build": bool(torch.version.debug),
            "cuda_build": torch.version.cuda,
            "hip_build": getattr(torch.version, "hip", None),
        },
        "cuda": {
            "available": cuda,
            "device_count": torch.cuda.device_count() if cuda else 0,
            "cudnn": torch.backends.cudnn.version() if cuda else None,
            "nccl": nccl,
            "bf16_supported": bool(cuda and torch.cuda.is_bf16_supported()),
            "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
        },
        "gpus": _gpus() if cuda else [],
        "cpu": {
            "logical_cores": os.cpu_count(),
            "usable_cores": cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
            "train_threads": _train_threads(auto_nproc("cpu")),
        },
        "distributed_backends": backends,
        "launch_environment": {"source": denv.source, "rank": denv.rank, "world_size": denv.world_size},
        "train_defaults": {
            "device": device,
            "nproc": auto_nproc(device),
            "backend": dist.backend_for(torch.device(device)),
            "strategy": "ddp" if auto_nproc(device) > 1 else "single (ddp on one process)",
            "precision": "fp32",
        },
    }


def render(r: dict[str, Any]) -> str:
    t, c = r["torch"], r["cuda"]
    lines = [
        f"ddpkit {r['ddpkit_version']} on {r['host']} (Python {r['python']}, {r['platform']})",
        f"PyTorch {t['version']}  build: {'CUDA ' + t['cuda_build'] if t['cuda_build'] else 'CPU-only'}"
        f"{'  (debug)' if t['debug_build'] else ''}",
        f"CUDA available: {'yes' if c['available'] else 'no'}"
        + (
            f"  cuDNN {c['cudnn']}  NCCL {c['nccl']}  bf16 {'yes' if c['bf16_supported'] else 'no'}"
            if c["available"]
            else ""
        ),
    ]
    if c["CUDA_VISIBLE_DEVICES"] is not None:
        lines.append(f"CUDA_VISIBLE_DEVICES={c['CUDA_VISIBLE_DEVICES']}")
    for g in r["gpus"]:
        lines.append(
            f"  GPU {g['index']}: {g['name']}, {g['memory_gib']} GiB, compute capability "
            f"{g['compute_capability']}, {g['multiprocessors']} SMs"
        )
    cpu = r["cpu"]
    lines.append(f"CPU cores: {cpu['logical_cores']} logical, {cpu['usable_cores']} usable by this process")
    chosen = cpu["train_threads"]
    lines.append(f"torch threads per process of a CPU ddpkit train here now: {chosen['count']} ({chosen['why']})")
    lines.append(
        "distributed backends: "
        + ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in r["distributed_backends"].items())
    )
    le = r["launch_environment"]
    if le["source"] != "single":
        lines.append(f"launched by {le['source']}: rank {le['rank']} of {le['world_size']}")
    d = r["train_defaults"]
    lines.append(
        f"ddpkit train defaults here: --device {d['device']} --nproc {d['nproc']} "
        f"(backend {d['backend']}, strategy {d['strategy']}, precision {d['precision']})"
    )
    return "\n".join(lines)


def _train_threads(nproc: int) -> dict[str, Any]:
    """The threads each of `nproc` CPU processes of `ddpkit train` would run now, and why: the
    user's OMP_NUM_THREADS, or ddpkit's choice from the cores and the load since start-up."""
    given = os.environ.get("OMP_NUM_THREADS")
    if given:  # as given: OpenMP takes lists ("4,2") too, a Runtime refuses what is not a count
        return {"count": int(given) if given.isdigit() else given, "why": f"OMP_NUM_THREADS={given} (yours)"}
    count, why = threads.choose(nproc)
    return {"count": count, "why": why}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git_commit() -> str | None:
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5
        )
        return out.stdout.strip() or None if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def metadata(device: str) -> dict[str, Any]:
    """Hardware, software versions and date: recorded with every result file."""

    gpu = None
    if device == "cuda" and torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        gpu = {
            "name": p.name,
            "count": torch.cuda.device_count(),
            "memory_gib": round(p.total_memory / 2**30, 1),
            "compute_capability": f"{p.major}.{p.minor}",
            "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(),
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else None,
        }
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "device": device,
        "cpu": {"model": _cpu_model(), "logical_cores": os.cpu_count(), "usable_cores": cpu_count()},
        "gpu": gpu,
        "memory_gib": _total_memory_gib(),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "ddpkit": __version__,
            "numpy": _version("numpy"),
            "platform": platform.platform(),
        },
        "git_commit": _git_commit(),
    }


def _version(dist_name: str) -> str | None:

    try:
        return version(dist_name)
    except PackageNotFoundError:
        return None


def _total_memory_gib() -> float | None:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        return None
