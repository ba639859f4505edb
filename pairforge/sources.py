"""What a step loads, by kind, and how each kind checks itself before any work starts.

A step's ``requirements`` (stage.py) list its sources: a local folder or a cached hub id
(``ModelFolder``), an open_clip model (``OpenClipModel``), a file (``ModelFile``) or a model
an OpenAI-compatible server serves (``ServedModel``). Each answers ``problems()``: what
would stop the step from loading it, every problem naming its config key, found without
loading weights. A folder holds the files its loader reads; an open_clip name and
pretrained tag are ones open_clip knows, or a file; a hub id is in the local Hugging Face
cache (looked up on disk, never over the network: build machines are often offline); a
file exists; a server answers ``GET /models`` and serves the model. A source's own
``check`` then reads what was found (a classifier's labels, a detector's model type).
``local_files()`` names the files the settings digest fingerprints.

Ground floor: ``pipeline/preflight.py`` only asks these. open_clip, huggingface_hub and
requests are imported inside the checks, so that declaring a source stays light.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

# The files a transformers folder (or cached hub repo) holds, one name of each group
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")  # AutoProcessor's
TRANSFORMERS_FILES = (("config.json",), WEIGHT_FILES, PROCESSOR_FILES)  # model + processor
CHECKPOINT_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors")
OPEN_CLIP_WEIGHTS = ("open_clip_model.safetensors", "open_clip_pytorch_model.bin")
SERVER_TIMEOUT_S = 5.0  # GET /models: a live server answers at once

# A further check of a source once its files are found (a folder's or cached repo's
# config.json, or the file itself): the problems it finds, each naming its config key. It
# may raise on a file it cannot read; the source names that for it.
SourceCheck = Callable[[str], list[str]]


def error_reason(err: BaseException) -> str:
    """A short cause, as every check before a run names it: an OSError's text and path,
    else the exception's own message."""
    if isinstance(err, OSError) and err.strerror:
        return f"{err.strerror}: {err.filename}" if err.filename else err.strerror
    return f"{type(err).__name__}: {err}"


@dataclass(frozen=True)
class ModelFolder:
    """A local folder holding one name of every group in ``files``, or (``hub``) a hub id
    whose files are in the local Hugging Face cache (never fetched: builds run offline)."""

    key: str  # the config key, as problems name it
    ref: str
    files: tuple[tuple[str, ...], ...] = ()
    revision: str | None = None
    hub: bool = True
    check: SourceCheck | None = None  # given the config.json
    setting: str | None = None  # the settings digest's key, when not ``key``
    fingerprint: bool = True  # False: recorded by its config value only

    def local_files(self) -> dict[str, str | None]:
        return {self.setting or self.key: self.ref} if self.fingerprint else {}

    def problems(self) -> list[str]:
        """The folder (or cached hub repo) holds one name of every group of ``files``; then
        the source's own check reads its config.json."""
        problems = list(_folder_files_problems(self.key, self.ref, self.files, self.revision,
                                               self.hub))
        if problems or self.check is None:  # a missing local path is no hub id to look up
            return problems
        config = _config_json(self.ref, self.revision)
        return [] if config is None else _checked(self.key, config, self.check)


@dataclass(frozen=True)
class OpenClipModel:
    """An open_clip model: a name open_clip ships (or one in ``model_config_path``, a file
    or folder of model configs), its weights a pretrained tag (from the local hub cache) or
    a checkpoint file."""

    key: str  # the config section: its keys are KEY.model, KEY.pretrained, ...
    model: str
    pretrained: str | None
    model_config_path: str | None = None

    def local_files(self) -> dict[str, str | None]:
        return {f"{self.key}.pretrained": self.pretrained,
                f"{self.key}.model_config_path": self.model_config_path}

    def problems(self) -> list[str]:
        """The name is one open_clip knows (or in the config path); the weights are a tag of
        it cached from its hub repo, or a file."""
        key = self.key
        if self.model.startswith("hf-hub:"):  # open_clip reads config and weights from it
            repo = self.model.removeprefix("hf-hub:")
            return list(_folder_files_problems(f"{key}.model", repo,
                                               (("open_clip_config.json",), OPEN_CLIP_WEIGHTS)))
        import open_clip

        problems, names = [], set(open_clip.list_models())
        if self.model_config_path:
            config = Path(self.model_config_path).expanduser()
            if not config.exists():
                problems.append(f"{key}.model_config_path: {config} does not exist")
            names |= {p.stem for p in ([config] if config.is_file() else config.glob("*.json"))}
        if self.model not in names:
            problems.append(f"{key}.model: {self.model!r} is neither an open_clip model nor "
                            f"in {key}.model_config_path")
        pretrained = self.pretrained
        if pretrained is None or Path(pretrained).expanduser().is_file():
            return problems
        if _looks_local(pretrained) or pretrained.endswith(CHECKPOINT_SUFFIXES):
            problems.append(f"{key}.pretrained: {pretrained} is not a file")
        elif self.model in names and not open_clip.get_pretrained_cfg(self.model, pretrained):
            tags = open_clip.list_pretrained_tags_by_model(self.model)
            problems.append(f"{key}.pretrained: {pretrained!r} is not a tag of {self.model} "
                            f"(open_clip knows {', '.join(tags) or 'none'}) nor a file")
        elif self.model in names:
            problems += _clip_tag_cached(f"{key}.pretrained",
                                         open_clip.get_pretrained_cfg(self.model, pretrained))
        return problems


