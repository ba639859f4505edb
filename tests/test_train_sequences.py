"""Sequence builder, target kinds, padding and the loss split (no shards needed)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pairforge.config import ConfigError
from pairforge.tokenizers.vocab import VocabLayout
from pairforge.train.config import parse_train_config
from pairforge.train.data import bucket
from pairforge.train.evaluate import LossSums, token_losses
from pairforge.train.loop import lr_factor
from pairforge.train.model import Transformer
from pairforge.train.sequences import Kind, build_sequence, collate

LAYOUT = VocabLayout(text_vocab_size=10, image_codebook_size=5)  # SOV 15 EOV 16 EOS 17 PAD 18
CAPTION = np.array([1, 2, 3], np.int32)
CODES = np.array([[0, 1], [2, 4]], np.int32)  # ids 10, 11, 12, 14
CF, IT, I0, TI, SP = (Kind.CAPTION_FIRST, Kind.IMAGE_AFTER_CAPTION, Kind.IMAGE_NO_CAPTION,
                      Kind.CAPTION_AFTER_IMAGE, Kind.SPECIAL)


def test_t2i_sequence_and_targets():
    seq = build_sequence("t2i", CAPTION, CODES, LAYOUT)
    assert seq.tokens.tolist() == [17, 1, 2, 3, 15, 10, 11, 12, 14, 16, 17]
    # target j is tokens[j + 1]: caption (first, still a target), SOV, image | caption, EOV, EOS
    assert seq.kinds.tolist() == [CF, CF, CF, SP, IT, IT, IT, IT, SP, SP]
    assert seq.task == "t2i" and seq.n_image_tokens == 4


def test_i2t_sequence_and_targets():
    seq = build_sequence("i2t", CAPTION, CODES, LAYOUT)
    assert seq.tokens.tolist() == [17, 15, 10, 11, 12, 14, 16, 1, 2, 3, 17]
    # image tokens of i2t stay targets (with no caption before them): L_I|0
    assert seq.kinds.tolist() == [SP, I0, I0, I0, I0, SP, TI, TI, TI, SP]


def test_img_sequence_and_targets():
    seq = build_sequence("img", CAPTION, CODES, LAYOUT)
    assert seq.tokens.tolist() == [17, 15, 10, 11, 12, 14, 16, 17]
    assert seq.kinds.tolist() == [SP, I0, I0, I0, I0, SP, SP]


def test_baseline_trains_i2t_as_caption_dropped_img():
    base = build_sequence("i2t", CAPTION, CODES, LAYOUT, recipe="baseline")
    assert base.task == "img" and base.label == "i2t"
    assert base.tokens.tolist() == build_sequence("img", CAPTION, CODES, LAYOUT).tokens.tolist()
    # the same image tokens with the same (empty) context: the image budget is identical
    assert (base.kinds == I0).sum() == 4
    assert build_sequence("t2i", CAPTION, CODES, LAYOUT, recipe="baseline").task == "t2i"


def test_out_of_range_ids_are_refused():
    with pytest.raises(ValueError):
        build_sequence("t2i", np.array([10]), CODES, LAYOUT)
    with pytest.raises(ValueError):
        build_sequence("t2i", CAPTION, np.array([5]), LAYOUT)


def test_padding_is_never_a_target():
    seqs = [build_sequence("t2i", CAPTION, CODES, LAYOUT), build_sequence("img", CAPTION,
                                                                         CODES, LAYOUT)]
    batch = collate(seqs, LAYOUT.pad)
    assert batch.inputs.shape == (2, 10)
    assert batch.kinds[1].tolist() == [SP, I0, I0, I0, I0, SP, SP, 0, 0, 0]
    assert batch.targets[1, 7:].tolist() == [LAYOUT.pad] * 3
    assert ((batch.targets == LAYOUT.pad) == (batch.kinds == Kind.PAD)).all()
    logits = torch.randn(2, 10, LAYOUT.total_size)
    losses = token_losses(logits, batch)
    assert (losses[1, 7:] == 0).all() and (losses[0] > 0).all()


def _random_batch(seed: int = 0):
    rng = np.random.default_rng(seed)
    seqs = []
    for task in ["t2i", "i2t", "img", "t2i", "i2t"]:
        caption = rng.integers(0, 10, rng.integers(1, 6))
        codes = rng.integers(0, 5, (2, 2))
        seqs.append(build_sequence(task, caption, codes, LAYOUT))
    return collate(seqs, LAYOUT.pad)


def test_loss_split_sums_to_the_total():
    from pairforge.train.config import ModelConfig

    torch.manual_seed(0)
    model = Transformer(ModelConfig(d_model=16, n_layers=1, n_heads=2, max_seq_len=32),
                        LAYOUT.total_size)
    batch = _random_batch()
    with torch.no_grad():
        logits = model(batch.inputs)
    sums = LossSums()
    sums.add(token_losses(logits, batch), batch)
    summary = sums.summary()
    # the total is the ordinary mean over non-padding targets
    expected = F.cross_entropy(logits.flatten(0, 1), batch.targets.flatten(),
                               ignore_index=LAYOUT.pad)
    assert summary["loss"] == pytest.approx(float(expected), rel=1e-6)
    kinds = ["L_I|T", "L_I|0", "L_T|I", "L_T", "L_special"]
    by_kind = sum(summary[k] * summary[f"n_{k}"] for k in kinds)
    by_task = sum(t["loss"] * t["targets"] for t in summary["tasks"].values())
    total = summary["loss"] * summary["targets"]
    assert by_kind == pytest.approx(total, rel=1e-9) and by_task == pytest.approx(total, rel=1e-9)
    assert sum(summary[f"n_{k}"] for k in kinds) == int((batch.kinds != 0).sum())
    # 2 t2i with 4 image tokens after a caption; 2 i2t + 1 img with 4 each without
    assert summary["n_L_I|T"] == 8 and summary["n_L_I|0"] == 12


def test_causal_model_ignores_padding_after_a_sequence():
    from pairforge.train.config import ModelConfig

    torch.manual_seed(0)
    model = Transformer(ModelConfig(d_model=16, n_layers=2, n_heads=2, max_seq_len=32),
                        LAYOUT.total_size)
    seq = build_sequence("img", CAPTION, CODES, LAYOUT)
    alone = collate([seq], LAYOUT.pad)
    padded = collate([seq, build_sequence("t2i", CAPTION, CODES, LAYOUT)], LAYOUT.pad)
    n = alone.inputs.shape[1]
    assert torch.allclose(model(alone.inputs)[0], model(padded.inputs)[0, :n], atol=1e-5)


def test_bucketing_keeps_every_sequence_once_and_batches_full():
    rng = np.random.default_rng(0)
    seqs = [build_sequence("t2i", rng.integers(0, 10, rng.integers(1, 20)), CODES, LAYOUT)
            for _ in range(50)]
    batches = list(bucket(iter(seqs), 4, 3, random.Random(0)))
    assert sorted(id(s) for b in batches for s in b) == sorted(id(s) for s in seqs)
    assert [len(b) for b in batches].count(4) == 12 and sum(len(b) for b in batches) == 50
    # sorting inside a buffer cuts padding against batching in stream order
    padded = sum(max(len(s.tokens) for s in b) * len(b) for b in batches)
    plain = sum(max(len(s.tokens) for s in seqs[i:i + 4]) * len(seqs[i:i + 4])
                for i in range(0, 50, 4))
    assert padded < plain


def test_train_config_is_strict_and_takes_overrides():
    cfg = parse_train_config({"data": {"path": "x"}}, ["run.steps=7", "model.d_model=32"])
    assert cfg.run.steps == 7 and cfg.model.d_model == 32
    with pytest.raises(ConfigError, match="unknown key 'run.stepz'"):
        parse_train_config({"data": {"path": "x"}, "run": {"stepz": 3}})
    with pytest.raises(ConfigError, match="run.recipe"):
        parse_train_config({"data": {"path": "x"}, "run": {"recipe": "other"}})
    with pytest.raises(ConfigError, match="multiple of n_heads"):
        parse_train_config({"data": {"path": "x"}, "model": {"d_model": 30, "n_heads": 4}})


def test_warmup_then_cosine():
    cfg = parse_train_config({"data": {"path": "x"}, "run": {"steps": 110},
                              "optim": {"warmup_steps": 10, "min_lr_ratio": 0.1}})
    assert lr_factor(0, cfg) == pytest.approx(0.1) and lr_factor(9, cfg) == pytest.approx(1.0)
    assert lr_factor(60, cfg) == pytest.approx(0.55)
    assert lr_factor(110, cfg) == pytest.approx(0.1)
