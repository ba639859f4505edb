"""People-attribute post-filter: recaptions describe what is visible, not who people are.

DESIGN.md section 9: a prompt alone is not a guarantee, so every recaption goes through
:func:`neutralize`, which removes attributes applied to people -- gender, age, race or
ethnicity, nationality, religion, disability, occupation, sexual orientation, body size,
attractiveness, socioeconomic and housing status, pregnancy and health -- and rewrites the
phrase neutrally ("a young woman in a red jacket" -> "a person in a red jacket"). The caller puts
``removed`` into ``recaption_flags`` and, when ``fluent`` is False, regenerates once with
:data:`STRICT_PROMPT_SUFFIX` added to the prompt.

Rules
-----
* Person nouns that carry an attribute (woman, boys, elderly man, toddler, nun, doctor,
  police officer, frenchman, mother) become "person"/"people", keeping number and the
  possessive ("a woman's handbag" -> "a person's handbag", "the boys" -> "the people").
* Children too: a child's apparent age is an inference like any other, so child, kid,
  toddler and teenager become "person"/"people" (a user file can drop a word). A baby is
  seen, not guessed: baby, infant and newborn are neutral nouns ("a young baby" -> "a
  baby", "a baby girl" -> "a baby": an attribute noun right after a neutral one goes).
* Relations are not visible: a possessive pronoun before a person noun becomes an article
  and the person stays ("a mother holding her baby" -> "a person holding a baby", "a man
  and his son" -> "two people", "her two sons" -> "two people").
* Attribute adjectives (young, asian, black, chinese, muslim, blind...) are removed only
  when they modify a person noun, possibly across other adjectives ("a young smiling
  woman"). So "a white car", "black and white photo", "french fries", "a chinese lantern",
  "an indian restaurant sign", "the Old Town square" and "a blind spot" stay. Colour words
  (white, black, brown) followed by haired/skinned/clad... describe hair or clothes and stay.
* Occupation: the job title becomes "person"; what is worn stays, because it is visible
  ("a man in a police uniform" -> "a person in a police uniform"). A sport's player is a
  role read from a uniform: "a baseball player" -> "a person playing baseball".
* Words that are things stay things: adjectives only go before a person noun ("a gay-pride
  flag", "a gay bar", "a fat cat", "a beautiful sunset", "a homeless shelter").
* An attribute adjective left without its noun stands for the person: "A young sleeping
  on a bed." (what a model kept from writing "woman" may write) -> "A person sleeping on a
  bed.", "the elderly at a bus stop" -> "the people at a bus stop". Only the adjectives in
  ``attr_nominal.txt``, only right after a determiner, and only before a verb, a
  preposition or the end ("a young sleeping puppy" is a puppy; "a little to the left",
  "the blind on the window" and "a danish on a plate" are not people: those words are not
  listed).
* Disability lines may name the visible fact to keep ("a wheelchair-bound man" -> "a
  person using a wheelchair"); "a person in a wheelchair" is left as it is.
* Exceptions (attr_exceptions.txt) are never touched: "boy scout" is an organisation
  ("a boy scout camp sign" is a sign), "chef's knife", "nurse shark", "baby carrots".
  Hyphenated words and compounds (man-made, snowman, manhole, Batman) are single words
  that no list names, so they stay by construction.
* Not people either: a person word right before an animal noun or after "its" ("a baby
  elephant", "a mother cat", "its mother"); a plural possessive without a determiner of its
  own, which names a kind of thing ("men's ties", "a children's book"; "the women's hands"
  is rewritten); a plural-looking noun right after a singular person or after he/she, which
  is a verb ("a woman nurses her baby").
* Pronouns he/she/him/his/her/himself/herself become they/them/their/themselves, unless
  the caption names an animal and no person (then they are the animal's), with the verb
  after the subject made plural ("she is holding" -> "they are holding", "he reads" ->
  "they read").
* Coordinations collapse: "a man and a woman" -> "two people", "men and women" -> "people".
* "a"/"an" is fixed before a rewritten word ("an elderly man" -> "a person", and "a women"
  reads "a person"); the first letter's case and the final punctuation are kept.
* A caption with nothing removed comes back unchanged, character for character.

``fluent`` is False when the rewrite left an empty caption, a doubled word, a dangling
article, "a people", or a relation that lost its meaning ("the woman's son" -> "the
person's person").

Data files
----------
The lists live in ``pairforge/recaption/data/attr_*.txt``; ``load_lexicon(extra_dirs)``
reads the same file names from each extra folder after the packaged ones, so a user file
``attr_age.txt`` extends the age category and ``attr_caste.txt`` adds a category "caste".
Format, one entry per line, ``#`` starts a comment, case does not matter:

* ``[nouns]`` then ``singular | plural`` (plural optional: the regular English rule, with
  -man -> -men); ``- | plural`` for a plural-only noun ("- | muslims": "muslims" is always
  people, "a muslim..." is handled as an adjective). Multi-word entries are fine.
* ``[adjectives]`` then ``term`` or ``term => words kept after the person noun``.
* ``!term`` removes a term loaded so far from that section (e.g. ``!child``).
* A file without a section header is read as ``[nouns]``. Hyphenated terms also match
  with a space ("middle-aged", "middle aged").

Special files: ``attr_heads.txt`` (neutral person nouns, in the noun format: never
rewritten, but adjectives before them are: "a young skier" -> "a skier"),
``attr_animals.txt`` (animal nouns, noun format), ``attr_descriptors.txt`` (adjectives that
may stand between an attribute adjective and its noun, one per line),
``attr_nominal.txt`` (attribute adjectives that stand for a person when no noun follows,
one per line) and
``attr_exceptions.txt`` (phrases left alone, one per line; the last word also matches its
regular plural). Every other ``attr_NAME.txt`` is the attribute category NAME.

Over 600 lines because the rewrite is one pass of small rules over one ``_Caption``'s
tokens, each rule reading the spans the earlier ones left; apart, the rules would share
the private token and span types across modules. The lexicon loading (about 80 lines) is
the part that could leave.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from pairforge.recaption.words import plural

STRICT_PROMPT_SUFFIX = (
    "Describe only what is visible. Refer to every human only as 'person' or 'people' and "
    "never state or guess anyone's gender, age, race or ethnicity, nationality, religion, "
    "disability, occupation, sexual orientation, body size, attractiveness, wealth or "
    "housing, pregnancy or health; describe their clothing, posture and actions instead, and "
    "do not use he, she, him, his or her, or say whose child or partner anyone is."
)

PREFIX = "attr_"
# special files read as plain word lists (no [nouns]/[adjectives] sections)
_WORD_SETS = ("descriptors", "exceptions", "nominal")

# colour words that are also race terms: "a white dog walker" is a white dog, so they only
# count when they sit right before the person noun or its adjectives
_COLOURS = {"white", "black", "brown"}
# "white haired man", "black clad woman": the colour belongs to the next word
_COLOUR_COMPOUNDS = {"haired", "skinned", "eyed", "colored", "coloured", "clad", "dressed",
                     "shirted", "suited", "striped", "spotted", "faced", "bearded", "hatted"}
_ARTICLES = {"a", "an", "the"}
_NUMBERS = {"one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7,
            "eight": 8, "nine": 9, "ten": 10, "eleven": 11, "twelve": 12}
_NUMBER_WORDS = {v: k for k, v in _NUMBERS.items()}
_VAGUE = {"some", "several", "many", "few", "the", "these", "those"}
_PLURAL_DETS = {"the", "these", "those", "some", "several", "many", "both", "all", "their",
                "our", "my", "your", "his", "her", "two", "three", "four", "five", "six"}
_POSSESSIVES = {"their", "my", "our", "your", "its", "his", "her"}
_ADVERBS = {"also", "still", "just", "now", "then", "often", "always", "sometimes", "never",
            "usually", "again", "even", "only", "really", "already", "too"}
_AGREEMENT = {"is": "are", "was": "were", "has": "have", "does": "do", "isn't": "aren't",
              "wasn't": "weren't", "hasn't": "haven't", "doesn't": "don't"}
# words after "her" that show it is an object ("hugging her and ...") not a determiner
_AFTER_OBJECT = {"a", "an", "the", "and", "or", "but", "to", "in", "on", "at", "with", "by",
                 "for", "from", "of", "as", "while", "into", "onto", "up", "down", "off",
                 "out", "over", "under", "near", "behind", "this", "that", "some", "two",
                 "her", "his", "their", "back", "again", "too", "so", "is", "are", "was"}
_SUBJECT = {"he": "they", "she": "they"}
_RELATION_OWNERS = {"his", "her", "their"}
# never a verb after "they", never the one compound word before a person noun
_FUNCTION_WORDS = (_AFTER_OBJECT | _ARTICLES | set(_NUMBERS) | _VAGUE | _POSSESSIVES
                   | {"he", "she", "it", "they", "we", "i", "you", "him", "them", "who",
                      "which", "its", "not", "no", "there", "here", "are", "were", "be"})
_PRONOUNS = {"him": "them", "his": "their", "hers": "theirs", "himself": "themselves",
             "herself": "themselves", "he's": "they're", "she's": "they're", "he'd": "they'd",
             "she'd": "they'd", "he'll": "they'll", "she'll": "they'll"}
# singular verbs after a coordination mean it was two clauses: "holds a baby and a man waves"
_SINGULAR_VERBS = {"is", "was", "has", "does"}
_NOT_VERBS = {"across", "towards", "as", "plus", "versus", "this", "his", "its", "is"}

_WORD = r"[A-Za-z0-9]+(?:[-'’][A-Za-z0-9]+)*(?:(?<=[sS])['’](?![A-Za-z0-9]))?"
_TOKEN = re.compile(rf"(?P<w>{_WORD})|(?P<s>\s+)|(?P<p>.)", re.S)


@dataclass(frozen=True)
class Term:
    """One lexicon entry as matched: its base form, categories, number, kept words."""

    lemma: str
    categories: tuple[str, ...]
    plural: bool = False
    after: str = ""


@dataclass
class AttributeLexicon:
    """Compiled word lists; keys are tuples of lower-case words ("police", "officer")."""

    nouns: dict[tuple[str, ...], Term] = field(default_factory=dict)
    adjectives: dict[tuple[str, ...], Term] = field(default_factory=dict)
    heads: dict[tuple[str, ...], Term] = field(default_factory=dict)
    descriptors: set[str] = field(default_factory=set)
    nominal: set[tuple[str, ...]] = field(default_factory=set)
    animals: set[str] = field(default_factory=set)
    exceptions: set[tuple[str, ...]] = field(default_factory=set)
    longest: int = 1  # words in the longest entry, so matching tries no longer phrases

    @property
    def categories(self) -> set[str]:
        terms = [*self.nouns.values(), *self.adjectives.values()]
        return {category for term in terms for category in term.categories}


@dataclass(frozen=True)
class NeutralizeResult:
    """The rewritten caption, the ``category:term`` strings removed, and whether it reads."""

    text: str
    removed: list[str]
    fluent: bool


# ---------------------------------------------------------------------------- loading


def _lines(text: str) -> Iterator[str]:
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip().lower().replace("’", "'")
        if line:
            yield line


def _keys(phrase: str) -> list[tuple[str, ...]]:
    """A phrase as word tuples; hyphenated words also match written with spaces."""
    keys = [tuple(phrase.split())]
    if "-" in phrase:
        keys.append(tuple(phrase.replace("-", " ").split()))
    return keys


# staged entries: (category, section) -> lemma -> (forms as (phrase, plural), kept words)
_Staged = dict[tuple[str, str], dict[str, tuple[list[tuple[str, bool]], str]]]


def _stage_file(staged: _Staged, category: str, text: str) -> None:
    section = "nouns"
    for line in _lines(text):
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1].strip()
            continue
        entries = staged.setdefault((category, section), {})
        if line.startswith("!"):
            entries.pop(line[1:].strip(), None)
            continue
        term, _, after = (part.strip() for part in line.partition("=>"))
        if section == "adjectives" or category in _WORD_SETS:
            entries[term] = ([(term, False)], after)
            continue
        singular, _, plural_form = (part.strip() for part in term.partition("|"))
        forms = [(plural_form or plural(singular), True)]
        if singular != "-":
            forms.insert(0, (singular, False))
        entries[singular if singular != "-" else forms[0][0]] = (forms, after)


def _data_files(extra_dirs: Iterable[str | Path]) -> Iterator[tuple[str, str]]:
    """(category, text) for the packaged files, then each extra folder's files."""
    packaged = resources.files("pairforge.recaption").joinpath("data")
    sources = [sorted(packaged.iterdir(), key=lambda p: p.name)]
    sources += [sorted(Path(d).iterdir(), key=lambda p: p.name) for d in extra_dirs]
    for files in sources:
        for path in files:
            if path.name.startswith(PREFIX) and path.name.endswith(".txt"):
                yield path.name[len(PREFIX):-4], path.read_text(encoding="utf-8")


