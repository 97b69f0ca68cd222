#!/usr/bin/env python
"""The download step of the WMT recipes: fetch a set-up's archives, check them, write raw text.

    python examples/wmt/download.py --setup {wmt16_en_ro,wmt14_en_de,wmt22_en_de} --dest DIR
        [--mirror BASE_URL] [--manifest FILE]

What each set-up holds, and where every checksum was published, is in manifest.json beside
this file. For each archive of the set-up, in DIR/<setup>/archives/:

- download it to NAME.part, resuming a partial file with an HTTP Range request (a server that
  ignores Range sends the whole file and the download restarts from byte 0);
- check it against every digest published for it (sha256, md5, size; an archive with none is
  used with a warning) before anything reads it; a mismatch moves the file to NAME.bad, so the
  next run downloads it again;
- extract the members the set-up reads into DIR/<setup>/extracted/NAME/, once (a .done marker).

An archive already in DIR/<setup>/archives/NAME (put there by hand when this machine is
offline) is checked and used as if downloaded. Then DIR/<setup>/raw/{train,valid,test}.<lang>
(UTF-8, one sentence per line, line-aligned; WMT's SGML converted as sacrebleu does) and
raw/COUNTS.json (lines per split and per corpus). A rerun after success does nothing.

--mirror BASE_URL replaces the scheme and host of every URL (http://host/a/b.tgz becomes
BASE_URL/a/b.tgz); --manifest FILE replaces manifest.json (same layout).
Standard library only: it runs before anything else of the recipe is installed.
"""

import argparse
import gzip
import hashlib
import http.client
import itertools
import json
import os
import posixpath
import re
import shutil
import sys
import tarfile
import time
import urllib.error
import urllib.parse
import urllib.request
import xml.etree.ElementTree as ElementTree
import zipfile
import zlib
from pathlib import Path

MANIFEST = Path(__file__).resolve().with_name("manifest.json")
SPLITS = ("train", "valid", "test")
CHUNK = 1 << 20
RESUMES = 3  # a connection dropped mid-transfer is resumed this often before giving up
CORRUPT = (tarfile.TarError, zipfile.BadZipFile, gzip.BadGzipFile, EOFError, zlib.error)


class Stop(Exception):
    """What went wrong and what to do, in one line."""


def log(message):
    print(f"[download] {message}", flush=True)


# ---------------------------------------------------------------- fetching and checking


def mirrored(url, mirror):
    if not mirror:
        return url
    parts = urllib.parse.urlsplit(url)
    return mirror.rstrip("/") + parts.path + (f"?{parts.query}" if parts.query else "")


def response_end(response, start):
    """The size the file will have once this response is read to its end (None: unknown)."""
    content_range = response.headers.get("Content-Range", "")
    if response.status == 206 and "/" in content_range and not content_range.endswith("*"):
        return int(content_range.rsplit("/", 1)[1])
    length = response.headers.get("Content-Length")
    return start + int(length) if length is not None else None


def copy_with_progress(response, out, end):
    """Copy the body, saying every 30 s how far it got (Common Crawl is 918 MB)."""
    said = time.monotonic()
    for block in iter(lambda: response.read(CHUNK), b""):
        out.write(block)
        if time.monotonic() - said > 30:
            said = time.monotonic()
            log(f"  {out.tell() >> 20} MiB" + (f" of {end >> 20} MiB" if end else ""))


def fetch(url, part, size, offline):
    """Download url into part, resuming what part already holds; offline: what to do by hand."""
    error = None
    for _ in range(RESUMES + 1):
        start = part.stat().st_size if part.exists() else 0
        if size is not None and start >= size:
            return  # complete (or too long): the checksum decides
        request = urllib.request.Request(url, headers={"Range": f"bytes={start}-"} if start else {})
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                if start and response.status != 206:
                    start = 0  # the server ignored Range and sends the whole file
                end = response_end(response, start)
                log(f"resuming {url} from byte {start}" if start else f"fetching {url}")
                with open(part, "ab" if start else "wb") as out:
                    out.truncate(start)
                    copy_with_progress(response, out, end)
            got = part.stat().st_size
            if end is None or got >= end:
                return
            error = f"connection closed at byte {got} of {end}"  # http.client returns short reads silently
        except urllib.error.HTTPError as e:
            if e.code == 416 and start:
                return  # nothing past what part holds: the checksum decides
            raise Stop(f"{url} answered HTTP {e.code} ({e.reason}); {offline}")
        except urllib.error.URLError as e:
            raise Stop(f"cannot reach {url} ({e.reason}): offline? {offline}")
        except (http.client.HTTPException, OSError) as e:  # reset or timeout mid-transfer
            error = f"{type(e).__name__}: {e}"
        time.sleep(1)
    held = part.stat().st_size if part.exists() else 0
    raise Stop(f"{url}: {error}, {RESUMES + 1} tries; {held} bytes kept in {part}: rerun to resume, or {offline}")


def digests(path):
    sha256, md5 = hashlib.sha256(), hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            sha256.update(block)
            md5.update(block)
    return {"sha256": sha256.hexdigest(), "md5": md5.hexdigest()}


