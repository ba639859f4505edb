"""The scene world's captioner before it learns: a random-weight BLIP ("small": 2 layers,
64 wide, ~1 MB) with a byte-level BPE trained on the world's captions, saved with
``save_pretrained`` so the recaption step loads the folder through ``AutoProcessor`` /
``AutoModelForImageTextToText`` as it loads a hub id. scenes/captioner.py teaches it.

No model hub is reachable here (DESIGN.md section 8). The tests' tiny captioners (BLIP, GIT,
Idefics3: tests/tiny_models.py) are built on this tokenizer and this BLIP config.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

SPECIALS = {"pad_token": "[PAD]", "bos_token": "[BOS]", "eos_token": "[EOS]",
            "unk_token": "[UNK]", "mask_token": "[MASK]"}
SMALL = dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4)


def train_tokenizer(captions: Iterable[str], vocab_size: int = 512,  # noqa: ANN201
                    add_prefix_space: bool = True):
    """A byte-level BPE with the specials BLIP and GIT expect, as a fast HF tokenizer;
    ``add_prefix_space=False`` encodes "man" and " man" apart, as GPT-2 and Llama do."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=list(SPECIALS.values()))
    tokenizer.train_from_iterator([c for c in captions if c], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, cls_token="[BOS]",
                                   sep_token="[EOS]", **SPECIALS)


def token_ids(tokenizer) -> dict[str, int]:  # noqa: ANN001
    return {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id}


def blip(tokenizer, resolution: int, dims: dict = SMALL,  # noqa: ANN001, ANN201, B006
         initializer_range: float | None = 0.02):
    """A random-weight BLIP of ``dims`` (8 px patches, 32-wide projections) and its
    processor; ``initializer_range=None`` keeps BLIP's default 1e-10 for the vision tower,
    which starts position embeddings at zero: no "where"."""
    from transformers import (
        BlipConfig,
        BlipForConditionalGeneration,
        BlipImageProcessor,
        BlipProcessor,
    )

    vision = dict(dims, image_size=resolution, patch_size=8, projection_dim=32)
    if initializer_range is not None:
        vision["initializer_range"] = initializer_range
    text = dict(vocab_size=len(tokenizer), sep_token_id=tokenizer.eos_token_id,
                **token_ids(tokenizer))
    text.update(dims, encoder_hidden_size=dims["hidden_size"], projection_dim=32,
                max_position_embeddings=96)
    model = BlipForConditionalGeneration(BlipConfig(text_config=text, vision_config=vision,
                                                    projection_dim=32))
    images = BlipImageProcessor(size={"height": resolution, "width": resolution})
    return model, BlipProcessor(image_processor=images, tokenizer=tokenizer)


def save_untrained(out_dir: str | Path, captions: Iterable[str], resolution: int = 32,
                   seed: int = 0) -> Path:
    """The small random-weight BLIP with a tokenizer trained on ``captions``, in ``out_dir``."""
    import torch

    torch.manual_seed(seed)
    model, processor = blip(train_tokenizer(captions), resolution)
    out = Path(out_dir)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out
