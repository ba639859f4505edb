"""Constrained decoding: the attribute filter's person nouns, blocked while the model writes.

DESIGN.md section 9 asks for a constrained-decoding *and* post-filter rule: a prompt is a
preference, a filter is a guarantee, and blocking at generation time saves the filter's
work (and the strict regeneration when a rewrite does not read). The words are the
attribute lexicon's person nouns (every category's, with their plurals) and the gendered
pronouns, each in the forms a tokenizer sees: lower case and capitalised, with and without
a leading space, as the tokenizer's own subword sequences.

Adjectives are not blocked: they are attributes only before a person noun ("a white car",
"french fries", "a young tree" are fine), and with the nouns blocked the post-filter still
removes them before "person". Blocking is by token sequence, so a blocked word's tokens
are also refused where they start a longer word ("man" in "manhole" when the tokenizer
splits it " man" + "hole"); the model then writes another word. Forms without a leading
space are blocked only at the start of the caption or after a token that ends in neither
a letter nor a digit, since inside a word they are suffixes ("hu" + "man").

The transformers backend applies :class:`WordBlocker` as a logits processor; an
OpenAI-compatible server gets ``logit_bias`` (-100) for the single-token spaced forms,
the only ones a per-token bias can express without refusing word pieces.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from pairforge.recaption.attributes import AttributeLexicon

PRONOUNS = ("he", "she", "him", "his", "her", "hers", "himself", "herself")
BIAS = -100


def blocked_words(lexicon: AttributeLexicon) -> list[str]:
    """The attribute categories' person nouns (singular and plural) and gendered pronouns."""
    nouns = {" ".join(key).removesuffix("'s") for key in lexicon.nouns}
    return sorted(nouns | set(PRONOUNS))


def _forms(word: str) -> list[tuple[str, bool]]:
    """(text, bare): lower and capitalised, with a leading space (bare False) and without."""
    cased = dict.fromkeys([word, word[:1].upper() + word[1:]])
    return [(f" {w}", False) for w in cased] + [(w, True) for w in cased]


def _boundary_ids(tokenizer: Any) -> set[int]:
    """Tokens after which a bare (no-space) word starts a new word: their text does not end
    in a letter or digit (punctuation, quotes, newlines), and the special tokens."""
    ids = set(tokenizer.all_special_ids)
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    return ids | {i for i, text in enumerate(texts) if not text or not text[-1].isalnum()}


class WordBlocker:
    """Token sequences to refuse, indexed by their prefix for one lookup per step."""

    def __init__(self, tokenizer: Any, words: list[str]) -> None:
        # prefix (all tokens but the last) -> {bare: last tokens refused after it}
        self.rules: dict[tuple[int, ...], dict[bool, set[int]]] = defaultdict(
            lambda: {True: set(), False: set()})
        for word in words:
            for text, bare in _forms(word):
                ids = tokenizer.encode(text, add_special_tokens=False)
                if ids:
                    self.rules[tuple(ids[:-1])][bare].add(ids[-1])
        self.prefix_lengths = sorted({len(prefix) for prefix in self.rules})
        self.boundary = _boundary_ids(tokenizer)
        self.single_spaced = sorted(self.rules.get((), {False: set()})[False])

    def refused(self, generated: list[int]) -> set[int]:
        """Tokens that may not come next after ``generated`` (this caption's tokens)."""
        out: set[int] = set()
        for length in self.prefix_lengths:
            if length > len(generated):
                break
            prefix = tuple(generated[len(generated) - length:])
            rule = self.rules.get(prefix)
            if rule is None:
                continue
            out |= rule[False]
            before = len(generated) - length - 1  # the token before the word, if any
            if before < 0 or generated[before] in self.boundary:
                out |= rule[True]
        return out

    def logits_processor(self) -> Any:
        """A fresh transformers logits processor for one ``generate`` call."""
        return _BlockingProcessor(self)

    def logit_bias(self) -> dict[str, int]:
        """OpenAI ``logit_bias``: the single-token words with a leading space."""
        return {str(i): BIAS for i in self.single_spaced}


class _BlockingProcessor:
    """Sets the refused tokens' scores to -inf; the caption starts after the first call's
    input (the prompt, or the decoder's start token)."""

    def __init__(self, blocker: WordBlocker) -> None:
        self.blocker = blocker
        self.start: int | None = None

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        if self.start is None:
            self.start = input_ids.shape[1]
        for row, ids in enumerate(input_ids[:, self.start:].tolist()):
            refused = self.blocker.refused(ids)
            if refused:
                scores[row, sorted(refused)] = float("-inf")
        return scores
