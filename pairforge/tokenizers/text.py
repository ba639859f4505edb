"""Text tokenizers: any Hugging Face tokenizer, a byte-level BPE trained on our captions,
and a byte fallback that needs no files.

Caption ids never include special tokens: the vocabulary layout (vocab.py) puts SOV, EOV,
EOS and PAD after the image codes, so the sequence builder adds them, not the tokenizer.
"""

from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pairforge.tokenizers.fingerprint import fingerprint_digest

# files that define a Hugging Face tokenizer's behaviour (hashed into the fingerprint)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "vocab.txt", "special_tokens_map.json",
                   "added_tokens.json")


class TextTokenizer(ABC):
    """str -> ids in ``[0, vocab_size)`` and back."""

    backend: str = "abstract"

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Ids of ``text``, without special tokens."""

    @abstractmethod
    def decode(self, ids: list[int]) -> str:
        """Text of ``ids`` (ids that are not text are skipped)."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """V_text: every id :meth:`encode` returns is below it."""

    @property
    @abstractmethod
    def fingerprint(self) -> dict[str, Any]:
        """backend, name or path, hash of the defining files, vocab size, ``digest``."""


class ByteTokenizer(TextTokenizer):
    """UTF-8 bytes as ids 0..255: always available, never out of vocabulary."""

    backend = "bytes"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    @property
    def vocab_size(self) -> int:
        return 256

    @property
    def fingerprint(self) -> dict[str, Any]:
        fingerprint: dict[str, Any] = {"backend": self.backend, "model": "utf-8 bytes",
                                       "vocab_size": 256}
        fingerprint["digest"] = fingerprint_digest(fingerprint)
        return fingerprint


class HFTextTokenizer(TextTokenizer):
    """``AutoTokenizer.from_pretrained`` by hub id or local path."""

    backend = "hf"

    def __init__(self, name_or_path: str, revision: str | None = None) -> None:
        from transformers import AutoTokenizer

        self.name_or_path = str(name_or_path)
        self.tokenizer = AutoTokenizer.from_pretrained(self.name_or_path, revision=revision)
        self._fingerprint = self._make_fingerprint(revision)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    @property
    def vocab_size(self) -> int:
        # len() counts added tokens too; .vocab_size does not, and added ids can occur
        return len(self.tokenizer)

    @property
    def fingerprint(self) -> dict[str, Any]:
        return dict(self._fingerprint)

    def _make_fingerprint(self, revision: str | None) -> dict[str, Any]:
        fingerprint: dict[str, Any] = {
            "backend": self.backend,
            "model": self.name_or_path,
            "revision": revision,
            "class": type(self.tokenizer).__name__,
            "files_sha256": _files_sha256(self.name_or_path, revision),
            "vocab_size": self.vocab_size,
        }
        fingerprint["digest"] = fingerprint_digest(fingerprint)
        return fingerprint


def _files_sha256(name_or_path: str, revision: str | None) -> str:
    """sha256 over whichever tokenizer files exist (local folder or hub cache)."""
    from transformers.utils import cached_file

    digest = hashlib.sha256()
    for name in TOKENIZER_FILES:
        path = cached_file(name_or_path, name, revision=revision,
                           _raise_exceptions_for_missing_entries=False)
        if path is not None:
            digest.update(name.encode() + b"\0" + Path(path).read_bytes())
    return digest.hexdigest()


def train_bpe(captions: Iterable[str], out_dir: str | Path, vocab_size: int = 8192,
              min_frequency: int = 2) -> Path:
    """Train a byte-level BPE on ``captions``; save it for ``PreTrainedTokenizerFast``.

    Byte-level: every string encodes (no unknown token) and decodes back exactly. No
    special tokens are added (the vocabulary layout owns them).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False, special_tokens=[])
    tokenizer.train_from_iterator((c for c in captions if c), trainer)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer).save_pretrained(str(out))
    return out


def read_captions(sources: Iterable[str | Path], column: str = "caption") -> Iterable[str]:
    """Captions from csv/tsv (``column``), jsonl (``column``), parquet, txt (one per line)
    and webdataset tars (the ``txt`` member of each sample)."""
    for source in sources:
        path = Path(source)
        suffix = path.suffix.lower()
        if suffix == ".tar":
            yield from _tar_captions(path)
        elif suffix in {".csv", ".tsv"}:
            yield from _table_captions(path, column, "\t" if suffix == ".tsv" else ",")
        elif suffix == ".jsonl":
            for line in path.read_text(encoding="utf-8").splitlines():
                if line.strip():
                    yield str(json.loads(line).get(column) or "")
        elif suffix == ".parquet":
            import pyarrow.parquet as pq

            yield from (str(c) for c in pq.read_table(path, columns=[column])[column].to_pylist()
                        if c is not None)
        else:
            yield from path.read_text(encoding="utf-8").splitlines()


def _table_captions(path: Path, column: str, delimiter: str) -> Iterable[str]:
    import csv

    with path.open(newline="", encoding="utf-8") as handle:
        for row in csv.DictReader(handle, delimiter=delimiter):
            if row.get(column):
                yield row[column].strip()


def _tar_captions(path: Path) -> Iterable[str]:
    import webdataset as wds

    for sample in wds.WebDataset(str(path), shardshuffle=False, empty_check=False):
        if "txt" in sample:
            yield sample["txt"].decode("utf-8", errors="replace").strip()
