"""Proof that the shards matter: the caption and recipe ablations through the real pipeline.

The scene world (pairforge/scenes) is served over loopback HTTP (127.0.0.1 only) with web
alt-text (a share of captions wrong, plus junk); `pairforge build` downloads, dedups,
recaptions with the world's captioner (pairforge/sample/captioner), tokenizes with the
world's VQ (pairforge/sample/vq32) and a BPE trained on the world's captions, and labels
t2i/i2t; `pairforge train` trains the same small model per arm; each run then draws the
held-out prompts with classifier-free guidance and captions held-out images, and the judge
scores both (pairforge/scenes/evaluate.py, the code behind `pairforge eval`).

Arms, all on the same image-token budget (samples seen, as DataComp fixes it), and on
the same images except the filtered arm:
  captions  noisy alt-text (tasks.caption original) / recaptioned / oracle (exact captions)
            / clip-top30: the alt-text filtered at DataComp's recipe, the top 30 % by the
            world CLIP's score of the alt-text (process.clip mode top_fraction), so ~30 % of
            the images seen ~3x as often / mixed-80-20: the recaption for a seeded 80 % of
            rows and the alt-text for the rest, as Recap-CLIP (tasks.caption mix,
            recaption_share 0.8; a junk alt-text drawn falls back to the recaption)
            No image-based arm (DataComp's step, intersected with the CLIP filter, keeps
            the pool's images whose embedding clusters near ImageNet's): every image of the
            world is drawn from the evaluation's own distribution, so the step's target is
            either the training scenes (it keeps every cluster: the CLIP arm again) or the
            held-out ones (it selects on the test set); see bench/RESULTS.md.
  recipe    replacement vs baseline at p_drop 0.3 (and 0.1), mixed vs staged
  plot      adherence against the alt-text corruption share 0, 0.25, 0.5, 0.75

    python bench/ablation.py --quick --json /tmp/ablation.json   # one seed, caption arms,
                                                # 3,000 scenes, a 2-layer model, 600 steps
    python bench/ablation.py --json /tmp/ablation.json           # every arm, 3 seeds, plot
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))  # when a test loads this by path
from common import SAMPLE, arg_parser, pairforge_cli  # noqa: E402

PLOT = Path(__file__).resolve().parent / "ablation_corruption.png"
SIDE = 32
LOSSES = ("L_I|T", "L_I|0", "L_T|I", "L_T")


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


# ---------------------------------------------------------------------------- the world
def write_site(work: Path, n_train: int, n_held: int) -> tuple[list, list]:
    """Render the training and held-out scenes as PNGs under work/site/img."""
    from pairforge.scenes.world import render, scenes

    train, held = scenes(n_train, "train"), scenes(n_held, "heldout")
    folder = work / "site" / "img"
    folder.mkdir(parents=True, exist_ok=True)
    for name, group in (("t", train), ("h", held)):
        for i, s in enumerate(group):
            path = folder / f"{name}{i:05d}.png"
            if not path.exists():
                render(s, SIDE).save(path)
    return train, held


def write_input(work: Path, base_url: str, train: list, held: list, share: float,
                junk: float) -> Path:
    """url,caption rows: training scenes with alt-text at ``share`` corruption (``junk`` of
    them web junk), then the held-out scenes (exact captions; they fill the last shard,
    held out by the trainer)."""
    from pairforge.scenes.corrupt import alt_texts

    path = work / f"input_share{share}_junk{junk}.csv"
    texts = alt_texts(train, share, junk=junk)
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["url", "caption"])
        out.writerows([f"{base_url}/img/t{i:05d}.png", text] for i, text in enumerate(texts))
        out.writerows([f"{base_url}/img/h{i:05d}.png", s.sentence] for i, s in enumerate(held))
    return path


def train_text_tokenizer(work: Path, train: list) -> Path:
    from pairforge.tokenizers.text import train_bpe

    out = work / "text"
    if not (out / "tokenizer.json").exists():
        train_bpe([s.sentence for s in train], out, vocab_size=400, min_frequency=2)
    return out


# ---------------------------------------------------------------------------- builds
class Build(NamedTuple):
    """One build of the world: the alt-text's wrong share, whether it recaptions, the
    t2i/i2t p_drop, and optionally the training caption (tasks.caption; default recaption
    when recaptioning, else original) with its mix share, and a CLIP filter keeping the
    top ``clip_top`` of the scored rows by the world CLIP."""

    share: float
    recaption: bool
    p_drop: float
    caption: str | None = None
    recaption_share: float | None = None
    clip_top: float | None = None


def clip_filter(top: float) -> dict[str, Any]:
    """process.clip: DataComp's CLIP-score filter with the world CLIP (examples/demo.yaml)."""
    clip = SAMPLE / "clip"
    return {"enabled": True, "model": "pf-scenes-clip",
            "pretrained": str(clip / "clip.safetensors"),
            "model_config_path": str(clip / "pf-scenes-clip.json"), "batch_size": 256,
            "mode": "top_fraction", "top_fraction": top}