def _add(table: dict[tuple[str, ...], Term], key: tuple[str, ...], term: Term) -> None:
    old = table.get(key)
    if old is not None:  # the same word in two files: report both categories
        cats = old.categories + tuple(c for c in term.categories if c not in old.categories)
        term = Term(old.lemma, cats, old.plural, old.after or term.after)
    table[key] = term


def _compile(staged: _Staged) -> AttributeLexicon:
    lex = AttributeLexicon()
    for (category, section), entries in staged.items():
        for lemma, (forms, after) in entries.items():
            for phrase, is_plural in forms:
                for key in _keys(phrase):
                    if category == "descriptors":
                        lex.descriptors.add(phrase)
                    elif category == "nominal":
                        lex.nominal.add(key)
                    elif category == "exceptions":
                        lex.exceptions.update({key, (*key[:-1], plural(key[-1]))})
                    elif category == "animals":
                        lex.animals.add(phrase)
                    elif category == "heads":
                        lex.heads[key] = Term(lemma, (), is_plural)
                    else:
                        table = lex.adjectives if section == "adjectives" else lex.nouns
                        _add(table, key, Term(lemma, (category,), is_plural, after))
    keys = [*lex.nouns, *lex.adjectives, *lex.heads, *lex.exceptions]
    lex.longest = max((len(key) for key in keys), default=1)
    return lex


