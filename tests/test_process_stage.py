"""Stage 3 frame: basic filters and CLIP scores through Ray Data actor pools, resumable."""

from __future__ import annotations

import csv
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import golden
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import webdataset as wds
import yaml
from conftest import COCO_CAPTIONS, download_raw
from PIL import Image

from pairforge.config import parse_config
from pairforge.pipeline import process as process_module
from pairforge.pipeline.entry import RunOptions
from pairforge.pipeline.process import run_process

N_IMAGES = 40


@pytest.fixture(scope="session")
def tiny_clip(tmp_path_factory) -> dict:
    """The golden build's tiny open_clip (random weights), saved as a local checkpoint +
    model config named pf-tiny-clip."""
    return golden.tiny_clip(tmp_path_factory.mktemp("clip"), name="pf-tiny-clip")


def _coco_rows() -> list[tuple[str, str]]:
    with open(COCO_CAPTIONS, newline="") as f:
        return [(r["filename"], r["caption"].strip()) for r in csv.DictReader(f)][:N_IMAGES]


@pytest.fixture(scope="session")
def coco_raw(tmp_path_factory, coco_server, ray_local) -> Path:
    """Raw shards (stage 1 output) of 40 COCO photos, two short captions, one 404."""
    photos = _coco_rows()
    rows = [(coco_server.url("/img/" + name), caption) for name, caption in photos]
    rows[3] = (coco_server.url("/img/" + photos[2][0]), "tiny")  # fails the word count
    rows[9] = (coco_server.url("/status/404"), "gone")
    return download_raw(tmp_path_factory.mktemp("coco_raw"), rows, shard_size=10)


def _config(out: Path, clip: dict, **clip_overrides) -> dict:
    return {"input": {"path": "unused"}, "output": {"path": str(out)},
            "ray": {"num_cpus": 2}, "dedup": {"enabled": False},
            "process": {"basic": {"min_image_side": 64},
                        "clip": {"enabled": True, "batch_size": 8, **clip, **clip_overrides}}}


def _fresh_out(tmp_path: Path, coco_raw: Path) -> Path:
    out = tmp_path / "out"
    shutil.copytree(coco_raw / "raw", out / "raw")
    return out


def _bare_open_clip_scores(raw: Path, clip: dict) -> dict[str, float]:
    """What a plain open_clip loop computes for every ok raw sample."""
    import open_clip
    import torch

    open_clip.add_model_config(clip["model_config_path"])
    model, _, preprocess = open_clip.create_model_and_transforms(
        clip["model"], pretrained=clip["pretrained"])
    model.eval()
    tokenizer = open_clip.get_tokenizer(clip["model"])
    scores = {}
    tars = sorted(str(p) for p in raw.glob("*.tar"))
    for sample in wds.WebDataset(tars, shardshuffle=False):
        image = Image.open(io.BytesIO(sample["jpg"])).convert("RGB")
        with torch.no_grad():
            img = model.encode_image(preprocess(image)[None])
            txt = model.encode_text(tokenizer([sample["txt"].decode()]))
        img = img / img.norm(dim=-1, keepdim=True)
        txt = txt / txt.norm(dim=-1, keepdim=True)
        scores[sample["__key__"]] = float((img * txt).sum())
    return scores


def _rows(out: Path) -> dict[str, dict]:
    table = pq.read_table(sorted((out / "shards").glob("*.parquet")))
    return {r["key"]: r for r in table.to_pylist()}


def _tar_keys(out: Path) -> list[str]:
    tars = sorted(str(p) for p in (out / "shards").glob("*.tar"))
    return [s["__key__"] for s in wds.WebDataset(tars, shardshuffle=False)]


def test_threshold_mode_scores_match_bare_open_clip(tmp_path, coco_raw, tiny_clip, ray_local,
                                                   monkeypatch):
    from ray.data import DataContext

    # Ray Data is quieted where stage 3 builds its dataset (init_ray no longer imports it)
    monkeypatch.setattr(DataContext.get_current(), "enable_progress_bars", True)
    monkeypatch.setattr(DataContext.get_current(), "print_on_execution_start", True)
    bare = _bare_open_clip_scores(coco_raw / "raw", tiny_clip)
    eligible = {k: s for k, s in bare.items() if k != "000000003"}  # 'tiny' fails basic
    threshold = float(np.median(list(eligible.values())))
    out = _fresh_out(tmp_path, coco_raw)
    summary = run_process(parse_config(_config(out, tiny_clip, threshold=threshold)),
                          RunOptions(show_progress=False))
    rows = _rows(out)
    assert len(rows) == N_IMAGES and summary["rows"] == N_IMAGES
    assert rows["000000009"]["status"] == "http_error"
    assert rows["000000003"]["status"] == "caption_too_short"
    for key, score in eligible.items():
        assert rows[key]["clip_score"] == pytest.approx(score, abs=1e-5)
        expected = "ok" if np.float32(score) >= threshold else "low_clip_score"
        assert rows[key]["status"] == expected, key
    kept = sorted(k for k, r in rows.items() if r["status"] == "ok")
    assert _tar_keys(out) == kept
    assert len(kept) == sum(np.float32(s) >= threshold for s in eligible.values())
    stats = json.loads((out / "shards" / "00000_stats.json").read_text())
    assert stats["clip_model"].startswith("pf-tiny-clip/") and stats["count"] == 10
    # Ray Data's executor ran in the coordinator task (its CPU is reported), not here
    assert summary["coordinator_cpu_s"] > 0


