"""The people-attribute post-filter on a hand-written table of captions.

Each row: caption, expected rewrite, gold attributes (``category:term`` for every
attribute a careful reader would say is applied to a person), and whether the rewrite is
fluent. Precision and recall are counted per term over the whole table: a removal is a
true positive when it is in the row's gold set. Run with ``-s`` to see them printed.
"""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pairforge.recaption.attributes import (
    STRICT_PROMPT_SUFFIX,
    NeutralizeResult,
    load_lexicon,
    neutralize,
)

Row = tuple[str, str, set[str], bool]

PEOPLE: list[Row] = [
    ("A young woman in a red jacket.", "A person in a red jacket.",
     {"age:young", "gender:woman"}, True),
    ("an elderly man sitting on a bench", "a person sitting on a bench",
     {"age:elderly", "gender:man"}, True),
    ("two young women walking a dog", "two people walking a dog",
     {"age:young", "gender:woman"}, True),
    ("a woman's handbag on a table", "a person's handbag on a table", {"gender:woman"}, True),
    ("the boys are playing soccer", "the people are playing soccer",
     {"gender:boy", "age:boy"}, True),
    ("a group of men and women standing outside", "a group of people standing outside",
     {"gender:man", "gender:woman"}, True),
    ("a man and a woman sitting on a couch", "two people sitting on a couch",
     {"gender:man", "gender:woman"}, True),
    ("A man, a woman and a child pose for a photo.", "Three people pose for a photo.",
     {"gender:man", "gender:woman", "age:child"}, True),
    ("She is holding an umbrella.", "They are holding an umbrella.", {"gender:she"}, True),
    ("A man sits on a bench while he reads a book.",
     "A person sits on a bench while they read a book.", {"gender:man", "gender:he"}, True),
    ("A woman walks her dog on the beach.", "A person walks their dog on the beach.",
     {"gender:woman", "gender:her"}, True),
    ("a boy giving her a flower", "a person giving them a flower",
     {"gender:boy", "age:boy", "gender:her"}, True),
    # a uniform is visible, the job is not
    ("a man in a police uniform", "a person in a police uniform", {"gender:man"}, True),
    ("a police officer in uniform standing by a car", "a person in uniform standing by a car",
     {"occupation:police officer"}, True),
    ("a wheelchair-bound man crossing the street",
     "a person using a wheelchair crossing the street",
     {"disability:wheelchair-bound", "gender:man"}, True),
    ("a blind man with a white cane", "a person with a white cane",
     {"disability:blind", "gender:man"}, True),
    ("an old, smiling woman", "a smiling person", {"age:old", "gender:woman"}, True),
    ("a tall, young man", "a tall person", {"age:young", "gender:man"}, True),
    ("a young and happy girl", "a happy person", {"age:young", "gender:girl", "age:girl"}, True),
    # a sport's player is a role read from a uniform; the activity is what is seen
    ("a young tennis player swinging a racket",
     "a person playing tennis swinging a racket", {"age:young", "occupation:tennis player"},
     True),
    # white hair is visible
    ("a white haired man reading a newspaper", "a white haired person reading a newspaper",
     {"gender:man"}, True),
    ("a woman doctor checks a patient", "a person checks a patient",
     {"gender:woman", "occupation:doctor"}, True),
    ("a muslim woman wearing a hijab", "a person wearing a hijab",
     {"religion:muslim", "gender:woman"}, True),
    ("muslims praying in a mosque", "people praying in a mosque", {"religion:muslims"}, True),
    ("a group of Japanese tourists near a temple", "a group of tourists near a temple",
     {"nationality:japanese"}, True),
    ("the man and the woman are talking", "the two people are talking",
     {"gender:man", "gender:woman"}, True),
    ("a black cat watching two boys", "a black cat watching two people",
     {"gender:boy", "age:boy"}, True),
    ("Man riding a horse", "Person riding a horse", {"gender:man"}, True),
    ("a surfer riding his board", "a surfer riding their board", {"gender:his"}, True),
    ("an asian man's hat", "a person's hat", {"race_ethnicity:asian", "gender:man"}, True),
    ("an old lady feeding pigeons", "a person feeding pigeons", {"age:old", "gender:lady"}, True),
    ("the kids' toys on the floor", "the people's toys on the floor", {"age:kid"}, True),
    ("a middle-aged man jogging", "a person jogging", {"age:middle-aged", "gender:man"}, True),
    ("a middle aged man jogging", "a person jogging", {"age:middle-aged", "gender:man"}, True),
    ("a priest in black robes", "a person in black robes", {"religion:priest"}, True),
    ("two nuns walking in a garden", "two people walking in a garden", {"religion:nun"}, True),
    ("a businessman talking on his phone", "a person talking on their phone",
     {"gender:businessman", "occupation:businessman", "gender:his"}, True),
    ("toddlers playing in a sandbox", "people playing in a sandbox", {"age:toddler"}, True),
    ("a hispanic family having dinner", "a family having dinner",
     {"race_ethnicity:hispanic"}, True),
    ("an indian woman in a sari", "a person in a sari",
     {"nationality:indian", "gender:woman"}, True),
    ("a black man and a white woman", "two people",
     {"race_ethnicity:black", "gender:man", "race_ethnicity:white", "gender:woman"}, True),
    ("a black and white cat next to a man", "a black and white cat next to a person",
     {"gender:man"}, True),
    ("Gentlemen playing chess in a park.", "People playing chess in a park.",
     {"gender:gentleman"}, True),
    ("The woman, who is smiling, holds her phone.",
     "The person, who is smiling, holds their phone.", {"gender:woman", "gender:her"}, True),
    ("a young girl, an old man and two dogs", "two people and two dogs",
     {"age:young", "gender:girl", "age:girl", "age:old", "gender:man"}, True),
    ("she always smiles at him", "they always smile at them", {"gender:she", "gender:him"}, True),
    ("a female police officer directing traffic", "a person directing traffic",
     {"gender:female", "occupation:police officer"}, True),
    ("a soldier in camouflage", "a person in camouflage", {"occupation:soldier"}, True),
    ("A chef cooking in a kitchen", "A person cooking in a kitchen", {"occupation:chef"}, True),
    ("a teenager on a skateboard", "a person on a skateboard", {"age:teenager"}, True),
    ("An elderly couple on a bench", "A couple on a bench", {"age:elderly"}, True),
    ("a construction worker in a hard hat", "a person in a hard hat",
     {"occupation:construction worker"}, True),
    ("A farmer and his cows", "A person and their cows",
     {"occupation:farmer", "gender:his"}, True),
    ("a girl's bicycle leaning on a fence", "a person's bicycle leaning on a fence",
     {"gender:girl", "age:girl"}, True),
    ("a cowboy riding a horse", "a person riding a horse",
     {"gender:cowboy", "occupation:cowboy"}, True),
    ("an african american man playing guitar", "a person playing guitar",
     {"race_ethnicity:african-american", "gender:man"}, True),
    # a relation ("her daughter") is not visible: the owned person stays, unowned; a baby
    # is seen as a baby (attr_heads.txt)
    ("a woman nurses her baby", "a person nurses a baby", {"gender:woman", "gender:her"},
     True),
    ("a woman and her daughter", "two people",
     {"gender:woman", "gender:her", "gender:daughter"}, True),
    ("a man holding his baby", "a person holding a baby", {"gender:man", "gender:his"}, True),
    # a possessive noun's relation still cannot be said neutrally: regenerate
    ("the woman's son", "the person's person", {"gender:woman", "gender:son"}, False),
]