def load_lexicon(extra_dirs: list[str] | None = None) -> AttributeLexicon:
    """The packaged word lists, extended by ``attr_*.txt`` files in ``extra_dirs``."""
    if not extra_dirs:
        return _default_lexicon()
    return _load(tuple(str(d) for d in extra_dirs))


@functools.cache
def _default_lexicon() -> AttributeLexicon:
    return _load(())


def _load(extra_dirs: tuple[str, ...]) -> AttributeLexicon:
    staged: _Staged = {}
    for category, text in _data_files(extra_dirs):
        _stage_file(staged, category, text)
    return _compile(staged)


# ---------------------------------------------------------------------------- tokens


@dataclass
class _Tok:
    text: str
    kind: str  # "w" word, "s" space, "p" punctuation
    protected: bool = False
    deleted: bool = False
    touched: bool = False  # rewritten, so the article before it is recomputed
    person: bool = False  # now reads person/people because of a rewrite
    plural: bool = False

    @property
    def low(self) -> str:
        return self.text.lower().replace("’", "'")


@dataclass
class _Span:
    """Words [start, end) of a person noun phrase; ``term`` None for neutral nouns."""

    start: int
    end: int
    term: Term | None
    plural: bool
    possessive: bool
    after: str = ""


def _split_possessive(word: str) -> tuple[str, bool]:
    if word.endswith("'s"):
        return word[:-2], True
    if word.endswith("s'"):
        return word[:-1], True
    return word, False