def test_top_fraction_keeps_exactly_the_highest_scores(tmp_path, coco_raw, tiny_clip, ray_local):
    out = _fresh_out(tmp_path, coco_raw)
    cfg = _config(out, tiny_clip, mode="top_fraction", top_fraction=0.25, save_embeddings=True)
    run_process(parse_config(cfg), RunOptions(show_progress=False))
    rows = _rows(out)
    scored = {k: r["clip_score"] for k, r in rows.items() if r["clip_score"] is not None}
    assert len(scored) == N_IMAGES - 2
    best = sorted(scored, key=lambda k: -scored[k])[:round(0.25 * len(scored))]
    assert sorted(k for k, r in rows.items() if r["status"] == "ok") == sorted(best)
    embeddings = np.load(out / "embeddings" / "00000.npy")
    keys = json.loads((out / "embeddings" / "00000_keys.json").read_text())
    assert sorted(keys) == sorted(k for k in scored if k.startswith("00000"))
    assert embeddings.shape == (len(keys), golden.TINY_CLIP["embed_dim"])
    assert np.allclose(np.linalg.norm(embeddings, axis=1), 1, atol=1e-4)


def test_cached_scores_are_reused_only_under_the_same_settings(tmp_path, coco_raw, tiny_clip,
                                                                ray_local):
    """As if killed after CLIP's scoring pass (score files, no training shard): a rerun
    under the same settings trusts the cached scores; under others it scores again."""
    import pyarrow as pa

    out = _fresh_out(tmp_path, coco_raw)
    cfg = _config(out, tiny_clip, mode="top_fraction", top_fraction=0.25)
    run_process(parse_config(cfg), RunOptions(show_progress=False))
    real = {k: r["clip_score"] for k, r in _rows(out).items() if r["clip_score"] is not None}

    def killed_after_scoring(digest: bytes | None) -> None:
        shutil.rmtree(out / "shards")
        for path in (out / "clip").glob("*.parquet"):
            table = pq.read_table(path)
            forged = pa.array([None if s is None else 0.5 for s in table["clip_score"].to_pylist()],
                              pa.float32())
            table = table.set_column(table.schema.get_field_index("clip_score"), "clip_score",
                                     forged)
            pq.write_table(table.replace_schema_metadata(
                {b"pairforge.settings": digest} if digest else table.schema.metadata), path)

    killed_after_scoring(None)  # the digest as written: this run's settings
    run_process(parse_config(cfg), RunOptions(show_progress=False))
    assert {k: r["clip_score"] for k, r in _rows(out).items() if k in real} == dict.fromkeys(
        real, 0.5)
    killed_after_scoring(b"0123456789abcdef")  # made under other settings
    run_process(parse_config(cfg), RunOptions(show_progress=False))
    rescored = {k: r["clip_score"] for k, r in _rows(out).items() if k in real}
    assert rescored == pytest.approx(real, abs=1e-5)  # batches may group rows differently


def test_two_model_pools_do_not_hang_two_cores(tmp_path, coco_raw, tiny_clip, ray_local,
                                              monkeypatch):
    """Two CLIP pools of two actors each on a 2-CPU Ray: fractional CPUs keep it moving."""
    from pairforge.filters.basic import BasicFilterStep
    from pairforge.filters.clip import ClipStep

    class SecondClipStep(ClipStep):
        name = "clip2"

    monkeypatch.setattr(process_module, "enabled_steps",
                        lambda cfg: [BasicFilterStep, ClipStep, SecondClipStep])
    out = _fresh_out(tmp_path, coco_raw)
    cfg = parse_config(_config(out, tiny_clip, pool_size=2, mode="score_only"))
    summary = run_process(cfg, RunOptions(show_progress=False))
    assert summary["status"] == {"ok": N_IMAGES - 2, "http_error": 1, "caption_too_short": 1}


