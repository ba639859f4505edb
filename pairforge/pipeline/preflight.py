"""Every model a build will load, looked up before any work starts.

A build downloads for hours before stage 3 loads its first model, and a model that cannot
load fails inside an actor. So the sources are checked first, without loading weights: a
local folder must hold the files its loader reads; an open_clip name and pretrained tag
must be ones open_clip knows, or a file. A hub id ("name" or "org/name") that is not a
local folder is left to the loader: checking it would need the network.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from pairforge.config import ClipConfig, ConfigError, PairforgeConfig

CHECKPOINT_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors")


def check_model_sources(cfg: PairforgeConfig) -> None:
    """Raise ``ConfigError`` naming each config key whose model cannot be found."""
    process = cfg.process
    problems: list[str] = []
    if process.tokenize.enabled:
        problems += _tokenizer_problems(cfg)
    if process.clip.enabled or (process.recaption.enabled and process.recaption.grounding.enabled):
        problems += _clip_problems(process.clip)
    if process.recaption.enabled and process.recaption.backend == "transformers":
        problems += _folder_problems("process.recaption.model", process.recaption.model,
                                     [("config.json",)])
    if problems:
        raise ConfigError("a model cannot be found:\n  " + "\n  ".join(problems))


def _tokenizer_problems(cfg: PairforgeConfig) -> list[str]:
    from pairforge.tokenizers.vqvae import CONFIG_NAME, WEIGHTS_NAME  # imports torch

    image, text = cfg.process.tokenize.image, cfg.process.tokenize.text
    key = "process.tokenize.image.path_or_id"
    if image.backend == "pairforge-vq":  # ours is a train-vq folder, never a hub id
        problems = list(_folder_problems(key, image.path_or_id,
                                         [(CONFIG_NAME,), (WEIGHTS_NAME,)], hub=False))
    else:
        problems = list(_folder_problems(key, image.path_or_id, [("config.json",)]))
    if text.backend == "hf" and text.path_or_id:
        problems += _folder_problems("process.tokenize.text.path_or_id", text.path_or_id,
                                     [("tokenizer.json", "tokenizer_config.json")])
    return problems


def _looks_local(ref: str) -> bool:
    """A path, not a hub id: hub ids have at most one slash and no leading dot or tilde."""
    return ref.startswith(("/", ".", "~")) or ref.count("/") > 1


def _folder_problems(key: str, ref: str, needs: list[tuple[str, ...]],
                     hub: bool = True) -> Iterator[str]:
    """``needs``: groups of file names; the folder must hold one name of every group."""
    folder = Path(ref).expanduser()
    if folder.is_dir():
        for names in needs:
            if not any((folder / name).is_file() for name in names):
                yield f"{key}: {ref} has no {' or '.join(names)}"
    elif not hub:
        yield f"{key}: {ref} is not a folder"
    elif _looks_local(ref):
        yield f"{key}: {ref} is not a folder (and is not a hub id)"


def _clip_problems(clip: ClipConfig) -> list[str]:
    if clip.model.startswith("hf-hub:"):
        return []  # open_clip fetches both the config and the weights from the hub
    import open_clip

    problems, names = [], set(open_clip.list_models())
    if clip.model_config_path:
        config = Path(clip.model_config_path).expanduser()
        if not config.exists():
            problems.append(f"process.clip.model_config_path: {config} does not exist")
        names |= {p.stem for p in ([config] if config.is_file() else config.glob("*.json"))}
    if clip.model not in names:
        problems.append(f"process.clip.model: {clip.model!r} is neither an open_clip model nor "
                        "in process.clip.model_config_path")
    pretrained = clip.pretrained
    if pretrained is None or Path(pretrained).expanduser().is_file():
        return problems
    if _looks_local(pretrained) or pretrained.endswith(CHECKPOINT_SUFFIXES):
        problems.append(f"process.clip.pretrained: {pretrained} is not a file")
    elif clip.model in names and not open_clip.get_pretrained_cfg(clip.model, pretrained):
        tags = open_clip.list_pretrained_tags_by_model(clip.model)
        problems.append(f"process.clip.pretrained: {pretrained!r} is not a tag of {clip.model} "
                        f"(open_clip knows {', '.join(tags) or 'none'}) nor a file")
    return problems