class _Caption:
    """A tokenised caption with word positions, so rules can look left and right."""

    def __init__(self, caption: str, lex: AttributeLexicon):
        self.lex = lex
        self.toks = [_Tok(m.group(), m.lastgroup or "p") for m in _TOKEN.finditer(caption)]
        self.words = [i for i, t in enumerate(self.toks) if t.kind == "w"]
        self.removed: list[tuple[int, str]] = []
        self.broken = False  # a rewrite that could not be made grammatical

    def tok(self, pos: int) -> _Tok:
        return self.toks[self.words[pos]]

    def low(self, pos: int) -> str:
        return self.tok(pos).low

    def gap(self, pos: int) -> str | None:
        """What separates word pos-1 from word pos: "space", "comma" or None (anything else)."""
        between = "".join(t.text for t in self.toks[self.words[pos - 1] + 1:self.words[pos]])
        if between.isspace():
            return "space"
        return "comma" if between.strip() == "," and between[0] == "," else None

    def comma_before(self, pos: int) -> _Tok:
        """The comma token of a "comma" gap before word ``pos``."""
        return next(t for t in self.toks[self.words[pos - 1] + 1:self.words[pos]]
                    if t.text == ",")

    def run(self, start: int, length: int) -> bool:
        """Whether words start..start+length-1 exist, are unprotected and space-separated."""
        if start + length > len(self.words):
            return False
        if any(self.tok(p).protected for p in range(start, start + length)):
            return False
        return all(self.gap(p) == "space" for p in range(start + 1, start + length))

    def match(self, table: dict[tuple[str, ...], Term], start: int) -> tuple[Term, int] | None:
        """The longest entry of ``table`` starting at word ``start`` (last word may be X's)."""
        for length in range(min(self.lex.longest, len(self.words) - start), 0, -1):
            if not self.run(start, length):
                continue
            lows = [self.low(p) for p in range(start, start + length)]
            lows[-1] = _split_possessive(lows[-1])[0]
            term = table.get(tuple(lows))
            if term is not None:
                return term, length
        return None

    def delete(self, pos: int) -> None:
        tok = self.tok(pos)
        tok.deleted = tok.touched = True

    def record(self, pos: int, term: Term) -> None:
        self.removed += [(pos, f"{category}:{term.lemma}") for category in term.categories]


# ---------------------------------------------------------------------------- rules


def _protect(cap: _Caption) -> None:
    firsts = {key[0] for key in cap.lex.exceptions}
    for start in range(len(cap.words)):
        if cap.low(start) not in firsts:
            continue
        for key in cap.lex.exceptions:
            if key[0] == cap.low(start) and cap.run(start, len(key)) and all(
                    cap.low(start + k) == word for k, word in enumerate(key)):
                for pos in range(start, start + len(key)):
                    cap.tok(pos).protected = True


def _find_spans(cap: _Caption) -> list[_Span]:
    spans, pos = [], 0
    while pos < len(cap.words):
        found = cap.match(cap.lex.nouns, pos)
        neutral = found is None
        found = found or cap.match(cap.lex.heads, pos)
        if found is None:
            pos += 1
            continue
        term, length = found
        possessive = _split_possessive(cap.low(pos + length - 1))[1]
        if (not possessive and _names_animal(cap, pos, pos + length)) or _is_verb(
                cap, spans, pos, term.plural) or (possessive and _is_category(cap, pos, term)):
            pos += length
            continue
        spans.append(_Span(pos, pos + length, None if neutral else term, term.plural,
                           possessive, "" if neutral else term.after))
        pos += length
    return spans


def _names_animal(cap: _Caption, start: int, end: int) -> bool:
    """"its mother", "a baby elephant", "a mother cat": the person word is an animal's."""
    if start > 0 and cap.low(start - 1) == "its" and cap.gap(start) == "space":
        return True
    return end < len(cap.words) and cap.gap(end) == "space" and cap.low(end) in cap.lex.animals


