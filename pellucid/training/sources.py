"""Readers for the Debian packages that the training corpus is made of.

Each source names its Debian package, the license Debian's copyright file gives for the text, and a
reader that yields (document id, text) from the installed files. Readers only clean markup; they never
sample or reorder, so the corpus depends on the package versions alone (recorded in the manifest).
"""
from __future__ import annotations

import gzip
import html
import os
import re
import subprocess
from dataclasses import dataclass
from html.parser import HTMLParser
from typing import Callable, Iterator

Document = tuple[str, str]


@dataclass(frozen=True)
class Source:
    name: str
    package: str
    license: str
    reader: Callable[[], Iterator[Document]]
    description: str


def _chunks(items: list[str], size: int) -> Iterator[list[str]]:
    for start in range(0, len(items), size):
        yield items[start:start + size]


def _paragraph_docs(name: str, text: str, target_chars: int = 4000) -> Iterator[Document]:
    """Cut a long text at paragraph boundaries into documents of about target_chars."""
    paragraphs = [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()]
    current: list[str] = []
    size = 0
    index = 0
    for paragraph in paragraphs:
        current.append(paragraph)
        size += len(paragraph)
        if size >= target_chars:
            yield f"{name}:{index}", "\n\n".join(current)
            current, size, index = [], 0, index + 1
    if current:
        yield f"{name}:{index}", "\n\n".join(current)


# --- King James Bible (bible-kjv-text, read through the `bible` program of bible-kjv) -----------------

_KJV_VERSE = re.compile(r"^\s+\d+ (.*)$")


def read_kjv() -> Iterator[Document]:
    """One document per chapter: its heading ("Psalms 23"), then one verse per line without numbers."""
    out = subprocess.run(["bible", "-l100000", "Gen1:1-Rev22:21"], check=True, capture_output=True,
                         text=True).stdout
    heading, verses = None, []
    for line in out.splitlines():
        if not line.strip():
            continue
        match = _KJV_VERSE.match(line)
        if match:
            verses.append(match.group(1).strip())
            continue
        if heading is not None:
            yield f"kjv:{heading}", heading + "\n\n" + "\n".join(verses)
        heading, verses = line.strip(), []
    if heading is not None:
        yield f"kjv:{heading}", heading + "\n\n" + "\n".join(verses)


# --- GCIDE (dict-gcide) ----------------------------------------------------------------------------

GCIDE_FILE = "/usr/share/dictd/gcide.dict.dz"
_GCIDE_HEAD = re.compile(r"^(\S[^\\]*?) \\[^\\]*\\(.*)$")
_GCIDE_PROVENANCE = re.compile(r"^\[[^\]]*(Webster|WordNet|PJC|Century|Suppl|Dict\.)[^\]]*\]$")


def _clean_gcide_entry(head: str, rest: str, body: list[str]) -> str:
    lines = [f"{head}{rest}".strip()]
    for line in body:
        stripped = line.strip()
        if _GCIDE_PROVENANCE.match(stripped):
            continue
        lines.append(stripped)
    text = "\n".join(lines)
    text = re.sub(r"\\[^\\\n]*\\", "", text)              # inline pronunciations
    text = text.replace("{", "").replace("}", "")          # cross-reference braces
    # Re-join wrapped lines: a paragraph is a run of non-empty lines.
    paragraphs = [" ".join(p.split("\n")) for p in re.split(r"\n\s*\n", text)]
    return "\n".join(re.sub(r"\s+", " ", p).strip() for p in paragraphs if p.strip())


def read_gcide(entries_per_doc: int = 64) -> Iterator[Document]:
    """Dictionary entries (headword, part of speech, etymology, senses) without pronunciation markup or
    provenance tags; license and header text between the letters is skipped."""
    with gzip.open(GCIDE_FILE, "rt", encoding="utf-8", errors="replace") as handle:
        lines = handle.read().splitlines()
    entries: list[str] = []
    current: tuple[str, str, list[str]] | None = None
    for line in lines:
        head = _GCIDE_HEAD.match(line)
        if head:
            if current:
                entries.append(_clean_gcide_entry(*current))
            current = (head.group(1), head.group(2), [])
        elif current is not None and (not line.strip() or line[:1].isspace()):
            current[2].append(line)
        else:                                      # unindented non-entry text: headers, license notices
            if current:
                entries.append(_clean_gcide_entry(*current))
            current = None
    if current:
        entries.append(_clean_gcide_entry(*current))
    for index, group in enumerate(_chunks(entries, entries_per_doc)):
        yield f"gcide:{index}", "\n\n".join(group)


