"""Stage-3 model steps at real sizes on CPU (issue 49 item 4): each step, called in this
process on a pyarrow batch as the tests call it, against its bare library loop on the same
images, batch size and torch threads.

    python bench/real_sizes.py [--quick] [--json FILE] [--models vlm clip vq]
                               [--threads 2] [--batch-size 4] [--clip-images 8]
                               [--vlm-captions 4] [--vlm-batch 2] [--vlm-threads 2]
                               [--vlm-constrained] [--max-new-tokens 16] [--vq-images 8]

Models (the published architectures, random weights: no hub is reachable here, and the
compute does not depend on the weights):

- clip: open_clip ``ViT-L-14`` (``pretrained=None``), batch ``--batch-size``. Step:
  ``ClipStep`` (score_only: image and caption embeddings, cosine). Bare:
  ``create_model_and_transforms``, decode + preprocess, ``encode_image``, ``encode_text``,
  normalise, cosine.
- vlm: SmolVLM-256M-Instruct's architecture (Idefics3: SigLIP-B/16 at 512 px, 12 layers;
  SmolLM2-135M text model, 30 layers, 576 wide, vocabulary 49,280; pixel shuffle 4, so 64
  image tokens per 512-px tile), built ``from_config`` and saved with ``save_pretrained``
  beside a byte-level BPE trained on the COCO captions (padded to the published vocabulary)
  and SmolVLM's chat template. ``input_resolution: 512`` (one tile per image: the step's cost
  dial, passed to both arms). Random weights never emit the end token, so every caption is
  ``--max-new-tokens`` long: ``min_new_tokens`` equal to it in both arms (the step through
  the saved ``generation_config``). Step: ``RecaptionStep`` (cache and grounding off; the
  checks and their strict retry on, as in a build: retries are counted, by the problem the
  checks found) with constrained decoding off (``--vlm-constrained``: an arm with it
  on), run as the build's actor runs it: ``--vlm-threads`` batches at once, one thread each
  (``RecaptionStep.concurrent_batches``: 2), so a batch's strict retries share generate
  calls with the other batch's rows (recaption/rounds.py); ``step_serial``: the same step
  one batch at a time, which makes the generate calls the step made before that change
  (each batch's retries a call of their own). Bare: ``AutoProcessor`` +
  ``AutoModelForImageTextToText``, the chat template with the step's prompt, ``generate``,
  ``batch_decode``, one call per ``--vlm-batch`` images. Each arm's generate calls are
  counted (``generate_calls``: calls and rows generated per counted caption).
- vq: Chameleon's VQ-VAE (transformers ``ChameleonVQVAE``, the published config) at 256 px,
  its image processor saved at 256. Step: ``TokenizeStep`` (byte caption tokens). Bare:
  ``ChameleonImageProcessor`` + ``ChameleonVQVAE.encode``.

Timing: the first batch of each arm is a warm-up and not counted; then the arms take turns
batch by batch (which one goes first alternates), so a neighbour's load on this shared
machine falls on both. The ratio is the step's rate over the bare loop's. Counts are
small (a ViT-L/14 image is ~160 GFLOP, a SmolVLM caption ~250): on the shared 2-core host
each model takes minutes; one model per process (``--models``) finishes sooner there. The
step decodes its own images (called alone, as the bare loop does); photos are the COCO
sample's (../shared/data), else synthesised 640x480 JPEGs. ``--quick``: one counted batch
per model. ``--json FILE`` (rewritten after each model): ``{"load_average_before",
"load_average_after", "threads", "models": {name: {"items", "batch_size",
"seconds_per_item_bare", "bare_per_s", "seconds_per_item_step", "step_per_s",
"ratio_step", "ratio", "cpu_seconds_per_item", "cpu_ratio", "wall_s", ...}}}``; the VLM adds
``strict_retries`` (per step arm, captions sent back by problem) and ``generate_calls``.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from common import COCO, TESTS, arg_parser

sys.path.insert(0, str(TESTS))  # tiny_models: SmolVLM's chat template, the BPE trainer

SMOLVLM_TEXT = dict(model_type="llama", hidden_size=576, intermediate_size=1536,
                    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
                    max_position_embeddings=8192, tie_word_embeddings=True)
SMOLVLM_VISION = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                      num_attention_heads=12, image_size=512, patch_size=16)
SMOLVLM_VOCAB, SMOLVLM_SCALE = 49280, 4
# the process's CPU seconds per item of each arm in the last side_by_side: on a shared
# host, where another process's load stretches wall time, the steadier figure
CPU_SECONDS: dict[str, float] = {}
TINY_TEXT = dict(model_type="llama", hidden_size=32, intermediate_size=64,
                 num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                 max_position_embeddings=512)
TINY_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                   num_attention_heads=2, image_size=64, patch_size=16)


# ------------------------------------------------------------------------- the images
def photos(n: int, side: int = 640) -> list[bytes]:
    """JPEG bytes of n photos: the COCO sample's when it is there, else synthesised
    (smooth colour fields with noise, 640x480, q90: a photo's decode cost)."""
    files = sorted((COCO / "images").glob("*.jpg")) if (COCO / "images").exists() else []
    if files:
        return [files[i % len(files)].read_bytes() for i in range(n)]
    from PIL import Image

    rng = np.random.default_rng(0)
    out: list[bytes] = []
    for _ in range(min(n, 64)):  # 64 distinct, then again in turn
        y, x = np.mgrid[0:side * 3 // 4, 0:side]
        base = np.stack([np.sin(x / rng.uniform(20, 90) + c) * 90 + 128 for c in range(3)], -1)
        pixels = np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, "JPEG", quality=90)
        out.append(buffer.getvalue())
    return [out[i % len(out)] for i in range(n)]


def captions(n: int) -> list[str]:
    path = COCO / "captions.csv"
    if path.exists():
        with open(path, newline="") as f:
            text = [r["caption"].strip() for r in csv.DictReader(f)]
    else:
        text = [f"a photo of {w} on a table" for w in ("a cat", "two cups", "a red bike")]
    return [text[i % len(text)] for i in range(n)]


def rows(n: int) -> pa.Table:
    """Raw stage-1 rows of n photos, every one ok, with the columns the steps read."""
    data, texts = photos(n), captions(n)
    return pa.table({
        "key": [f"{i:09d}" for i in range(n)], "caption": texts, "train_caption": texts,
        "caption_issue": pa.array([None] * n, pa.string()), "status": ["ok"] * n,
        "error": pa.array([None] * n, pa.string()), "image_format": ["jpg"] * n,
        "pixel_hash": [hashlib.sha256(d).hexdigest() for d in data],
        "phash": [f"{i:016x}" for i in range(n)], "image": pa.array(data, pa.large_binary())})


def decode(data: bytes):  # noqa: ANN201 - a PIL image
    from PIL import Image

    return Image.open(io.BytesIO(data)).convert("RGB")


# -------------------------------------------------------------------- the checkpoints
def _tokenizer(vocab: int):  # noqa: ANN202 - a PreTrainedTokenizerFast
    """A byte-level BPE trained on the captions at hand (``save_smolvlm`` pads it to the
    model's vocabulary once the processor has added its image tokens)."""
    from tiny_models import train_tokenizer

    return train_tokenizer(captions(5000) * 2, vocab_size=min(vocab, 16384))


def save_smolvlm(out: Path, size: str = "real", max_new_tokens: int = 16) -> Path:
    """SmolVLM-256M-Instruct's architecture (``size="tiny"``: the same classes a few
    hundred kB large, for smoke runs) with random weights, processor and chat template."""
    import torch
    from tiny_models import IDEFICS3_TEMPLATE
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessor,
        Idefics3Processor,
    )

    torch.manual_seed(0)
    real = size == "real"
    text, vision = (SMOLVLM_TEXT, SMOLVLM_VISION) if real else (TINY_TEXT, TINY_VISION)
    side, patch = vision["image_size"], vision["patch_size"]
    scale = SMOLVLM_SCALE if real else 2
    images = Idefics3ImageProcessor(size={"longest_edge": 4 * side}, do_image_splitting=True,
                                    max_image_size={"longest_edge": side})
    processor = Idefics3Processor(image_processor=images,
                                  tokenizer=_tokenizer(SMOLVLM_VOCAB if real else 600),
                                  image_seq_len=(side // patch) ** 2 // scale ** 2,
                                  chat_template=IDEFICS3_TEMPLATE)
    tokenizer = processor.tokenizer
    if real:  # plain added words up to the published size: every id decodes to text
        tokenizer.add_tokens([f"w{i}" for i in range(SMOLVLM_VOCAB - len(tokenizer))])
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
           "pad_token_id": tokenizer.pad_token_id}
    vocab = max(SMOLVLM_VOCAB if real else 0, len(tokenizer))
    model = Idefics3ForConditionalGeneration(Idefics3Config(
        vision_config=vision, text_config=dict(text, vocab_size=vocab, **ids),
        scale_factor=scale, image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True))
    end = tokenizer.convert_tokens_to_ids("<end_of_utterance>")
    model.generation_config.eos_token_id = end
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    # random weights never end a caption; both arms generate exactly this many tokens
    model.generation_config.min_new_tokens = max_new_tokens
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