def _is_verb(cap: _Caption, spans: list[_Span], pos: int, is_plural: bool) -> bool:
    """"she nurses", "a woman nurses her baby": a plural-looking noun after a singular
    subject is a verb, not a second person."""
    if pos == 0 or cap.gap(pos) != "space":
        return False
    if cap.low(pos - 1) in ("he", "she", "it", "they", "who"):
        return True
    if cap.low(pos - 1) == "to" and not is_plural:  # "to groom a horse", "to nurse"
        return True
    last = spans[-1] if spans else None
    return (is_plural and cap.low(pos).endswith("s") and last is not None
            and last.end == pos and not last.plural and not last.possessive)


def _is_category(cap: _Caption, pos: int, term: Term) -> bool:
    """"men's ties", "a children's book": a plural possessive without a determiner of its
    own names a kind of thing; "the women's hands" and "two boys' bikes" are people."""
    return term.plural and (pos == 0 or cap.low(pos - 1) not in _PLURAL_DETS)


def _is_modifier(cap: _Caption, pos: int) -> bool:
    """Adjective-like words that may sit between an attribute adjective and its noun."""
    low = cap.low(pos)
    return ((low,) in cap.lex.adjectives or low in cap.lex.descriptors or "-" in low
            or (len(low) > 5 and low.endswith(("ing", "ed"))))


def _head_after(cap: _Caption, pos: int, colour: bool, spans: dict[int, _Span]) -> _Span | None:
    """The person noun that the adjective ending before word ``pos`` modifies, if any."""
    if pos < len(cap.words) and colour and cap.low(pos) in _COLOUR_COMPOUNDS:
        return None
    after_and = False
    while pos < len(cap.words) and not cap.tok(pos).protected:
        gap = cap.gap(pos)
        if pos in spans:
            return spans[pos] if gap == "space" and not after_and else None
        if gap is None:
            return None
        if cap.low(pos) == "and" and gap == "space" and not after_and:
            after_and = True
        elif _is_modifier(cap, pos):
            after_and = False
        elif (not colour and not after_and and pos + 1 in spans
              and cap.gap(pos + 1) == "space" and cap.low(pos).isalpha()
              and cap.low(pos) not in _FUNCTION_WORDS):
            return spans[pos + 1]  # one compound word: "a young tennis player"
        else:
            return None
        pos += 1
    return None


def _drop_connector(cap: _Caption, start: int, end: int) -> None:
    """Remove the "and" or comma that joined a removed adjective to its neighbour."""
    if end < len(cap.words) and cap.gap(end) == "comma":
        cap.comma_before(end).deleted = True
    elif end < len(cap.words) and cap.low(end) == "and" and cap.gap(end) == "space":
        cap.delete(end)
    elif start >= 2 and cap.low(start - 1) == "and" and _is_modifier(cap, start - 2):
        cap.delete(start - 1)
    elif start >= 1 and cap.gap(start) == "comma" and _is_modifier(cap, start - 1):
        cap.comma_before(start).deleted = True


def _drop_adjectives(cap: _Caption, spans: list[_Span]) -> None:
    by_start = {span.start: span for span in spans}
    covered = {pos for span in spans for pos in range(span.start, span.end)}
    pos = 0
    while pos < len(cap.words):
        found = None if pos in covered else cap.match(cap.lex.adjectives, pos)
        if found is None or _split_possessive(cap.low(pos + found[1] - 1))[1]:
            pos += 1
            continue
        term, length = found
        head = _head_after(cap, pos + length, term.lemma in _COLOURS, by_start)
        if head is not None:
            cap.record(pos, term)
            for word in range(pos, pos + length):
                cap.delete(word)
            _drop_connector(cap, pos, pos + length)
            head.after = head.after or term.after
        pos += length


# an orphaned attribute adjective ("A young sleeping on a bed.") after these determiners
_ONE = {"a", "an", "one", "each", "every", "another"}
_MANY = {"these", "those", "some", "several", "many", "both", "all"} | (set(_NUMBERS) - {"one"})
# after the adjective, these words show that no noun follows it
_NO_NOUN = {"in", "on", "at", "with", "near", "next", "beside", "behind", "under", "by",
            "inside", "outside", "against", "into", "onto", "across", "along", "among",
            "around", "between", "beneath", "over", "through", "toward", "towards", "who",
            "is", "are", "was", "were", "has", "have"}
_END = set(".;:!?")


def _verb_like(cap: _Caption, pos: int) -> bool:
    """"sleeping on", "holding a", "dressed in": a participle followed by a function word,
    a preposition or the end is a verb; "a sleeping puppy" is a modifier."""
    low = cap.low(pos)
    if len(low) <= 4 or not low.endswith(("ing", "ed")):
        return False
    nxt = pos + 1
    return nxt == len(cap.words) or cap.gap(nxt) != "space" or (
        cap.low(nxt) in _FUNCTION_WORDS | _NO_NOUN)


def _no_noun_at(cap: _Caption, pos: int) -> bool:
    """Whether word ``pos`` (right after an adjective) shows that no noun follows it."""
    if pos == len(cap.words):
        return True
    if cap.gap(pos) != "space":  # "a young." ends it; "a young, happy person" does not
        between = cap.toks[cap.words[pos] - 1].text
        return between in _END
    return cap.low(pos) in _NO_NOUN or _verb_like(cap, pos)


