"""One GPU run of stage 3's model steps at real sizes (issue 49 item 5): bench/gpu/run.sh
installs the bundle and calls this; README.md beside it lists every JSON field.

    python bench/gpu/run.py [--out DIR] [--budget-s 480] [--cpu-smoke]

Each part runs while a sampler reads the GPU's utilisation and memory every 0.2 s
(NVML through nvidia-ml-py; ``nvidia-smi`` when that is missing), and records its own
window's mean and peak. Parts, in order (each skipped, and said so, when the budget's
deadline is near; a part that fails records its error and the run goes on):

- clip_ceiling: CLIP ViT-L/14's ``encode_image`` on random device tensors, bf16 autocast
  (as the step runs on a GPU): the most images/s the model gives on this card.
- clip_step: the CLIP step (``ClipStep``, in this process) on rows whose pictures the
  chain's decoding task prepared (``images.decode_views``, not timed), against its bare
  loop (the same pictures to tensors, ``encode_image`` + ``encode_text``, cosine), arms
  taking turns batch by batch after a warm-up batch.
- chain: ``run_process`` (what ``pairforge process`` runs) on synthesised raw shards of
  256-px JPEGs (bench/stage3.py's ``write_raw``: stage 1's image pass on the bundled
  scenes): read, basic filters, CLIP L/14, a clip-head classifier, write. Once per
  ``num_gpus`` of 1, 0.5 and 0.25 for CLIP's pool, with ``1 / num_gpus`` actors sharing
  the GPU; the classifier's pool (a linear head over CLIP's embedding) runs on CPU.
  images/s is ok rows over the run's wall time (Ray's start excluded, model loading in).
- chain_decode_in_actor, chain_decode_on_gpu: the chain at ``num_gpus`` 1 with
  ``process.decode.where: actor`` (CLIP's actors decode in a thread beside their
  forwards), and with ``device: cuda`` too (JPEGs decoded and resized on CLIP's GPU by
  nvJPEG; GPU only), against the first chain's decoding task.
- vlm: the recaption step (transformers backend) with SmolVLM-256M's architecture,
  ``constrained_decoding`` on and off, and its bare ``generate`` loop; captions/s.
- vq: the tokenize step with Chameleon's VQ at 256 px, and its bare loop; images/s.

Random weights throughout (the GPU machine reaches no hub); the compute does not depend
on them. ``--cpu-smoke``: the same code paths at tiny sizes on CPU (a two-layer open_clip,
a tiny Idefics3, tests/tiny_vq.py's Chameleon at 32 px, 64 chain rows) in a few minutes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent / "tests"))  # golden (tiny CLIP), tiny_vq, tiny_models

import real_sizes as rs  # noqa: E402

GPU_SIZES = dict(clip="ViT-L-14", clip_bs=128, clip_batches=30, step_images=1024,
                 chain_rows=16384, vlm_captions=256, vlm_bs=32, max_new_tokens=32,
                 vq_images=512, vq_bs=32, vq_side=256, size="real")
SMOKE_SIZES = dict(clip="pf-smoke-clip", clip_bs=4, clip_batches=2, step_images=4,
                   chain_rows=32, vlm_captions=4, vlm_bs=2, max_new_tokens=4,
                   vq_images=2, vq_bs=2, vq_side=32, size="tiny")


# ---------------------------------------------------------------------- GPU sampling
class Sampler:
    """GPU utilisation (%) and memory used (MiB) every ``interval`` s in a thread."""

    def __init__(self, interval: float = 0.2) -> None:
        self.samples: list[tuple[float, float, float]] = []
        self.source = "none"
        self._stop = threading.Event()
        self._read = self._nvml() or self._smi()
        if self._read is not None:
            threading.Thread(target=self._loop, args=(interval,), daemon=True).start()

    def _nvml(self) -> Callable[[], tuple[float, float]] | None:
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        except Exception:  # noqa: BLE001 - no NVML library, no GPU: try nvidia-smi
            return None
        self.source = "nvml"

        def read() -> tuple[float, float]:
            util = pynvml.nvmlDeviceGetUtilizationRates(handle)
            return float(util.gpu), pynvml.nvmlDeviceGetMemoryInfo(handle).used / 2**20
        return read

    def _smi(self) -> Callable[[], tuple[float, float]] | None:
        if shutil.which("nvidia-smi") is None:
            return None
        self.source = "nvidia-smi"

        def read() -> tuple[float, float]:
            line = subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu,memory.used",
                                   "--format=csv,noheader,nounits"], capture_output=True,
                                  text=True, check=True).stdout.splitlines()[0]
            util, mem = (float(x) for x in line.split(","))
            return util, mem
        return read

    def _loop(self, interval: float) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(Exception):  # one failed reading is a gap, not an end
                self.samples.append((time.monotonic(), *self._read()))
            self._stop.wait(interval)

    def window(self, start: float, end: float) -> dict[str, Any]:
        got = [(u, m) for t, u, m in self.samples if start <= t <= end]
        if not got:
            return {"gpu_util_mean": None, "gpu_util_max": None, "gpu_mem_mib_max": None,
                    "samples": 0}
        return {"gpu_util_mean": round(sum(u for u, _ in got) / len(got), 1),
                "gpu_util_max": max(u for u, _ in got),
                "gpu_mem_mib_max": round(max(m for _, m in got)), "samples": len(got)}

    def close(self) -> None:
        self._stop.set()


# ------------------------------------------------------------------------------ parts
def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def clip_section(sizes: dict[str, Any], device: str, threads: int | None) -> dict[str, Any]:
    """The CLIP step's config (what the step, the bare loop and the chain load)."""
    extra = {"model_config_path": sizes["clip_config_path"]} if "clip_config_path" in sizes \
        else {}
    return {"enabled": True, "model": sizes["clip"], "pretrained": None,
            "mode": "score_only", "batch_size": sizes["clip_bs"],
            "num_gpus": 1 if device == "cuda" else 0, "torch_threads": threads, **extra}


