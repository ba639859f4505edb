"""The training loop: AdamW + warmup/cosine, clipping, bf16 on GPU, DDP, checkpoints, resume.

A checkpoint holds the model, optimizer, scheduler, every process's RNG state, the data
position (batches drawn from each stream) and the running counters, so a resumed run
replays the same stream to the same place and continues exactly as an uninterrupted run.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pairforge.shards.labels import I2T, IMG, T2I
from pairforge.tokenizers.vocab import VocabLayout
from pairforge.train.config import OptimConfig, RunConfig, TrainConfig
from pairforge.train.data import (
    UNCONDITIONAL,
    Datasets,
    PositionedStream,
    StreamSpec,
    heldout_batches,
    model_layout,
    open_datasets,
    task_totals,
    train_batches,
)
from pairforge.train.evaluate import LossSums, autocast, evaluate, token_losses
from pairforge.train.model import Transformer
from pairforge.train.sequences import TASKS, Batch, Kind

CHECKPOINT = "checkpoint.pt"
REPORT = "report.json"
Log = Callable[[str], None]


# ---------------------------------------------------------------------------- processes
@dataclass(frozen=True)
class Dist:
    rank: int
    world: int
    device: torch.device
    precision: str

    @property
    def main(self) -> bool:
        return self.rank == 0


def setup_distributed(run: RunConfig) -> Dist:
    """One process, or one of WORLD_SIZE started by torchrun (gloo on CPU, nccl on GPU)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    cuda = run.device == "cuda" or (run.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda \
        else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if run.threads and not cuda:
        torch.set_num_threads(run.threads)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    precision = run.precision if run.precision != "auto" else ("bf16" if cuda else "fp32")
    return Dist(rank, world, device, precision)


def teardown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


# ---------------------------------------------------------------------------- optimizer
def make_optimizer(model: torch.nn.Module, o: OptimConfig) -> torch.optim.AdamW:
    """Weight decay on matrices and embeddings only, not on norms and biases."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": o.weight_decay},
              {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2))


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Linear warmup over warmup_steps, then cosine from 1 down to min_lr_ratio."""
    o, total = cfg.optim, cfg.run.steps
    if step < o.warmup_steps:
        return (step + 1) / o.warmup_steps
    progress = (step - o.warmup_steps) / max(1, total - o.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return o.min_lr_ratio + (1 - o.min_lr_ratio) * cosine


# ---------------------------------------------------------------------------- state
def _zero_counts() -> dict[str, dict[str, dict[str, int]]]:
    return {view: {t: {"samples": 0, "image_tokens": 0} for t in TASKS}
            for view in ("by_label", "as_trained")}


@dataclass
class State:
    """What a checkpoint must carry besides the model and optimizer."""

    step: int = 0
    positions: dict[str, int] = field(default_factory=dict)
    consumed: dict[str, dict[str, dict[str, int]]] = field(default_factory=_zero_counts)
    history: list[dict[str, Any]] = field(default_factory=list)


def count_consumed(state: State, batch: Batch) -> None:
    for label, task, n in zip(batch.labels, batch.tasks.tolist(), batch.image_tokens.tolist(),
                              strict=True):
        for view, name in (("by_label", label), ("as_trained", TASKS[task])):
            state.consumed[view][name]["samples"] += 1
            state.consumed[view][name]["image_tokens"] += n


def reduce_counts(consumed: dict[str, dict[str, dict[str, int]]]) -> dict:
    """Sum the consumed counters over processes (each counts its own batches)."""
    flat = [(v, t, k) for v in consumed for t in consumed[v] for k in consumed[v][t]]
    values = torch.tensor([consumed[v][t][k] for v, t, k in flat], dtype=torch.int64)
    if dist.is_initialized():
        dist.all_reduce(values)
    out = _zero_counts()
    for (v, t, k), value in zip(flat, values.tolist(), strict=True):
        out[v][t][k] = value
    return out


# ---------------------------------------------------------------------------- streams
def staged_switch(steps: int, datasets: Datasets) -> int:
    """Step at which the staged schedule moves from i2t/img to t2i: each stage gets steps in
    proportion to its samples, so each task sees about as many passes as in the mixed run."""
    totals = task_totals(datasets.train)
    samples = {t: totals.get(t, {}).get("samples", 0) for t in (T2I, I2T, IMG)}
    first = sum(samples[t] for t in UNCONDITIONAL)
    return round(steps * first / max(1, sum(samples.values())))


def make_streams(cfg: TrainConfig, datasets: Datasets, layout: VocabLayout, d: Dist,
                 positions: dict[str, int]) -> dict[str, PositionedStream]:
    resampled = cfg.data.resampled if cfg.data.resampled is not None else d.world > 1
    if cfg.data.epochs and (resampled or d.world > 1):
        raise ValueError("data.epochs needs one process and data.resampled off")
    base = StreamSpec([s.url for s in datasets.train], cfg.data, layout, cfg.run.recipe,
                      cfg.run.batch_size, cfg.run.seed, d.rank, d.world, resampled)
    specs = {"mixed": base} if cfg.run.schedule == "mixed" else {
        "stage1": StreamSpec(**{**base.__dict__, "labels": UNCONDITIONAL}),
        "stage2": StreamSpec(**{**base.__dict__, "labels": (T2I,)})}
    return {name: PositionedStream(lambda s=spec: train_batches(s), positions.get(name, 0))
            for name, spec in specs.items()}


def next_batch(streams: dict[str, PositionedStream], step: int, switch: int) -> Batch | None:
    """The batch for this step, or None when the data (data.epochs) is used up."""
    if "mixed" in streams:
        return next(streams["mixed"], None)
    if step < switch:
        batch = next(streams["stage1"], None)
        if batch is not None:
            return batch
    return next(streams["stage2"], None)


# ---------------------------------------------------------------------------- checkpoints
def _rng_states(d: Dist) -> list[Any]:
    state = {"cpu": torch.get_rng_state(),
             "cuda": torch.cuda.get_rng_state(d.device) if d.device.type == "cuda" else None}
    if d.world == 1:
        return [state]
    gathered: list[Any] = [None] * d.world
    dist.all_gather_object(gathered, state)
    return gathered


def save_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler: Any, state: State, window: LossSums, cfg: TrainConfig,
                    layout: VocabLayout, d: Dist) -> None:
    """Counters and the log window are summed over processes; rank 0 writes atomically."""
    rng = _rng_states(d)
    consumed = reduce_counts(state.consumed)
    window.all_reduce()
    data = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(), "step": state.step,
            "positions": state.positions, "consumed": consumed, "history": state.history,
            "window": window.state(), "rng": rng, "config": cfg.model_dump(mode="json"),
            "layout": layout.to_manifest()}
    # after the sums, rank 0 holds the totals and the others restart from zero
    state.consumed = consumed if d.main else _zero_counts()
    if not d.main:
        window.load({k: torch.zeros_like(v) for k, v in window.state().items()})
    if d.main:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save(data, tmp)
        os.replace(tmp, path)
    if dist.is_initialized():
        dist.barrier()


