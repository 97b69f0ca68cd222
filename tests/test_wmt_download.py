"""examples/wmt/download.py against a local mirror of statmt.org's and OPUS's archives.

The mirror rebuilds each archive of examples/wmt/manifest.json with the member paths the real
one has (written out below from fairseq's prepare-wmt14en2de.sh, TFDS's wmt.py and sacrebleu,
not from the manifest), filled with a few lines of ../shared/data (synthetic lines without it),
and serves it over HTTP on 127.0.0.1 with Range support. download.py runs as a subprocess
with --mirror and a copy of the manifest whose checksums are those of the mirror's archives.
"""

import gzip
import hashlib
import http.server
import io
import json
import re
import shutil
import socket
import subprocess
import sys
import tarfile
import threading
import zipfile
from pathlib import Path
from xml.sax.saxutils import escape

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "wmt" / "download.py"
MANIFEST = REPO / "examples" / "wmt" / "manifest.json"
SHARED = REPO.parent / "shared" / "data"

# URL path -> (the non-English language, {member path: (format, language)}); "*.gz" archives
# hold one file, named by format alone. A member no split reads proves extraction is selective.
LAYOUT = {
    "/wmt13/training-parallel-europarl-v7.tgz": (
        "de",
        {
            "training/europarl-v7.de-en.en": ("text", "en"),
            "training/europarl-v7.de-en.de": ("text", "de"),
            "training/europarl-v7.fr-en.fr": ("text", "de"),
        },
    ),
    "/wmt13/training-parallel-commoncrawl.tgz": (
        "de",
        {"commoncrawl.de-en.en": ("text", "en"), "commoncrawl.de-en.de": ("text", "de")},
    ),
    "/wmt14/training-parallel-nc-v9.tgz": (
        "de",
        {
            "training/news-commentary-v9.de-en.en": ("text", "en"),
            "training/news-commentary-v9.de-en.de": ("text", "de"),
        },
    ),
    "/wmt17/translation-task/dev.tgz": (
        "de",
        {"dev/newstest2013.en": ("text", "en"), "dev/newstest2013.de": ("text", "de")},
    ),
    "/wmt14/test-full.tgz": (
        "de",
        {
            "test-full/newstest2014-deen-src.en.sgm": ("sgm", "en"),
            "test-full/newstest2014-deen-ref.de.sgm": ("sgm", "de"),
        },
    ),
    "/wmt16/translation-task/training-parallel-ep-v8.tgz": (
        "ro",
        {
            "training-parallel-ep-v8/europarl-v8.ro-en.en": ("text", "en"),
            "training-parallel-ep-v8/europarl-v8.ro-en.ro": ("text", "ro"),
        },
    ),
    "/OPUS-SETIMES/v2/tmx/en-ro.tmx.gz": ("ro", "tmx"),
    "/wmt16/translation-task/dev.tgz": (
        "ro",
        {"dev/newsdev2016-enro-src.en.sgm": ("sgm", "en"), "dev/newsdev2016-enro-ref.ro.sgm": ("sgm", "ro")},
    ),
    "/wmt16/translation-task/test.tgz": (
        "ro",
        {"test/newstest2016-enro-src.en.sgm": ("sgm", "en"), "test/newstest2016-enro-ref.ro.sgm": ("sgm", "ro")},
    ),
    "/europarl/v9/training/europarl-v9.de-en.tsv.gz": ("de", "tsv"),
    "/news-commentary/v14/training/news-commentary-v14.de-en.tsv.gz": ("de", "tsv"),
    "/tilde-model/rapid2019.de-en.zip": (
        "de",
        {"rapid2019.de-en.en": ("text", "en"), "rapid2019.de-en.de": ("text", "de")},
    ),
    "/wmt19/translation-task/test.tgz": (
        "de",
        {"sgm/newstest2019-ende-src.en.sgm": ("sgm", "en"), "sgm/newstest2019-ende-ref.de.sgm": ("sgm", "de")},
    ),
    "/wmt20/translation-task/test.tgz": (
        "de",
        {"sgm/newstest2020-ende-src.en.sgm": ("sgm", "en"), "sgm/newstest2020-ende-ref.de.sgm": ("sgm", "de")},
    ),
}
SETUPS = ("wmt14_en_de", "wmt16_en_ro", "wmt22_en_de")


def sentence_pool(other):
    """Aligned (English, other) sentences: Multi30k for German, newstest2016 for Romanian."""
    folder = SHARED / ("multi30k-en-de" if other == "de" else "wmt16-en-ro-newstest")
    name = "train" if other == "de" else "test"
    if (folder / f"{name}.en").is_file():
        en = (folder / f"{name}.en").read_text(encoding="utf-8").splitlines()[:300]
        xx = (folder / f"{name}.{other}").read_text(encoding="utf-8").splitlines()[:300]
        return list(zip(en, xx))
    return [(f"English sentence {i} & more", f"{other} Satz {i} ș ü") for i in range(300)]


