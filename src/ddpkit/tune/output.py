"""What `ddpkit find-batch-size` prints and writes: the table as trials run, the conclusion,
the result as JSON and a plot of throughput against batch size."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from ..observe.plots import pyplot, save_figure
from .plan import Settings
from .search import CRITERIA, KNEE_FRACTION, Trial, largest_fit, pick


def summarize(
    trials: list[Trial], settings: Settings, criterion: str, world: int, device: str, data_ranks: int | None = None
) -> dict[str, Any]:
    """The result: the pick, the trials and the settings. `data_ranks`: the ranks reading other
    samples (fewer than `world` under tp and pp, whose groups share theirs)."""
    chosen, largest = pick(trials, criterion), largest_fit(trials)
    failed = any(not t.fits for t in trials)
    stop = (
        "did not fit"
        if failed
        else ("--max-batch" if largest and largest.per_device_batch >= settings.max_batch else "plateau")
    )
    best = max((t for t in trials if t.fits), key=lambda t: t.samples_per_s or 0.0, default=None)
    return {
        "per_device_batch": chosen.per_device_batch if chosen else None,
        "global_batch": chosen.global_batch if chosen else None,
        "world_size": world,
        "data_ranks": world if data_ranks is None else data_ranks,
        "criterion": CRITERIA[criterion],
        "knee_fraction": KNEE_FRACTION,
        "knee_rule": f"smallest per-device batch tried reaching >= {KNEE_FRACTION:.0%} of the best samples/s seen",
        "largest_fitting_per_device_batch": largest.per_device_batch if largest else None,
        "best_samples_per_s": best.samples_per_s if best else None,
        "best_per_device_batch": best.per_device_batch if best else None,
        "search_stopped_by": stop,
        "trials": [asdict(t) for t in trials],
        "settings": {**asdict(settings), "in_shape": list(settings.in_shape)},
        "peak_memory_measure": "torch.cuda.max_memory_allocated" if device == "cuda" else "process peak RSS (VmHWM)",
    }


TABLE_HEADER = f"{'per-device':>10} {'global':>8} {'samples/s':>11} {'step ms':>9} {'peak MiB':>9}  fits"


def header(s: Settings, world: int, device: str, strategy: str, probes: bool = True) -> str:
    """The first line: what is searched, where, and what runs per size (`probes`: a probe step
    below the strategy first; a sharded one has none, see `probe`)."""
    if s.language:
        what = (
            f"{s.model} (width {s.gpt_width}, depth {s.gpt_depth}, heads {s.gpt_heads}{_gpt_extras(s)}) on sequences of "
            f"{s.in_shape[0]} tokens (a vocabulary of {s.num_classes})"
        )
    else:
        what = f"{s.model} on {s.data} {'x'.join(map(str, s.in_shape))} ({s.num_classes} classes)"
    return (
        f"ddpkit find-batch-size: {what}, {world} x {device} {strategy}, {s.precision}, {s.optimizer}; per size: "
        f"{'1 probe step, then ' if probes else ''}{s.warmup} warm-up and {s.steps} timed training steps on a "
        "synthetic batch"
    )


def _gpt_extras(s: Settings) -> str:
    """The gpt shape's flags beyond width, depth and heads, where given: ', llama, kv heads 2'."""
    extras = [s.gpt_style] if s.gpt_style != "gpt2" else []
    extras += [f"kv heads {s.gpt_kv_heads}"] if s.gpt_kv_heads is not None else []
    extras += [f"hidden {s.gpt_hidden}"] if s.gpt_hidden is not None else []
    return "".join(f", {e}" for e in extras)


def shared_samples(world: int, data_ranks: int, mesh: str) -> str | None:
    """The line saying what a size is where ranks share their samples (tp, pp), else None."""
    if data_ranks == world:
        return None
    return (
        f"(on --mesh {mesh} the {world} processes form {data_ranks} data rank{'s' if data_ranks > 1 else ''}: a "
        f"per-device size is the samples of one data rank, which its {world // data_ranks} processes share)"
    )


