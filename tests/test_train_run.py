"""The trainer on real shards: COCO photos tokenized by our VQ (trained here at 32 px),
built by `pairforge build`; training, budget accounting, recipes, resume, DDP, sampling."""

from __future__ import annotations

import csv
import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from conftest import COCO_CAPTIONS, COCO_IMAGES

from pairforge.tokenizers.vocab import VocabMismatch
from pairforge.train.config import parse_train_config
from pairforge.train.loop import CHECKPOINT, train

N_IMAGES = 160  # 4 shards of 40: 3 to train on, 1 held out
P_DROP = 0.25
TINY = {"d_model": 64, "n_layers": 2, "n_heads": 4, "max_seq_len": 256}


def _cli(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pairforge.cli", *args], capture_output=True,
                          text=True, **kwargs)


@pytest.fixture(scope="session")
def coco_shards(tmp_path_factory, ray_env) -> Path:
    """COCO photos with caption sidecars -> our VQ at 32 px (8x8 codes, K=64) -> shards."""
    root = tmp_path_factory.mktemp("train_coco")
    images = root / "images"
    images.mkdir()
    with open(COCO_CAPTIONS, newline="") as f:
        rows = list(csv.DictReader(f))[:N_IMAGES]
    for row in rows:
        (images / row["filename"]).symlink_to(COCO_IMAGES / row["filename"])
        (images / row["filename"]).with_suffix(".txt").write_text(row["caption"].strip())
    vq = _cli("tokenizers", "train-vq", str(images), "--out", str(root / "vq"), "--resolution",
              "32", "--codebook-size", "64", "--channels", "16,32", "--embed-dim", "8",
              "--steps", "120", "--batch-size", "32", "--threads", "1")
    assert vq.returncode == 0, vq.stderr
    config = {"input": {"path": str(images), "format": "folder", "shard_size": 40},
              "output": {"path": str(root / "out")}, "ray": {"num_cpus": 2},
              "download": {"threads": 4, "allow_file_scheme": True, "image": {"image_size": 64}},
              "dedup": {"enabled": False},
              "process": {"basic": {"min_image_side": 32},
                          "tokenize": {"enabled": True, "image": {"path_or_id": str(root / "vq")}},
                          "tasks": {"p_drop": P_DROP}}}
    (root / "build.yaml").write_text(yaml.safe_dump(config))
    build = _cli("build", str(root / "build.yaml"), "-q", env=ray_env)
    assert build.returncode == 0, build.stdout + build.stderr
    return root / "out"


def _config(shards: Path, out: Path, model: dict | None = None, **run) -> dict:
    return {"data": {"path": str(shards), "heldout_shards": 1, "shuffle_buffer": 32,
                     "bucket_batches": 4},
            "model": {**TINY, **(model or {})},
            "optim": {"lr": 3e-3, "warmup_steps": 5},
            "run": {"out": str(out), "steps": 40, "batch_size": 16, "log_every": 10,
                    "threads": 1, **run}}


def _train(shards: Path, out: Path, model: dict | None = None, **run) -> dict:
    return train(parse_train_config(_config(shards, out, model, **run)), log=lambda _: None)


