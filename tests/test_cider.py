"""CIDEr-D (recaption/cider.py) against values computed by hand from its definition."""

from __future__ import annotations

import math

import pytest

from pairforge.recaption.cider import cider_d, ngrams, tokens

LOG2 = math.log(2)


def test_tokens_are_lower_case_words_without_punctuation():
    assert tokens("A red Circle, on the left.") == ["a", "red", "circle", "on", "the", "left"]
    assert ngrams("a cat")[("a", "cat")] == 1 and len(ngrams("a cat")) == 3


def test_identical_and_disjoint_captions():
    # N = 2 images: "a" is in both reference sets (idf 0), every other n-gram in one (log 2)
    scores = cider_d(["a cat", "a cat"], [["a cat"], ["a dog"]])
    # image 1: unigrams {a: 0, cat: log2} against the same, cosine 1; bigram cosine 1;
    # no 3- or 4-grams (0); mean over n = 2/4, times 10
    assert scores[0] == pytest.approx(5.0)
    # image 2: the only shared n-gram is "a", whose weight is 0
    assert scores[1] == 0.0


def test_the_length_penalty():
    # "a cat sat" against "a cat" (corpus as above): unigrams cat, sat (log2 each) against
    # cat: 1/sqrt(2); bigrams "a cat", "cat sat" against "a cat": 1/sqrt(2); the trigram
    # meets no reference trigram; one word longer: exp(-1 / (2 * 36))
    score = cider_d(["a cat sat", "a dog"], [["a cat"], ["a dog"]])[0]
    assert score == pytest.approx(10 * (2 / math.sqrt(2)) / 4 * math.exp(-1 / 72))


def test_repeated_words_are_clipped():
    # "cat cat" against "a cat": unigram cat has tf 2 (weight 2 log2), clipped to the
    # reference's log2: (log2 * log2) / (2 log2 * log2) = 1/2; bigram "cat cat" is not in
    # the reference: 0; lengths are equal (2 words)
    score = cider_d(["cat cat", "a dog"], [["a cat"], ["a dog"]])[0]
    assert score == pytest.approx(10 * 0.5 / 4)


def test_scores_average_over_references():
    # image 1 has two references; df counts an n-gram once per image
    scores = cider_d(["a cat", "a dog"], [["a cat", "a dog"], ["a dog"]])
    # df: a 2, cat 1, dog 2, "a cat" 1, "a dog" 2; weights: cat log2, "a cat" log2, others 0
    # against "a cat": 2/4 * 10 = 5; against "a dog": no weighted overlap: 0; mean 2.5
    assert scores[0] == pytest.approx(2.5)
    # image 2: every n-gram of "a dog" has idf 0: all vectors are zero, the score is 0
    assert scores[1] == 0.0


def test_every_candidate_needs_references():
    with pytest.raises(ValueError, match="no reference"):
        cider_d(["a cat"], [[]])
    with pytest.raises(ValueError, match="one list of references per candidate"):
        cider_d(["a cat"], [])