def _modifier_run(cap: _Caption, pos: int, covered: set[int]) -> list[tuple[int, int, Term | None]]:
    """Adjectives from word ``pos`` on: (start, words, attribute term or None)."""
    run: list[tuple[int, int, Term | None]] = []
    while pos < len(cap.words) and pos not in covered and not cap.tok(pos).deleted:
        if run and cap.gap(pos) != "space":
            break
        found = cap.match(cap.lex.adjectives, pos)
        if found is not None:
            run.append((pos, found[1], found[0]))
            pos += found[1]
        elif cap.low(pos) in cap.lex.descriptors and not cap.tok(pos).protected:
            run.append((pos, 1, None))
            pos += 1
        else:
            break
    return run


def _orphans(cap: _Caption, spans: list[_Span]) -> bool:
    """"A young sleeping on a bed." -> "A person sleeping on a bed.": a listed attribute
    adjective after a determiner with no noun after it is the person. True if any."""
    covered = {pos for span in spans for pos in range(span.start, span.end)}
    found, pos = False, 1
    while pos < len(cap.words):
        det = cap.low(pos - 1)
        run = [] if (det not in _ONE | _MANY | {"the"} or cap.gap(pos) != "space"
                     or cap.tok(pos - 1).deleted) else _modifier_run(cap, pos, covered)
        if not run:
            pos += 1
            continue
        start, length, term = run[-1]
        end = start + length
        words = tuple(cap.low(p) for p in range(start, end))
        if term is None or words not in cap.lex.nominal or not _no_noun_at(cap, end):
            pos = end
            continue
        for at, size, attribute in run:
            if attribute is not None:
                cap.record(at, attribute)
                for word in range(at, at + size):
                    cap.delete(word)
        tok = cap.tok(start)
        following = cap.low(end) if end < len(cap.words) else ""
        tok.plural = det in _MANY or (det == "the" and following not in _SINGULAR_VERBS)
        tok.text = _cased("people" if tok.plural else "person", tok.text)
        tok.deleted, tok.touched, tok.person = False, True, True
        found, pos = True, end
    return found


def _cased(word: str, like: str) -> str:
    if len(like) > 1 and like.isupper():
        return word.upper()
    return word[:1].upper() + word[1:] if like[:1].isupper() else word


def _rewrite_nouns(cap: _Caption, spans: list[_Span]) -> None:
    for n, span in enumerate(spans):
        following = spans[n + 1] if n + 1 < len(spans) else None
        if span.term is None:
            if span.after and not span.possessive:
                cap.tok(span.end - 1).text += " " + span.after
            continue
        cap.record(span.start, span.term)
        for pos in range(span.start + 1, span.end):
            cap.delete(pos)
        modifier = (following is not None and following.start == span.end
                    and not span.possessive and cap.gap(following.start) == "space")
        if modifier or _after_neutral(cap, spans[n - 1] if n else None, span):
            # "a woman doctor": the next noun is the person; "a baby girl": the baby is
            cap.delete(span.start)
            continue
        tok = cap.tok(span.start)
        tok.text = _cased(_person_word(cap, span, tok.text), tok.text)
        tok.touched = tok.person = True
        tok.plural = span.plural


def _after_neutral(cap: _Caption, before: _Span | None, span: _Span) -> bool:
    """An attribute noun right after a neutral one ("a baby girl") only qualifies it."""
    return (before is not None and before.term is None and before.end == span.start
            and not before.possessive and cap.gap(span.start) == "space")


def _drop_relations(cap: _Caption, spans: list[_Span]) -> None:
    """"her baby" -> "a baby", "his son" -> "a person": a possessive pronoun before a
    person noun states a relation nobody can see; the person it owns stays, unowned."""
    live = _live(cap)
    starts = {cap.words[span.start]: span for span in spans}
    for n, i in enumerate(live[:-1]):
        tok = cap.toks[i]
        # "her two sons": a number may stand between the owner and the person
        counted = cap.toks[live[n + 1]].low in _NUMBERS and n + 2 < len(live)
        nxt = live[n + 2] if counted else live[n + 1]
        if tok.low not in _RELATION_OWNERS or tok.protected or nxt not in starts:
            continue
        if any(t.kind == "p" for t in cap.toks[i + 1:nxt]):
            continue
        span = starts[nxt]
        if tok.low != "their":
            cap.removed.append((cap.words.index(i), f"gender:{tok.low}"))
        if span.plural or counted:  # "her children" -> "people", "her two sons" -> "two"
            tok.deleted = True
            continue
        tok.text = _cased(_article(cap.toks[nxt].text), tok.text)
        tok.protected = True  # the pronoun rewrite must not see "a" as "her"


def _person_word(cap: _Caption, span: _Span, old: str) -> str:
    """person / people / person's / people's (+ the visible words a disability keeps)."""
    # "a women that is walking": the article says one person
    after_a = span.start > 0 and cap.low(span.start - 1) in ("a", "an")
    span.plural = span.plural and (span.possessive or not after_a)
    word = "people" if span.plural else "person"
    if span.possessive:
        return word + ("’s" if "’" in old else "'s")
    return f"{word} {span.after}" if span.after else word


