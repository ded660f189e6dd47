"""Memory readers: this process's resident and peak memory (/proc/self/status), what the
machine can still give out (/proc/meminfo), and a device's peak (CUDA's allocator on a GPU)."""

from __future__ import annotations

import resource

import torch


def proc_status_mib(key: str) -> float | None:
    """A memory figure of this process from /proc/self/status (VmRSS, VmHWM, RssAnon...) in
    MiB; None where there is no such file (not Linux)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return None


def peak_rss_mib() -> float:
    """This process's peak resident set size so far (Linux VmHWM; elsewhere ru_maxrss)."""
    peak = proc_status_mib("VmHWM")
    if peak is not None:
        return peak

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def reset_peak_rss() -> bool:
    """Restart the peak-RSS count from the current RSS (Linux >= 4.0); False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def rss_mib() -> float:
    """This process's resident set size now (0 where /proc is missing)."""
    return proc_status_mib("VmRSS") or 0.0


def available_mib() -> float | None:
    """Memory the machine can still give out (MemAvailable), None where it is not reported."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return None


def peak_memory_mib(device: torch.device) -> float:
    """Peak memory of this process: CUDA memory allocated by tensors on a GPU; resident set
    size (VmHWM, everything the process touched) on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return peak_rss_mib()


def reset_peak_memory(device: torch.device) -> bool:
    """Restart what `peak_memory_mib` reports from now; False where the OS does not allow it."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    return reset_peak_rss()
