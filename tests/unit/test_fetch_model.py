"""The chart's model-provisioning init container: services.trainer.fetch_model with a URL source."""

from __future__ import annotations

import io
import tarfile
import threading
import zipfile
from collections.abc import Iterator
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from services.trainer.fetch_model import main


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    root = tmp_path / "www"
    root.mkdir()
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(SimpleHTTPRequestHandler, directory=str(root)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield root, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


def model_files() -> dict[str, bytes]:
    return {
        "config.json": b'{"model_type": "qwen3"}',
        "model.safetensors": b"\0" * 64,
        "tokenizer.json": b"{}",
    }


def test_a_tarball_of_the_model_folder_is_unpacked(served: tuple[Path, str], tmp_path: Path) -> None:
    root, url = served
    with tarfile.open(root / "m.tar.gz", "w:gz") as tar:
        for name, data in model_files().items():
            info = tarfile.TarInfo(f"Qwen3-tiny/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    out = tmp_path / "models" / "current"
    assert main(["--out", str(out), "--url", f"{url}/m.tar.gz"]) == 0
    assert {p.name: p.read_bytes() for p in out.iterdir()} == model_files()
    # A second start finds the model and fetches nothing (the archive is gone now).
    (root / "m.tar.gz").unlink()
    assert main(["--out", str(out), "--url", f"{url}/m.tar.gz"]) == 0


def test_a_zip_of_the_folder_contents_works_too(served: tuple[Path, str], tmp_path: Path) -> None:
    root, url = served
    with zipfile.ZipFile(root / "m.zip", "w") as zipped:
        for name, data in model_files().items():
            zipped.writestr(name, data)
    out = tmp_path / "current"
    assert main(["--out", str(out), "--url", f"{url}/m.zip"]) == 0
    assert (out / "config.json").read_bytes() == model_files()["config.json"]


@pytest.mark.parametrize("content", [b"not an archive", b"missing"], ids=["garbage", "404"])
def test_a_bad_source_fails_with_nothing_left_behind(
    served: tuple[Path, str], tmp_path: Path, content: bytes
) -> None:
    root, url = served
    if content != b"missing":
        (root / "m.tar").write_bytes(content)
    out = tmp_path / "current"
    assert main(["--out", str(out), "--url", f"{url}/m.tar"]) == 1
    assert not out.exists() and list(tmp_path.iterdir()) == [tmp_path / "www"]


def test_an_archive_without_a_model_is_refused(served: tuple[Path, str], tmp_path: Path) -> None:
    root, url = served
    with tarfile.open(root / "m.tar", "w") as tar:
        info = tarfile.TarInfo("../escape.json")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"{}"))
    assert main(["--out", str(tmp_path / "current"), "--url", f"{url}/m.tar"]) == 1
    assert not (tmp_path / "escape.json").exists()