def clip_ceiling(sizes: dict[str, Any], device: str) -> dict[str, Any]:
    import open_clip
    import torch

    model, _, _ = open_clip.create_model_and_transforms(sizes["clip"], pretrained=None,
                                                        device=device)
    model.eval()
    side = model.visual.image_size
    side = side[0] if isinstance(side, tuple | list) else side
    batch = torch.randn(sizes["clip_bs"], 3, side, side, device=device)
    autocast = torch.autocast(device, torch.bfloat16, enabled=device == "cuda")
    with torch.inference_mode(), autocast:
        for _ in range(3):  # warm-up: kernels chosen, memory pooled
            model.encode_image(batch)
        sync(device)
        start = time.perf_counter()
        for _ in range(sizes["clip_batches"]):
            model.encode_image(batch)
        sync(device)
    seconds = time.perf_counter() - start
    n = sizes["clip_batches"] * sizes["clip_bs"]
    return {"images": n, "batch_size": sizes["clip_bs"], "images_per_s": round(n / seconds, 1)}


def clip_step_vs_bare(sizes: dict[str, Any], device: str, work: Path) -> dict[str, Any]:
    import open_clip
    import torch

    from pairforge import images
    from pairforge.filters.clip import ClipStep

    bs = sizes["clip_bs"]
    handed = rs.step_config({"clip": clip_section(sizes, device, None)}, work)
    step = ClipStep(handed)
    rows = images.decode_views(rs.rows(sizes["step_images"] + bs), ClipStep.image_views(handed))
    model, _, _ = open_clip.create_model_and_transforms(sizes["clip"], pretrained=None,
                                                        device=device)
    model.eval()
    tokenizer = open_clip.get_tokenizer(sizes["clip"])
    view, to_tensor = step.scorer.view, step.scorer.to_tensor
    autocast = torch.autocast(device, torch.bfloat16, enabled=device == "cuda")

    def bare(batch: Any) -> None:
        pictures = images.view_images(batch, view)
        pixels = torch.stack([to_tensor(p) for p in pictures]).to(device)
        texts = tokenizer(batch["caption"].to_pylist()).to(device)
        with torch.inference_mode(), autocast:
            img = torch.nn.functional.normalize(model.encode_image(pixels).float(), dim=-1)
            txt = torch.nn.functional.normalize(model.encode_text(texts).float(), dim=-1)
            (img * txt).sum(-1).cpu().numpy()

    per_item = rs.side_by_side({"step": step, "bare": bare}, rows, bs)
    return {"images": sizes["step_images"], "batch_size": bs,
            "step_images_per_s": round(1 / per_item["step"], 1),
            "bare_images_per_s": round(1 / per_item["bare"], 1),
            "ratio": round(per_item["bare"] / per_item["step"], 3)}