def test_a_pool_shares_one_shard_batch_by_batch(tmp_path, coco_raw, ray_local, monkeypatch,
                                                 tiny_clip):
    """A shard is cut into blocks (placement.BLOCK_ROWS rows, 1 here for a 10-row shard),
    so both actors of a pool work on it (a shard used to be one block, which went to one
    actor whatever the pool size)."""
    import pyarrow as pa

    from pairforge.pipeline import placement
    from pairforge.stage import ModelStep, StepResult

    class ActorPidStep(ModelStep):  # a model step that says which actor ran each row
        name = "actor_pid"
        requires = ("image",)
        provides = {"actor_pid": pa.int64()}

        @classmethod
        def pool_config(cls, cfg):
            return cfg.process.clip

        def process(self, rows):
            time.sleep(0.5)  # busy while the next batch is handed out
            return StepResult(columns={"actor_pid": [os.getpid()] * rows.num_rows})

    from ray.data import DataContext

    monkeypatch.setattr(process_module, "enabled_steps", lambda cfg: [ActorPidStep])
    monkeypatch.setattr(placement, "BLOCK_ROWS", 1)
    # both actors up before the first batch, so a slow start cannot leave one idle
    monkeypatch.setattr(DataContext.get_current(), "wait_for_min_actors_s", 120)
    out = _fresh_out(tmp_path, coco_raw)
    for extra in (out / "raw").iterdir():
        if not extra.name.startswith("00000"):
            extra.unlink()
    cfg = parse_config(_config(out, tiny_clip, pool_size=2, batch_size=1))
    summary = run_process(cfg, RunOptions(show_progress=False))
    assert summary["status"] == {"ok": 9, "http_error": 1}
    pids = [r["actor_pid"] for r in _rows(out).values() if r["status"] == "ok"]
    assert len(pids) == 9 and None not in pids and len(set(pids)) == 2


def test_shards_are_written_while_the_pool_still_works(tmp_path, coco_raw, ray_local,
                                                      monkeypatch, tiny_clip):
    """A shard is written as soon as its rows are back, while the actors go on with later
    shards. (After an actor pool, an operator that asked Ray for a whole CPU waited for
    the pool to end, so every write came after the last model call and every image
    stayed in the object store until then.)"""
    import pyarrow as pa

    from pairforge.stage import ModelStep, StepResult

    ok_rows = N_IMAGES - 1  # one 404; the basic filter is off
    out_dir = None

    class LastBatchWaits(ModelStep):  # one actor: its last batch is the run's last
        name = "last_batch_waits"
        provides = {"shards_written": pa.int64()}
        seen = 0

        @classmethod
        def pool_config(cls, cfg):
            return cfg.process.clip

        def process(self, rows):
            self.seen += rows.num_rows
            written = []
            deadline = time.monotonic() + 60
            # Ray may hand the last batch over in one task with a neighbour shard's last
            # rows, but the shards before those are back and written by now
            while self.seen == ok_rows and not written and time.monotonic() < deadline:
                written = list((out_dir / "shards").glob("*_stats.json"))
                time.sleep(0.1)
            return StepResult(columns={"shards_written": [len(written)] * rows.num_rows})

    monkeypatch.setattr(process_module, "enabled_steps", lambda cfg: [LastBatchWaits])
    out_dir = _fresh_out(tmp_path, coco_raw)
    # the actor asks for all the CPUs that the stage's tasks leave (1.25 of 2)
    cfg = parse_config(_config(out_dir, tiny_clip, pool_size=1, batch_size=2, num_cpus=2))
    run_process(cfg, RunOptions(show_progress=False))
    written = [r["shards_written"] for r in _rows(out_dir).values() if r["status"] == "ok"]
    assert len(written) == ok_rows
    assert max(written) >= 1, written  # a shard was complete before the last model call


def _seconds_since_boot() -> float:
    with open("/proc/uptime") as f:
        return float(f.read().split()[0])