def save_chameleon(out: Path, side: int = 256, size: str = "real") -> Path:
    """Chameleon's VQ-VAE (the published config; ``tiny``: tests/tiny_vq.py's) with its
    image processor at ``side`` px."""
    import tiny_vq
    from transformers import ChameleonImageProcessor

    tiny_vq.save_vq("chameleon", out, size=size, with_processor=False)
    ChameleonImageProcessor(size={"shortest_edge": side},
                            crop_size={"height": side, "width": side}).save_pretrained(out)
    return out


# --------------------------------------------------------------------------- the arms
def step_config(process: dict[str, Any], out: Path) -> Any:
    from pairforge.config import parse_config
    from pairforge.pipeline.contract import step_config as handed

    return handed(parse_config({
        "input": {"path": "unused"}, "output": {"path": str(out)},
        "dedup": {"enabled": True},  # no claim registry: the steps run without Ray
        "process": {"basic": {"enabled": False}, **process}}))


def clip_arms(bs: int, threads: int, model: str, work: Path) -> tuple[Callable, Callable]:
    """(step, bare): each takes a pyarrow batch and does the same work."""
    import open_clip
    import torch

    from pairforge.filters.clip import ClipStep

    step = ClipStep(step_config({"clip": {
        "enabled": True, "model": model, "pretrained": None, "mode": "score_only",
        "batch_size": bs, "torch_threads": threads}}, work))
    net, _, preprocess = open_clip.create_model_and_transforms(model, pretrained=None)
    net.eval()
    tokenizer = open_clip.get_tokenizer(model)

    def bare(batch: pa.Table) -> None:
        images = torch.stack([preprocess(decode(d)) for d in batch["image"].to_pylist()])
        texts = tokenizer(batch["caption"].to_pylist())
        with torch.inference_mode():
            img = torch.nn.functional.normalize(net.encode_image(images), dim=-1)
            txt = torch.nn.functional.normalize(net.encode_text(texts), dim=-1)
            (img * txt).sum(-1).numpy()

    return step, bare


