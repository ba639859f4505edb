"""Image classifiers in stage 3 (issue 21): the classifier step against a bare transformers
loop, and what a clip-head classifier adds to the CLIP step.

    python bench/classifiers.py [--images 48] [--batch-size 16] [--vit base] \
        [--threads 2] [--pool-size 2 --stage-threads 1] [--heads-only | --step-only] \
        [--interleave] [--repeats 2]

- step: a ViT image classifier (``--vit base``: the architecture of
  Falconsai/nsfw_image_detection, ViT-B/16 at 224 px; ``small``: ViT-S/16) with random
  weights (no hub; the compute does not depend on them), saved with save_pretrained and
  loaded by path. bare: one process, AutoImageProcessor + AutoModelForImageClassification,
  decode + preprocess + forward + softmax per batch, timed from model loading to the last
  score. stage: `run_process` with only the classifier step, timed from the call.
  Both run on N, 2N, 3N images; the steady-state ratio is what a long build sees
  (bench/stage_step.py).
- heads: the CLIP step alone (score_only) against the CLIP step plus a clip-head
  classifier (LAION's aesthetic-predictor layout over ViT-B-32's 512-dim embeddings), on
  the same raw shards; the manifest's per-step seconds show what each step costs per
  image. A head that encoded the images again would cost about as much as CLIP.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from common import TreeSampler, arg_parser
from stage_step import (
    add_stage_args,
    cleared,
    compare,
    decode,
    make_raw,
    pool_label,
    pool_section,
    raw_images,
    stage_seconds,
)

VITS = {"base": {},  # ViTConfig's defaults are ViT-B/16 at 224 px
        "small": {"hidden_size": 384, "num_attention_heads": 6, "intermediate_size": 1536}}


def save_vit(folder: Path, size: str) -> str:
    """A random-weight ViT image classifier with labels normal / nsfw, saved by path."""
    import torch
    from transformers import ViTConfig, ViTForImageClassification, ViTImageProcessor

    torch.manual_seed(0)
    config = ViTConfig(**VITS[size], id2label={0: "normal", 1: "nsfw"},
                       label2id={"normal": 0, "nsfw": 1})
    ViTForImageClassification(config).save_pretrained(folder)
    ViTImageProcessor().save_pretrained(folder)
    return str(folder)


def bare_loop(raw: Path, model: str, batch_size: int, threads: int) -> tuple[float, int]:
    import torch
    from transformers import AutoImageProcessor, AutoModelForImageClassification

    torch.set_num_threads(threads)
    samples = raw_images(raw)
    start = time.perf_counter()
    processor = AutoImageProcessor.from_pretrained(model)
    net = AutoModelForImageClassification.from_pretrained(model).eval()
    for i in range(0, len(samples), batch_size):
        images = [decode(data) for data, _ in samples[i:i + batch_size]]
        pixels = processor(images=images, return_tensors="pt")["pixel_values"]
        with torch.inference_mode():
            net(pixel_values=pixels).logits.float().softmax(-1)[:, 1].numpy()
    return time.perf_counter() - start, len(samples)


def step_vs_bare(args: argparse.Namespace, model: str) -> None:
    entry = {"name": "nsfw", "backend": "transformers", "model": model, "label": "nsfw",
             "batch_size": args.batch_size, **pool_section(args)}
    label = (f"classifier step, ViT-{args.vit}/16 224 px (random weights, fp32), batch "
             f"{args.batch_size}; {pool_label(args)}")
    bare = lambda raw: bare_loop(raw, model, args.batch_size, args.threads)  # noqa: E731
    if args.interleave:
        interleaved(args.images, bare, {"classifiers": [entry]}, label, args.multiples,
                    args.repeats)
    else:
        compare(args.images, bare, {"classifiers": [entry]}, label,
                multiples=args.multiples, repeats=args.repeats)


def interleaved(n: int, bare, process: dict, label: str, multiples: int,  # noqa: ANN001
                repeats: int) -> None:
    """compare()'s measurement with the bare and stage runs alternating (bare, stage, bare,
    stage ...) instead of all bare runs first: on a machine whose load from other users
    drifts over minutes, both sides then see the same load. Also prints the seconds per
    image inside the step's process() (the manifest's step stats) of the largest run."""
    from stage_step import _fit

    from pairforge.config import RayConfig
    from pairforge.pipeline.ray_runtime import init_ray

    sizes = [n * k for k in range(1, multiples + 1)]
    with tempfile.TemporaryDirectory() as tmp:
        outs = {size: Path(tmp) / f"out{size}" for size in (n // 2, *sizes)}
        for size, out in outs.items():
            make_raw(out, size)
        init_ray(RayConfig())
        warm = outs.pop(n // 2)
        bare(warm / "raw")
        stage_seconds(warm, process)
        bares: dict[int, list] = {size: [] for size in sizes}
        stages: dict[int, list] = {size: [] for size in sizes}
        cpu: dict[str, dict[int, list]] = {"bare": {s: [] for s in sizes},
                                           "stage": {s: [] for s in sizes}}
        for _ in range(repeats):
            for size, out in outs.items():
                started = time.process_time()  # this process and its torch threads
                bares[size].append(bare(out / "raw"))
                cpu["bare"][size].append(time.process_time() - started)
                run, stage_cpu = tree_cpu(lambda o=out: stage_seconds(cleared(o), process))
                stages[size].append(run)
                cpu["stage"][size].append(stage_cpu)
        steps = json.loads((outs[sizes[-1]] / "manifest.json").read_text())["steps"]
    print(label + " (bare and stage runs interleaved)")
    # (seconds, images): the fastest run of each; other work only ever slows one
    best = {size: (min(bares[size]), min(stages[size])) for size in sizes}
    for size, ((bare_s, bare_n), (stage_s, stage_n)) in best.items():
        print(f"  {size:5d} images: bare {bare_s:6.1f} s = {bare_n / bare_s:7.2f} images/s, "
              f"stage {stage_s:6.1f} s = {stage_n / stage_s:7.2f} images/s, "
              f"ratio {(stage_n / stage_s) / (bare_n / bare_s):.2f}x")
    bare_rate, bare_fixed = _fit([best[s][0] for s in sizes])
    stage_rate, stage_fixed = _fit([best[s][1] for s in sizes])
    print(f"  steady state (fit over {len(sizes)} sizes, best of {repeats}): bare "
          f"{bare_rate:.2f} images/s + {bare_fixed:.1f} s fixed, stage {stage_rate:.2f} "
          f"images/s + {stage_fixed:.1f} s fixed; ratio stage/bare = "
          f"{stage_rate / bare_rate:.2f}x")
    # CPU seconds per image: the slope of CPU seconds against images, each side's least
    # CPU per size. A loaded machine stretches wall time; CPU time much less.
    rates = {side: _fit([(min(runs[s]), s) for s in sizes])[0] for side, runs in cpu.items()}
    print(f"  CPU per image (fit, least of {repeats}): bare {1e3 / rates['bare']:.0f} ms "
          f"(this process), stage {1e3 / rates['stage']:.0f} ms (driver, Ray and every "
          f"worker and actor); ratio bare/stage = {rates['stage'] / rates['bare']:.2f}x")
    for size in sizes:
        print(f"    {size:5d} images: CPU bare {min(cpu['bare'][size]):6.1f} s, stage "
              f"{min(cpu['stage'][size]):6.1f} s")
    step = steps["classifier.nsfw"]
    print(f"  inside the step's process() at {sizes[-1]} images (last run): "
          f"{step['seconds'] / step['rows_in'] * 1e3:.1f} ms per image per actor", flush=True)


def tree_cpu(run) -> tuple[float, float]:  # noqa: ANN001
    """(result of ``run``, CPU seconds this process and all its descendants (Ray's daemons,
    workers and actors) spent while it ran)."""
    with TreeSampler(os.getpid(), 0.25) as sampler:  # reading /proc costs CPU too
        before = {pid: proc.cpu_s for pid, proc in sampler.procs.items()}
        result = run()
        sampler.sample()
    spent = sum(p.cpu_s - before.get(pid, 0.0) for pid, p in sampler.procs.items())
    return result, spent


def save_aesthetic_head(path: Path, dim: int) -> None:
    """LAION's improved aesthetic predictor layout (layers.0 ... layers.7), random weights."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(dim, 1024), nn.Dropout(0.2), nn.Linear(1024, 128),
                           nn.Dropout(0.2), nn.Linear(128, 64), nn.Dropout(0.1),
                           nn.Linear(64, 16), nn.Linear(16, 1))
    torch.save({f"layers.{k}": v for k, v in layers.state_dict().items()}, path)