def clip_head(folder: Path, model: str) -> str:
    """A linear head over CLIP's image embedding, saved as a state dict."""
    import torch

    from pairforge.config import ClipConfig
    from pairforge.filters.clip import clip_embed_dim

    dim = clip_embed_dim(ClipConfig(model=model)) or 768  # the model's config is registered
    torch.manual_seed(0)
    path = folder / "head.pt"
    torch.save(torch.nn.Linear(dim, 1).state_dict(), path)
    return str(path)


def chain_config(out: Path, sizes: dict[str, Any], device: str, gpus: float,
                 head: str, decode: dict[str, str] | None = None) -> Any:
    from stage3 import config as stage3_config

    from pairforge.config import parse_config

    clip = clip_section(sizes, device, None)
    if device == "cuda":
        clip.update(num_gpus=gpus, pool_size=round(1 / gpus), num_cpus=1)
    values = stage3_config(out, 256)
    # CPU: logical CPUs enough for the coordinator, both pools and the read, decode and
    # write tasks at once (2 leave the tasks none: the chain waits forever)
    values["ray"] = {"object_store_memory": 4 * 1024**3} if device == "cuda" else {
        "num_cpus": 6}
    values["process"] = {"basic": {"min_image_side": 16}, "clip": clip, "classifiers": [
        {"name": "aesthetic", "backend": "clip-head", "path": head}], "decode": decode or {}}
    return parse_config(values)


def chain(sizes: dict[str, Any], device: str, work: Path, gpus: float,
          decode: dict[str, str] | None = None) -> dict[str, Any]:
    from stage3 import write_raw

    from pairforge.pipeline.entry import RunOptions
    from pairforge.pipeline.process import run_process

    out = work / "chain"
    if not (out / "raw").exists():
        write_raw(out, sizes["chain_rows"], shard_size=1024, image_size=256)
    for path in out.iterdir():  # the stage redoes every shard
        if path.name != "raw":
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    cfg = chain_config(out, sizes, device, gpus, clip_head(work, sizes["clip"]), decode)
    start_ray(cfg.ray)  # before the clock: a build starts it once
    start = time.perf_counter()
    summary = run_process(cfg, RunOptions(show_progress=False))
    seconds = time.perf_counter() - start
    ok = summary["status"].get("ok", 0)
    return {"num_gpus": gpus, "clip_actors": cfg.process.clip.pool_size,
            "decode": cfg.process.decode.model_dump(),
            "rows": sizes["chain_rows"], "rows_ok": ok, "seconds": round(seconds, 1),
            "images_per_s": round(ok / seconds, 1), **steady_rate(out, sizes["chain_rows"])}


def start_ray(ray_cfg: Any) -> None:
    """``init_ray``, tried a second time: Ray gives its raylet 30 s to register, which a
    heavily loaded machine (the shared 2-core build host) can miss."""
    import ray

    from pairforge.pipeline.ray_runtime import init_ray

    try:
        init_ray(ray_cfg)
    except Exception:  # noqa: BLE001 - "The current node timed out during startup"
        ray.shutdown()
        init_ray(ray_cfg)