def vlm_process(folder: Path, bs: int, threads: int | None, max_new: int,
                constrained: bool) -> dict[str, Any]:
    return {"recaption": {"enabled": True, "model": str(folder), "batch_size": bs,
                          "max_new_tokens": max_new, "input_resolution": 512,
                          "constrained_decoding": constrained, "torch_threads": threads,
                          "cache": {"enabled": False}, "grounding": {"enabled": False}}}


def vlm_bare(folder: Path, max_new: int, side: int = 512, device: str = "cpu",
             bs: int | None = None, calls: list[int] | None = None) -> Callable:
    """The bare loop; ``bs``: generate calls of at most that many images (default: the
    whole batch); ``calls``: each call's rows are appended to it."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from pairforge.recaption.prompts import DEFAULT_PROMPT

    processor = AutoProcessor.from_pretrained(folder)
    processor.tokenizer.padding_side = "left"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # the step's dtype auto
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=dtype).to(device).eval()
    messages = [{"role": "user", "content": [{"type": "image"},
                                             {"type": "text", "text": DEFAULT_PROMPT}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)

    def bare(batch: pa.Table) -> None:
        size = bs or batch.num_rows
        for start in range(0, batch.num_rows, size):
            call(batch.slice(start, size))

    def call(batch: pa.Table) -> None:
        images = [[decode(d)] for d in batch["image"].to_pylist()]
        if calls is not None:
            calls.append(len(images))
        inputs = processor(text=[text] * len(images), images=images, return_tensors="pt",
                           padding=True, size={"longest_edge": side}).to(device)
        inputs["pixel_values"] = inputs["pixel_values"].to(dtype)
        with torch.inference_mode():
            out = model.generate(**inputs, max_new_tokens=max_new, min_new_tokens=max_new,
                                 do_sample=False)
        processor.batch_decode(out[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)

    return bare


def vq_arms(folder: Path, bs: int, threads: int | None, work: Path,
            device: str = "cpu") -> tuple[Callable, Callable]:
    import torch
    from transformers import ChameleonImageProcessor, ChameleonVQVAE

    from pairforge.tokenizers.step import TokenizeStep

    step = TokenizeStep(step_config({"tokenize": {
        "enabled": True, "batch_size": bs, "torch_threads": threads,
        "num_gpus": 1 if device == "cuda" else 0,
        "image": {"backend": "chameleon", "path_or_id": str(folder)}}}, work))
    vq = ChameleonVQVAE.from_pretrained(folder).to(device).eval()
    processor = ChameleonImageProcessor.from_pretrained(folder)
    down = 2 ** (len(vq.config.channel_multiplier) - 1)

    def bare(batch: pa.Table) -> None:
        pixels = processor([decode(d) for d in batch["image"].to_pylist()],
                           return_tensors="pt")["pixel_values"].to(device)
        with torch.inference_mode():
            codes = vq.encode(pixels).image_tokens
        codes.view(len(pixels), pixels.shape[2] // down, -1).to(torch.int32).cpu().numpy()

    return step, bare


def counting_retries(step: Any, name: str, retried: dict[str, Any], bs: int, threads: int,
                     calls: list[int]) -> Callable:
    """The recaption step as an arm that counts the captions its checks sent back for a
    strict second try (each one a second generation the bare loop does not make), by the
    problem the checks found, warm-up batch included. The arm's rows are cut into batches
    of ``bs``, ``threads`` of them captioned at once (as Ray Data's threaded actor calls
    the step); each generate call's rows are appended to ``calls``."""
    from concurrent.futures import ThreadPoolExecutor

    retried[name] = {}
    captioner = step.checked.captioner  # loaded now, to count its calls
    generate = captioner.generate

    def counted(images: list[Any], prompt: Any) -> list[str]:
        calls.append(len(images))
        return generate(images, prompt)

    captioner.generate = counted
    pool = ThreadPoolExecutor(threads)

    def run(rows: pa.Table) -> None:
        batches = [rows.slice(i, bs) for i in range(0, rows.num_rows, bs)]
        for out in pool.map(step, batches):
            for flags in out["recaption_flags"].to_pylist():
                for problem in {f.split(":")[1] for f in flags or []
                                if f.startswith("regenerated:")}:
                    retried[name][problem] = retried[name].get(problem, 0) + 1
    return run