@dataclass(frozen=True)
class ModelFile:
    """A file: a checkpoint, a head's state dict, a word list."""

    key: str
    path: str
    check: SourceCheck | None = None  # given the file
    setting: str | None = None
    fingerprint: bool = True

    def local_files(self) -> dict[str, str | None]:
        return {self.setting or self.key: self.path} if self.fingerprint else {}

    def problems(self) -> list[str]:
        if not Path(self.path).expanduser().is_file():
            return [f"{self.key}: {self.path} is not a file"]
        return [] if self.check is None else _checked(self.key, self.path, self.check)


@dataclass(frozen=True)
class ServedModel:
    """A model an OpenAI-compatible server serves: ``GET {base_url}/models`` lists it."""

    key: str  # the model name's config key
    model: str
    base_url: str
    url_key: str
    api_key_env: str
    timeout_s: float

    def local_files(self) -> dict[str, str | None]:
        return {}

    def problems(self) -> list[str]:
        """The server answers ``GET {base_url}/models`` and lists the model."""
        import requests

        url = self.base_url.rstrip("/") + "/models"
        key = os.environ.get(self.api_key_env)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        timeout = min(SERVER_TIMEOUT_S, self.timeout_s)
        where = f"{self.url_key}: {self.base_url}"
        try:
            response = requests.get(url, headers=headers, timeout=timeout)
        except requests.Timeout:
            return [f"{where}: GET /models got no answer within {timeout:g} s; start the "
                    "server or correct the URL"]
        except requests.RequestException as err:
            return [f"{where}: GET /models failed ({_connection_reason(err)}); start the "
                    "server or correct the URL"]
        if response.status_code != 200:
            return [f"{where}: GET /models answered HTTP {response.status_code}"
                    + (" (check the key in $" + self.api_key_env + ")"
                       if response.status_code in (401, 403) else "")]
        try:
            served = [m["id"] for m in response.json()["data"]]
        except (ValueError, KeyError, TypeError):
            return [f"{where}: GET /models did not answer an OpenAI model list"]
        if self.model not in served:
            return [f"{self.key}: {self.model!r} is not served by {self.base_url} "
                    f"(it serves {', '.join(repr(m) for m in served) or 'nothing'})"]
        return []


ModelSource = ModelFolder | OpenClipModel | ModelFile | ServedModel


def _checked(key: str, path: str, check: SourceCheck) -> list[str]:
    try:
        return check(path)
    except (OSError, ValueError) as err:  # unreadable, or not what it should hold
        return [f"{key}: cannot read {path} ({error_reason(err)})"]


def _folder_files_problems(key: str, ref: str, needs: tuple[tuple[str, ...], ...],
                           revision: str | None = None, hub: bool = True) -> Iterator[str]:
    """``needs``: groups of file names; the folder (or cached hub repo) must hold one name of
    every group."""
    folder = Path(ref).expanduser()
    if folder.is_dir():
        for names in needs:
            if not any((folder / name).is_file() for name in names):
                yield f"{key}: {ref} has no {' or '.join(names)}"
    elif not hub:
        yield f"{key}: {ref} is not a folder"
    elif _looks_local(ref):
        yield f"{key}: {ref} is not a folder (and is not a hub id)"
    else:
        missing = [names for names in needs if not _in_hub_cache(ref, names, revision)]
        if missing:
            yield _not_cached(key, ref, revision, missing[0])


def _config_json(ref: str, revision: str | None) -> str | None:
    """A model's config.json: in its folder, or in the local hub cache."""
    folder = Path(ref).expanduser()
    if folder.is_dir():
        return str(folder / "config.json")
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(ref, "config.json", revision=revision)
    return found if isinstance(found, str) else None


def _looks_local(ref: str) -> bool:
    """A path, not a hub id: hub ids have at most one slash and no leading dot or tilde."""
    return ref.startswith(("/", ".", "~")) or ref.count("/") > 1


def _in_hub_cache(repo_id: str, names: tuple[str, ...], revision: str | None) -> bool:
    from huggingface_hub import try_to_load_from_cache

    # a str is a cached file; None (unknown) and _CACHED_NO_EXIST (known absent) are not
    return any(isinstance(try_to_load_from_cache(repo_id, name, revision=revision), str)
               for name in names)


def _not_cached(key: str, repo_id: str, revision: str | None, names: tuple[str, ...],
                instead: str = "a local folder") -> str:
    from huggingface_hub import constants

    at = f" at revision {revision}" if revision else ""
    fetch = f"hf download {repo_id}" + (f" --revision {revision}" if revision else "")
    return (f"{key}: hub id {repo_id}{at} is not in the local Hugging Face cache "
            f"({constants.HF_HUB_CACHE} has no {' or '.join(names)} of it) and this run does "
            f"not download; fetch it on a machine with network (`{fetch}`) and copy the cache "
            f"here (HF_HUB_CACHE), or set {key} to {instead}")


def _clip_tag_cached(key: str, tag: dict) -> list[str]:
    """open_clip fetches a tag's weights from its hub repo (every tag of open_clip 3 has one;
    a tag with a URL only is left to the loader)."""
    if not tag.get("hf_hub"):
        return []
    repo, filename = os.path.split(tag["hf_hub"])
    names = (filename,) if filename else OPEN_CLIP_WEIGHTS
    if filename.endswith(".bin"):  # open_clip tries the safetensors twin first
        names = (filename.removesuffix(".bin") + ".safetensors", filename)
    if _in_hub_cache(repo, names, None):
        return []
    return [_not_cached(key, repo, None, names, "a checkpoint file")]


def _connection_reason(err: Exception) -> str:
    # requests wraps the socket error three deep; its "[Errno 111] Connection refused" is
    # the part a person needs
    found = re.search(r"\[Errno -?\d+\] [^'\")]+", str(err))
    return found.group(0).strip() if found else type(err).__name__