def verify(path, name, entry):
    """Check path against every published digest; a mismatch moves it to NAME.bad (the next run
    fetches it again)."""
    got, size = digests(path), path.stat().st_size
    kinds = [kind for kind in ("sha256", "md5") if entry.get(kind)]
    if not kinds:
        log(f"{name}: no published checksum: verify by hand (this copy: {size} bytes, sha256 {got['sha256']})")
        return
    wrong = [kind for kind in kinds if got[kind] != entry[kind]]
    if not wrong and entry.get("size") in (None, size):
        log(f"{name}: {' and '.join(kinds)} ok")
        return
    kind = (wrong or kinds)[0]
    bad = path.with_name(name + ".bad")
    path.replace(bad)
    raise Stop(
        f"checksum mismatch for {name}: expected {kind} {entry[kind]} ({entry.get('size') or '?'} bytes), "
        f"got {got[kind]} ({size} bytes); moved to {bad}: rerun to download it again (re-released upstream? "
        "check it by hand and give its digests in a copy of the manifest, --manifest)"
    )


# ---------------------------------------------------------------- extracting


def members(setup, name):
    """The member paths of archive name that the set-up reads."""
    wanted = set()
    for entry in itertools.chain.from_iterable(setup["splits"].values()):
        if entry["archive"] == name:
            wanted.update(entry["files"].values() if "files" in entry else [entry["file"]])
    return wanted


def unpack(archive, name, wanted, out):
    if name.endswith((".tgz", ".tar.gz", ".tar")):
        with tarfile.open(archive) as tar:
            for member in tar:
                if posixpath.normpath(member.name) in wanted:
                    tar.extract(member, out, filter="data")
    elif name.endswith(".zip"):
        with zipfile.ZipFile(archive) as z:
            for member in set(z.namelist()) & wanted:
                z.extract(member, out)
    elif name.endswith(".gz"):  # one compressed file: its member is the name without .gz
        with gzip.open(archive) as src, open(out / name[:-3], "wb") as dst:
            shutil.copyfileobj(src, dst, CHUNK)
    else:
        raise Stop(f"{name}: unknown archive type (expected .tgz, .tar.gz, .tar, .zip or .gz); fix the manifest")


def extract(archive, name, wanted, out):
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    try:
        unpack(archive, name, wanted, out)
    except CORRUPT as e:
        shutil.rmtree(out, ignore_errors=True)
        bad = archive.with_name(name + ".bad")
        archive.replace(bad)
        raise Stop(f"{name} is corrupt ({type(e).__name__}: {e}); moved to {bad}: rerun to download it again")
    missing = sorted(m for m in wanted if not (out / m).is_file())
    if missing:
        raise Stop(f"{name} lacks {', '.join(missing)}: not the archive the manifest describes; replace {archive}")
    (out / ".done").write_text("")
    log(f"{name}: extracted {len(wanted)} file(s)")


def reuse(archive, name, entry):
    """Link another set-up's verified copy of the same archive (Common Crawl is in two set-ups)."""
    kind = "sha256" if entry.get("sha256") else "md5" if entry.get("md5") else None
    for other in archive.parents[2].glob(f"*/archives/{name}"):
        if kind and other != archive and digests(other)[kind] == entry[kind]:
            try:
                os.link(other, archive)
            except OSError:  # another file system
                shutil.copyfile(other, archive)
            log(f"{name}: {kind} ok, the copy in {other.parent}")
            return True
    return False


def obtain(root, name, entry, wanted, mirror, manifest_path):
    """Download, check and extract one archive, skipping whatever an earlier run finished."""
    out = root / "extracted" / name
    if (out / ".done").exists():
        return
    archive = root / "archives" / name
    archive.parent.mkdir(parents=True, exist_ok=True)
    if archive.exists():
        verify(archive, name, entry)
    elif not reuse(archive, name, entry):
        part = archive.with_name(name + ".part")
        by_hand = f"download it by hand to {archive} and rerun: it is then checked and used (all URLs: {manifest_path})"
        fetch(mirrored(entry["url"], mirror), part, entry.get("size"), by_hand)
        verify(part, name, entry)
        part.replace(archive)
    extract(archive, name, wanted, out)


# ---------------------------------------------------------------- raw text


def clean_line(raw):
    """One sentence per line whatever the corpus holds: \\r, U+2028 and the like become spaces
    (fairseq and Moses read lines with other rules than a plain split on \\n)."""
    return " ".join(raw.decode("utf-8", errors="replace").splitlines())


def read_text(path_a, path_b):
    with open(path_a, "rb") as a, open(path_b, "rb") as b:
        for n, (line_a, line_b) in enumerate(itertools.zip_longest(a, b), 1):
            if line_a is None or line_b is None:
                raise Stop(f"{path_a} and {path_b} differ in length from line {n}: not line-aligned; re-extract them")
            yield clean_line(line_a), clean_line(line_b)