# ------------------------------------------------------------------------- measuring
def side_by_side(arms: dict[str, Callable[[pa.Table], Any]], table: pa.Table,
                 bs: int, turn: int | None = None,
                 warmed: Callable[[], Any] | None = None) -> dict[str, float]:
    """Seconds per item of each arm over table's batches after the first (a warm-up of
    ``bs`` rows), the arms taking turns every ``turn`` rows (default ``bs``), the first
    arm rotating."""
    turn = turn or bs
    batches = [table.slice(0, bs)] + [table.slice(i, turn) for i in range(bs, table.num_rows,
                                                                         turn)]
    names = list(arms)
    for name in names:
        arms[name](batches[0])
    if warmed is not None:
        warmed()
    spent = dict.fromkeys(names, 0.0)
    cpu = dict.fromkeys(names, 0.0)
    for b, batch in enumerate(batches[1:]):
        for name in names[b % len(names):] + names[:b % len(names)]:
            start, start_cpu = time.perf_counter(), time.process_time()
            arms[name](batch)
            spent[name] += time.perf_counter() - start
            cpu[name] += time.process_time() - start_cpu
    counted = table.num_rows - batches[0].num_rows
    CPU_SECONDS.update({name: cpu[name] / counted for name in names})
    return {name: spent[name] / counted for name in names}


def report(name: str, per_item: dict[str, float], items: int, bs: int,
           **extra: Any) -> dict[str, Any]:
    bare = per_item["bare"]
    out: dict[str, Any] = {"items": items, "batch_size": bs,
                           "seconds_per_item_bare": round(bare, 4),
                           "bare_per_s": round(1 / bare, 4)}
    for arm, seconds in per_item.items():
        if arm != "bare":
            out[f"seconds_per_item_{arm}"] = round(seconds, 4)
            out[f"{arm}_per_s"] = round(1 / seconds, 4)
            out[f"ratio_{arm}"] = round(bare / seconds, 3)
    out["ratio"] = out["ratio_step"]
    out["cpu_seconds_per_item"] = {arm: round(s, 3) for arm, s in CPU_SECONDS.items()}
    out["cpu_ratio"] = round(CPU_SECONDS["bare"] / CPU_SECONDS["step"], 3)
    out.update(extra)
    line = ", ".join(f"{arm} {1 / s:.3f}/s" for arm, s in per_item.items())
    print(f"{name}: {items} counted, batch {bs}: {line}; step/bare {out['ratio']:.2f}x",
          flush=True)
    return out


