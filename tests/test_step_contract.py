"""The step contract (pairforge/stage.py) is the one answer to what a step needs.

A toy model step, added as a class, a config section and its line in the chain only, is
seen by preflight, the settings digest, the start-up line and the manifest; none of
them names a step. CLIP's two-pass threshold is the step's own mergeable state.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from pydantic import Field

from pairforge.config import ConfigError, ModelPoolConfig, PairforgeConfig, ProcessConfig
from pairforge.pipeline import chain
from pairforge.sources import ModelFolder
from pairforge.stage import ModelStep, Requirements, StepResult, setting_values

PACKAGE = Path(__file__).resolve().parents[1] / "pairforge"


# -- a new step: its config section, its class ---------------------------------------------

class ToyConfig(ModelPoolConfig):
    enabled: bool = False
    model: str = "toy-model"
    cutoff: float = 0.5


class ToyProcessConfig(ProcessConfig):
    toy: ToyConfig = Field(default_factory=ToyConfig)


class ToyPairforgeConfig(PairforgeConfig):
    process: ToyProcessConfig = Field(default_factory=ToyProcessConfig)


class ToyStep(ModelStep):
    name = "toy"
    requires = ("image",)

    @classmethod
    def pool_config(cls, cfg: PairforgeConfig) -> ModelPoolConfig:
        return cfg.process.toy

    @classmethod
    def enabled(cls, cfg: PairforgeConfig) -> bool:
        return cfg.process.toy.enabled

    @classmethod
    def requirements(cls, cfg: PairforgeConfig) -> Requirements:
        toy = cfg.process.toy
        return Requirements(
            display=toy.model,
            sources=(ModelFolder("process.toy.model", toy.model,
                                 (("config.json",), ("toy.safetensors",)), hub=False),),
            settings=setting_values(toy, "process.toy."))

    @classmethod
    def manifest_entries(cls, cfg: PairforgeConfig, first: dict, totals: dict) -> dict:
        return {"models": {"toy": cfg.process.toy.model if cls.enabled(cfg) else None}}

    def process(self, rows: pa.Table) -> StepResult:
        return StepResult()


@pytest.fixture
def with_toy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its line in the chain, after the built-in steps."""
    built_in = chain.stage_steps
    monkeypatch.setattr(chain, "stage_steps", lambda cfg: [*built_in(cfg), ToyStep])


def _cfg(tmp_path: Path, **toy) -> ToyPairforgeConfig:
    return ToyPairforgeConfig.model_validate({
        "input": {"path": "unused"}, "output": {"path": str(tmp_path / "out")},
        "process": {"toy": {"enabled": True, "model": str(tmp_path / "toy"), **toy}}})


def _toy_model(tmp_path: Path, weights: bytes = b"w1") -> None:
    (tmp_path / "toy").mkdir(exist_ok=True)
    (tmp_path / "toy" / "config.json").write_text("{}")
    (tmp_path / "toy" / "toy.safetensors").write_bytes(weights)


def test_preflight_checks_the_toy_steps_model(tmp_path, with_toy):
    from pairforge.pipeline.preflight import check_model_sources, preflight

    cfg = _cfg(tmp_path)
    with pytest.raises(ConfigError) as err:
        check_model_sources(cfg)
    assert str(err.value).splitlines()[1:] == [
        f"  process.toy.model: {tmp_path / 'toy'} is not a folder"]
    (tmp_path / "toy").mkdir()
    (tmp_path / "toy" / "config.json").write_text("{}")
    with pytest.raises(ConfigError) as err:
        preflight(cfg, "process")  # the whole stage's preflight asks the same steps
    assert f"process.toy.model: {tmp_path / 'toy'} has no toy.safetensors" in str(err.value)
    _toy_model(tmp_path)
    check_model_sources(cfg)
    check_model_sources(_cfg(tmp_path / "elsewhere", enabled=False))  # off: not asked


def test_the_settings_digest_records_the_toy_steps_settings_and_model_files(tmp_path,
                                                                            with_toy):
    from pairforge.pipeline.settings import settings_digest, stage_settings

    _toy_model(tmp_path)
    before = stage_settings(_cfg(tmp_path), "process")
    assert before["process.toy.cutoff"] == 0.5 and before["process.toy.enabled"] is True
    assert "process.toy.model#files" in before
    assert not any(k.startswith("process.toy.") and k.endswith(("pool_size", "batch_size"))
                   for k in before)  # how fast, not what
    assert stage_settings(_cfg(tmp_path, pool_size=4, batch_size=2), "process") == before
    changed = stage_settings(_cfg(tmp_path, cutoff=0.7), "process")
    assert {k for k in before if before[k] != changed[k]} == {"process.toy.cutoff"}
    _toy_model(tmp_path, b"w2")  # retrained in place
    retrained = stage_settings(_cfg(tmp_path), "process")
    assert {k for k in before if before[k] != retrained[k]} == {"process.toy.model#files"}
    assert settings_digest(retrained) != settings_digest(before)