def row(t: Trial) -> str:
    if not t.fits:
        ranks = ",".join(map(str, t.failed_ranks))
        blank = f"{'-':>11} {'-':>9} {'-':>9}"
        return f"{t.per_device_batch:>10,} {t.global_batch:>8,} {blank}  no: {t.reason}, rank {ranks}"
    return (
        f"{t.per_device_batch:>10,} {t.global_batch:>8,} {t.samples_per_s:>11,.0f} {t.step_ms:>9.2f} "
        f"{t.peak_memory_mib:>9,.0f}  yes"
    )


def nothing_fits(r: dict[str, Any]) -> str:
    smallest = min(r["trials"], key=lambda t: t["per_device_batch"])
    return (
        f"no per-device batch fits on every rank: even {smallest['per_device_batch']} did not "
        f"({smallest['reason']} on rank {','.join(map(str, smallest['failed_ranks']))})"
    )


def conclusion(r: dict[str, Any]) -> list[str]:
    """The lines after the table: why this size, and what to pass to `ddpkit train`."""
    b, g, lines = r["per_device_batch"], r["global_batch"], []
    ranks = r["data_ranks"]
    largest = r["largest_fitting_per_device_batch"]
    bad = [t for t in r["trials"] if not t["fits"]]
    if bad:
        first_bad = min(t["per_device_batch"] for t in bad)
        lines.append(
            f"largest that fits on every rank: per-device {largest:,} (global {largest * ranks:,}); "
            f"{first_bad:,} did not fit"
        )
    else:
        hint = "; raise it to look further" if r["search_stopped_by"] == "--max-batch" else ""
        lines.append(
            f"everything tried fitted, up to per-device {largest:,} (search stopped by {r['search_stopped_by']}{hint})"
        )
    if r["criterion"] == "knee":
        lines.append(
            f"knee: per-device {b:,} is the smallest size reaching >= {r['knee_fraction']:.0%} of the best "
            f"{r['best_samples_per_s']:,.0f} samples/s (at per-device {r['best_per_device_batch']:,})"
        )
    each = f"per device {b}" if ranks == r["world_size"] else f"{b} per data rank, --mesh {r['mesh']}"
    if "pp=" in r.get("mesh", "") and r["settings"]["pp_schedule"] != "1f1b":
        each += f" --pp-schedule {r['settings']['pp_schedule']}"  # what ddpkit train is to run as well
    lines.append(
        f"use --batch-size {g} ({each}) on {r['world_size']} process"
        f"{'es' if r['world_size'] > 1 else ''} [criterion: {r['criterion']}]"
    )
    return lines


def plot(result: dict[str, Any], path: str) -> None:
    """Throughput against per-device batch (log2 axis), the pick starred, failures crossed."""

    plt = pyplot()
    fits = sorted((t for t in result["trials"] if t["fits"]), key=lambda t: t["per_device_batch"])
    bad = [t for t in result["trials"] if not t["fits"]]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot([t["per_device_batch"] for t in fits], [t["samples_per_s"] for t in fits], "o-", label="fits")
    if bad:
        ax.plot([t["per_device_batch"] for t in bad], [0] * len(bad), "rx", markersize=10, label="did not fit")
    if result["criterion"] == "knee" and result["best_samples_per_s"]:
        ax.axhline(
            result["knee_fraction"] * result["best_samples_per_s"],
            color="gray",
            linestyle="--",
            label=f"{result['knee_fraction']:.0%} of best",
        )
    chosen = next((t for t in fits if t["per_device_batch"] == result["per_device_batch"]), None)
    if chosen:
        ax.plot(
            [chosen["per_device_batch"]],
            [chosen["samples_per_s"]],
            "*",
            color="tab:orange",
            markersize=16,
            label=f"pick ({result['criterion']}): {chosen['per_device_batch']}",
        )
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(lambda value, _: f"{value:g}")  # 1, 2, 4 ... rather than 2^0, 2^1 ...
    shared = result.get("data_ranks", result["world_size"]) != result["world_size"]
    ax.set_xlabel("per-data-rank batch" if shared else "per-device batch")
    ax.set_ylabel("samples/s (all data ranks)" if shared else "samples/s (all ranks)")
    ax.set_ylim(bottom=0)
    s = result["settings"]
    layout = f" {result['strategy']} on {result['mesh']}" if result.get("mesh") and s.get("mesh") else ""
    ax.set_title(
        f"{s['model']}, {result['world_size']} x {result.get('device', s['device'])}{layout}, {s['precision']}"
    )
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    save_figure(fig, path, dpi=100)
