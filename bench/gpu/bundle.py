"""Builds bench/gpu/bundle/: the wheels a lent GPU machine lacks to run pairforge, at the
versions pinned in this environment (bench/gpu/bundle.sh calls this; README.md there).

The lent H100/H200 image (/work/.library/device/KINDS.md: Python 3.12, torch, transformers,
pyarrow, numpy, pillow, pandas, scipy, aiohttp, requests, typer, rich, xxhash, timm,
huggingface-hub, ...) lacks Ray, open_clip, pydantic, webdataset, pyvips and a few small
ones; ``--full`` adds transformers and tokenizers at this environment's pins (the image
has older ones). Every wheel is downloaded with pip for the target's Python and platform
(``--python-version``), ``--no-deps``, one pinned version each.

Ray's wheel (76 MiB) alone is over the 64 MiB a GPU call may carry, so it is repacked:
``ray/jars`` (the Java workers' jar), the dashboard's web client and RLlib are left out
(nothing of pairforge uses them), and the three native executables (gcs_server, raylet,
_raylet.so) are stored LZMA-compressed (a zip method pip's zipfile extraction reads); the
RECORD is rewritten with the new hashes.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import importlib.metadata as md
import subprocess
import sys
import zipfile
from pathlib import Path

# what pairforge's stage 3 imports or loads that the lent image does not hold
LEAN = ["ray", "open_clip_torch", "webdataset", "wids", "braceexpand", "ftfy", "wcwidth",
        "pydantic", "pydantic_core", "annotated_types", "typing_inspection", "jsonschema",
        "jsonschema_specifications", "referencing", "rpds_py", "pyvips", "pyvips_binary",
        "cffi", "pycparser", "simplejpeg", "protego", "nvidia-ml-py"]
FULL = ["transformers", "tokenizers"]
RAY_DROP = ("ray/jars/", "ray/dashboard/client/", "ray/rllib/")
RAY_LZMA = ("ray/core/src/ray/gcs/gcs_server", "ray/core/src/ray/raylet/raylet",
            "ray/_raylet.so")
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64"]
SDIST_ONLY = {"pyvips"}  # no wheel on PyPI: built here (pure Python, cffi ABI mode)


def pinned(name: str) -> str:
    if name == "nvidia-ml-py":  # not a pairforge dependency: the version pip --dry-run chose
        return "nvidia-ml-py==13.615.71"
    return f"{name}=={md.version(name)}"


def download(spec: str, into: Path, python: str) -> None:
    platforms = [a for p in PLATFORMS for a in ("--platform", p)]
    if spec.split("==")[0] in SDIST_ONLY:
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                        "--no-build-isolation", "-w", str(into), spec], check=True)
        return
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                    "--only-binary=:all:", "--python-version", python, "--implementation",
                    "cp", *platforms, "-d", str(into), spec], check=True)


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def repack_ray(wheel: Path) -> None:
    """Ray's wheel less RAY_DROP, its executables LZMA-compressed, RECORD rewritten."""
    slim = wheel.with_suffix(".slim")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(slim, "w", zipfile.ZIP_DEFLATED) as dst:
        record_name, lines = "", []
        for info in src.infolist():
            if info.filename.startswith(RAY_DROP):
                continue
            if info.filename.endswith(".dist-info/RECORD"):
                record_name = info.filename
                continue
            data = src.read(info.filename)
            method = zipfile.ZIP_LZMA if info.filename in RAY_LZMA else zipfile.ZIP_DEFLATED
            info.compress_type = method
            dst.writestr(info, data, compress_type=method)
            lines.append(_record_line(info.filename, data))
        dst.writestr(record_name, "\n".join([*lines, f"{record_name},,"]) + "\n")
    slim.replace(wheel)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--python-version", default="3.12", help="the GPU machine's Python")
    parser.add_argument("--full", action="store_true", help="also transformers, tokenizers")
    args = parser.parse_args()
    wheels = args.out / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    specs = [pinned(n) for n in LEAN + (FULL if args.full else [])]
    for spec in specs:
        download(spec, wheels, args.python_version)
    ray = next(wheels.glob("ray-*.whl"))
    if not (args.out / f".{ray.name}.repacked").exists():
        repack_ray(ray)
        (args.out / f".{ray.name}.repacked").touch()
    names = sorted(s.split("==")[0] for s in specs)
    (args.out / "requirements.txt").write_text("\n".join(names) + "\n")
    size = sum(p.stat().st_size for p in args.out.rglob("*") if p.is_file())
    print(f"{args.out}: {len(list(wheels.glob('*.whl')))} wheels, {size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