NOT_PEOPLE: list[Row] = [
    ("a man-made lake in a park", "a man-made lake in a park", set(), True),
    # "boy scout" is an organisation; the sign shows no person
    ("a boy scout camp sign", "a boy scout camp sign", set(), True),
    ("a manhole cover on the street", "a manhole cover on the street", set(), True),
    ("a snowman in a yard", "a snowman in a yard", set(), True),
    ("a white dog on a white car", "a white dog on a white car", set(), True),
    ("black and white photo of a harbor", "black and white photo of a harbor", set(), True),
    ("french fries and a burger", "french fries and a burger", set(), True),
    ("a chinese lantern hanging from a tree", "a chinese lantern hanging from a tree", set(),
     True),
    ("an Indian restaurant sign", "an Indian restaurant sign", set(), True),
    ("The Old Town square at night", "The Old Town square at night", set(), True),
    ("a blind spot mirror on a truck", "a blind spot mirror on a truck", set(), True),
    ("window blinds in a bedroom", "window blinds in a bedroom", set(), True),
    ("a Batman toy on a shelf", "a Batman toy on a shelf", set(), True),
    ("a mannequin in a shop window", "a mannequin in a shop window", set(), True),
    ("a crowd of people at a concert", "a crowd of people at a concert", set(), True),
    ("a baby elephant with its mother", "a baby elephant with its mother", set(), True),
    ("a nurse shark in an aquarium", "a nurse shark in an aquarium", set(), True),
    ("a chef's knife on a cutting board", "a chef's knife on a cutting board", set(), True),
    ("women's restroom sign", "women's restroom sign", set(), True),
    ("a cat licking his paw", "a cat licking his paw", set(), True),
    ("a mother cat and her kittens", "a mother cat and her kittens", set(), True),
    ("an american flag on a pole", "an american flag on a pole", set(), True),
    ("a deaf dog sleeping on a rug", "a deaf dog sleeping on a rug", set(), True),
    ("a young elephant drinking water", "a young elephant drinking water", set(), True),
    ("a human skeleton model", "a human skeleton model", set(), True),
    ("Superman poster on a wall", "Superman poster on a wall", set(), True),
    ("an african elephant", "an african elephant", set(), True),
    ("a cowboy hat on a table", "a cowboy hat on a table", set(), True),
    ("a plate of baby carrots", "a plate of baby carrots", set(), True),
    ("a handicapped parking sign", "a handicapped parking sign", set(), True),
    ("a buddhist temple on a hill", "a buddhist temple on a hill", set(), True),
]