def steady_rate(out: Path, rows: int) -> dict[str, Any]:
    """Rows per second between the first and the last training shard written (the run's
    fixed costs, actors starting and models loading, fall before the first)."""
    tars = sorted((p.stat().st_mtime for p in out.rglob("*.tar")
                   if "raw" not in p.relative_to(out).parts), key=float)
    if len(tars) < 3 or tars[-1] <= tars[0]:
        return {"shards": len(tars), "steady_images_per_s": None}
    per_shard = rows / len(tars)
    return {"shards": len(tars),
            "steady_images_per_s": round(per_shard * (len(tars) - 1) / (tars[-1] - tars[0]), 1)}


def vlm(sizes: dict[str, Any], device: str, work: Path) -> dict[str, Any]:
    """The recaption step, constrained decoding on and off, and the bare generate loop;
    the step as the build's actor runs it (``concurrent_batches`` batches at once)."""
    from pairforge.recaption.step import MODEL_BATCHES_IN_FLIGHT, RecaptionStep

    bs, new = sizes["vlm_bs"], sizes["max_new_tokens"]
    folder = rs.save_smolvlm(work / "smolvlm", sizes["size"], new)
    side = 512 if sizes["size"] == "real" else 64
    arms: dict[str, Callable] = {}
    retried: dict[str, Any] = {}
    threads = MODEL_BATCHES_IN_FLIGHT
    calls: dict[str, list[int]] = {"constrained_on": [], "constrained_off": [], "bare": []}
    for name, constrained in (("constrained_on", True), ("constrained_off", False)):
        process = rs.vlm_process(folder, bs, None, new, constrained)
        process["recaption"].update(num_gpus=1 if device == "cuda" else 0,
                                    input_resolution=side)
        arms[name] = rs.counting_retries(RecaptionStep(rs.step_config(process, work)), name,
                                         retried, bs, threads, calls[name])
    arms["bare"] = rs.vlm_bare(folder, new, side, device, bs, calls["bare"])
    per_item = rs.side_by_side(arms, rs.rows(sizes["vlm_captions"] + bs), bs, bs * threads)
    return {"backend": "transformers", "model": "SmolVLM-256M-Instruct architecture",
            "captions": sizes["vlm_captions"], "batch_size": bs, "new_tokens": new,
            "input_resolution": side,
            **{f"{arm}_captions_per_s": round(1 / s, 2) for arm, s in per_item.items()},
            "ratio_constrained_off": round(per_item["bare"] / per_item["constrained_off"], 3),
            "constrained_cost": round(per_item["constrained_on"] / per_item["constrained_off"]
                                      - 1, 3), "strict_retries": retried,
            "generate_calls": {arm: len(c) for arm, c in calls.items()}}


def vq(sizes: dict[str, Any], device: str, work: Path) -> dict[str, Any]:
    bs = sizes["vq_bs"]
    folder = rs.save_chameleon(work / "chameleon", sizes["vq_side"], sizes["size"])
    step, bare = rs.vq_arms(folder, bs, None, work, device)
    per_item = rs.side_by_side({"step": step, "bare": bare},
                               rs.rows(sizes["vq_images"] + bs), bs)
    return {"model": "ChameleonVQVAE", "side": sizes["vq_side"], "images": sizes["vq_images"],
            "batch_size": bs, "step_images_per_s": round(1 / per_item["step"], 1),
            "bare_images_per_s": round(1 / per_item["bare"], 1),
            "ratio": round(per_item["bare"] / per_item["step"], 3)}