# --- WordNet glosses (wordnet-base) ----------------------------------------------------------------

WORDNET_DIR = "/usr/share/wordnet"
_WORDNET_POS = {"noun": "noun", "verb": "verb", "adj": "adjective", "adv": "adverb"}


def wordnet_glosses() -> Iterator[tuple[str, str, str]]:
    """(lemma, part of speech, gloss) for every synset, its first lemma."""
    for part, pos in _WORDNET_POS.items():
        with open(os.path.join(WORDNET_DIR, f"data.{part}"), encoding="utf-8", errors="replace") as handle:
            for line in handle:
                if line.startswith("  ") or "|" not in line:    # license header lines start with spaces
                    continue
                fields, gloss = line.split("|", 1)
                words = fields.split()
                lemma = re.sub(r"\(.*\)$", "", words[4]).replace("_", " ")
                yield lemma, pos, gloss.strip()


def read_wordnet(glosses_per_doc: int = 100) -> Iterator[Document]:
    lines = [f"{lemma} ({pos}): {gloss}" for lemma, pos, gloss in wordnet_glosses()]
    for index, group in enumerate(_chunks(lines, glosses_per_doc)):
        yield f"wordnet:{index}", "\n".join(group)


# Questions answered from the glosses, in ChatML, so that `--chat` has something to imitate.
_CHAT_QUESTIONS = ["What does the word \"{w}\" mean?", "Define \"{w}\".", "What is the meaning of {w}?",
                   "Can you explain what {w} means?", "What does {w} mean?"]


def read_wordnet_chat(every: int = 3) -> Iterator[Document]:
    """One short dialogue per every `every`-th synset: a user asks for a word's meaning, the assistant
    answers with its WordNet gloss."""
    for index, (lemma, pos, gloss) in enumerate(wordnet_glosses()):
        if index % every:
            continue
        question = _CHAT_QUESTIONS[index % len(_CHAT_QUESTIONS)].format(w=lemma)
        definition = gloss.split(";")[0].strip()
        answer = f"{lemma[:1].upper()}{lemma[1:]} ({pos}): {definition}."
        yield (f"chat:{index}", f"<|im_start|>user\n{question}<|im_end|>\n"
                                f"<|im_start|>assistant\n{answer}<|im_end|>")


# --- fortunes (fortunes, fortunes-min) -------------------------------------------------------------

FORTUNE_DIR = "/usr/share/games/fortunes"
FORTUNE_SKIP = {"ascii-art"}     # pictures, not prose


def read_fortunes(per_doc: int = 20) -> Iterator[Document]:
    for name in sorted(os.listdir(FORTUNE_DIR)):
        path = os.path.join(FORTUNE_DIR, name)
        if "." in name or name in FORTUNE_SKIP or not os.path.isfile(path) or os.path.islink(path):
            continue
        with open(path, encoding="utf-8", errors="replace") as handle:
            items = [item.strip("\n") for item in re.split(r"^%$", handle.read(), flags=re.M)]
        items = [item for item in items if item.strip()]
        for index, group in enumerate(_chunks(items, per_doc)):
            yield f"fortunes:{name}:{index}", "\n\n".join(group)


# --- The Jargon File (jargon-text) -----------------------------------------------------------------

JARGON_FILE = "/usr/share/doc/jargon-text/jargon.txt.gz"


def read_jargon() -> Iterator[Document]:
    with gzip.open(JARGON_FILE, "rt", encoding="utf-8", errors="replace") as handle:
        text = handle.read()
    # Box-drawing tables and rules carry no prose.
    lines = [line for line in text.splitlines() if not re.search(r"[\u2500-\u257f]", line)]
    yield from _paragraph_docs("jargon", "\n".join(lines))


# --- Debian Reference (debian-reference-en) --------------------------------------------------------

DEBREF_DIR = "/usr/share/debian-reference"