# An attribute adjective whose noun is missing stands for the person ("A young sleeping on
# a bed.": what a model kept from writing "woman" wrote); words that are also things stay.
ORPHANS: list[Row] = [
    ("A young sleeping on a bed.", "A person sleeping on a bed.", {"age:young"}, True),
    ("A young holding a red bag.", "A person holding a red bag.", {"age:young"}, True),
    ("An elderly sitting on a bench.", "A person sitting on a bench.", {"age:elderly"}, True),
    ("the elderly at a bus stop", "the people at a bus stop", {"age:elderly"}, True),
    ("The young is sitting on a bench with her cat.",
     "The person is sitting on a bench with their cat.", {"age:young", "gender:her"}, True),
    ("two young walking a dog", "two people walking a dog", {"age:young"}, True),
    ("A tall young smiling at the camera.", "A tall person smiling at the camera.",
     {"age:young"}, True),
    ("A beautiful young dressed in red.", "A person dressed in red.",
     {"attractiveness:beautiful", "age:young"}, True),
    ("a pregnant standing in a kitchen", "a person standing in a kitchen",
     {"health:pregnant"}, True),
    ("A young.", "A person.", {"age:young"}, True),
    ("a middle-aged sitting on a bench", "a person sitting on a bench", {"age:middle-aged"},
     True),
    # a noun follows, or the word is a thing, or no determiner stands before it
    ("a young sleeping puppy", "a young sleeping puppy", set(), True),
    ("a little to the left of the door", "a little to the left of the door", set(), True),
    ("the blind on the window", "the blind on the window", set(), True),
    ("a danish on a plate", "a danish on a plate", set(), True),
    ("a bird feeding its young in a nest", "a bird feeding its young in a nest", set(), True),
    ("the old and the new town hall", "the old and the new town hall", set(), True),
    ("the young of the species", "the young of the species", set(), True),
    ("a white on a black background", "a white on a black background", set(), True),
]

