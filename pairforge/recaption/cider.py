"""CIDEr-D (Vedantam et al., CVPR 2015), as the COCO caption evaluation computes it.

For each image, candidate and references become vectors of n-gram counts (n = 1..4)
weighted by inverse document frequency over the whole reference corpus: an n-gram's weight
is ``log(N) - log(max(1, df))``, where N is the number of images and df the number of
images whose references contain it. Per n, the score is the clipped cosine

    sum_g min(c_g, r_g) * r_g / (|c| * |r|)

times a Gaussian length penalty ``exp(-(len_c - len_r)^2 / (2 * 6^2))`` (the "D" of
CIDEr-D: the clipping and the penalty keep repeated words and length from gaming it),
averaged over n, averaged over the references, times 10. The corpus score is the mean over
images. This follows ``pycocoevalcap/cider/cider_scorer.py`` line by line; tokens here are
lower-case words with punctuation removed, where pycocoevalcap runs Stanford's PTB
tokenizer (the same for plain captions; contractions split differently).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence

N = 4
SIGMA = 6.0
_PUNCT = re.compile(r"[^\w\s]")

Ngrams = Counter[tuple[str, ...]]


def tokens(caption: str) -> list[str]:
    """Lower-case words, punctuation removed."""
    return _PUNCT.sub(" ", caption.lower()).split()


def ngrams(caption: str) -> Ngrams:
    words = tokens(caption)
    return Counter(tuple(words[i:i + n]) for n in range(1, N + 1)
                   for i in range(len(words) - n + 1))


def _vector(counts: Ngrams, df: Counter, log_n: float) -> tuple[list[dict], list[float], int]:
    """Per n: {ngram: tf * idf} and its norm; and the caption's length."""
    vec: list[dict] = [{} for _ in range(N)]
    norm = [0.0] * N
    for gram, tf in counts.items():
        weight = tf * (log_n - math.log(max(1.0, df[gram])))
        vec[len(gram) - 1][gram] = weight
        norm[len(gram) - 1] += weight * weight
    # pycocoevalcap counts the length in bigrams (words - 1): the same difference between
    # two captions, except against an empty one
    length = sum(tf for gram, tf in counts.items() if len(gram) == 2)
    return vec, [math.sqrt(x) for x in norm], length


def _similarity(cand: tuple, ref: tuple) -> list[float]:
    (vec_c, norm_c, len_c), (vec_r, norm_r, len_r) = cand, ref
    penalty = math.exp(-((len_c - len_r) ** 2) / (2 * SIGMA ** 2))
    values = []
    for n in range(N):
        value = sum(min(w, vec_r[n][g]) * vec_r[n][g] for g, w in vec_c[n].items()
                    if g in vec_r[n])
        if norm_c[n] != 0 and norm_r[n] != 0:
            value /= norm_c[n] * norm_r[n]
        values.append(value * penalty)
    return values


def cider_d(candidates: Sequence[str], references: Sequence[Sequence[str]]) -> list[float]:
    """CIDEr-D of each candidate against its references; the document frequencies are
    those of all ``references`` (one list per image, as the corpus to score against)."""
    if len(candidates) != len(references):
        raise ValueError("one list of references per candidate")
    refs = [[ngrams(r) for r in group] for group in references]
    df: Counter = Counter()
    for group in refs:
        df.update({gram for counts in group for gram in counts})
    log_n = math.log(float(len(refs))) if refs else 0.0
    scores = []
    for candidate, group in zip(candidates, refs, strict=True):
        if not group:
            raise ValueError(f"no reference for the candidate {candidate!r}")
        cand = _vector(ngrams(candidate), df, log_n)
        total = [0.0] * N
        for ref in group:
            total = [t + s for t, s in zip(total, _similarity(cand, _vector(ref, df, log_n)),
                                           strict=True)]
        scores.append(sum(total) / N / len(group) * 10.0)
    return scores