def sgml(lines, lang, ref):
    """WMT's SGML layout: a set, documents, one <seg> per line (two documents)."""
    head = f'<refset setid="newstest" trglang="{lang}">' if ref else f'<srcset setid="newstest" srclang="{lang}">'
    out, half = [head], len(lines) // 2
    for doc, part in enumerate((lines[:half], lines[half:])):
        out += [f'<doc sysid="ref" docid="doc{doc}" genre="news" origlang="en">', "<p>"]
        out += [f'<seg id="{i}"> {text} </seg>' for i, text in enumerate(part, 1)]
        out += ["</p>", "</doc>"]
    return "\n".join(out + ["</refset>" if ref else "</srcset>"]) + "\n"


def member_bytes(fmt, lang, pairs, other):
    column = 0 if lang == "en" else 1
    if fmt == "text":
        return "".join(pair[column] + "\n" for pair in pairs).encode()
    if fmt == "sgm":
        return sgml([pair[column] for pair in pairs], lang, ref=lang != "en").encode()
    if fmt == "tsv":  # de <TAB> en, plus one line without a tab that must be skipped
        return ("".join(f"{xx}\t{en}\n" for en, xx in pairs) + "no tab on this line\n").encode()
    tuv = '<tuv xml:lang="{}"><seg>{}</seg></tuv>'
    units = "".join(f"<tu>{tuv.format('en', escape(en))}{tuv.format(other, escape(xx))}</tu>\n" for en, xx in pairs)
    return f'<?xml version="1.0" encoding="utf-8"?>\n<tmx version="1.4"><body>\n{units}</body></tmx>\n'.encode()


def pack(url_path, members):
    """The archive's bytes: tar.gz, zip or one gzip-compressed file, as its name says."""
    buffer = io.BytesIO()
    if url_path.endswith(".tgz"):
        with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
            for name, data in members.items():
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    elif url_path.endswith(".zip"):
        with zipfile.ZipFile(buffer, "w") as z:
            for name, data in members.items():
                z.writestr(name, data)
    else:
        return gzip.compress(next(iter(members.values())))
    return buffer.getvalue()


def build_mirror():
    """{URL path: archive bytes} and {URL path: the (en, other) pairs it holds}."""
    files, pairs = {}, {}
    pools = {other: sentence_pool(other) for other in ("de", "ro")}
    for i, (url_path, (other, layout)) in enumerate(LAYOUT.items()):
        pairs[url_path] = pools[other][i * 12 : i * 12 + 5 + i % 4]
        if not isinstance(layout, dict):
            layout = {"": (layout, None)}
        members = {name: member_bytes(fmt, lang, pairs[url_path], other) for name, (fmt, lang) in layout.items()}
        files[url_path] = pack(url_path, members)
    return files, pairs