def test_task_workers_outlive_pauses_while_actors_hold_the_cpus(ray_local):
    """While two actors hold the 2 CPUs, a task after a pause of 1.5 s runs in a worker
    that was already there. (Ray's default keeps one idle worker per CPU, actors included,
    and kills the others after 1 s: each task of stage 3 then paid for a new process.)"""
    import ray

    @ray.remote(num_cpus=0.75)
    class Holder:
        def ready(self) -> bool:
            return True

    def worker_started() -> tuple[int, float]:  # defined here: Ray ships it by value
        """(pid, start time in seconds since boot) of the process this runs in."""
        with open(f"/proc/{os.getpid()}/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        return os.getpid(), ticks / os.sysconf("SC_CLK_TCK")

    holders = [Holder.remote() for _ in range(2)]
    ray.get([h.ready.remote() for h in holders])
    started = ray.remote(num_cpus=0.25)(worker_started)
    ray.get(started.remote())
    for _ in range(2):
        pause_began = _seconds_since_boot()
        time.sleep(1.5)
        pid, worker_started = ray.get(started.remote())
        assert worker_started < pause_began, f"worker {pid} was started after the pause"
    for holder in holders:
        ray.kill(holder)


@pytest.mark.slow
def test_resume_after_sigkill_gives_same_output(tmp_path, coco_raw, tiny_clip, ray_env):
    """The CLI (joined to this worker's Ray) killed with SIGKILL while its last shard is
    held; the rerun (in this process) completes it as one whole run would, to the bit."""
    def config(out: Path) -> dict:
        cfg = _config(out, tiny_clip, mode="threshold", threshold=-1.0)
        cfg["process"]["clip"]["batch_size"] = 2
        return cfg

    killed = _fresh_out(tmp_path / "k", coco_raw)
    cfg_path = tmp_path / "killed.yaml"
    cfg_path.write_text(yaml.safe_dump(config(killed)))
    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("hold_last_shard.py")),
                             "process", str(cfg_path), "-q"], start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=ray_env)
    deadline = time.monotonic() + 420  # a slow start on a loaded host is not a failure
    while not list((killed / "shards").glob("*_stats.json")):
        assert proc.poll() is None, proc.stderr.read().decode()
        assert time.monotonic() < deadline
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert len(list((killed / "shards").glob("*_stats.json"))) < 4
    run_process(parse_config(config(killed)), RunOptions(show_progress=False))
    whole = _fresh_out(tmp_path / "w", coco_raw)
    run_process(parse_config(config(whole)), RunOptions(show_progress=False))
    assert _rows(killed) == _rows(whole)
    assert _tar_keys(killed) == _tar_keys(whole)
    assert not [p for p in (killed / "shards").iterdir() if ".tmp-" in p.name]


def test_actor_cpus_leave_room_for_tasks():
    from pairforge.filters.basic import BasicFilterStep
    from pairforge.filters.clip import ClipStep
    from pairforge.pipeline.placement import TASK_CPU_RESERVE, fit_actor_cpus

    class Other(ClipStep):
        name = "other"

    cfg = parse_config({"input": {"path": "x"},
                        "process": {"clip": {"pool_size": 2, "num_cpus": 1.0}}})
    cpus = fit_actor_cpus([BasicFilterStep, ClipStep, Other], cfg, cluster_cpus=2)
    assert set(cpus) == {"clip", "other"}
    assert 2 * cpus["clip"] + 2 * cpus["other"] == pytest.approx(2 - TASK_CPU_RESERVE)
    assert fit_actor_cpus([ClipStep], cfg, cluster_cpus=64) == {"clip": 1.0}


@pytest.fixture(scope="session")
def tiny_vq(tmp_path_factory) -> str:
    """Our VQ-VAE at 32 px, random weights, saved the way train-vq saves it."""
    import torch

    from pairforge.tokenizers import vqvae

    torch.manual_seed(0)
    model = vqvae.VQVAE(vqvae.VQVAEConfig(resolution=32, channels=[16, 32], codebook_size=64,
                                          embed_dim=8))
    return str(vqvae.save(model, tmp_path_factory.mktemp("vq") / "ckpt"))


def test_tokenize_step_writes_codes_tokens_and_tasks(tmp_path, coco_raw, tiny_vq, ray_local):
    from pairforge.tokenizers.registry import load_image_tokenizer
    from pairforge.tokenizers.text import ByteTokenizer

    out = _fresh_out(tmp_path, coco_raw)
    cfg = _config(out, {}, enabled=False)
    cfg["process"]["tokenize"] = {"enabled": True, "batch_size": 8,
                                  "image": {"backend": "pairforge-vq", "path_or_id": tiny_vq}}
    cfg["process"]["tasks"] = {"p_drop": 0.25, "seed": 1}
    run_process(parse_config(cfg), RunOptions(show_progress=False))

    tokenizer = load_image_tokenizer({"backend": "pairforge-vq", "path_or_id": tiny_vq})
    tars = sorted(str(p) for p in (out / "shards").glob("*.tar"))
    samples = list(wds.WebDataset(tars, shardshuffle=False).decode())
    assert len(samples) == N_IMAGES - 2
    bare = tokenizer.encode([Image.open(io.BytesIO(raw["jpg"])).convert("RGB") for raw in
                             wds.WebDataset(sorted(str(p) for p in (coco_raw / "raw").glob(
                                 "*.tar")), shardshuffle=False) if raw["__key__"] != "000000003"])
    for sample, codes in zip(samples, bare, strict=True):
        meta = sample["json"]
        assert set(sample) >= {"jpg", "txt", "json", "vq.npy", "tok.npy"}
        assert sample["vq.npy"].dtype == np.int32 and sample["vq.npy"].shape == (8, 8)
        assert np.array_equal(sample["vq.npy"], codes)  # what the bare tokenizer gives
        assert sample["tok.npy"].tolist() == ByteTokenizer().encode(sample["txt"])
        assert meta["n_image_tokens"] == 64 and meta["token_grid"] == [8, 8]
        assert meta["n_caption_tokens"] == len(sample["tok.npy"])
        assert meta["task"] in {"t2i", "i2t"}
    stats = [json.loads(p.read_text()) for p in sorted((out / "shards").glob("*_stats.json"))]
    for shard in stats:  # batches of 8 span the shards of 10: each still names its layout
        assert shard["vocab"]["image_codebook_size"] == 64
        tasks = shard["tasks"]
        total = sum(t["image_tokens"] for t in tasks.values())
        assert abs(tasks.get("i2t", {}).get("image_tokens", 0) - 0.25 * total) <= 64
        assert shard["budget"]["max_prefix_deviation"] <= 64
        assert all(t["sequence_tokens"] == t["image_tokens"] + t["caption_tokens"]
                   + 4 * t["samples"] for t in tasks.values())
    i2t = sum(s["json"]["task"] == "i2t" for s in samples)
    assert sum(s["tasks"].get("i2t", {}).get("samples", 0) for s in stats) == i2t


