"""python -m services.trainer.fetch_model — put the trainer's model folder in place before it starts.

The Helm chart's init container runs this (values `model.source`): from the Hugging Face hub (a
token from the environment, HF_TOKEN, for gated models) or from a URL of a .tar / .tar.gz / .zip
of the model folder. A folder that already holds config.json is left alone, so a restarted pod on
the same volume does not download again.

    python -m services.trainer.fetch_model --out /models/current --hf Qwen/Qwen3-1.7B [--revision main]
    python -m services.trainer.fetch_model --out /models/current --url https://host/qwen3.tar.gz
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
import tarfile
import tempfile
import urllib.request
import zipfile
from pathlib import Path

log = logging.getLogger("fetch_model")


def is_model_dir(path: Path) -> bool:
    return (path / "config.json").is_file()


def fetch_hf(repo: str, revision: str, out: Path) -> None:
    from huggingface_hub import snapshot_download  # a dependency of transformers

    # Weights, config and tokenizer only: no other checkpoint formats a repo may carry too.
    snapshot_download(
        repo,
        revision=revision,
        local_dir=out,
        allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken"],
    )


def fetch_url(url: str, out: Path, timeout_s: float = 60.0) -> None:
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".fetch-") as tmp:
        archive = Path(tmp) / "archive"
        with urllib.request.urlopen(url, timeout=timeout_s) as response, archive.open("wb") as sink:
            shutil.copyfileobj(response, sink, length=1 << 20)
        unpacked = Path(tmp) / "unpacked"
        if zipfile.is_zipfile(archive):
            with zipfile.ZipFile(archive) as zipped:
                zipped.extractall(unpacked)
        elif tarfile.is_tarfile(archive):
            with tarfile.open(archive) as tarred:
                tarred.extractall(unpacked, filter="data")  # no absolute paths, links out or devices
        else:
            raise ValueError(f"{url} is neither a tar nor a zip archive")
        # The archive holds the model folder itself or its contents.
        found = [p.parent for p in unpacked.rglob("config.json")]
        if not found:
            raise ValueError(f"{url} holds no config.json: not a model folder")
        source = min(found, key=lambda p: len(p.parts))
        shutil.rmtree(out, ignore_errors=True)
        shutil.move(str(source), out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m services.trainer.fetch_model",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--out", type=Path, required=True, help="model folder to fill (config.json lands here)"
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--hf", metavar="REPO", help="Hugging Face hub repository, e.g. Qwen/Qwen3-1.7B")
    source.add_argument("--url", help="URL of a .tar, .tar.gz or .zip of the model folder")
    parser.add_argument("--revision", default="main", help="hub revision (branch, tag or commit)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s fetch_model %(levelname)s: %(message)s")
    if is_model_dir(args.out):
        log.info("%s already holds a model; nothing to fetch", args.out)
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    try:
        if args.hf:
            fetch_hf(args.hf, args.revision, args.out)
        else:
            fetch_url(args.url, args.out)
    except Exception as exc:  # noqa: BLE001 - one clear line for the pod's log, then a failing exit
        log.error("fetching the model failed: %s: %s", type(exc).__name__, exc)
        return 1
    if not is_model_dir(args.out):
        log.error("%s holds no config.json after the download", args.out)
        return 1
    log.info("model ready in %s", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
