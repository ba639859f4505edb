"""Stage 3's step chain: every step the stage knows, in the order rows meet them.

This is the one place a step is named. Everything else asks the steps themselves (the
contract in pairforge/stage.py): whether each runs (``enabled``), what it loads and which
settings shape its output (``requirements``), what the stats and the manifest record of it.
Every answer is from the ``StepConfig`` a step is handed (``contract.step_config``: the
process section and the few settings of other parts a step reads), never the whole config.
A new step is its class, its config section and its line here.
"""

from __future__ import annotations

from pairforge.config import PairforgeConfig
from pairforge.filters.basic import BasicFilterStep
from pairforge.filters.classify import classifier_steps
from pairforge.filters.clip import ClipCandidatesStep, ClipStep, ClipTrainingStep
from pairforge.pipeline.contract import step_config
from pairforge.recaption.choice import TrainingCaptionStep
from pairforge.recaption.step import RecaptionStep, SecondRecaptionStep
from pairforge.stage import Step
from pairforge.tokenizers.step import TokenizeStep


def stage_steps(cfg: PairforgeConfig) -> list[type[Step]]:
    """Every step, on or off: the settings digest and the manifest record them all."""
    return [
        BasicFilterStep,
        ClipStep,
        # after the cheap filters and CLIP (a clip-head reads its embedding), before the
        # recaption step, so dropped rows cost no generation
        *classifier_steps(cfg.process.classifiers),
        RecaptionStep,
        SecondRecaptionStep,
        # recaption-first builds: CLIP scores the candidate captions, the choice takes one
        # (best: the highest), CLIP judges the chosen one
        ClipCandidatesStep,
        TrainingCaptionStep,
        ClipTrainingStep,
        TokenizeStep,
    ]


def enabled_steps(cfg: PairforgeConfig) -> list[type[Step]]:
    """The steps that run, in order."""
    handed = step_config(cfg)
    return [step for step in stage_steps(cfg) if step.enabled(handed)]
