"""Build the training corpus from Debian packages: `python -m pellucid.training.corpus --out DIR [--install]`.

Writes DIR/train.jsonl.xz and DIR/val.jsonl.xz (one {"source", "id", "text"} per line), DIR/val.txt (the
validation documents, each followed by the end-of-text token: the file `pellucid eval ppl` reads), DIR/words.txt
(every word seen at least twice in the train split, for checking generated text) and DIR/manifest.json
(package versions, licenses, sizes, hashes). A document goes to validation when a hash of its id says so,
so the split does not depend on the order or the number of documents.
"""
from __future__ import annotations

import argparse
import collections
import hashlib
import json
import lzma
import os
import re
import subprocess
import sys
from typing import Iterator

from pellucid.logger import get_logger
from pellucid.training.sources import PACKAGES, SOURCES

logger = get_logger(__name__)

END_OF_TEXT = "<|endoftext|>"
VALIDATION_PER_MILLE = 10          # 1% of the documents
WORD = re.compile(r"[A-Za-z]+(?:'[A-Za-z]+)*")


def is_validation(doc_id: str) -> bool:
    digest = hashlib.sha256(doc_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % 1000 < VALIDATION_PER_MILLE


def words_of(text: str) -> list[str]:
    """Lower-cased words: letters with inner apostrophes ("shepherd", "don't"); numbers and symbols are
    not words."""
    return [w.lower() for w in WORD.findall(text)]


def package_version(package: str) -> str:
    out = subprocess.run(["dpkg-query", "-W", "-f=${Version}", package], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"Debian package {package} is not installed; run with --install "
                           f"(apt-get install -y {' '.join(PACKAGES)})")
    return out.stdout.strip()


def install_packages() -> None:
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES], check=True, env=env)


def read_jsonl_xz(path: str) -> Iterator[dict]:
    with lzma.open(path, "rt", encoding="utf-8") as handle:
        for line in handle:
            yield json.loads(line)


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def build_corpus(out_dir: str, min_word_count: int = 2) -> dict:
    os.makedirs(out_dir, exist_ok=True)
    versions = {package: package_version(package) for package in PACKAGES}
    stats: dict[str, dict] = {}
    word_counts: collections.Counter[str] = collections.Counter()
    val_docs: list[str] = []
    train_path, val_path = os.path.join(out_dir, "train.jsonl.xz"), os.path.join(out_dir, "val.jsonl.xz")
    with lzma.open(train_path, "wt", encoding="utf-8", preset=6) as train, \
            lzma.open(val_path, "wt", encoding="utf-8", preset=6) as val:
        for source in SOURCES:
            counts = {"train_docs": 0, "val_docs": 0, "train_chars": 0, "val_chars": 0}
            for doc_id, text in source.reader():
                text = text.strip()
                if END_OF_TEXT in text:
                    raise ValueError(f"{doc_id} contains the end-of-text token")
                split = "val" if is_validation(doc_id) else "train"
                line = json.dumps({"source": source.name, "id": doc_id, "text": text}, ensure_ascii=False)
                (val if split == "val" else train).write(line + "\n")
                counts[f"{split}_docs"] += 1
                counts[f"{split}_chars"] += len(text)
                if split == "train":
                    word_counts.update(words_of(text))
                else:
                    val_docs.append(text)
            stats[source.name] = {"package": source.package, "version": versions[source.package],
                                  "license": source.license, "description": source.description, **counts}
            logger.info("%s: %s", source.name, counts)
    with open(os.path.join(out_dir, "val.txt"), "w", encoding="utf-8") as handle:
        # Each document followed by the end-of-text token, as the training stream has it, so that
        # `pellucid eval ppl --data val.txt` scores the windows that training's validation scored.
        handle.write("".join(text + END_OF_TEXT for text in val_docs))
    words = sorted(w for w, n in word_counts.items() if n >= min_word_count)
    with open(os.path.join(out_dir, "words.txt"), "w", encoding="utf-8") as handle:
        handle.write("\n".join(words) + "\n")
    manifest = {
        "packages": versions,
        "sources": stats,
        "validation_rule": f"sha256(document id) % 1000 < {VALIDATION_PER_MILLE}",
        "words_rule": f"lower-cased words {WORD.pattern} seen at least {min_word_count} times in train",
        "files": {name: _sha256(os.path.join(out_dir, name))
                  for name in ("train.jsonl.xz", "val.jsonl.xz", "val.txt", "words.txt")},
    }
    with open(os.path.join(out_dir, "manifest.json"), "w", encoding="utf-8") as handle:
        json.dump(manifest, handle, indent=2, sort_keys=True)
        handle.write("\n")
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pellucid.training.corpus", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--install", action="store_true",
                        help=f"apt-get install the packages first ({' '.join(PACKAGES)})")
    args = parser.parse_args(argv)
    if args.install:
        install_packages()
    manifest = build_corpus(args.out)
    for name, stat in manifest["sources"].items():
        print(f"{name:10s} {stat['package']:22s} {stat['version']:18s} train {stat['train_chars']:>11,} chars "
              f"val {stat['val_chars']:>9,}  {stat['license']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