# Documented misses: the filter leaves these attributes in place (see the report).
KNOWN_MISSES: list[Row] = [
    # the exception list protects "boy scout" everywhere, also when a scout is pictured
    ("a boy scout saluting the flag", "a boy scout saluting the flag",
     {"gender:boy", "age:boy"}, True),
    # predicative adjectives are not seen: only the noun is rewritten
    ("the woman is young", "the person is young", {"gender:woman", "age:young"}, True),
]


def _wider_set() -> tuple[list[Row], set[tuple[str, str]]]:
    """tests/data/attribute_captions.tsv: the wider rule's hand-written set (issue 20)."""
    rows, missed = [], set()
    path = Path(__file__).parent / "data" / "attribute_captions.tsv"
    lines = [line for line in path.read_text().splitlines() if not line.startswith("#")]
    for record in csv.DictReader(lines, delimiter="\t"):
        terms = {t for t in record["gold"].split("; ") if t}
        rows.append((record["caption"], record["expected"], terms, record["fluent"] == "yes"))
        missed |= {(record["caption"], t) for t in record["known_misses"].split("; ") if t}
    return rows, missed


WIDER, WIDER_MISSED = _wider_set()
TABLE = PEOPLE + NOT_PEOPLE + ORPHANS + KNOWN_MISSES + WIDER
MISSED = {("a boy scout saluting the flag", "gender:boy"),
          ("a boy scout saluting the flag", "age:boy"),
          ("the woman is young", "age:young")} | WIDER_MISSED


def test_table_shape() -> None:
    assert len(TABLE) >= 60
    assert len(WIDER) >= 200
    assert len({row[0] for row in TABLE}) == len(TABLE)  # no caption counted twice


WIDER_CATEGORIES = ("sexual_orientation", "body", "attractiveness", "socioeconomic", "health")


@pytest.mark.parametrize("category", WIDER_CATEGORIES)
def test_wider_categories_are_measured(category: str) -> None:
    """Each new category is a lexicon category with at least five gold terms in the set,
    all but the documented misses removed, and captions where its words are things."""
    assert category in load_lexicon().categories
    gold = [(cap, term) for cap, _, terms, _ in WIDER for term in terms
            if term.startswith(category + ":")]
    assert len(gold) >= 5
    caught = [(cap, term) for cap, term in gold if term in neutralize(cap).removed]
    assert set(caught) == set(gold) - WIDER_MISSED
    assert sum(bool(gold) for _, _, gold, _ in TABLE) >= len(TABLE) // 2
    assert len(NOT_PEOPLE) >= 15


@pytest.mark.parametrize(("caption", "expected", "gold", "fluent"), TABLE,
                         ids=[row[0][:40] for row in TABLE])
def test_rewrite(caption: str, expected: str, gold: set[str], fluent: bool) -> None:
    result = neutralize(caption)
    assert result.text == expected
    assert result.fluent is fluent
    missed = {term for cap, term in MISSED if cap == caption}
    assert set(result.removed) == gold - missed  # no extra removals, only documented misses


def test_precision_recall() -> None:
    true_pos = false_pos = false_neg = 0
    for caption, _, gold, _ in TABLE:
        removed = set(neutralize(caption).removed)
        true_pos += len(removed & gold)
        false_pos += len(removed - gold)
        false_neg += len(gold - removed)
    precision = true_pos / (true_pos + false_pos)
    recall = true_pos / (true_pos + false_neg)
    print(f"\nattribute filter on {len(TABLE)} captions ({true_pos + false_neg} gold terms): "
          f"precision {precision:.3f}, recall {recall:.3f} "
          f"(TP {true_pos}, FP {false_pos}, FN {false_neg})")
    assert precision == 1.0
    assert false_neg == len(MISSED)  # the documented misses and nothing else
    assert recall >= 0.95