class _TextExtractor(HTMLParser):
    """Visible text of an HTML page, with block elements as paragraph breaks."""
    BLOCKS = {"p", "div", "pre", "li", "tr", "h1", "h2", "h3", "h4", "h5", "h6", "br", "dt", "dd", "table"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self._skip = 0

    def handle_starttag(self, tag: str, attrs: list) -> None:
        if tag in ("script", "style", "head"):
            self._skip += 1
        elif tag in self.BLOCKS:
            self.parts.append("\n\n")

    def handle_endtag(self, tag: str) -> None:
        if tag in ("script", "style", "head"):
            self._skip = max(0, self._skip - 1)
        elif tag in self.BLOCKS:
            self.parts.append("\n\n")

    def handle_data(self, data: str) -> None:
        if not self._skip:
            self.parts.append(data)

    def text(self) -> str:
        joined = html.unescape("".join(self.parts))
        paragraphs = [re.sub(r"[ \t]+", " ", p).strip() for p in re.split(r"\n\s*\n", joined)]
        return "\n\n".join(p for p in paragraphs if p)


def read_debian_reference() -> Iterator[Document]:
    for name in sorted(os.listdir(DEBREF_DIR)):
        if not re.fullmatch(r"ch\d+\.en\.html", name):
            continue
        parser = _TextExtractor()
        with open(os.path.join(DEBREF_DIR, name), encoding="utf-8", errors="replace") as handle:
            parser.feed(handle.read())
        yield from _paragraph_docs(f"debref:{name}", parser.text())


# --- Python documentation (python3.11-doc, its Info manual) ----------------------------------------

PYTHON_INFO = "/usr/share/info/python3.11.info.gz"
# "*note dataclass(): 193." -> "dataclass()": the cross-reference's target is an Info address, not prose.
_INFO_XREF = re.compile(r"\*[Nn]ote\s+([^:]+?):(?::|\s+[^\s.,]+([.,]))")


def read_python_docs() -> Iterator[Document]:
    """One document per Info node, without the node header line and menus."""
    with gzip.open(PYTHON_INFO, "rt", encoding="utf-8", errors="replace") as handle:
        nodes = handle.read().split("\x1f")
    for index, node in enumerate(nodes):
        lines = node.strip("\n").splitlines()
        if not lines or not lines[0].startswith("File:"):
            continue
        body = [line for line in lines[1:] if not line.startswith("* ") and line.strip() != "* Menu:"]
        text = _INFO_XREF.sub(lambda m: m.group(1) + ("," if m.group(2) == "," else ""), "\n".join(body)).strip()
        if len(text) > 200:
            yield f"python:{index}", text


SOURCES: list[Source] = [
    Source("kjv", "bible-kjv-text", "public domain (King James Version, 1611; Debian's copyright file: "
           "\"the copyright ... is expired\")", read_kjv, "The King James Bible, one chapter per document"),
    Source("gcide", "dict-gcide", "GPL-2.0-or-later", read_gcide,
           "GNU Collaborative International Dictionary of English (Webster 1913 + WordNet)"),
    Source("wordnet", "wordnet-base", "WordNet-3.0 (Princeton's permissive license)", read_wordnet,
           "WordNet 3.0 glosses: lemma (part of speech): definition"),
    Source("chat", "wordnet-base", "WordNet-3.0 (Princeton's permissive license)", read_wordnet_chat,
           "ChatML dialogues asking for a word's meaning, answered with its WordNet gloss"),
    Source("fortunes", "fortunes", "BSD-3-Clause (Debian's copyright file for fortune-mod; quotations "
           "belong to their authors)", read_fortunes, "fortune(6) cookies and quotations (fortunes, "
           "fortunes-min; ascii-art skipped)"),
    Source("jargon", "jargon-text", "public domain (Debian's copyright file)", read_jargon,
           "The Jargon File 4.4.7"),
    Source("debref", "debian-reference-en", "GPL-2.0-or-later", read_debian_reference,
           "Debian Reference (English), text of its HTML chapters"),
    Source("python", "python3.11-doc", "PSF-2.0 (Python Software Foundation License)", read_python_docs,
           "Python 3.11 documentation, its Info manual"),
]

PACKAGES = sorted({s.package for s in SOURCES} | {"bible-kjv", "fortunes-min"})
