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

The transformers backend applies :class:`WordBlocker` as a logits processor that stays on
the model's device (the rules as tensors, matched against the last tokens of every row at
once: no per-token read-back, so a GPU's generation never waits on the host); an
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
        self._device_rules: dict[tuple[str, int], DeviceRules] = {}

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

    def device_rules(self, device: Any, vocab: int) -> DeviceRules:
        """The rules as tensors on ``device``, built once per device and vocabulary."""
        key = (str(device), vocab)
        if key not in self._device_rules:
            self._device_rules[key] = DeviceRules(self, vocab, device)
        return self._device_rules[key]

    def logit_bias(self) -> dict[str, int]:
        """OpenAI ``logit_bias``: the single-token words with a leading space."""
        return {str(i): BIAS for i in self.single_spaced}


class _BlockingProcessor:
    """Sets the refused tokens' scores to -inf; the caption starts after the first call's
    input (the prompt, or the decoder's start token). Runs on the scores' device without
    reading anything back: the rules are tensors there (:class:`DeviceRules`), and the only
    host values it branches on are shapes."""

    def __init__(self, blocker: WordBlocker) -> None:
        self.blocker = blocker
        self.start: int | None = None

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        if self.start is None:
            self.start = input_ids.shape[1]
        rules = self.blocker.device_rules(scores.device, scores.shape[1])
        return rules.apply(input_ids, input_ids.shape[1] - self.start, scores)


# Suffixes are matched by a polynomial hash of their tokens (int64, wrapping), salted by
# their length: one searchsorted for every row and suffix length instead of a comparison
# per prefix length (a byte-level tokenizer splits a word into up to ~17 tokens). A
# collision can only refuse a token that a rule did not name (the model writes another),
# never let a named one through: an actual prefix always finds its own key.
HASH_BASE = 1_000_003
LENGTH_SALT = 0x9E3779B97F4A7C15 - 2**64  # int64


def _powers(n: int) -> Any:
    import torch

    powers = [1]
    for _ in range(n - 1):
        powers.append(powers[-1] * HASH_BASE % 2**64)
    return torch.tensor([p - 2**64 if p >= 2**63 else p for p in powers], dtype=torch.long)


def _suffix_keys(reversed_ids: Any, powers: Any) -> Any:
    """[B, n] keys of the suffixes of lengths 1..n (``reversed_ids[:, k]``: the token k+1
    from the end)."""
    import torch

    lengths = torch.arange(1, reversed_ids.shape[1] + 1, device=reversed_ids.device)
    return (reversed_ids * powers).cumsum(1) + lengths * LENGTH_SALT


def _padded(lists: list[list[int]]) -> tuple[Any, Any]:
    """Token lists as a [N, K] tensor (0 where padded) and its validity mask."""
    import torch

    width = max((len(x) for x in lists), default=0) or 1
    tokens = torch.zeros(len(lists), width, dtype=torch.long)
    valid = torch.zeros(len(lists), width, dtype=torch.bool)
    for i, x in enumerate(lists):
        tokens[i, :len(x)] = torch.tensor(x, dtype=torch.long)
        valid[i, :len(x)] = True
    return tokens, valid


class DeviceRules:
    """A :class:`WordBlocker`'s rules on one device, for a vocabulary of ``vocab`` scores:
    the empty prefix's tokens (refused at every step, the bare ones after a boundary), and
    the longer prefixes by key, each with its refused tokens padded to one width."""

    def __init__(self, blocker: WordBlocker, vocab: int, device: Any) -> None:
        import torch

        def kept(tokens: set[int]) -> list[int]:
            return sorted(t for t in tokens if t < vocab)

        empty = blocker.rules.get((), {False: set(), True: set()})
        self.first_spaced = torch.tensor(kept(empty[False]), dtype=torch.long, device=device)
        self.first_bare = torch.tensor(kept(empty[True]), dtype=torch.long, device=device)
        prefixes = [p for p in blocker.rules if p and max(p) < vocab]
        self.longest = max(map(len, prefixes), default=0)
        powers = _powers(max(self.longest, 1))
        keys = torch.tensor([int(_suffix_keys(torch.tensor([p[::-1]]), powers[:len(p)])[0, -1])
                             for p in prefixes], dtype=torch.long)
        keys, order = keys.sort()
        self.keys, self.powers = keys.to(device), powers.to(device)
        ordered = [prefixes[i] for i in order.tolist()]
        spaced, spaced_ok = _padded([kept(blocker.rules[p][False]) for p in ordered])
        bare, bare_ok = _padded([kept(blocker.rules[p][True]) for p in ordered])
        self.tokens = torch.cat([spaced, bare], 1).to(device)
        self.valid = torch.cat([spaced_ok, bare_ok], 1).to(device)
        self.is_bare = torch.cat([torch.zeros(spaced.shape[1], dtype=torch.bool),
                                  torch.ones(bare.shape[1], dtype=torch.bool)]).to(device)
        size = max(vocab, *(i + 1 for i in blocker.boundary)) if blocker.boundary else vocab
        boundary = torch.zeros(size, dtype=torch.bool)
        boundary[sorted(blocker.boundary)] = True
        self.boundary = boundary.to(device)

    def apply(self, input_ids: Any, generated: int, scores: Any) -> Any:
        """``scores`` with -inf where a row's next token is refused (``generated``: tokens
        of the caption so far, the same in every row of a batched ``generate``). Modifies
        ``scores`` in place, as transformers' own processors may."""
        import torch

        batch, width = input_ids.shape
        m = min(self.longest, generated)  # suffix lengths 1..m lie inside the caption
        # after_boundary[:, L]: the token before the last L tokens starts a word (L = 0..m)
        before = input_ids[:, width - m - 1:].flip(1) if generated else input_ids[:, -1:]
        after_boundary = self.boundary[before]
        if m == generated:  # the caption's start: a bare form may begin there
            after_boundary[:, m] = True
        inf = torch.tensor(float("-inf"), dtype=scores.dtype, device=scores.device)
        zero = torch.zeros((), dtype=scores.dtype, device=scores.device)
        scores.index_fill_(1, self.first_spaced, float("-inf"))
        first = torch.where(after_boundary[:, :1], inf, zero).expand(batch, len(self.first_bare))
        scores.scatter_add_(1, self.first_bare.expand(batch, -1), first.contiguous())
        if m == 0 or not len(self.keys):
            return scores
        keys = _suffix_keys(input_ids[:, width - m:].flip(1), self.powers[:m])  # [B, m]
        at = torch.searchsorted(self.keys, keys).clamp_(max=len(self.keys) - 1)
        found = self.keys[at] == keys  # [B, m]
        allowed = ~self.is_bare | after_boundary[:, 1:, None]  # [B, m, K]
        refused = found[..., None] & self.valid[at] & allowed
        penalty = torch.where(refused, inf, zero).reshape(batch, -1)
        return scores.scatter_add_(1, self.tokens[at].reshape(batch, -1), penalty)