def build(work: Path, name: str, table: Path, spec: Build, shard_size: int,
          text: Path) -> tuple[Path, float]:
    out = work / "builds" / name
    if (out / "manifest.json").exists():
        return out, 0.0
    config = build_config(work, out, table, spec, shard_size, text)
    out.mkdir(parents=True, exist_ok=True)
    (out.parent / f"{name}.yaml").write_text(yaml.safe_dump(config))
    started = time.perf_counter()
    pairforge_cli("build", str(out.parent / f"{name}.yaml"), "-q")
    return out, time.perf_counter() - started


def build_config(work: Path, out: Path, table: Path, spec: Build, shard_size: int,
                 text: Path) -> dict[str, Any]:
    """The build's config; the keys a Build leaves unset are not written, so the caption
    arms' configs (and their digests) stay those of the recorded runs."""
    recaption = spec.recaption
    tasks: dict[str, Any] = {"p_drop": spec.p_drop, "caption": spec.caption or (
        "recaption" if recaption else "original")}
    if spec.recaption_share is not None:
        tasks["recaption_share"] = spec.recaption_share
    config = {
        "input": {"path": str(table), "format": "csv", "shard_size": shard_size},
        "output": {"path": str(out)},
        "ray": {"num_cpus": 2},
        # off: the arms compare captions on the same images, and dedup (as in the demo)
        # would drop renders of the same scene a fraction of a pixel apart
        "dedup": {"enabled": False},
        "download": {"threads": 8, "timeout": 10, "allow_addresses": ["127.0.0.1/32"],
                     "image": {"resize_mode": "keep_ratio", "image_size": SIDE,
                               "encode_format": "png"}},
        "process": {
            # keep every row: arms must train on the same images (junk alt-text included)
            "basic": {"min_image_side": SIDE, "min_caption_words": 0, "min_caption_chars": 0},
            "recaption": {"enabled": recaption, "model": str(SAMPLE / "captioner"),
                          "batch_size": 64, "max_new_tokens": 24, "prompt_mode": "none",
                          "grounding": {"enabled": False},
                          "cache": {"path": str(work / "recaption_cache")}},
            "tokenize": {"enabled": True, "batch_size": 64,
                         "image": {"backend": "pairforge-vq", "path_or_id": str(SAMPLE / "vq32")},
                         "text": {"backend": "hf", "path_or_id": str(text)}},
            "tasks": tasks}}
    if spec.clip_top is not None:
        config["process"]["clip"] = clip_filter(spec.clip_top)
    return config


def caption_quality(out: Path, train: list) -> dict[str, Any]:
    """Rows kept, the training rows (images) kept and where their captions came from, and
    the share of training captions stating their scene exactly."""
    import pyarrow.parquet as pq

    from pairforge.scenes.world import parse_caption

    rows = [r for f in sorted((out / "shards").glob("*.parquet"))
            for r in pq.read_table(f).to_pylist()]
    ok = [r for r in rows if r["status"] == "ok" and "/img/t" in r["url"]]
    right = 0
    for r in ok:
        text = r["recaption"] if r.get("caption_source") == "recaption" else r["caption"]
        truth = train[int(r["url"].rsplit("/t", 1)[1][:5])]
        right += parse_caption(text or "") == truth.attributes()
    sources = Counter(r.get("caption_source") or "none" for r in ok)
    return {"rows": len(rows), "ok_train_rows": len(ok),
            "caption_sources": dict(sorted(sources.items())),
            "training_caption_exact": right / max(1, len(ok))}


