"""What a run shows and leaves behind: a progress bar, a CSV log, a loss-curve PNG, a summary.

Only rank 0 builds one with ``enabled=True``; elsewhere every method is a no-op::

    mon = RunMonitor("runs/demo", total=300, enabled=rank == 0)
    mon.log(step=1, loss=5.5, lr=3e-3, loss_scale=1.0, grad_norm=0.8, tokens_per_s=9000.0)
    mon.finish({"final_loss": ...})   # writes train_log.csv, loss.png, summary.json; prints
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

from tqdm import tqdm

FIELDS = ("step", "loss", "lr", "loss_scale", "grad_norm", "tokens_per_s")


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


class RunMonitor:
    def __init__(self, out_dir: str | Path, *, total: int, enabled: bool, progress: bool = True):
        self.enabled = enabled
        self.out = Path(out_dir)
        self.rows: list[dict] = []
        self.bar = None
        if enabled:
            self.out.mkdir(parents=True, exist_ok=True)
            self._csv_file = open(self.out / "train_log.csv", "w", newline="")  # noqa: SIM115
            self._csv = csv.DictWriter(self._csv_file, fieldnames=FIELDS)
            self._csv.writeheader()
            if progress:
                self.bar = tqdm(total=total, desc="train", unit="step", dynamic_ncols=True)

    def log(self, **row) -> None:
        if not self.enabled:
            return
        self.rows.append(row)
        self._csv.writerow({k: row.get(k) for k in FIELDS})
        if self.bar is not None:
            self.bar.set_postfix(
                loss=f"{row['loss']:.3f}",
                tok_s=f"{row['tokens_per_s']:.0f}",
                scale=f"{row['loss_scale']:g}",
                refresh=False,
            )
            self.bar.update(1)

    def recent_loss(self, window: int = 10) -> float | None:
        tail = [r["loss"] for r in self.rows[-window:]]
        return sum(tail) / len(tail) if tail else None

    def _plot(self) -> Path | None:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return None
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot([r["step"] for r in self.rows], [r["loss"] for r in self.rows], lw=1)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("training loss (nats/byte)")
        ax.set_title("zerostack train")
        ax.grid(alpha=0.3)
        path = self.out / "loss.png"
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path

    def finish(self, summary: dict) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.close()
        self._csv_file.close()
        plot = self._plot()
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        mem = summary.get("bytes_per_rank", {})
        grid = ""
        if any(summary.get(axis, 1) > 1 for axis in ("tp", "pp", "sp", "ep")):
            sp = ", sequence parallel" if summary.get("sequence_parallel") else ""
            pp = ""
            if summary.get("pp", 1) > 1:
                pp = f"pp {summary['pp']} ({summary['schedule']}) x "
            ulysses = f" x sp {summary['sp']}" if summary.get("sp", 1) > 1 else ""
            ulysses += f", ep {summary['ep']}" if summary.get("ep", 1) > 1 else ""
            grid = f" ({pp}tp {summary['tp']} x dp {summary['dp']}{ulysses}{sp})"
        lines = [
            "",
            f"zerostack train: {summary['world_size']} ranks{grid}, "
            f"ZeRO stage {summary['zero_stage']}"
            + (f" + {summary['offload']} offload" if summary.get("offload") else "")
            + (" + activation checkpointing" if summary.get("activation_checkpointing") else "")
            + ", "
            f"{summary['precision']}, {summary['parameters']:,} parameters",
            f"  loss            {summary['first_loss']:.4f} -> {summary['final_loss']:.4f} "
            f"(mean of last 10 steps); validation {summary['val_loss']:.4f}",
            f"  throughput      {summary['tokens_per_s']:,.0f} tokens/s "
            f"over {summary['steps']} steps; MFU {summary['mfu']:.1%} of "
            f"{summary['peak_flops_per_rank'] / 1e9:,.1f} GFLOP/s per rank "
            f"({summary['peak_source']})",
            "  bytes per rank  "
            + ", ".join(f"{k} {_human_bytes(v)}" for k, v in mem.items())
            + f" (total {_human_bytes(sum(mem.values()))})",
            f"  comm per step   {_human_bytes(summary['comm_bytes_per_step'])}",
            f"  log             {self.out / 'train_log.csv'}",
            *([f"  checkpoint      {summary['checkpoint']}"] if summary.get("checkpoint") else []),
        ]
        if plot is not None:
            lines.append(f"  loss curve      {plot}")
        else:
            lines.append("  loss curve      (install matplotlib for loss.png)")
        if summary["final_loss"] is not None and not math.isfinite(summary["final_loss"]):
            lines.append("  WARNING: the loss is not finite")
        print("\n".join(lines), flush=True)