# ------------------------------------------------------------------------------- run
def timed_part(name: str, fn: Callable[[], dict[str, Any]], sampler: Sampler,
               deadline: float, needs_s: float) -> dict[str, Any]:
    """``fn``'s result with its wall time and GPU window; skipped near the deadline, its
    error recorded when it fails (the run goes on to the next part)."""
    left = deadline - time.monotonic()
    if left < needs_s:
        print(f"{name}: skipped, {left:.0f} s left", flush=True)
        return {"skipped": f"{left:.0f} s left of the budget, {needs_s:.0f} s needed"}
    start = time.monotonic()
    try:
        result = fn()
    except Exception as error:  # noqa: BLE001 - one part's failure is its row, not the run's
        traceback.print_exc()
        result = {"error": f"{type(error).__name__}: {error}"}
    end = time.monotonic()
    result.update(wall_s=round(end - start, 1), **sampler.window(start, end))
    print(f"{name}: {json.dumps(result)}", flush=True)
    return result


def smoke_clip(work: Path) -> dict[str, Any]:
    """A two-layer open_clip registered under SMOKE_SIZES' name (tests/golden.py's)."""
    import golden
    import open_clip

    path = work / "pf-smoke-clip.json"
    path.write_text(json.dumps(golden.TINY_CLIP))
    open_clip.add_model_config(path)
    return {**SMOKE_SIZES, "clip_config_path": str(path)}


def environment(device: str, sampler: Sampler) -> dict[str, Any]:
    import ray
    import torch
    import transformers

    return {"device": device, "gpu": torch.cuda.get_device_name(0) if device == "cuda" else
            None, "torch": torch.__version__, "transformers": transformers.__version__,
            "ray": ray.__version__, "python": sys.version.split()[0],
            "cpus": os.cpu_count(), "sampler": sampler.source}


def parts(sizes: dict[str, Any], device: str, work: Path) -> list[tuple[str, Callable, float]]:
    """(name, part, seconds it needs at least) in the order they run."""
    slow = 1.0 if device == "cuda" else 0.2
    chains = [(f"chain_num_gpus_{g}", lambda g=g: chain(sizes, device, work, g), 70 * slow)
              for g in ((1.0, 0.5, 0.25) if device == "cuda" else (1.0,))]
    # where the chain decodes (process.decode): the first model step's actors, in a
    # thread beside the forwards; on a GPU also JPEGs by nvJPEG on CLIP's device
    decodes = [("chain_decode_in_actor", {"where": "actor"})] + (
        [("chain_decode_on_gpu", {"where": "actor", "device": "cuda"})]
        if device == "cuda" else [])
    decode_chains = [(name, lambda d=d: chain(sizes, device, work, 1.0, d), 70 * slow)
                     for name, d in decodes]
    return [("clip_ceiling", lambda: clip_ceiling(sizes, device), 20 * slow),
            ("clip_step", lambda: clip_step_vs_bare(sizes, device, work), 40 * slow),
            chains[0], *decode_chains,
            ("vlm", lambda: vlm(sizes, device, work), 60 * slow),
            ("vq", lambda: vq(sizes, device, work), 30 * slow), *chains[1:]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-out")))
    parser.add_argument("--budget-s", type=float, default=480,
                        help="parts that would start after this are skipped")
    parser.add_argument("--cpu-smoke", action="store_true")
    parser.add_argument("--parts", nargs="+", help="run only these parts (a rerun)")
    args = parser.parse_args()
    import torch

    started = time.monotonic()
    device = "cpu" if args.cpu_smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --cpu-smoke on a CPU machine")
    args.out.mkdir(parents=True, exist_ok=True)
    sampler = Sampler()
    results: dict[str, Any] = {"mode": "cpu-smoke" if args.cpu_smoke else "gpu",
                               "environment": environment(device, sampler), "parts": {}}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        sizes = smoke_clip(work) if args.cpu_smoke else dict(GPU_SIZES)
        results["sizes"] = sizes
        for name, part, needs in parts(sizes, device, work):
            if args.parts and name not in args.parts:
                continue
            results["parts"][name] = timed_part(name, part, sampler,
                                                started + args.budget_s, needs)
            (args.out / "gpu.json").write_text(json.dumps(results, indent=1) + "\n")
    sampler.close()
    results["wall_s"] = round(time.monotonic() - started, 1)
    (args.out / "gpu.json").write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.out / 'gpu.json'}")


if __name__ == "__main__":
    main()
