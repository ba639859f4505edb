"""Constrained decoding (issue 20): the attribute nouns refused while a real model writes.

The tokenizer is a byte-level BPE trained on the spot and the model a tiny random-weight
BLIP (tests/tiny_models.py), loaded by path through the backend's own loading code;
the OpenAI backend's ``logit_bias`` is checked on the wire.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import COCO_IMAGES
from openai_server import OpenAIServer
from PIL import Image
from tiny_models import save_tiny_captioner, train_tokenizer

from pairforge.config import RecaptionConfig
from pairforge.recaption.attributes import load_lexicon, neutralize
from pairforge.recaption.backends import OpenAICaptioner, TransformersCaptioner, load_captioner
from pairforge.recaption.constrain import PRONOUNS, WordBlocker, blocked_words

TAUGHT = ["A man holding his baby.", "A woman riding a horse.", "Two boys on a road.",
          "A girl with her dog.", "A mother and her son.", "A man in a red hat."]


def _photos(n: int) -> list[Image.Image]:
    return [Image.open(p).convert("RGB") for p in sorted(COCO_IMAGES.glob("*.jpg"))[:n]]


@pytest.fixture(scope="module")
def tiny_blip(tmp_path_factory) -> Path:
    """A random-weight BLIP (training one takes minutes on a loaded 2-core machine)."""
    return save_tiny_captioner("blip", tmp_path_factory.mktemp("blip"), TAUGHT * 4)


def test_blocked_words_are_the_person_nouns_and_pronouns() -> None:
    words = blocked_words(load_lexicon())
    for word in ("man", "men", "woman", "women", "mother", "police officer", "homeless" * 0
                 or "beggar", "lesbian", "tennis player", *PRONOUNS):
        assert word in words
    # adjectives and neutral nouns are the post-filter's: "a white car", "a baby"
    for word in ("white", "young", "french", "gay", "person", "people", "baby", "skier"):
        assert word not in words


def test_refused_tokens_follow_the_tokenizer_subwords() -> None:
    # no prefix space: "man" (a caption's first word, or a suffix in "hu" + "man") and
    # " man" are different tokens, as in GPT-2's and Llama's tokenizers
    tokenizer = train_tokenizer(["a man and a dog", "human hands", "the woman's hat",
                                 "Man on a bench", '"man" sign'] * 3, vocab_size=300,
                                add_prefix_space=False)
    blocker = WordBlocker(tokenizer, ["man", "woman"])

    def ids(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    word = ids("a")
    for form in (" man", " Man", " woman", " Woman"):  # after a word: the spaced forms
        assert ids(form)[-1] in blocker.refused(word + ids(form)[:-1]), form
    for form in ("man", "Man", "woman", "Woman"):  # at the start, or after a quote
        assert ids(form)[-1] in blocker.refused(ids(form)[:-1]), form
        assert ids(form)[-1] in blocker.refused(ids('"') + ids(form)[:-1]), form
    # inside a word the bare form is a suffix, not the word: "hu" + "man" stays possible
    assert len(ids("man")) == 1 and ids("man") != ids(" man")
    assert ids("man")[0] not in blocker.refused(ids("a hu"))
    assert ids("man")[0] in blocker.refused(ids("a hu") + ids('"'))
    # a token no form ends with is never refused
    assert ids(" dog")[-1] not in blocker.refused(word + ids(" dog")[:-1])
    assert blocker.logit_bias() == {str(i): -100 for i in sorted(
        {s[0] for s in map(ids, (" man", " Man", " woman", " Woman")) if len(s) == 1})}


def test_the_device_processor_refuses_exactly_what_the_rules_refuse() -> None:
    """The tensor rules (one pass over every row, on the scores' device) against the
    per-caption lookup, on every prefix of random captions made of the words' own tokens,
    boundaries and other tokens, mid-caption and at its start."""
    import torch

    tokenizer = train_tokenizer(["a man and a dog", "human hands", "the woman's hat",
                                 "Man on a bench", '"man" sign', "police officer at work",
                                 "a tennis player"] * 3, vocab_size=300,
                                add_prefix_space=False)
    blocker = WordBlocker(tokenizer, ["man", "woman", "police officer", "tennis player"])
    pieces = sorted({t for prefix, rule in blocker.rules.items()
                     for t in (*prefix, *rule[True], *rule[False])})
    pool = pieces + tokenizer.encode('a" hu.', add_special_tokens=False)
    generator = torch.Generator().manual_seed(0)
    prompt, steps, batch = 3, 7, 64
    rows = torch.tensor(pool)[torch.randint(len(pool), (batch, prompt + steps),
                                            generator=generator)]
    vocab = len(tokenizer) + 5  # a model's vocabulary may be padded past the tokenizer's
    checked = 0
    processor = blocker.logits_processor()
    for length in range(prompt, prompt + steps + 1):
        scores = processor(rows[:, :length], torch.zeros(batch, vocab))
        for row in range(batch):
            refused = set(torch.nonzero(torch.isinf(scores[row])).flatten().tolist())
            assert refused == blocker.refused(rows[row, prompt:length].tolist())
            checked += bool(refused)
    assert checked > batch  # the captions did reach refusals, bare and spaced


def test_constrained_generation_never_writes_a_blocked_word(tiny_blip: Path) -> None:
    """Block the whole words the free model writes; constrained, no generated token is one
    the blocker refuses after what came before it, and the captions change."""
    cfg = RecaptionConfig(model=str(tiny_blip), max_new_tokens=10)
    images = _photos(4)
    free = TransformersCaptioner(cfg)
    tokenizer = free.processor.tokenizer
    pieces = [tokenizer.decode([i]) for i in free.generate_ids(images, "x").flatten().tolist()]
    words = sorted({p.strip() for p in pieces if p.startswith(" ") and p.strip().isalpha()})
    assert words
    constrained = load_captioner(cfg, "cpu", words)
    assert isinstance(constrained, TransformersCaptioner) and constrained.blocker is not None
    start = 1  # BLIP's decoder output begins with its start token
    for row in constrained.generate_ids(images, "x")[:, start:].tolist():
        for t in range(len(row)):
            assert row[t] not in constrained.blocker.refused(row[:t])
    assert constrained.generate(images, "x") != free.generate(images, "x")
    # the lexicon's words load too, and a caption with none of them is unchanged
    lexicon_blocked = load_captioner(cfg, "cpu", blocked_words(load_lexicon()))
    for text, same in zip(lexicon_blocked.generate(images, "x"), free.generate(images, "x"),
                          strict=True):
        assert text == same or neutralize(same).removed


def test_openai_backend_sends_logit_bias_from_the_served_tokenizer(tiny_blip: Path) -> None:
    served = TransformersCaptioner(RecaptionConfig(model=str(tiny_blip), max_new_tokens=8))
    words = blocked_words(load_lexicon())
    expected = WordBlocker(served.processor.tokenizer, words).logit_bias()
    assert expected and set(expected.values()) == {-100}
    with OpenAIServer(["tiny-blip"], served) as server:
        openai = {"base_url": server.base_url, "logit_bias_tokenizer": str(tiny_blip)}
        cfg = RecaptionConfig(backend="openai", model="tiny-blip", openai=openai)
        load_captioner(cfg, "cpu", words).generate(_photos(2), "x")
        plain = RecaptionConfig(backend="openai", model="tiny-blip",
                                openai={"base_url": server.base_url})
        load_captioner(plain, "cpu", words).generate(_photos(1), "x")
        OpenAICaptioner(cfg).generate(_photos(1), "x")  # nothing blocked: no bias
    assert server.logit_biases == [expected, expected, None, None]