class Mirror(http.server.BaseHTTPRequestHandler):
    """Serves `files`, honouring `Range: bytes=N-` unless `ignore_range`; the first request for
    a path in `drop_once` sends half of its body and closes the connection."""

    files, served, requests, drop_once, ignore_range = {}, {}, [], set(), False

    def do_GET(self):
        data = self.files.get(self.path)
        range_header = self.headers.get("Range")
        Mirror.requests.append((self.path, range_header))
        if data is None:
            self.send_error(404)
            return
        start = int(re.fullmatch(r"bytes=(\d+)-", range_header).group(1)) if range_header else 0
        if self.ignore_range:
            start = 0
        if start >= len(data) and start:
            self.send_error(416)
            return
        self.send_response(206 if start else 200)
        self.send_header("Content-Length", str(len(data) - start))
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.end_headers()
        body = data[start:]
        if self.path in self.drop_once:
            Mirror.drop_once.discard(self.path)
            body = body[: len(body) // 2]
            self.close_connection = True
        self.wfile.write(body)
        Mirror.served[self.path] = Mirror.served.get(self.path, 0) + len(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def mirror():
    files, pairs = build_mirror()
    Mirror.files = files
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Mirror)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", pairs
    server.shutdown()
    server.server_close()


@pytest.fixture
def served(mirror):
    """Counters of this test's requests (the server is shared by the module)."""
    Mirror.served, Mirror.requests, Mirror.drop_once, Mirror.ignore_range = {}, [], set(), False
    yield Mirror
    Mirror.ignore_range = False


def mirror_manifest(path, edit=None):
    """manifest.json with the mirror's true checksums where the original has published ones (sha256,
    md5, size: the same kinds). `edit(setups)` changes it further."""
    manifest = json.loads(MANIFEST.read_text())
    for setup in manifest["setups"].values():
        for entry in setup["archives"].values():
            data = Mirror.files[url_path(entry["url"])]
            if entry.get("sha256"):
                entry.update(sha256=hashlib.sha256(data).hexdigest(), size=len(data) if entry["size"] else None)
            if entry.get("md5"):
                entry.update(md5=hashlib.md5(data).hexdigest())
    if edit:
        edit(manifest["setups"])
    path.write_text(json.dumps(manifest))
    return path


def url_path(url):
    return re.sub(r"^[a-z]+://[^/]+", "", url)


def download(setup, dest, mirror_url, manifest):
    cmd = [sys.executable, str(SCRIPT), "--setup", setup, "--dest", str(dest), "--mirror", mirror_url]
    return subprocess.run(cmd + ["--manifest", str(manifest)], capture_output=True, text=True, timeout=120)


def expected_raw(setup, pairs):
    """{file name: lines} the raw folder must hold, from the pairs each archive was built with."""
    manifest = json.loads(MANIFEST.read_text())["setups"][setup]
    en, other = manifest["langs"]
    out = {}
    for split, entries in manifest["splits"].items():
        rows = []
        for entry in entries:
            archive = manifest["archives"][entry["archive"]]
            rows += [(" ".join(e.split()), " ".join(x.split())) for e, x in pairs[url_path(archive["url"])]]
        out[f"{split}.{en}"], out[f"{split}.{other}"] = [r[0] for r in rows], [r[1] for r in rows]
    return out


def one_line(result):
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_full_run_writes_raw_text_and_rerun_does_nothing(mirror, served, tmp_path):
    base, pairs = mirror
    # wmt16's dev.tgz without a checksum: the tool must say so rather than pass it silently
    manifest = mirror_manifest(tmp_path / "m.json", lambda s: s["wmt16_en_ro"]["archives"]["dev.tgz"].pop("md5"))
    logs = {}
    for setup in SETUPS:
        result = download(setup, tmp_path / "data", base, manifest)
        assert result.returncode == 0, result.stderr
        logs[setup] = result.stdout
        raw = tmp_path / "data" / setup / "raw"
        expected = expected_raw(setup, pairs)
        for name, lines in expected.items():
            assert (raw / name).read_text(encoding="utf-8").splitlines() == lines, (setup, name)
        counts = json.loads((raw / "COUNTS.json").read_text())
        for split in ("train", "valid", "test"):
            assert counts[split]["lines"] == len(expected[f"{split}.en"]) > 0
    out = tmp_path / "data" / "wmt14_en_de" / "extracted" / "training-parallel-europarl-v7.tgz" / "training"
    assert (out / "europarl-v7.de-en.de").is_file() and not (out / "europarl-v7.fr-en.fr").exists()
    assert "dev.tgz: no published checksum: verify by hand" in logs["wmt16_en_ro"]
    # every archive fetched once: Common Crawl, in two set-ups, is linked from the first
    assert sorted(p for p, _ in served.requests) == sorted(Mirror.files)
    assert all(served.served[p] == len(data) for p, data in Mirror.files.items())

    served.requests.clear()
    again = download("wmt14_en_de", tmp_path / "data", base, manifest)
    assert again.returncode == 0 and "nothing to do" in again.stdout
    assert served.requests == []


def test_interrupted_download_resumes_without_fetching_bytes_twice(mirror, served, tmp_path):
    base, _ = mirror
    europarl, news = "/wmt13/training-parallel-europarl-v7.tgz", "/wmt14/training-parallel-nc-v9.tgz"
    served.drop_once = {europarl}  # the connection drops half-way through
    archives = tmp_path / "data" / "wmt14_en_de" / "archives"
    archives.mkdir(parents=True)
    third = len(Mirror.files[news]) // 3  # and a .part left by a killed earlier run
    (archives / "training-parallel-nc-v9.tgz.part").write_bytes(Mirror.files[news][:third])

    result = download("wmt14_en_de", tmp_path / "data", base, mirror_manifest(tmp_path / "m.json"))
    assert result.returncode == 0, result.stderr
    half = len(Mirror.files[europarl]) // 2
    assert [r for p, r in served.requests if p == europarl] == [None, f"bytes={half}-"]
    assert [r for p, r in served.requests if p == news] == [f"bytes={third}-"]
    assert served.served[europarl] == len(Mirror.files[europarl])
    assert served.served[news] == len(Mirror.files[news]) - third
    assert (archives / "training-parallel-europarl-v7.tgz").read_bytes() == Mirror.files[europarl]


def test_server_without_range_restarts_cleanly(mirror, served, tmp_path):
    base, _ = mirror
    served.ignore_range = True
    archives = tmp_path / "data" / "wmt14_en_de" / "archives"
    archives.mkdir(parents=True)
    (archives / "training-parallel-nc-v9.tgz.part").write_bytes(b"stale bytes of another file")
    result = download("wmt14_en_de", tmp_path / "data", base, mirror_manifest(tmp_path / "m.json"))
    assert result.returncode == 0, result.stderr
    assert (archives / "training-parallel-nc-v9.tgz").read_bytes() == Mirror.files["/wmt14/training-parallel-nc-v9.tgz"]


def test_checksum_mismatch_is_one_line_and_rerun_fetches_again(mirror, served, tmp_path):
    base, _ = mirror
    news = "/wmt14/training-parallel-nc-v9.tgz"

    def wrong(setups):
        setups["wmt14_en_de"]["archives"]["training-parallel-nc-v9.tgz"]["sha256"] = "0" * 64

    line = one_line(download("wmt14_en_de", tmp_path / "data", base, mirror_manifest(tmp_path / "bad.json", wrong)))
    true_sha = hashlib.sha256(Mirror.files[news]).hexdigest()
    assert "checksum mismatch for training-parallel-nc-v9.tgz" in line and "0" * 64 in line and true_sha in line
    archives = tmp_path / "data" / "wmt14_en_de" / "archives"
    assert not (archives / "training-parallel-nc-v9.tgz.part").exists()
    assert (archives / "training-parallel-nc-v9.tgz.bad").is_file()

    # the archives before it were extracted: the rerun neither fetches nor extracts them again
    served.requests.clear()
    result = download("wmt14_en_de", tmp_path / "data", base, mirror_manifest(tmp_path / "m.json"))
    assert result.returncode == 0, result.stderr
    assert [r for p, r in served.requests if p == news] == [None]  # from byte 0, once
    assert [p for p, _ in served.requests] == [news, "/wmt17/translation-task/dev.tgz", "/wmt14/test-full.tgz"]
    assert "dev.tgz: extracted" in result.stdout and "europarl-v7.tgz: extracted" not in result.stdout


def test_corrupt_archive_is_one_line(mirror, served, tmp_path):
    base, _ = mirror
    news = "/wmt14/training-parallel-nc-v9.tgz"
    truncated = Mirror.files[news][: len(Mirror.files[news]) // 2]
    Mirror.files["/corrupt/training-parallel-nc-v9.tgz"] = truncated

    def corrupt(setups):  # the published checksum of a damaged file: only extraction can tell
        entry = setups["wmt14_en_de"]["archives"]["training-parallel-nc-v9.tgz"]
        entry.update(url="http://www.statmt.org/corrupt/training-parallel-nc-v9.tgz", size=len(truncated))
        entry.update(sha256=hashlib.sha256(truncated).hexdigest())

    try:
        line = one_line(download("wmt14_en_de", tmp_path / "data", base, mirror_manifest(tmp_path / "m.json", corrupt)))
    finally:
        del Mirror.files["/corrupt/training-parallel-nc-v9.tgz"]
    assert "training-parallel-nc-v9.tgz is corrupt" in line and "rerun" in line
    archives = tmp_path / "data" / "wmt14_en_de" / "archives"
    assert (archives / "training-parallel-nc-v9.tgz.bad").is_file()
    assert not (tmp_path / "data" / "wmt14_en_de" / "extracted" / "training-parallel-nc-v9.tgz").exists()


def test_unreachable_host_is_one_line_and_archives_put_by_hand_are_used(mirror, served, tmp_path):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    manifest = mirror_manifest(tmp_path / "m.json")
    line = one_line(download("wmt14_en_de", tmp_path / "data", closed, manifest))
    archives = tmp_path / "data" / "wmt14_en_de" / "archives"
    assert f"cannot reach {closed}/wmt13/training-parallel-europarl-v7.tgz" in line
    assert f"by hand to {archives / 'training-parallel-europarl-v7.tgz'}" in line

    for entry_name, entry in json.loads(manifest.read_text())["setups"]["wmt14_en_de"]["archives"].items():
        (archives / entry_name).write_bytes(Mirror.files[url_path(entry["url"])])
    shutil.rmtree(archives.parent / "extracted", ignore_errors=True)
    result = download("wmt14_en_de", tmp_path / "data", closed, manifest)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "data" / "wmt14_en_de" / "raw" / "COUNTS.json").is_file()