def test_removed_is_ordered_and_unique() -> None:
    result = neutralize("two young women and two young men")
    assert result == NeutralizeResult("four people", ["age:young", "gender:woman",
                                                      "gender:man"], True)


def test_user_files_extend_and_trim_the_lexicon(tmp_path: Path) -> None:
    (tmp_path / "attr_age.txt").write_text("[nouns]\n!child  # keep 'child' in our captions\n")
    (tmp_path / "attr_marital.txt").write_text("# a new category\n[nouns]\nwidow\n"
                                              "[adjectives]\nmarried\n")
    (tmp_path / "attr_exceptions.txt").write_text("widow spider\n")
    lexicon = load_lexicon([str(tmp_path)])
    assert "marital" in lexicon.categories

    result = neutralize("a married widow and a child in black", lexicon)
    assert result.text == "a person and a child in black"
    assert result.removed == ["marital:married", "marital:widow"]
    assert neutralize("a widow spider", lexicon).removed == []
    # the packaged lexicon is unchanged
    assert neutralize("a widow and a child").text == "a widow and a person"


def test_not_fluent_when_nothing_readable_is_left() -> None:
    assert neutralize("").fluent is False
    assert neutralize("a man's son").fluent is False
    assert neutralize("a man and his son") == NeutralizeResult(
        "two people", ["gender:man", "gender:his", "gender:son"], True)
    assert neutralize("A man.").fluent is True


def test_case_and_final_punctuation_kept() -> None:
    assert neutralize("Young boys run!").text == "People run!"
    assert neutralize("SHE IS RUNNING").text == "THEY ARE RUNNING"
    assert neutralize("An old man’s cane.").text == "A person’s cane."


def test_strict_prompt_names_every_category() -> None:
    for word in ("person", "gender", "age", "ethnicity", "nationality", "religion",
                 "disability", "occupation", "sexual orientation", "body size",
                 "attractiveness", "wealth", "housing", "pregnancy", "health"):
        assert word in STRICT_PROMPT_SUFFIX


def test_importable_without_torch() -> None:
    code = ("import sys, pairforge.recaption.attributes as a; a.neutralize('a man');"
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


_WORDS = ["a", "an", "the", "two", "and", ",", ".", "'s", "young", "old", "white", "black",
          "asian", "man", "women", "boy's", "girls'", "child", "nurse", "nurses", "police",
          "officer", "he", "she", "her", "his", "is", "holds", "person", "people", "dog",
          "baby", "elephant", "scout", "smiling", "wheelchair-bound", "in", "with", "men's"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(_WORDS), max_size=14))
def test_any_word_soup_is_handled(words: list[str]) -> None:
    caption = " ".join(words).replace(" 's", "'s")
    result = neutralize(caption)
    assert isinstance(result.text, str) and isinstance(result.fluent, bool)
    # the filter never edits a caption without reporting what it removed
    assert result.removed or result.text == caption


def test_one_plural_rule_for_attributes_and_grounding() -> None:
    from pairforge.recaption.words import plural

    cases = {"woman": "women", "police man": "police men", "human": "humans",
             "lady": "ladies", "boy": "boys", "box": "boxes", "bench": "benches",
             "knife": "knives", "hot dog": "hot dogs"}
    assert {word: plural(word) for word in cases} == cases


def test_user_files_extend_and_trim_the_nominal_adjectives(tmp_path: Path) -> None:
    (tmp_path / "attr_nominal.txt").write_text("!young\nlittle\n")
    lexicon = load_lexicon([str(tmp_path)])
    assert neutralize("A young sleeping on a bed.", lexicon).removed == []
    assert neutralize("a little sitting on a chair", lexicon) == NeutralizeResult(
        "a person sitting on a chair", ["age:little"], True)
    assert "nominal" not in lexicon.categories  # a word list, not a category