def load_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler: Any, window: LossSums, layout: VocabLayout, d: Dist) -> State:
    data = torch.load(path, map_location=d.device, weights_only=False)
    VocabLayout.from_manifest(data["layout"]).check_compatible(layout, "checkpoint", "config")
    model.load_state_dict(data["model"])
    optimizer.load_state_dict(data["optimizer"])
    scheduler.load_state_dict(data["scheduler"])
    rng = data["rng"][d.rank] if d.rank < len(data["rng"]) else data["rng"][0]
    torch.set_rng_state(rng["cpu"].cpu())
    if rng["cuda"] is not None and d.device.type == "cuda":
        torch.cuda.set_rng_state(rng["cuda"].cpu(), d.device)
    if d.main:
        window.load(data["window"])
    return State(data["step"], data["positions"],
                 data["consumed"] if d.main else _zero_counts(), data["history"])


# ---------------------------------------------------------------------------- report
def budget_report(consumed: dict, datasets: Datasets) -> dict[str, Any]:
    """Image tokens consumed per task against the manifest's totals for the train shards."""
    manifest = task_totals(datasets.train)
    out: dict[str, Any] = {"manifest_train_shards": manifest}
    for view in ("by_label", "as_trained"):
        out[view] = {t: {**c, "passes": (c["image_tokens"] / manifest[t]["image_tokens"]
                                         if view == "by_label" and manifest.get(t) else None)}
                     for t, c in consumed[view].items()}
    trained = consumed["as_trained"]
    total = sum(c["image_tokens"] for c in trained.values())
    uncond = trained[I2T]["image_tokens"] + trained[IMG]["image_tokens"]
    m_total = sum(c.get("image_tokens", 0) for c in manifest.values())
    m_uncond = sum(manifest.get(t, {}).get("image_tokens", 0) for t in UNCONDITIONAL)
    out.update({"image_tokens": total, "image_tokens_after_caption": total - uncond,
                "image_tokens_no_caption": uncond,
                "no_caption_share": uncond / total if total else None,
                "manifest_no_caption_share": m_uncond / m_total if m_total else None})
    return out