# ---------------------------------------------------------------------------- runs
def train_run(work: Path, shards: Path, name: str, recipe: str, schedule: str, seed: int,
              args: argparse.Namespace) -> dict[str, Any]:
    out = work / "runs" / f"{name}-s{seed}"
    if not (out / "report.json").exists():
        cfg = {"data": {"path": str(shards), "heldout_shards": 1, "shuffle_buffer": 256,
                        "bucket_batches": 4},
               "model": {"d_model": args.d_model, "n_layers": args.layers, "n_heads": 4,
                         "max_seq_len": 128},
               "optim": {"lr": args.lr, "warmup_steps": 30, "weight_decay": 0.05},
               "run": {"out": str(out), "steps": args.steps, "batch_size": args.batch_size,
                       "seed": seed, "recipe": recipe, "schedule": schedule,
                       "log_every": 100, "resume": False, "threads": args.threads}}
        out.mkdir(parents=True, exist_ok=True)
        (out / "train.yaml").write_text(yaml.safe_dump(cfg))
        pairforge_cli("train", str(out / "train.yaml"))
    report = json.loads((out / "report.json").read_text())
    return {"run": str(out), "report": report}


def passes(report: dict[str, Any]) -> float:
    """How many times the run saw its training shards: image tokens trained over the image
    tokens the train shards hold (every arm trains the same steps, so a filtered arm sees
    its fewer images more often)."""
    budget = report["budget"]
    held = sum(t.get("image_tokens", 0) for t in budget["manifest_train_shards"].values())
    return budget["image_tokens"] / held