def _plural_verb(word: str) -> str:
    """'they' + verb: is -> are, holds -> hold, watches -> watch, carries -> carry."""
    low = word.lower()
    if low in _AGREEMENT:
        return _cased(_AGREEMENT[low], word)
    if len(low) < 3 or not low.endswith("s") or low.endswith(("ss", "us", "is")):
        return word
    if low.endswith("ies") and len(low) > 4:
        return word[:-3] + "y"
    if low.endswith(("ches", "shes", "sses", "xes", "zes", "oes")):
        return word[:-2]
    return word[:-1]


def _live(cap: _Caption) -> list[int]:
    return [i for i, t in enumerate(cap.toks) if t.kind == "w" and not t.deleted]


def _rewrite_pronouns(cap: _Caption) -> None:
    live = _live(cap)
    for n, i in enumerate(live):
        tok = cap.toks[i]
        if tok.protected:
            continue
        nxt = cap.toks[live[n + 1]] if n + 1 < len(live) else None
        low = tok.low
        if low == "her":
            ends = nxt is None or any(t.kind == "p" for t in cap.toks[i + 1:live[n + 1]])
            new = "them" if ends or nxt.low in _AFTER_OBJECT else "their"
        elif low == "his":
            ends = nxt is None or any(t.kind == "p" for t in cap.toks[i + 1:live[n + 1]])
            new = "theirs" if ends else "their"
        elif low in ("he's", "she's") and nxt is not None and nxt.low in ("got", "been"):
            new = "they've"
        else:
            new = _SUBJECT.get(low) or _PRONOUNS.get(low)
        if new is None:
            continue
        cap.removed.append((cap.words.index(i), f"gender:{low.split(chr(39))[0]}"))
        tok.text = _cased(new, tok.text)
        if low in _SUBJECT:
            _agree(cap, live[n + 1:])


def _agree(cap: _Caption, following: list[int]) -> None:
    """Make the verb after a new 'they' plural, skipping adverbs ("they often read")."""
    for i in following:
        tok = cap.toks[i]
        if tok.low in _ADVERBS or (tok.low.endswith("ly") and len(tok.low) > 4):
            continue
        if tok.low in _AGREEMENT or ("'" not in tok.low and tok.low not in _FUNCTION_WORDS):
            tok.text = _plural_verb(tok.text)
        return


def _is_person_word(tok: _Tok) -> bool:
    return (tok.person or tok.low in ("person", "people")) and not tok.protected


def _element(cap: _Caption, live: list[int], n: int) -> tuple[int | None, int, int] | None:
    """A coordinated person at live word n: (count or None, first live, last live)."""
    if n >= len(live):
        return None
    first = cap.toks[live[n]]
    det = first.low if first.low in _ARTICLES | _VAGUE | set(_NUMBERS) else None
    noun_n = n + 1 if det else n
    if noun_n >= len(live) or not _is_person_word(cap.toks[live[noun_n]]):
        return None
    if det and _between(cap, live[n], live[noun_n]):
        return None
    noun = cap.toks[live[noun_n]]
    if noun.plural or noun.low == "people":
        count = _NUMBERS.get(det or "")
    else:
        count = None if det in _VAGUE - {"the"} else 1
    return count, n, noun_n


def _between(cap: _Caption, i: int, j: int) -> str:
    return "".join(t.text for t in cap.toks[i + 1:j] if not t.deleted).strip()


def _chain(cap: _Caption, live: list[int], n: int) -> tuple[list[tuple], int] | None:
    """Coordinated people from live word n ("a man, a woman and a child"), end exclusive."""
    elements, pos = [], n
    while (element := _element(cap, live, pos)) is not None:
        elements.append(element)
        pos = element[2] + 1
        if pos >= len(live):
            break
        sep = _between(cap, live[pos - 1], live[pos])
        if cap.toks[live[pos]].low == "and" and sep in ("", ","):
            pos += 1
        elif sep != ",":
            break
    end = elements[-1][2] + 1 if elements else n
    return (elements, end) if len(elements) > 1 else None


def _collapse(cap: _Caption) -> None:
    """"a man and a woman" -> "two people"; "men and women" -> "people"."""
    live, n = _live(cap), 0
    while n < len(live):
        found = _chain(cap, live, n)
        if found is None or not _collapsible(cap, live, *found):
            n += 1
            continue
        elements, end = found
        counts = [count for count, _, _ in elements]
        first = cap.toks[live[n]]
        det = first.low if first.low in _ARTICLES | _VAGUE | set(_NUMBERS) else ""
        if None not in counts:
            total = sum(counts)  # type: ignore[arg-type]
            words = f"{_NUMBER_WORDS.get(total, str(total))} people"
            words = f"the {words}" if det == "the" else words
        else:
            words = f"{det} people" if det in _VAGUE else "people"
        for i in live[n + 1:end]:
            cap.toks[i].deleted = True
        for i in range(live[n] + 1, live[end - 1]):
            cap.toks[i].deleted = True
        first.text, first.person, first.plural, first.touched = (
            _cased(words, first.text), True, True, True)
        n = end