def log_line(entry: dict[str, Any], steps: int) -> str:
    def f(v: float | None) -> str:
        return "  -  " if v is None else f"{v:.3f}"

    t = entry["train"]
    line = (f"step {entry['step']}/{steps} lr {entry['lr']:.2e} loss {f(t['loss'])} | "
            f"L_I|T {f(t['L_I|T'])} L_I|0 {f(t['L_I|0'])} L_T|I {f(t['L_T|I'])}")
    if "heldout" in entry:
        h = entry["heldout"]
        line += (f" | held-out L_I|T {f(h['L_I|T'])} L_I|0 {f(h['L_I|0'])} "
                 f"L_T|I {f(h['L_T|I'])}")
    return line


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{secs:02d}" if minutes >= 60 else \
        f"{minutes}:{secs:02d}"


@dataclass
class Pace:
    """Speed since the previous log line, for the person watching (not in report.json:
    it says how busy the machine was, not what the run learned)."""

    last_step: int = 0
    started: float = field(default_factory=time.perf_counter)
    last_time: float = field(default_factory=time.perf_counter)
    tokens: Any = 0  # non-pad tokens since the last line, all processes (a device tensor)

    def line(self, step: int, steps: int) -> str:
        now = time.perf_counter()
        seconds = max(now - self.last_time, 1e-9)
        rate = (step - self.last_step) / seconds
        tokens = float(self.tokens) / seconds
        eta = (steps - step) / rate if rate > 0 else math.inf
        self.last_step, self.last_time, self.tokens = step, now, 0
        return (f" | {rate:.2f} steps/s {tokens:,.0f} tokens/s, elapsed "
                f"{_duration(now - self.started)}, ETA {_duration(eta)}")


# ---------------------------------------------------------------------------- loop
@dataclass
class Run:
    cfg: TrainConfig
    d: Dist
    datasets: Datasets
    layout: VocabLayout
    model: Transformer
    ddp: torch.nn.Module
    optimizer: torch.optim.AdamW
    scheduler: Any
    state: State
    window: LossSums
    out: Path
    log: Log
    pace: Pace = field(default_factory=Pace)
    quiet: bool = False  # no line per log_every steps (report.json still has them)

    def step(self, batch: Batch) -> None:
        batch = batch.to(self.d.device)
        with autocast(self.d.device, self.d.precision):
            logits = self.ddp(batch.inputs)
        losses = token_losses(logits, batch)
        n = (batch.kinds != Kind.PAD).sum().double()
        if dist.is_initialized():  # the global token mean: DDP averages over processes
            dist.all_reduce(n)
        loss = losses.sum() / n * self.d.world
        self.pace.tokens = self.pace.tokens + n.detach()  # read only when a line is logged
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.cfg.optim.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optim.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.window.add(losses, batch)
        count_consumed(self.state, batch)

    def heldout(self) -> dict[str, Any] | None:
        if not self.datasets.heldout:
            return None
        batches = heldout_batches([s.url for s in self.datasets.heldout], self.layout,
                                  self.cfg.run.batch_size, self.cfg.run.eval_batches,
                                  self.d.rank, self.d.world)
        return evaluate(self.model, batches, self.d.device, self.d.precision)

    def record(self, evaluate_now: bool) -> dict[str, Any]:
        entry = {"step": self.state.step, "lr": self.scheduler.get_last_lr()[0],
                 "train": self.window.all_reduce().summary()}
        self.window = LossSums(self.d.device)
        if evaluate_now and (held := self.heldout()) is not None:
            entry["heldout"] = held
        self.state.history.append(entry)
        if self.d.main and not self.quiet:
            self.log(log_line(entry, self.cfg.run.steps) + self.pace.line(
                self.state.step, self.cfg.run.steps))
        return entry

    def save(self) -> None:
        save_checkpoint(self.out / CHECKPOINT, self.model, self.optimizer, self.scheduler,
                        self.state, self.window, self.cfg, self.layout, self.d)