def test_the_start_up_line_and_the_manifest_name_the_toy_model(tmp_path, with_toy):
    from pairforge.pipeline.process import _step_line, dataset_manifest
    from pairforge.shards.storage import OutputDir

    cfg = _cfg(tmp_path, pool_size=2)
    assert chain.enabled_steps(cfg)[-1] is ToyStep
    assert _step_line(ToyStep, cfg) == f"toy ({tmp_path / 'toy'} on 2 actors)"
    with dataset_manifest(OutputDir(str(tmp_path / "out")), cfg,
                          chain.stage_steps(cfg)) as manifest:
        models = manifest.fields["models"]
    assert models == {"clip": None, "clip_threshold": None, "recaption": None,
                                  "toy": str(tmp_path / "toy")}


def test_every_process_section_is_recorded_by_the_stage_or_a_step():
    """A config section no step claims would be left out of the digest: reruns would skip
    shards made under another value of it."""
    from pairforge.config import parse_config
    from pairforge.pipeline.settings import stage_settings

    cfg = parse_config({"input": {"path": "unused"}, "process": {
        "tokenize": {"image": {"path_or_id": "vq"}},
        "classifiers": [{"name": "a", "backend": "clip-head", "path": "h.pth"}],
        "clip": {"enabled": True},
        # decode.device's default is left out of the digest (ADDED_SETTINGS): not it
        "decode": {"where": "actor", "device": "cuda"}}})
    from pairforge.pipeline.contract import PROCESS_SPEED_KEYS

    recorded = {k.split(".")[1] for k in stage_settings(cfg, "process") if "." in k
                and k.startswith("process.")}
    assert recorded == set(ProcessConfig.model_fields) - set(PROCESS_SPEED_KEYS)
    assert not recorded & set(PROCESS_SPEED_KEYS)


# -- the scoring pass ----------------------------------------------------------------------

def test_the_top_fraction_threshold_is_learned_from_shards_in_any_order():
    from pairforge.config import parse_config
    from pairforge.filters.clip import ClipStep
    from pairforge.pipeline.contract import step_config

    cfg = step_config(parse_config({"input": {"path": "unused"}, "process": {
        "clip": {"enabled": True, "mode": "top_fraction", "top_fraction": 0.25}}}))
    assert ClipStep.needs_scoring_pass(cfg)
    scores = np.random.default_rng(0).uniform(0, 1, 40).astype(np.float32)
    shards = np.array_split(scores, 4)

    def over(parts):  # noqa: ANN001, ANN202 - the driver's map, here in one process
        return lambda fn: (fn(p) for p in parts)

    resolved, stats = ClipStep.learn(cfg, over(shards))
    again, _ = ClipStep.learn(cfg, over(shards[::-1]))
    expected = float(np.sort(scores)[::-1][9])  # the 10th highest of 40 keeps 25%
    assert resolved.process.clip.threshold == again.process.clip.threshold == expected
    assert resolved.process.clip.mode == "threshold" and cfg.process.clip.mode == "top_fraction"
    assert stats == {"clip_threshold": expected, "clip_top_fraction": 0.25}
    assert ClipStep.score_cut(resolved) == expected and ClipStep.score_cut(cfg) is None
    empty, _ = ClipStep.learn(cfg, over([]))
    assert empty.process.clip.threshold == float("-inf")


def test_the_generic_stage_3_driver_names_no_model():
    for name in ("process", "stream", "plan", "write", "placement"):
        assert "clip" not in (PACKAGE / "pipeline" / f"{name}.py").read_text().lower(), name
    assert "ClipStep" not in (PACKAGE / "pipeline" / "semantic_stage.py").read_text()


def test_a_recaption_first_build_cuts_no_semantic_rows_by_a_score_clip_does_not_give():
    """The scoring pass of a build whose CLIP judges the training caption (after recaptioning)
    leaves clip_score empty: a cut at the threshold would keep no row for semantic dedup."""
    from pairforge.config import parse_config
    from pairforge.filters.clip import ClipStep
    from pairforge.pipeline.contract import step_config

    def cut(score: str, caption: str) -> float | None:
        cfg = parse_config({"input": {"path": "x"}, "process": {
            "clip": {"enabled": True, "threshold": 0.3, "score": score},
            "recaption": {"enabled": True}, "tasks": {"caption": caption}}})
        return ClipStep.score_cut(step_config(cfg))

    assert cut("training", "recaption") is None and cut("both", "mix") is None
    assert cut("original", "recaption") == 0.3  # the alt-text is judged in the first pass
    assert cut("training", "original") == 0.3  # not recaption-first: judged here