def _collapsible(cap: _Caption, live: list[int], elements: list[tuple], end: int) -> bool:
    if not any(cap.toks[live[noun]].person for _, _, noun in elements):
        return False
    if any(cap.toks[live[noun]].low.endswith(("'s", "s'")) for _, _, noun in elements):
        return False
    if end >= len(live):
        return True
    nxt = cap.toks[live[end]].low
    # "holds a baby and a woman waves": a singular verb means the "and" joined two clauses
    return nxt not in _SINGULAR_VERBS and not (
        nxt.endswith("s") and not nxt.endswith("ss") and len(nxt) > 3 and nxt not in _NOT_VERBS)


def _fix_articles(cap: _Caption) -> None:
    live = _live(cap)
    for n, i in enumerate(live[:-1]):
        tok, nxt = cap.toks[i], cap.toks[live[n + 1]]
        if tok.low not in ("a", "an"):
            continue
        changed = nxt.touched or any(t.deleted for t in cap.toks[i + 1:live[n + 1]])
        if changed:
            tok.text = _cased(_article(nxt.text), tok.text)


def _article(word: str) -> str:
    low = word.lower()
    if low.startswith(("hour", "honest", "honor", "honour", "heir")):
        return "an"
    if low.startswith(("uni", "use", "usu", "eu", "one", "once", "ubi")):
        return "a"
    return "an" if low[:1] in "aeiou" else "a"


def _render(cap: _Caption) -> str:
    """Join the live tokens, dropping the spaces that deletions left doubled or dangling."""
    out: list[tuple[int, _Tok]] = []
    lost_start = False  # the caption's first word went: its space goes with it
    for i, tok in enumerate(cap.toks):
        lost_start = lost_start or (tok.deleted and not out)
        if tok.deleted or (tok.kind == "s" and (
                (not out and lost_start) or (out and out[-1][1].kind == "s"))):
            continue
        if (tok.kind == "p" and tok.text in ",.;:!?)" and out and out[-1][1].kind == "s"
                and out[-1][0] != i - 1):
            out.pop()  # the space belonged to a deleted word before this punctuation
        out.append((i, tok))
    while out and out[-1][1].kind == "s" and out[-1][0] != len(cap.toks) - 1:
        out.pop()
    return "".join(tok.text for _, tok in out)


def _restore_case(text: str, original: str) -> str:
    first = re.search(r"[A-Za-z]", original)
    at = re.search(r"[A-Za-z]", text)
    if first is None or at is None:
        return text
    letter = text[at.start()]
    letter = letter.upper() if original[first.start()].isupper() else letter
    return text[:at.start()] + letter + text[at.start() + 1:]


_DOUBLED = re.compile(r"\b(\w+)\s+\1\b", re.I)
_DANGLING = re.compile(
    r"\b(a|an|the)\s*(?=[,.;:!?]|$)|\b(a|an|the)\s+(a|an|the|and|or|of)\b"
    r"|\b(a|an|one|each|every|another)\s+people\b(?!['’])", re.I)


def _fluent(cap: _Caption, text: str, original: str) -> bool:
    if cap.broken or not re.search(r"[A-Za-z0-9]", text):
        return False
    if len(_DOUBLED.findall(text)) > len(_DOUBLED.findall(original)):
        return False
    if len(_DANGLING.findall(text)) > len(_DANGLING.findall(original)):
        return False
    return not _lost_relation(cap)


def _lost_relation(cap: _Caption) -> bool:
    """"her son" -> "their person": a rewritten noun right after a possessive."""
    live = _live(cap)
    for n, i in enumerate(live[1:], start=1):
        prev = cap.toks[live[n - 1]].low
        possessive = prev in _POSSESSIVES or prev.endswith(("'s", "s'"))
        if cap.toks[i].person and possessive and cap.toks[i].touched:
            return True
    return False


def neutralize(caption: str, lexicon: AttributeLexicon | None = None) -> NeutralizeResult:
    """Remove attributes applied to people and rewrite the phrase neutrally (module doc)."""
    cap = _Caption(caption, lexicon or load_lexicon())
    _protect(cap)
    spans = _find_spans(cap)
    _drop_adjectives(cap, spans)
    orphaned = _orphans(cap, spans)
    _rewrite_nouns(cap, spans)
    _drop_relations(cap, spans)
    if spans or orphaned or not any(cap.low(p) in cap.lex.animals
                                    for p in range(len(cap.words))):
        _rewrite_pronouns(cap)  # with an animal and no person, he/she is the animal's
    _collapse(cap)
    _fix_articles(cap)
    text = _restore_case(_render(cap), caption)
    removed = list(dict.fromkeys(entry for _, entry in sorted(cap.removed)))
    return NeutralizeResult(text, removed, _fluent(cap, text, caption))