def heads(args: argparse.Namespace, folder: Path) -> None:
    """CLIP alone vs CLIP + a clip-head classifier: whole-run seconds and per-step seconds
    per image from the manifest (best of --repeats)."""
    from pairforge.config import RayConfig
    from pairforge.pipeline.ray_runtime import init_ray

    head = folder / "aesthetic.pth"
    save_aesthetic_head(head, 512)
    n = args.images * args.multiples
    out = folder / f"heads{n}"
    make_raw(out, n)
    clip = {"enabled": True, "model": "ViT-B-32", "pretrained": None, "mode": "score_only",
            "batch_size": args.batch_size, **pool_section(args)}
    aesthetic = {"name": "aesthetic", "backend": "clip-head", "path": str(head),
                 "batch_size": args.batch_size, "pool_size": 1, "num_cpus": 0.1}
    init_ray(RayConfig())
    stage_seconds(cleared(out), {"clip": clip})  # warm-up: workers have imported torch
    print(f"clip-head: ViT-B-32 CLIP (random weights, fp32), {n} images, batch "
          f"{args.batch_size}; {pool_label(args)}")
    for label, process in (("CLIP only", {"clip": clip}),
                           ("CLIP + aesthetic head", {"clip": clip,
                                                      "classifiers": [aesthetic]})):
        best = min((_run(out, process) for _ in range(args.repeats)), key=lambda r: r[0])
        seconds, ok, steps = best
        per_step = ", ".join(f"{name} {s['seconds'] / max(s['rows_in'], 1) * 1e3:.2f} ms"
                             for name, s in steps.items() if name != "caption")
        print(f"  {label:22s}: {seconds:6.1f} s = {ok / seconds:6.2f} images/s; per image "
              f"in process(): {per_step}", flush=True)


def _run(out: Path, process: dict) -> tuple[float, int, dict]:
    seconds, ok = stage_seconds(cleared(out), process)
    steps = json.loads((out / "manifest.json").read_text())["steps"]
    return seconds, ok, steps


def main() -> None:
    parser = arg_parser(__doc__)
    parser.add_argument("--images", type=int, default=48)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--vit", choices=sorted(VITS), default="base")
    parser.add_argument("--heads-only", action="store_true")
    parser.add_argument("--step-only", action="store_true")
    parser.add_argument("--interleave", action="store_true",
                        help="alternate bare and stage runs (a machine with drifting load)")
    add_stage_args(parser)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if not args.heads_only:
            step_vs_bare(args, save_vit(Path(tmp) / "vit", args.vit))
        if not args.step_only:
            heads(args, Path(tmp))


if __name__ == "__main__":
    main()