@pytest.fixture(scope="session")
def trained(coco_shards, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("run")
    return out, _train(coco_shards, out, eval_every=20)


def test_all_three_losses_fall(trained):
    _, report = trained
    first, last = report["history"][0]["train"], report["history"][-1]["train"]
    for name in ("L_I|T", "L_I|0", "L_T|I"):
        assert last[name] < first[name] - 0.5, (name, first[name], last[name])
    held = report["final"]["heldout"]
    uniform = math.log(report["vocab"]["total_size"])  # an untrained model's loss
    for name in ("L_I|T", "L_I|0", "L_T|I"):
        assert held[name] < uniform - 1.5, (name, held[name])
    assert report["history"][1]["heldout"]["loss"] > held["loss"]
    assert report["status"] == "finished" and report["heldout_shards"] == ["00003.tar"]


def test_budget_counts_every_image_token_of_one_epoch(coco_shards, tmp_path):
    cfg = _config(coco_shards, tmp_path / "r", {"d_model": 32, "n_layers": 1}, steps=1000)
    cfg["data"]["epochs"] = 1
    report = train(parse_train_config(cfg), log=lambda _: None)
    budget = report["budget"]
    manifest = budget["manifest_train_shards"]
    assert report["status"] == "data_exhausted"
    assert report["step"] == math.ceil(sum(t["samples"] for t in manifest.values()) / 16)
    for task in ("t2i", "i2t"):
        for view in ("by_label", "as_trained"):
            assert budget[view][task]["samples"] == manifest[task]["samples"]
            assert budget[view][task]["image_tokens"] == manifest[task]["image_tokens"]
        assert budget["by_label"][task]["passes"] == 1.0
    assert budget["no_caption_share"] == budget["manifest_no_caption_share"]
    assert budget["manifest_no_caption_share"] == pytest.approx(P_DROP, abs=0.05)

    cfg["run"].update(out=str(tmp_path / "b"), recipe="baseline")
    base = train(parse_train_config(cfg), log=lambda _: None)["budget"]
    # baseline: every i2t sample trains as a caption-dropped img example, same image tokens
    assert base["as_trained"]["i2t"]["samples"] == 0
    assert base["as_trained"]["img"]["image_tokens"] == manifest["i2t"]["image_tokens"]
    assert base["image_tokens_no_caption"] == budget["image_tokens_no_caption"]
    assert base["image_tokens"] == budget["image_tokens"]


def test_baseline_never_trains_caption_after_image(coco_shards, tmp_path):
    report = _train(coco_shards, tmp_path, {"d_model": 32, "n_layers": 1}, steps=10,
                    recipe="baseline")
    assert report["final"]["train"]["L_T|I"] is None
    assert report["final"]["train"]["n_L_T|I"] == 0
    assert report["final"]["heldout"]["L_T|I"] is not None  # held-out measures all three


def test_staged_schedule_trains_i2t_first_then_t2i(coco_shards, tmp_path):
    report = _train(coco_shards, tmp_path, {"d_model": 32, "n_layers": 1}, steps=20,
                    schedule="staged", log_every=5)
    manifest = report["budget"]["manifest_train_shards"]
    total = sum(t["samples"] for t in manifest.values())
    switch = round(20 * manifest["i2t"]["samples"] / total)
    consumed = report["budget"]["by_label"]
    assert consumed["i2t"]["samples"] == switch * 16
    assert consumed["t2i"]["samples"] == (20 - switch) * 16
    # the first log window (5 steps) saw only i2t, the last only t2i
    first, last = report["history"][0]["train"], report["history"][-1]["train"]
    assert switch >= 5 and first["n_L_I|T"] == 0 and first["n_L_T|I"] > 0
    assert last["n_L_I|T"] > 0 and last["n_L_T|I"] == 0


def test_resume_matches_an_uninterrupted_run(coco_shards, tmp_path):
    whole = _train(coco_shards, tmp_path / "whole", steps=30, checkpoint_every=0)
    part = _train(coco_shards, tmp_path / "part", steps=30, stop_after=10)
    assert part["status"] == "stopped" and part["step"] == 10
    resumed = _train(coco_shards, tmp_path / "part", steps=30)
    assert resumed["status"] == "finished" and resumed["step"] == 30
    # CPU fp32 with the same threads and the same replayed batches: bit-exact
    assert [h["train"] for h in resumed["history"]] == [h["train"] for h in whole["history"]]
    assert resumed["budget"] == whole["budget"]
    a = torch.load(tmp_path / "whole" / CHECKPOINT, weights_only=False)
    b = torch.load(tmp_path / "part" / CHECKPOINT, weights_only=False)
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
    assert a["positions"] == b["positions"] == {"mixed": 30}


def test_shards_of_another_vocabulary_are_refused(coco_shards, tmp_path):
    vocab = json.loads((coco_shards / "manifest.json").read_text())["vocab"]
    other_vq = {**vocab, "image_tokenizer": {**vocab["image_tokenizer"], "digest": "0" * 16}}
    cfg = _config(coco_shards, tmp_path, {"vocab": other_vq}, steps=2)
    with pytest.raises(VocabMismatch, match="image tokenizer") as err:
        train(parse_train_config(cfg), log=lambda _: None)
    assert "digest 0000000000000000" in str(err.value)
    bigger = {k: v for k, v in vocab.items() if k in ("text_vocab_size", "text_tokenizer")}
    cfg = _config(coco_shards, tmp_path, {"vocab": {**bigger, "image_codebook_size": 128}})
    (tmp_path / "t.yaml").write_text(yaml.safe_dump(cfg))
    cli = _cli("train", str(tmp_path / "t.yaml"))
    assert cli.returncode == 2 and "image codebook size" in cli.stderr
    assert "K=128" in cli.stderr and "K=64" in cli.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_torchrun_two_processes_on_gloo(coco_shards, tmp_path):
    cfg = _config(coco_shards, tmp_path / "ddp", {"d_model": 32, "n_layers": 1}, steps=12,
                  log_every=6)
    (tmp_path / "t.yaml").write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo",
           "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
         "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}",
         "-m", "pairforge.cli", "train", str(tmp_path / "t.yaml")],
        capture_output=True, text=True, env=env, timeout=240)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    report = json.loads((tmp_path / "ddp" / "report.json").read_text())
    assert report["world_size"] == 2 and report["status"] == "finished"
    consumed = report["budget"]["by_label"]
    assert sum(c["samples"] for c in consumed.values()) == 2 * 12 * 16  # both ranks counted
    assert report["final"]["heldout"]["L_T|I"] is not None


def test_cfg_sampling_captioning_and_the_sheet(trained, tmp_path):
    from PIL import Image

    from pairforge.train.sampling import caption_codes, generate_image_codes, load_model

    run, report = trained
    model, layout, _ = load_model(run)
    caption = list(b"A dog on a couch.")

    def draw(text, scale):
        return generate_image_codes(model, layout, text, 16, scale,
                                    generator=torch.Generator().manual_seed(3))

    codes = draw(caption, 3.0)
    assert codes.shape == (16,) and codes.min() >= 0 and codes.max() < 64
    # guidance 0 is the unconditional branch: the same as an empty caption
    assert np.array_equal(draw(caption, 0.0), draw([], 1.0))
    assert not np.array_equal(draw(caption, 3.0), draw([], 1.0))
    image = np.resize(codes, (8, 8))
    text = caption_codes(model, layout, image, max_tokens=16)
    assert text == caption_codes(model, layout, image, max_tokens=16)  # greedy
    assert all(0 <= t < layout.text_vocab_size for t in text)

    cli = _cli("sample", str(run), "-o", str(tmp_path / "s.png"), "-n", "2", "-p", "a red bus")
    assert cli.returncode == 0, cli.stderr
    result = json.loads((tmp_path / "s.json").read_text())
    assert [i["prompt"] for i in result["images"]] == ["a red bus"]
    assert len(result["captions"]) == 2 and result["captions"][0]["key"].startswith("00003")
    assert Image.open(tmp_path / "s.png").size == (2 * 160, 2 * (160 + 5 * 12 + 8))