def measure(run: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The run's measures, kept beside it (measured.json) for as long as the measuring
    settings stay the same, so a rerun with more arms measures only the new runs."""
    saved = Path(run["run"]) / "measured.json"
    settings = {"prompts": args.prompts, "cfg_scales": args.cfg_scales}
    if saved.exists() and (kept := json.loads(saved.read_text()))["settings"] == settings:
        return kept["measures"]
    measures = _measure(run, args)
    saved.write_text(json.dumps({"settings": settings, "measures": measures}))
    return measures


def _measure(run: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    from pairforge.scenes.evaluate import evaluate_run

    result = evaluate_run(run["run"], prompts=args.prompts, captions=args.prompts,
                          cfg_scale=args.cfg_scales, seed=0,
                          sheet=Path(run["run"]) / "adherence.png")
    held = run["report"]["final"]["heldout"]
    a, c = result["adherence"], result["caption_accuracy"]
    return {**{k: held[k] for k in LOSSES}, "adherence": a["all"],
            "adherence_colour_shape": a["colour+shape"], "cfg_scale": a["cfg_scale"],
            "validation_adherence_by_scale": a["validation_by_scale"],
            "adherence_per_attribute": {k: a[k] for k in
                                        ("count", "colour", "shape", "size", "position",
                                         "background")},
            "caption_accuracy": c["all"],
            "caption_accuracy_per_attribute": {k: c[k] for k in
                                               ("colour", "shape", "size", "position",
                                                "background")},
            "image_tokens": run["report"]["budget"]["image_tokens"],
            "no_caption_share": run["report"]["budget"]["no_caption_share"],
            "train_seconds": run["report"]["seconds"],
            "examples": a["examples"][:4], "caption_examples": c["examples"][:4]}


def summarise(per_seed: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean of every number (nested dicts too), its std over seeds, and the seeds' values."""
    def mean_std(values: list[float]) -> tuple[float, float]:
        return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0

    out: dict[str, Any] = {"seeds": len(per_seed), "std": {}}
    for key, first in per_seed[0].items():
        if isinstance(first, int | float) and not isinstance(first, bool):
            out[key], out["std"][key] = mean_std([r[key] for r in per_seed])
        elif isinstance(first, dict):
            out[key] = {k: mean_std([r[key][k] for r in per_seed])[0] for k in first}
            out["std"][key] = {k: mean_std([r[key][k] for r in per_seed])[1] for k in first}
        else:
            out[key] = first
    return out


# ---------------------------------------------------------------------------- report
def fmt(arm: dict[str, Any], key: str) -> str:
    return f"{arm[key]:.3f} ± {arm['std'][key]:.3f}"


def colour(arm: dict[str, Any]) -> str:
    per, std = arm["adherence_per_attribute"], arm["std"]["adherence_per_attribute"]
    return f"{per['colour']:.3f} ± {std['colour']:.3f}"


def table(result: dict[str, Any]) -> str:
    head = ("| arm | seeds | adherence (all) | colour+shape | colour | guidance per seed | "
            "L_I\\|T | L_I\\|∅ | L_T\\|I | L_T | caption accuracy | training captions exact | "
            "training images | passes |")
    lines = [head, "|" + "---|" * 14]
    for group in ("arms", "recipe"):
        for name, arm in result[group].items():
            lines.append(f"| {group}/{name} | {arm['seeds']} | {fmt(arm, 'adherence')} | "
                         f"{fmt(arm, 'adherence_colour_shape')} | {colour(arm)} | "
                         f"{' / '.join(f'{c:g}' for c in arm['cfg_scale_per_seed'])} | "
                         + " | ".join(fmt(arm, k) for k in LOSSES)
                         + f" | {fmt(arm, 'caption_accuracy')} | "
                         f"{arm.get('training_caption_exact', float('nan')):.3f} | "
                         f"{arm.get('training_images', '-')} | {arm.get('passes', 0):.1f} |")
    return "\n".join(lines)


def plot(corruption: dict[str, Any], recaption: dict[str, Any] | None, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shares = sorted(float(s) for s in corruption)
    means = [corruption[str(s)]["adherence"] for s in shares]
    stds = [corruption[str(s)]["std"]["adherence"] for s in shares]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.errorbar(shares, means, yerr=stds, marker="o", capsize=3, label="alt-text captions")
    if recaption:
        ax.errorbar([0.5], [recaption["adherence"]], yerr=[recaption["std"]["adherence"]],
                    marker="s", color="C2", capsize=3, label="recaptioned (alt-text 0.5)")
    ax.set_xlabel("share of wrong alt-text")
    ax.set_ylabel("prompt adherence (all attributes)")
    ax.set_title("Scene world: adherence vs caption corruption")
    ax.set_ylim(0, 1)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ---------------------------------------------------------------------------- main
# Defaults of a full run and of --quick. Adherence with every attribute right needs the full
# model trained ~10 passes over 10,000 scenes (RESULTS.md); the quick profile's model shows
# the direction per attribute (colour, position, background) and in the recipe's losses.
FULL = {"seeds": 3, "train": 10000, "heldout": 1000, "prompts": 200, "steps": 3000,
        "d_model": 128, "layers": 3}
QUICK = {"seeds": 1, "train": 3000, "heldout": 500, "prompts": 100, "steps": 600,
         "d_model": 96, "layers": 2}


def with_profile(args: argparse.Namespace) -> argparse.Namespace:
    """Fill every setting left unset from the quick or the full profile."""
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def plan(quick: bool) -> tuple[dict[str, Build], dict]:
    """builds: name -> Build; runs: group/arm -> (build, recipe, schedule)."""
    builds = {"noisy": Build(0.5, False, 0.3), "recaption": Build(0.5, True, 0.3),
              "oracle": Build(0.0, False, 0.3)}
    runs = {"arms/noisy": ("noisy", "replacement", "mixed"),
            "arms/recaption": ("recaption", "replacement", "mixed"),
            "arms/oracle": ("oracle", "replacement", "mixed"),
            "recipe/replacement": ("recaption", "replacement", "mixed"),
            "recipe/baseline": ("recaption", "baseline", "mixed")}
    if not quick:
        builds |= {"recaption-p0.1": Build(0.5, True, 0.1),
                   "share0.25": Build(0.25, False, 0.3), "share0.75": Build(0.75, False, 0.3),
                   "clip-top30": Build(0.5, False, 0.3, clip_top=0.3),
                   "mixed-80-20": Build(0.5, True, 0.3, caption="mix", recaption_share=0.8)}
        runs |= {"arms/clip-top30": ("clip-top30", "replacement", "mixed"),
                 "arms/mixed-80-20": ("mixed-80-20", "replacement", "mixed"),
                 "recipe/replacement-p0.1": ("recaption-p0.1", "replacement", "mixed"),
                 "recipe/baseline-p0.1": ("recaption-p0.1", "baseline", "mixed"),
                 "recipe/staged": ("recaption", "replacement", "staged"),
                 "corruption/0.25": ("share0.25", "replacement", "mixed"),
                 "corruption/0.75": ("share0.75", "replacement", "mixed")}
    return builds, runs


def without(builds: dict, runs: dict, skip: set[str],
            only: set[str] | None = None) -> tuple[dict, dict]:
    """The plan less the skipped arms (and those not in ``only``, when given) and the builds
    only they used."""
    runs = {key: run for key, run in runs.items()
            if key not in skip and (not only or key in only)}
    return {name: b for name, b in builds.items() if any(r[0] == name for r in runs.values())}, runs


def main() -> None:
    parser = arg_parser(__doc__)
    parser.add_argument("--quick", action="store_true", help="one seed, caption and "
                        "p_drop 0.3 recipe arms only, a smaller world and model (no plot)")
    parser.add_argument("--seeds", type=int, help="runs per arm")
    parser.add_argument("--work", type=Path, help="where builds and runs go (reused)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--train", type=int, help="training scenes")
    parser.add_argument("--heldout", type=int, help="held-out shard scenes")
    parser.add_argument("--prompts", type=int, help="held-out prompts / captions per run")
    parser.add_argument("--steps", type=int, help="optimizer steps per run")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--d-model", type=int)
    parser.add_argument("--layers", type=int)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--cfg-scales", default="1.0,1.5,3.0",
                        help="guidance scales; each run uses the one with the best adherence "
                             "on separate validation prompts")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads per training run")
    parser.add_argument("--one-seed", default="", help="arms run at one seed only, "
                        "comma-separated, to fit a time budget (the table says each arm's seeds)")
    parser.add_argument("--skip", default="", help="arms not to run, comma-separated "
                        "(e.g. recipe/baseline-p0.1); the plot needs arms/ and corruption/")
    parser.add_argument("--only", default="", help="run only these arms, comma-separated "
                        "(e.g. arms/clip-top30,arms/recaption)")
    parser.add_argument("--junk", type=float, default=0.02,
                        help="share of the training alt-text that is web junk (empty, a file "
                        "name, boilerplate); 0.02 made the recorded figures, the demo's "
                        "world uses 0.2")
    parser.add_argument("--parallel", type=int, default=2,
                        help="training runs at once (2 x 1 thread beats 1 x 2 on 2 cores)")
    args = with_profile(parser.parse_args())
    args.cfg_scales = [float(x) for x in args.cfg_scales.split(",")]
    args.skip = {arm for arm in args.skip.split(",") if arm}
    args.only = {arm for arm in args.only.split(",") if arm}
    unknown = (args.skip | args.only) - set(plan(quick=False)[1])
    if unknown:  # a misspelt arm would silently run (--skip) or run nothing (--only)
        parser.error(f"no such arm: {', '.join(sorted(unknown))}")
    args.one_seed = {arm for arm in args.one_seed.split(",") if arm}
    work = args.work or Path(tempfile.mkdtemp(prefix="pairforge-ablation-"))
    import torch

    torch.set_num_threads(args.threads)  # sampling and judging in this process
    started = time.perf_counter()
    result = run_all(work, args)
    result["seconds"] = round(time.perf_counter() - started, 1)
    result["settings"] = {k: str(v) if isinstance(v, Path) else sorted(v) if isinstance(v, set)
                          else v for k, v in vars(args).items()}
    log(f"done in {result['seconds']:.0f} s; work folder {work}")
    print(table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


def train_and_measure(work: Path, built: dict[str, Any], jobs: list[tuple],
                      args: argparse.Namespace) -> dict[tuple, dict[str, Any]]:
    """Each job (build, recipe, schedule, seed) trained in its own process, ``--parallel``
    at once, and measured here as soon as it is trained, one measure at a time: a slot
    measures instead of training, so no more than ``--parallel`` runs use the CPU, and
    every finished run is measured (measured.json) even if a later one fails."""
    one_at_a_time = threading.Lock()

    def job_done(job: tuple) -> dict[str, Any]:
        name, recipe, schedule, seed = job
        run = train_run(work, built[name]["path"], "-".join(job[:3]), recipe, schedule,
                        seed, args)
        with one_at_a_time:
            return {**measure(run, args), "passes": passes(run["report"])}

    with ThreadPoolExecutor(args.parallel) as pool:  # each training run is its own process
        return dict(zip(jobs, pool.map(job_done, jobs), strict=True))


def run_all(work: Path, args: argparse.Namespace) -> dict[str, Any]:
    from pairforge.download.folder_server import serve_directory

    train, held = write_site(work, args.train, args.heldout)
    text = train_text_tokenizer(work, train)
    builds, runs = without(*plan(args.quick), args.skip, args.only)
    shard_size = args.heldout  # the held-out scenes fill exactly the last shard
    if args.train % shard_size:
        raise SystemExit(f"--train ({args.train}) must be a multiple of --heldout ({shard_size})")
    built: dict[str, Any] = {}
    with serve_directory(work / "site") as base_url:
        for name, spec in builds.items():
            table_path = write_input(work, base_url, train, held, spec.share, args.junk)
            out, seconds = build(work, name, table_path, spec, shard_size, text)
            built[name] = {"path": out, "seconds": round(seconds, 1),
                           **caption_quality(out, train)}
            log(f"build {name}: {seconds:.0f} s, {built[name]['ok_train_rows']} training rows "
                f"({built[name]['caption_sources']}), training captions exact "
                f"{built[name]['training_caption_exact']:.3f}")
    result: dict[str, Any] = {"arms": {}, "recipe": {}, "corruption": {},
                              "builds": {k: {**v, "path": str(v["path"])}
                                         for k, v in built.items()}}
    seeds = {key: 1 if key in args.one_seed else args.seeds for key in runs}
    # in the plan's order (an arm's seeds side by side); arms sharing a run train it once
    jobs = list(dict.fromkeys((name, recipe, schedule, seed)
                              for key, (name, recipe, schedule) in runs.items()
                              for seed in range(seeds[key])))
    measured = train_and_measure(work, built, jobs, args)
    for key, (name, recipe, schedule) in runs.items():
        per_seed = [measured[(name, recipe, schedule, seed)] for seed in range(seeds[key])]
        for seed, m in enumerate(per_seed):
            log(f"{key} seed {seed}: adherence {m['adherence']:.3f} (guidance "
                f"{m['cfg_scale']}), caption accuracy {m['caption_accuracy']:.3f}, L_T|I "
                f"{m['L_T|I']:.3f}, L_T {m['L_T']:.3f}")
        group, arm = key.split("/")
        result[group][arm] = {**summarise(per_seed), "build": name, "recipe": recipe,
                              "cfg_scale_per_seed": [m["cfg_scale"] for m in per_seed],
                              "adherence_per_seed": [m["adherence"] for m in per_seed],
                              "caption_accuracy_per_seed": [m["caption_accuracy"]
                                                            for m in per_seed],
                              "schedule": schedule,
                              "training_images": built[name]["ok_train_rows"],
                              "caption_sources": built[name]["caption_sources"],
                              "training_caption_exact": built[name]["training_caption_exact"]}
    plotted = {"oracle", "noisy", "recaption"} <= set(result["arms"]) and result["corruption"]
    if not args.quick and plotted:
        result["corruption"] |= {"0.0": result["arms"]["oracle"], "0.5": result["arms"]["noisy"]}
        plot(result["corruption"], result["arms"]["recaption"], PLOT)
        log(f"plot → {PLOT}")
    return result


if __name__ == "__main__":
    main()
