"""Run logging: progress bar, metrics.jsonl, trackers (through accelerate) and the loss-curve plot.

Only the main process writes or prints; the others get a logger that does nothing.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

from tqdm.auto import tqdm

METRICS_FILE = "metrics.jsonl"
EVENTS_FILE = "events.jsonl"
RANK_EVENTS = "events.rank*.jsonl"  # a rank's own events, until the main process merges them
PLOT_FILE = "loss_curve.png"


def write_event(path: Path, kind: str, step: int | None, message: str) -> None:
    with path.open("a") as fh:
        fh.write(json.dumps({"time": time.time(), "step": step, "event": kind, "message": message}) + "\n")


def merge_rank_events(output_dir: Path) -> None:
    """Fold what other ranks wrote on their own (a hang their watchdog saw) into events.jsonl, in time order."""
    files = sorted(output_dir.glob(RANK_EVENTS))
    if not files:
        return
    rows = []
    for f in files:
        for line in f.read_text(errors="replace").splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:  # a rank killed in the middle of a line
                continue
    with (output_dir / EVENTS_FILE).open("a") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in sorted(rows, key=lambda r: r["time"]))
    for f in files:
        f.unlink()


class RunLog:
    def __init__(self, output_dir: Path, total_steps: int, accelerator, enabled: bool, progress_bar: bool, start_step: int = 0):
        self.accelerator = accelerator
        self.enabled = enabled
        self.path = output_dir / METRICS_FILE
        self.events_path = output_dir / EVENTS_FILE
        self.rank_events_path = output_dir / RANK_EVENTS.replace("*", str(accelerator.process_index))
        self.step = start_step
        if enabled:
            merge_rank_events(output_dir)
            # A new run starts a new log; a resumed one keeps the rows up to where it resumes.
            kept = [r for r in read_metrics(output_dir) if r["step"] <= start_step] if start_step else []
            self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        self.bar = (
            tqdm(total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True) if enabled and progress_bar else None
        )

    def write(self, row: dict) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as fh:  # reopened per row: a crash never loses buffered rows
            fh.write(json.dumps(row) + "\n")
        numbers = {k: v for k, v in row.items() if isinstance(v, (int, float)) and k != "step"}
        self.accelerator.log(numbers, step=row["step"])
        if self.bar is not None and "loss" in row:
            accuracy = row.get("reward_accuracy", row.get("accuracy"))  # pairs' (dpo, orpo, ...) or a reward model's
            preference = {"acc": f"{accuracy:.2f}", "margin": f"{row['reward_margin']:.3f}"} if "reward_margin" in row else {}
            self.bar.set_postfix(loss=f"{row['loss']:.4f}", **preference, lr=f"{row['lr']:.2e}", tok_s=f"{row['tokens_per_s']:.0f}", refresh=False)

    def event(self, kind: str, step: int | None, message: str, any_rank: bool = False) -> None:
        """Something happened that a person should know about (a skip, a rollback, a restart, a
        damaged checkpoint, a preemption): one line on the console and one row in events.jsonl,
        which is kept across restarts. `any_rank`: what one rank alone sees (a hang) is written by
        that rank to a file of its own, which the main process folds in when it next starts."""
        if not self.enabled:
            if any_rank:
                write_event(self.rank_events_path, kind, step, message)
            return
        write_event(self.events_path, kind, step, message)
        self.print(f"[{kind}] {message}")

    def advance(self, steps: int = 1) -> None:
        """Move the progress bar (back, too, after a rollback)."""
        self.step += steps
        if self.bar is not None:
            self.bar.update(steps)

    def position(self) -> int:
        return self.step

    def print(self, message: str) -> None:
        if self.enabled:
            (self.bar.write if self.bar is not None else print)(message)

    def close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def read_metrics(output_dir: Path) -> list[dict]:
    path = Path(output_dir) / METRICS_FILE
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def tracked_config(cfg) -> dict:
    """The whole resolved config as the trackers take it: flat keys (`adapter.r`), plain values (lists
    and mappings as JSON text, since TensorBoard's hyperparameters take only scalars)."""
    from finetune.config.schema import flatten

    return {k: v if isinstance(v, (bool, int, float, str)) else json.dumps(v) for k, v in flatten(cfg.model_dump(mode="json")).items()}


def tracker_kwargs(logging, output_dir: Path) -> dict:
    """Each tracker's own names for the run's name, entity and tags (accelerate's init_kwargs)."""
    name = logging.run_name or Path(output_dir).resolve().name
    return {"wandb": {"name": name, "entity": logging.entity, "tags": logging.tags or None, "dir": os.environ.get("WANDB_DIR", str(output_dir))},
            "mlflow": {"run_name": name, "tags": dict.fromkeys(logging.tags, "") or None}}


# Guard and run events drawn on the loss curve: event -> (colour, line style).
EVENT_STYLES = {"skip": ("tab:red", ":"), "anomaly": ("tab:red", ":"), "rollback": ("tab:orange", "-"), "stop": ("black", "-"),
                "restart": ("tab:gray", "--"), "resize": ("tab:green", "--"), "preempted": ("tab:purple", "--"), "hang": ("tab:brown", "-.")}


def curve_data(output_dir: Path) -> dict:
    """What loss_curve.png shows: train loss, eval loss (and a preference run's eval reward accuracy) and learning rate per
    step, and the events with a step."""
    rows = read_metrics(output_dir)
    path = Path(output_dir) / EVENTS_FILE
    events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    return {"train": [(r["step"], r["loss"]) for r in rows if "loss" in r and math.isfinite(r["loss"])],
            "eval": [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r],
            "accuracy": [(r["step"], r["eval_reward_accuracy"]) for r in rows if "eval_reward_accuracy" in r],  # preference runs
            "lr": [(r["step"], r["lr"]) for r in rows if "lr" in r],
            "events": [(e["step"], e["event"]) for e in events if e.get("step") is not None and e.get("event") in EVENT_STYLES]}


def plot_loss_curve(output_dir: Path) -> Path | None:
    """loss_curve.png: training loss per step, eval loss as points, the learning rate on a second axis,
    and a vertical line at each guard or run event (skips, rollbacks, restarts, ...)."""
    data = curve_data(output_dir)
    if not data["train"]:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.2), dpi=110)
    ax.plot(*zip(*data["train"]), label="train loss", linewidth=1.2)
    if data["eval"]:
        ax.plot(*zip(*data["eval"]), "o-", label="eval loss", markersize=4)
    if data["accuracy"]:
        ax.plot(*zip(*data["accuracy"]), "s--", color="tab:purple", label="eval reward accuracy", markersize=4)
    seen = set()
    for step, kind in data["events"]:
        colour, style = EVENT_STYLES[kind]
        ax.axvline(step, color=colour, linestyle=style, linewidth=1, alpha=0.8, label=None if kind in seen else kind)
        seen.add(kind)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (per pair) / accuracy" if data["accuracy"] else "loss (per token)")
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if data["lr"]:
        lr_axis = ax.twinx()
        lr_axis.plot(*zip(*data["lr"]), color="tab:green", linewidth=1, alpha=0.7, label="learning rate")
        lr_axis.set_ylabel("learning rate")
        lr_axis.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
        more = lr_axis.get_legend_handles_labels()
        handles, labels = handles + more[0], labels + more[1]
    ax.legend(handles, labels, fontsize=8, loc="upper right")
    fig.tight_layout()
    out = Path(output_dir) / PLOT_FILE
    fig.savefig(out)
    plt.close(fig)
    return out


def summary_line(summary: dict) -> str:
    final = (f"final step's mean reward {summary['train_reward']:.4f}, KL {summary['train_kl']:.4g}" if "train_reward" in summary
             else f"final train loss {summary['train_loss']:.4f}")
    parts = [f"done: {summary['steps']} steps, {final}"]
    if "eval_loss" in summary:
        parts.append(f"eval reward {summary['eval_reward']:.4f}" if "eval_reward" in summary else f"eval loss {summary['eval_loss']:.4f}"
                     + (f" (ppl {summary['eval_ppl']:.2f})" if "eval_ppl" in summary else "")
                     + (f" (reward accuracy {summary['eval_reward_accuracy']:.1%})" if "eval_reward_accuracy" in summary else ""))
    parts.append(f"{summary['elapsed_s']:.1f} s")
    lines = [", ".join(parts)]
    if summary.get("loss_curve"):
        lines.append(f"loss curve: {summary['loss_curve']}")
    lines.append(f"saved to:   {summary['saved_to']}" + (f" (an adapter for {summary['base_model']})" if summary.get("adapter") else ""))
    return "\n".join(lines)