def test_manifest_sizes_and_wids_index(tmp_path, coco_raw, tiny_vq, ray_local):
    import wids

    from pairforge.tokenizers.vocab import VocabLayout

    out = _fresh_out(tmp_path, coco_raw)
    cfg = _config(out, {}, enabled=False)
    cfg["process"]["tokenize"] = {"enabled": True, "image": {"path_or_id": tiny_vq}}
    cfg["process"]["tasks"] = {"p_drop": 0.5}
    run_process(parse_config(cfg), RunOptions(show_progress=False))
    manifest = json.loads((out / "manifest.json").read_text())
    layout = VocabLayout.from_manifest(manifest["vocab"])
    assert (layout.text_vocab_size, layout.image_codebook_size) == (256, 64)
    assert manifest["vocab"]["sov"] == 320 and manifest["vocab"]["pad"] == 323
    tasks = manifest["totals"]["tasks"]
    assert sum(t["samples"] for t in tasks.values()) == N_IMAGES - 2
    assert sum(t["image_tokens"] for t in tasks.values()) == 64 * (N_IMAGES - 2)
    assert abs(manifest["budget"]["realized_unconditional_share"] - 0.5) <= 4 * 64 / (64 * 38)
    assert manifest["funnel"]["input_rows"] == N_IMAGES
    assert manifest["funnel"]["final"] == {"ok": 38, "http_error": 1, "caption_too_short": 1}
    log = (out / manifest["log"]).read_text()  # the run's log, named by the manifest
    assert re.match(r"logs/process-\d{8}T\d{6}Z\.log$", manifest["log"])
    assert re.search(r"INFO process: steps basic, .*tokenize \(\S+ on 1 actor\)", log), log
    # shards of 10 rows: the first lost row 9 to a 404 (basic sees 9) and row 3 to its
    # one-word caption
    assert re.search(r"INFO shards/00000: 10 rows, 8 ok; steps: basic 9 rows [\d.]+ s, "
                     r"tokenize 8 rows [\d.]+ s, training_caption 8 rows", log), log
    assert "WARNING shards/00000: 1 caption_too_short, e.g. 000000003" in log
    assert re.search(r"WARNING shards/00000: 1 http_error, e\.g\. 000000009 \(.*404", log), log
    assert log.rstrip().endswith("INFO process finished")
    sizes = json.loads((out / "sizes.json").read_text())
    assert sizes == json.loads((out / "shards" / "sizes.json").read_text())
    assert sum(sizes.values()) == N_IMAGES - 2
    dataset = wids.ShardListDataset(str(out / "index.wids.json"))
    assert len(dataset) == N_IMAGES - 2
    assert dataset[0]["__key__"] == "000000000"


@pytest.fixture(scope="module")
def tokenized_dataset(tmp_path_factory, coco_raw, tiny_vq, ray_local) -> Path:
    out = _fresh_out(tmp_path_factory.mktemp("tokenized"), coco_raw)
    cfg = _config(out, {}, enabled=False)
    cfg["process"]["tokenize"] = {"enabled": True, "image": {"path_or_id": tiny_vq}}
    cfg["process"]["tasks"] = {"p_drop": 0.3}
    run_process(parse_config(cfg), RunOptions(show_progress=False))
    return out


def _copy(dataset: Path, tmp_path: Path) -> Path:
    target = tmp_path / "copy"
    shutil.copytree(dataset, target)
    return target


def _rewrite_tar(path: Path, edit) -> None:
    import tarfile

    with tarfile.open(path) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]
    with tarfile.open(path, "w") as tar:
        for member, data in edit(members):
            member.size = len(data)
            tar.addfile(member, io.BytesIO(data))


def test_verify_passes_a_good_dataset(tokenized_dataset):
    from pairforge.inspection.verify import verify_dataset

    assert verify_dataset(str(tokenized_dataset)) == []
    cli = subprocess.run([sys.executable, "-m", "pairforge.cli", "verify",
                          str(tokenized_dataset)], capture_output=True, text=True)
    assert cli.returncode == 0 and "matches" in cli.stdout  # the answer is data: stdout