def build_run(cfg: TrainConfig, d: Dist, log: Log) -> Run:
    datasets = open_datasets(cfg.data)
    layout = model_layout(cfg.model.vocab, datasets, cfg.data.storage_options)
    torch.manual_seed(cfg.run.seed)  # the same initial weights on every process
    model = Transformer(cfg.model, layout.total_size).to(d.device)
    torch.manual_seed(cfg.run.seed * 1000 + d.rank)  # then per-process dropout streams
    optimizer = make_optimizer(model, cfg.optim)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg))
    window = LossSums(d.device)
    out = Path(cfg.run.out)
    state = State()
    if cfg.run.resume and (out / CHECKPOINT).exists():
        state = load_checkpoint(out / CHECKPOINT, model, optimizer, scheduler, window, layout, d)
        if d.main:
            log(f"resuming from {out / CHECKPOINT} at step {state.step}")
    ddp = model
    if d.world > 1:
        ids = [d.device.index] if d.device.type == "cuda" else None
        ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
    return Run(cfg, d, datasets, layout, model, ddp, optimizer, scheduler, state, window, out,
               log, Pace(last_step=state.step))


def run_loop(run: Run) -> str:
    """Train until run.steps (or the data or stop_after ends it); return why it stopped."""
    cfg, state = run.cfg.run, run.state
    switch = staged_switch(run.cfg.run.steps, run.datasets)
    streams = make_streams(run.cfg, run.datasets, run.layout, run.d, state.positions)
    while state.step < cfg.steps:
        batch = next_batch(streams, state.step, switch)
        if batch is None:
            return "data_exhausted"
        run.step(batch)
        state.step += 1
        state.positions = {name: s.position for name, s in streams.items()}
        if state.step % cfg.log_every == 0 and state.step < cfg.steps:
            run.record(bool(cfg.eval_every) and state.step % cfg.eval_every == 0)
        if cfg.checkpoint_every and state.step % cfg.checkpoint_every == 0:
            run.save()
        if cfg.stop_after and state.step >= cfg.stop_after and state.step < cfg.steps:
            return "stopped"
    return "finished"


def train(cfg: TrainConfig, log: Log = print, quiet: bool = False) -> dict[str, Any]:
    """Train as configured; write OUT/checkpoint.pt and OUT/report.json; return the report.
    ``quiet``: no progress line per ``log_every`` steps."""
    d = setup_distributed(cfg.run)
    try:
        started = time.perf_counter()
        run = build_run(cfg, d, log)
        run.quiet = quiet
        if d.main:
            log(f"model: {run.model.num_parameters():,} parameters, vocabulary "
                f"{run.layout.describe()}; {len(run.datasets.train)} train shards, "
                f"{len(run.datasets.heldout)} held out; {d.world} process(es) on "
                f"{d.device.type}, {d.precision}")
        status = run_loop(run)
        history = run.state.history
        if history and history[-1]["step"] == run.state.step:
            final = history[-1]  # already logged at this step (stop_after on a log step)
        else:
            final = run.record(evaluate_now=status != "stopped")
        run.save()
        report = make_report(run, status, final, time.perf_counter() - started)
        if d.main:
            (run.out / REPORT).write_text(json.dumps(report, indent=2))
            log(f"report → {run.out / REPORT}")
        return report
    finally:
        teardown_distributed()


def make_report(run: Run, status: str, final: dict[str, Any], seconds: float) -> dict[str, Any]:
    return {"status": status, "step": run.state.step, "steps": run.cfg.run.steps,
            "world_size": run.d.world, "device": run.d.device.type,
            "precision": run.d.precision, "recipe": run.cfg.run.recipe,
            "schedule": run.cfg.run.schedule, "parameters": run.model.num_parameters(),
            "vocab": run.layout.to_manifest(),
            "train_shards": [s.name for s in run.datasets.train],
            "heldout_shards": [s.name for s in run.datasets.heldout],
            "final": {"train": final["train"], "heldout": final.get("heldout")},
            "budget": budget_report(reduce_counts(run.state.consumed), run.datasets),
            "history": run.state.history, "seconds": round(seconds, 2),
            "config": run.cfg.model_dump(mode="json")}
