"""A tiny random-weight OWL-ViT and the CLIP tokenizer it needs, for the detector tests and
bench/detector.py (which imports it with tests/ on sys.path). No model hub is reachable
here (DESIGN.md section 8): the grounding code loads the saved folder as it loads a hub id.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tiny_models import TINY


def clip_tokenizer(texts: Iterable[str], vocab_size: int = 600):  # noqa: ANN201
    """A CLIP tokenizer (lower case, "</w>" word ends, byte-level BPE) trained on
    ``texts``, with the start and end tokens last, as CLIP's own vocabulary has them
    (OWL-ViT takes a query whose first id is 0 for padding)."""
    import json

    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import CLIPTokenizer

    bpe = Tokenizer(models.BPE(end_of_word_suffix="</w>"))
    bpe.normalizer = normalizers.Lowercase()
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Whitespace(), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  end_of_word_suffix="</w>",
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(list(texts), trainer)
    model = json.loads(bpe.to_str())["model"]
    vocab = dict(model["vocab"])
    vocab.update({"<|startoftext|>": len(vocab), "<|endoftext|>": len(vocab) + 1})
    # 16 tokens per query, as OWL-ViT's tokenizer pads them
    return CLIPTokenizer(vocab=vocab, merges=[tuple(m) for m in model["merges"]],
                         model_max_length=16)


def save_tiny_detector(out_dir: str | Path, texts: Iterable[str], resolution: int = 32,
                       seed: int = 0) -> Path:
    """A random-weight OWL-ViT (``AutoModelForZeroShotObjectDetection``) a few hundred kB
    large, with a CLIP tokenizer trained on ``texts`` and OWL-ViT's image processor, saved
    with ``save_pretrained``. The class head's learned logit shift and scale start at zero
    (scale 1 after OWL-ViT's elu + 1), so box scores are sigmoids of cosines, spread around
    0.5 instead of saturated at 0 or 1 by random scales."""
    import torch
    from transformers import (
        OwlViTConfig,
        OwlViTForObjectDetection,
        OwlViTImageProcessor,
        OwlViTProcessor,
    )

    torch.manual_seed(seed)
    tokenizer = clip_tokenizer(texts)
    text = dict(TINY, vocab_size=len(tokenizer), max_position_embeddings=16,
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id)
    vision = dict(TINY, image_size=resolution, patch_size=8)
    model = OwlViTForObjectDetection(OwlViTConfig(text_config=text, vision_config=vision,
                                                  projection_dim=32))
    with torch.no_grad():
        for layer in (model.class_head.logit_shift, model.class_head.logit_scale):
            layer.weight.zero_()
            layer.bias.zero_()
    size = {"height": resolution, "width": resolution}
    processor = OwlViTProcessor(image_processor=OwlViTImageProcessor(size=size, crop_size=size),
                                tokenizer=tokenizer)
    out = Path(out_dir)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out