def test_verify_catches_a_deleted_sample(tokenized_dataset, tmp_path):
    from pairforge.inspection.verify import verify_dataset

    data = _copy(tokenized_dataset, tmp_path)
    _rewrite_tar(data / "shards" / "00001.tar",
                 lambda ms: [(m, d) for m, d in ms if not m.name.startswith("000010000.")])
    problems = verify_dataset(str(data))
    assert any("00001.tar: 9 samples, manifest says 10" in p for p in problems)
    cli = subprocess.run([sys.executable, "-m", "pairforge.cli", "verify", str(data)],
                         capture_output=True, text=True)
    assert cli.returncode == 1


def test_verify_names_a_member_without_an_extension(tokenized_dataset, tmp_path):
    import tarfile

    from pairforge.inspection.verify import verify_dataset

    data = _copy(tokenized_dataset, tmp_path)
    _rewrite_tar(data / "shards" / "00001.tar",
                 lambda ms: [*ms, (tarfile.TarInfo("README"), b"stray")])
    problems = verify_dataset(str(data))
    assert "00001.tar: member README is not named KEY.EXT" in problems


def test_verify_catches_a_truncated_tar(tokenized_dataset, tmp_path):
    from pairforge.inspection.verify import verify_dataset

    data = _copy(tokenized_dataset, tmp_path)
    tar = data / "shards" / "00002.tar"
    tar.write_bytes(tar.read_bytes()[: tar.stat().st_size // 2])
    problems = verify_dataset(str(data))
    assert any("00002.tar" in p for p in problems)


def test_verify_catches_an_edited_token_file(tokenized_dataset, tmp_path):
    from pairforge.inspection.verify import verify_dataset

    data = _copy(tokenized_dataset, tmp_path)

    def shorten(members):
        for member, payload in members:
            if member.name == "000000001.tok.npy":
                buffer = io.BytesIO()
                np.save(buffer, np.load(io.BytesIO(payload))[:-3])
                payload = buffer.getvalue()
            yield member, payload

    _rewrite_tar(data / "shards" / "00000.tar", shorten)
    problems = verify_dataset(str(data))
    assert any("000000001 tok.npy has" in p for p in problems)
    assert any("caption_tokens is" in p for p in problems)


def test_verify_catches_a_manifest_whose_budget_is_off(tokenized_dataset, tmp_path):
    from pairforge.inspection.verify import verify_dataset

    data = _copy(tokenized_dataset, tmp_path)
    manifest = json.loads((data / "manifest.json").read_text())
    manifest["budget"]["target_unconditional_share"] = 0.6
    manifest["budget"]["realized_unconditional_share"] += 0.05
    (data / "manifest.json").write_text(json.dumps(manifest))
    problems = verify_dataset(str(data))
    assert any("is off the target 0.6" in p for p in problems)
    assert any("manifest states share" in p for p in problems)


def test_inspect_shows_funnel_budget_and_models(tokenized_dataset):
    cli = subprocess.run([sys.executable, "-m", "pairforge.cli", "inspect",
                          str(tokenized_dataset)], capture_output=True, text=True,
                         env={**os.environ, "COLUMNS": "160"})
    assert cli.returncode == 0, cli.stderr
    text = cli.stdout  # the answer of a read-only verb: stdout (messages: stderr)
    assert "38 samples from 40 input rows" in text
    assert "caption_too_short" in text and "http_error" in text
    assert "token budget per task" in text and "t2i" in text and "i2t" in text
    assert "image tokenizer: pairforge-vq" in text and "K=64" in text


def test_show_writes_a_contact_sheet_with_reconstructions(tokenized_dataset, tmp_path):
    sheet = tmp_path / "sheet.png"
    cli = subprocess.run([sys.executable, "-m", "pairforge.cli", "show", str(tokenized_dataset),
                          "--task", "i2t", "-n", "6", "-o", str(sheet)],
                         capture_output=True, text=True)
    assert cli.returncode == 0, cli.stderr
    image = Image.open(sheet)
    from pairforge.inspection.contact_sheet import LABEL_HEIGHT, LINE_HEIGHT, PAD, TEXT_LINES, TILE

    # 4 columns of image + reconstruction (2 x 192 px), 2 rows for 6 samples
    assert image.size == (4 * 2 * TILE,
                          2 * (LABEL_HEIGHT + TILE + TEXT_LINES * LINE_HEIGHT + 2 * PAD))
    none = subprocess.run([sys.executable, "-m", "pairforge.cli", "show", str(tokenized_dataset),
                           "--grep", "zzzz-no-such-word", "-o", str(tmp_path / "x.png")],
                          capture_output=True, text=True)
    assert none.returncode == 1 and "no sample matches" in none.stderr


def test_report_is_one_self_contained_page(tokenized_dataset, tmp_path):
    page = tmp_path / "report.html"
    cli = subprocess.run([sys.executable, "-m", "pairforge.cli", "report",
                          str(tokenized_dataset), "-o", str(page)], capture_output=True,
                         text=True)
    assert cli.returncode == 0, cli.stderr
    text = page.read_text()
    # funnel, budget prefix, caption tokens (every image has 64 tokens: said in a sentence)
    assert text.count("data:image/png;base64,") == 3
    assert "every one of the 38 images&#x27; token counts is 64" in text
    assert "38 training samples from 40 input rows" in text
    assert set(re.findall(r'(?:src|href)="([a-z]+):', text)) == {"data"}  # nothing fetched


def test_huggingface_datasets_reads_the_shards_unchanged(tokenized_dataset, tmp_path):
    import datasets

    tars = sorted(str(p) for p in (tokenized_dataset / "shards").glob("*.tar"))
    ds = datasets.load_dataset("webdataset", data_files={"train": tars}, split="train",
                               cache_dir=str(tmp_path / "hf"))
    assert ds.num_rows == N_IMAGES - 2
    assert {"jpg", "txt", "json", "vq.npy", "tok.npy", "__key__"} <= set(ds.column_names)
    row = ds[0]
    assert row["json"]["task"] in {"t2i", "i2t"} and len(row["json"]["phash"]) == 16
    assert np.asarray(row["vq.npy"]).shape == tuple(row["json"]["token_grid"])
    assert len(row["tok.npy"]) == row["json"]["n_caption_tokens"]


def test_the_layout_rides_on_each_shards_first_row_of_a_batch():
    """A batch spanning shards carries the vocabulary layout once per shard, so every
    shard's stats name it (once per batch left it to whichever shard led the batch)."""
    import pyarrow as pa

    from pairforge.tokenizers.step import _shard_starts

    rows = pa.table({"shard": [3, 3, 4, 4, 4, 5]})
    assert _shard_starts(rows) == [True, False, True, False, False, True]
    assert _shard_starts(pa.table({"key": ["a", "b"]})) == [True, False]


class _NoDuplicates:
    def of_shard(self, shard_id: int) -> set[str]:
        return set()


def _cut(table: pa.Table, sizes: list[int]) -> list[pa.Table]:
    """``table`` in consecutive slices of ``sizes`` (the last slice takes the rest)."""
    slices, start = [], 0
    for size in sizes:
        slices.append(table.slice(start, size))
        start += size
    return [*slices, table.slice(start)]


def test_model_outputs_do_not_depend_on_how_the_batches_are_cut(coco_raw, tiny_clip, tiny_vq):
    """A row's CLIP score and embedding and its VQ codes, to the bit, whether the step
    gets the shards' rows whole or cut into batches of 1, 2, 3 and 5 rows (a resume, an
    append or another pool size cuts Ray Data's batches elsewhere; with the tiny CLIP a
    forward of 1 row moves the last bits): every forward runs on batch_size rows
    (pairforge/batching.py)."""
    from pairforge.filters.clip import ClipStep
    from pairforge.pipeline.contract import step_config
    from pairforge.pipeline.stream import load_rows
    from pairforge.tokenizers.step import TokenizeStep

    cfg = _config(coco_raw, tiny_clip, mode="threshold", threshold=-1.0, batch_size=4)
    cfg["process"]["tokenize"] = {"enabled": True, "batch_size": 4,
                                  "image": {"path_or_id": tiny_vq}}
    cfg = parse_config(cfg)
    rows = load_rows(pa.table({"shard": [0, 1, 2]}), str(coco_raw), {}, _NoDuplicates())
    rows = rows.append_column("train_caption", rows["caption"])
    for step, columns in ((ClipStep(step_config(cfg)), ("clip_score", "clip_embedding")),
                          (TokenizeStep(step_config(cfg)), ("image_tokens",))):
        whole = step(rows)
        for sizes in ([1, 2, 3, 5, 1], [3, 3, 3, 3, 3, 3], [5, 1, 1, 7]):
            cut = pa.concat_tables([step(part) for part in _cut(rows, sizes)])
            for column in columns:
                assert cut[column].to_pylist() == whole[column].to_pylist(), (step.name,
                                                                               column, sizes)


def test_the_coordinator_iterates_fragment_records_not_rows(tmp_path, coco_raw, tiny_clip,
                                                            ray_local):
    """The chain's last tasks write each shard's rows, images included, as fragment files
    and return one small record per fragment: what reaches the coordinator holds no row
    (and the driver gets only snapshots of the counts)."""
    from pairforge.pipeline.chain import enabled_steps
    from pairforge.pipeline.placement import BLOCK_ROWS
    from pairforge.pipeline.plan import plan_shards
    from pairforge.pipeline.stream import _chain, _ChainSettings
    from pairforge.shards.storage import SHARDS_FOLDER, OutputDir

    out = _fresh_out(tmp_path, coco_raw)
    cfg = parse_config(_config(out, tiny_clip, mode="threshold", threshold=-1.0))
    store = OutputDir(str(out))
    plans = plan_shards(store, cfg, SHARDS_FOLDER)
    records = _chain(cfg, store, plans, enabled_steps(cfg),
                     _ChainSettings((), BLOCK_ROWS, None)).take_all()
    assert {tuple(sorted(r)) for r in records} == {
        ("fragment", "rows", "shard", "statuses", "through")}
    assert sum(r["rows"] for r in records) == sum(p.to_process for p in plans) == 39
    fragments = sorted((out / "process-work").rglob("*.parquet"))
    assert len(fragments) == len(records)
    table = pq.read_table(fragments[0])
    assert {"image", "clip_score", "key"} <= set(table.column_names)


def test_fragments_a_stopped_run_left_are_removed_not_read(tmp_path, coco_raw, tiny_clip,
                                                           ray_local):
    out = _fresh_out(tmp_path, coco_raw)
    stale = out / "process-work" / "00000"
    stale.mkdir(parents=True)
    pq.write_table(pa.table({"key": ["000000000"], "status": ["bogus"]}),
                   stale / "000000000.parquet")
    run_process(parse_config(_config(out, tiny_clip, mode="threshold", threshold=-1.0)),
                RunOptions(show_progress=False))
    assert not (out / "process-work").exists()
    rows = _rows(out)
    assert len(rows) == N_IMAGES and rows["000000000"]["status"] == "ok"


def test_gpu_demand_sums_every_pool_hidden_ones_included():
    """Ray Data runs every pool at once: their GPUs add up, clip_candidates' second pool
    of process.clip included, and fractions share a GPU (issue 49)."""
    from pairforge.config import ConfigError
    from pairforge.filters.clip import ClipCandidatesStep, ClipStep
    from pairforge.pipeline.placement import check_gpu_demand, gpu_demand
    from pairforge.tokenizers.step import TokenizeStep

    steps = [ClipStep, ClipCandidatesStep, TokenizeStep]
    fits = parse_config({"input": {"path": "x"}, "process": {
        "clip": {"pool_size": 2, "num_gpus": 0.25}, "tokenize": {"num_gpus": 0}}})
    assert [gpus for _, gpus in gpu_demand(steps, fits)] == [0.5, 0.5]
    check_gpu_demand(steps, fits, cluster_gpus=1)  # 0.25 x 2 x 2 pools: one GPU

    over = parse_config({"input": {"path": "x"}, "process": {
        "clip": {"pool_size": 2, "num_gpus": 0.25}, "tokenize": {"num_gpus": 0.25}}})
    with pytest.raises(ConfigError) as err:
        check_gpu_demand(steps, over, cluster_gpus=1)
    message = str(err.value)
    assert "ask for 1.25 GPUs at once and the cluster has 1" in message
    for key in ("clip: process.clip.pool_size 2 x process.clip.num_gpus 0.25",
                "clip_candidates: process.clip.pool_size 2",
                "tokenize: process.tokenize.pool_size 1 x process.tokenize.num_gpus 0.25"):
        assert key in message


def test_over_asking_for_gpus_stops_before_any_shard(tmp_path, coco_raw, tiny_clip):
    """This machine's Ray has no GPU: a CLIP pool asking for one would wait forever."""
    from pairforge.config import ConfigError

    out = _fresh_out(tmp_path, coco_raw)
    cfg = parse_config(_config(out, tiny_clip, num_gpus=1))
    with pytest.raises(ConfigError, match=r"process\.clip\.num_gpus 1 = 1 GPUs"):
        run_process(cfg, RunOptions())
    assert not list((out / "shards").glob("*.tar"))


def test_build_checks_stage_three_gpus_before_downloading(tmp_path, tiny_clip, ray_env):
    """`pairforge build` asks stage 3's GPU question before stage 1 fetches a byte: an
    over-asking config exits 2 with the key named and no raw shard written."""
    import subprocess
    import sys

    import yaml

    (tmp_path / "in.csv").write_text("url,caption\nhttp://127.0.0.1:9/a.jpg,a photo\n")
    cfg = _config(tmp_path / "out", tiny_clip, num_gpus=1)
    cfg["input"]["path"] = str(tmp_path / "in.csv")
    cfg["download"] = {"allow_addresses": ["127.0.0.1/32"]}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    result = subprocess.run([sys.executable, "-m", "pairforge.cli", "build",
                             str(tmp_path / "c.yaml"), "-q"], capture_output=True, text=True,
                            timeout=300, env=ray_env)
    assert result.returncode == 2, result.stderr
    assert "process.clip.num_gpus 1" in result.stderr
    assert not list((tmp_path / "out").rglob("*.tar"))