def read_sgm(path):
    """WMT's SGML: the text of each <seg> line, whitespace collapsed (sacrebleu's conversion)."""
    with open(path, "rb") as f:
        for line in f:
            match = re.search(r"<seg[^>]*>(.*)</seg>", line.decode("utf-8", errors="replace"))
            if match:
                yield re.sub(r"\s+", " ", match.group(1).strip())


def read_pairs(folder, entry, langs):
    """(source, target) pairs of one manifest entry. As TFDS does, a TSV line without exactly two
    fields and a TMX unit lacking one of the languages are skipped."""
    fmt = entry["format"]
    if fmt in ("text", "sgm"):
        a, b = (folder / entry["files"][lang] for lang in langs)
        if fmt == "text":
            yield from read_text(a, b)
        else:
            src, tgt = list(read_sgm(a)), list(read_sgm(b))
            if len(src) != len(tgt):
                raise Stop(f"{a} has {len(src)} segments and {b} {len(tgt)}: not line-aligned")
            yield from zip(src, tgt)
    elif fmt == "tsv":
        order = [entry["columns"].index(lang) for lang in langs]
        with open(folder / entry["file"], "rb") as f:
            for line in f:
                fields = line.rstrip(b"\r\n").split(b"\t")
                if len(fields) == 2:
                    yield tuple(clean_line(fields[i]).strip() for i in order)
    elif fmt == "tmx":
        for _, element in ElementTree.iterparse(folder / entry["file"]):
            if element.tag == "tu":
                text = {}
                for tuv in element.iter("tuv"):
                    lang = next((v for k, v in tuv.attrib.items() if k.endswith("lang")), "").lower()
                    seg = tuv.find("seg")
                    text[lang] = " ".join("".join(seg.itertext()).split()) if seg is not None else ""
                if all(lang in text for lang in langs):
                    yield tuple(text[lang] for lang in langs)
                element.clear()
    else:
        raise Stop(f"unknown format {fmt!r} in the manifest (text, sgm, tsv or tmx)")


def write_raw(root, setup):
    langs, raw = setup["langs"], root / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    counts = {"langs": langs}
    for split in SPLITS:
        outs = [open(raw / f"{split}.{lang}.tmp", "w", encoding="utf-8") for lang in langs]
        per_corpus = {}
        try:
            for entry in setup["splits"][split]:
                corpus = f"{entry['archive']}:{entry.get('file') or entry['files'][langs[0]]}"
                n = 0
                try:
                    for pair in read_pairs(root / "extracted" / entry["archive"], entry, langs):
                        for out, sentence in zip(outs, pair):
                            out.write(sentence + "\n")
                        n += 1
                except ElementTree.ParseError as e:
                    folder = root / "extracted" / entry["archive"]
                    raise Stop(f"{folder / entry['file']} is not well-formed TMX ({e}): delete {folder} and rerun")
                per_corpus[corpus] = n
        finally:
            for out in outs:
                out.close()
        for lang in langs:
            (raw / f"{split}.{lang}.tmp").replace(raw / f"{split}.{lang}")
        counts[split] = {"lines": sum(per_corpus.values()), "corpora": per_corpus}
        log(f"raw/{split}.{{{','.join(langs)}}}: {counts[split]['lines']} lines")
    # Written last: its presence says the raw text is complete.
    (raw / "COUNTS.json").write_text(json.dumps(counts, indent=1) + "\n")


def complete(raw, langs):
    return (raw / "COUNTS.json").is_file() and all((raw / f"{s}.{lang}").is_file() for s in SPLITS for lang in langs)


# ---------------------------------------------------------------- command line


def run(setup_name, dest, mirror, manifest_path):
    try:
        setups = json.loads(Path(manifest_path).read_text())["setups"]
    except (OSError, ValueError, KeyError) as e:
        raise Stop(f"cannot read the manifest {manifest_path} ({e}): pass a manifest.json-shaped file to --manifest")
    if setup_name not in setups:
        raise Stop(f"{manifest_path} has no set-up {setup_name!r} (it has {', '.join(setups)})")
    setup, root = setups[setup_name], Path(dest) / setup_name
    if complete(root / "raw", setup["langs"]):
        log(f"{root / 'raw'} is complete (COUNTS.json): nothing to do")
        return
    for name, entry in setup["archives"].items():
        obtain(root, name, entry, members(setup, name), mirror, manifest_path)
    write_raw(root, setup)
    log(f"done: {root / 'raw'}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--setup", required=True, help="wmt16_en_ro, wmt14_en_de or wmt22_en_de (a set-up of the manifest)")
    p.add_argument("--dest", required=True, help="data folder: DIR/<setup>/{archives,extracted,raw}")
    p.add_argument("--mirror", help="base URL replacing the scheme and host of every archive URL")
    p.add_argument("--manifest", default=str(MANIFEST), help="manifest replacing examples/wmt/manifest.json")
    args = p.parse_args(argv)
    try:
        run(args.setup, args.dest, args.mirror, args.manifest)
    except Stop as e:
        sys.exit(f"[download] {e}")
    except KeyboardInterrupt:
        sys.exit("[download] interrupted; run the same command again to resume")


if __name__ == "__main__":
    main()