def run_clip(args: Any, work: Path) -> dict[str, Any]:
    bs, n = args.batch_size, args.clip_images
    step, bare = clip_arms(bs, args.threads, args.clip_model, work)
    per_item = side_by_side({"step": step, "bare": bare}, rows(n + bs), bs)
    return report(f"clip {args.clip_model}", per_item, n, bs, model=args.clip_model)


def run_vlm(args: Any, work: Path) -> dict[str, Any]:
    from pairforge.recaption.step import RecaptionStep

    bs, n, new, threads = args.vlm_batch, args.vlm_captions, args.max_new_tokens, args.vlm_threads
    folder = save_smolvlm(work / "smolvlm", max_new_tokens=new)
    variants = [("step", False, threads), ("step_serial", False, 1)]
    if args.vlm_constrained:
        variants.append(("step_constrained", True, threads))
    retried: dict[str, Any] = {}
    calls: dict[str, list[int]] = {name: [] for name, _, _ in variants}
    calls["bare"] = []
    arms = {name: counting_retries(RecaptionStep(step_config(vlm_process(
        folder, bs, args.threads, new, constrained), work)), name, retried, bs, k,
        calls[name]) for name, constrained, k in variants}
    arms["bare"] = vlm_bare(folder, new, bs=bs, calls=calls["bare"])
    warm: dict[str, int] = {}  # calls each arm's warm-up batch made
    per_item = side_by_side(arms, rows(n + bs), bs, bs * threads,
                            lambda: warm.update({k: len(c) for k, c in calls.items()}))
    counted = {name: {"calls_per_caption": round((len(c) - warm[name]) / n, 3),
                      "rows_per_caption": round(sum(c[warm[name]:]) / n, 3),
                      "rows_per_call": sorted(set(c[warm[name]:]))}
               for name, c in calls.items()}
    return report("vlm SmolVLM-256M", per_item, n, bs, model="SmolVLM-256M-Instruct (random)",
                  max_new_tokens=new, input_resolution=512, threads_per_actor=threads,
                  strict_retries=retried, generate_calls=counted)



def run_vq(args: Any, work: Path) -> dict[str, Any]:
    bs, n = args.batch_size, args.vq_images
    step, bare = vq_arms(save_chameleon(work / "chameleon"), bs, args.threads, work)
    per_item = side_by_side({"step": step, "bare": bare}, rows(n + bs), bs)
    return report("vq chameleon 256 px", per_item, n, bs, model="ChameleonVQVAE", side=256)


def main() -> None:
    parser = arg_parser(__doc__)
    parser.add_argument("--models", nargs="+", default=["vlm", "clip", "vq"],
                        choices=["clip", "vlm", "vq"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--clip-model", default="ViT-L-14")
    parser.add_argument("--batch-size", type=int, default=4, help="CLIP's and the VQ's")
    parser.add_argument("--clip-images", type=int, default=8, help="counted (after warm-up)")
    parser.add_argument("--vlm-captions", type=int, default=4, help="counted (after warm-up)")
    parser.add_argument("--vlm-batch", type=int, default=2)
    parser.add_argument("--vlm-threads", type=int, default=2,
                        help="batches the step's actor holds at once (the step's "
                        "concurrent_batches for a transformers captioner)")
    parser.add_argument("--vlm-constrained", action="store_true",
                        help="another arm: the step with constrained decoding on")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--vq-images", type=int, default=8, help="counted (after warm-up)")
    parser.add_argument("--quick", action="store_true", help="one counted batch per model")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.quick:
        args.clip_images = args.vq_images = args.batch_size
        args.vlm_captions = args.vlm_batch * args.vlm_threads
    import tempfile

    import torch

    torch.set_num_threads(args.threads)
    results: dict[str, Any] = {"load_average_before": list(os.getloadavg()),
                               "threads": args.threads, "models": {}}
    runs = {"clip": run_clip, "vlm": run_vlm, "vq": run_vq}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            started = time.perf_counter()
            results["models"][name] = runs[name](args, Path(tmp))
            results["models"][name]["wall_s"] = round(time.perf_counter() - started, 1)
            results["load_average_after"] = list(os.getloadavg())
            if args.json:  # after each model: a long run keeps what it measured
                args.json.write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
