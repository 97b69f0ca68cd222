"""examples/wmt/prepare.py's cleaning of the training pairs (each rule removes exactly the pairs
it names, the held-out splits stay whole, misaligned sides stop in one line) and the sources of
examples/wmt/setups.py: every number of a full-scale set-up has one, and every sentence a
source quotes is in the paper's text, with the value as the set-up has it."""

import importlib.util
import subprocess
import sys

import pytest

from fairseq_hrt.testing.tiny_runs import REPO, cli_env

WMT = REPO / "examples" / "wmt"
PAPERS_DIR = REPO.parent / "shared" / "papers"


def _load(name):
    spec = importlib.util.spec_from_file_location(f"wmt_{name}", WMT / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


prepare = _load("prepare")
sys.path.insert(0, str(WMT))  # recipe.py imports its neighbours by name
setups = _load("setups")
recipe = _load("recipe")


# ----------------------------------------------------------------------------- cleaning


def words(n: int, word: str = "w") -> str:
    return " ".join([word] * n)


def test_each_rule_removes_exactly_the_pairs_it_names():
    pairs = [
        (words(3), words(4), ""),
        (words(80), words(80), ""),  # at the length limit: kept
        (words(81), words(80), "length"),
        (words(5), words(81), "length"),
        ("", words(2), "length"),  # an empty side
        ("  ", words(2), "length"),  # whitespace only is empty
        (words(2), words(18), ""),  # a ratio of 9: kept
        (words(2), words(19), "ratio"),
        (words(19), words(2), "ratio"),
        (words(1), words(81), "length"),  # both rules: the length rule names it, as clean-corpus-n
    ]
    verdicts = [v for _, _, v in prepare.clean_pairs([(s, t) for s, t, _ in pairs], 80, 9.0)]
    assert verdicts == [v for _, _, v in pairs]
    # 0 turns a rule off: nothing goes by length (and an empty side has no ratio), or by ratio
    no_length = [v for _, _, v in prepare.clean_pairs([(s, t) for s, t, _ in pairs], 0, 9.0)]
    assert no_length == ["", "", "", "ratio", "", "", "", "ratio", "ratio", "ratio"]
    no_ratio = [v for _, _, v in prepare.clean_pairs([(s, t) for s, t, _ in pairs], 80, 0)]
    assert no_ratio == [v if v != "ratio" else "" for _, _, v in pairs]


def sentence(i: int, n: int) -> str:
    """A sentence of n words that differs from line to line (SentencePiece needs some text)."""
    vocabulary = "the house is small and old but we like it very much today river green".split()
    return " ".join(vocabulary[(i * 7 + j * 3) % len(vocabulary)] for j in range(n))


def write_corpus(raw, pairs_by_split):
    raw.mkdir(parents=True, exist_ok=True)
    for split, pairs in pairs_by_split.items():
        for side, lang in ((0, "en"), (1, "ro")):
            (raw / f"{split}.{lang}").write_text("".join(p[side] + "\n" for p in pairs), encoding="utf-8")


def lines_of(path):
    """A file's lines, split at "\\n" only."""
    return path.read_bytes().decode("utf-8").split("\n")[:-1]


def test_prepare_cleans_the_training_pairs_only_and_says_how_many_each_rule_removed(tmp_path, capsys):
    good = [(sentence(i, 4 + i % 6), sentence(i + 1, 5 + i % 5)) for i in range(60)]
    long_pair = (sentence(0, 12), sentence(1, 3))  # over --clean-max-len 10
    lopsided = (sentence(2, 2), sentence(3, 7))  # ratio 3.5 over --clean-ratio 3
    empty = ("", sentence(4, 3))
    carriage = ("the house\ris small", "casa este mica")  # a "\r" inside a line: a space
    train = good[:20] + [long_pair] + good[20:40] + [lopsided, empty, carriage] + good[40:]
    held_out = [long_pair, lopsided] + good[:8]  # scored line by line: never cleaned
    raw, out = tmp_path / "raw", tmp_path / "data"
    write_corpus(raw, {"train": train, "valid": held_out, "test": held_out})

    argv = ["--raw", str(raw), "--out", str(out), "--src", "en", "--tgt", "ro", "--vocab-size", "40"]
    prepare.main(argv + ["--threads", "1", "--clean-max-len", "10", "--clean-ratio", "3"])

    printed = capsys.readouterr().out
    assert "64 pairs, 61 kept; removed 2 by length (an empty side or over 10 words), 1 by ratio" in printed
    kept = good[:20] + good[20:40] + [("the house is small", "casa este mica")] + good[40:]
    assert lines_of(out / "raw" / "train.en") == [s for s, _ in kept]
    assert lines_of(out / "raw" / "train.ro") == [t for _, t in kept]
    for lang in ("en", "ro"):
        assert len(lines_of(out / "spm" / f"train.{lang}")) == len(kept)
        assert "\r" not in (out / "spm" / f"train.{lang}").read_bytes().decode()  # fairseq reads it as a line end
        for split in ("valid", "test"):
            assert (out / "raw" / f"{split}.{lang}").read_bytes() == (raw / f"{split}.{lang}").read_bytes()
            assert len(lines_of(out / "spm" / f"{split}.{lang}")) == len(held_out)
    assert (out / "spm" / "spm.model").is_file()


def test_misaligned_sides_are_refused_in_one_line_and_nothing_is_written(tmp_path):
    raw, out = tmp_path / "raw", tmp_path / "data"
    pairs = [(sentence(i, 5), sentence(i + 1, 5)) for i in range(10)]
    write_corpus(raw, {"train": pairs, "valid": pairs[:3], "test": pairs[:3]})
    with open(raw / "train.ro", "a", encoding="utf-8") as f:
        f.write("one line too many\n")
    before = {p.name: p.read_bytes() for p in raw.iterdir()}
    done = subprocess.run(
        [sys.executable, str(WMT / "prepare.py"), "--raw", str(raw), "--out", str(out)]
        + ["--src", "en", "--tgt", "ro", "--vocab-size", "40"],
        capture_output=True,
        text=True,
        env=cli_env(),
        timeout=120,
    )
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert f"{raw / 'train.en'} has 10 lines and {raw / 'train.ro'} has 11" in lines[0]
    assert "--steps download" in lines[0]
    assert not out.exists()
    assert {p.name: p.read_bytes() for p in raw.iterdir()} == before


@pytest.mark.parametrize("name", sorted(setups.SETUPS))
def test_the_recipes_prepare_step_cleans_with_the_setups_values(tmp_path, name):
    s = setups.SETUPS[name]
    r = recipe.Recipe(recipe.parse_args(["--setup", name, "--work", str(tmp_path / "w"), "--print-commands"]))
    words_ = r.step("prepare").jobs[0].command.split()
    assert words_[words_.index("--clean-max-len") + 1] == str(s.clean_max_len)
    assert float(words_[words_.index("--clean-ratio") + 1]) == s.clean_ratio
    assert s.clean_max_len > 0 and s.clean_ratio > 0  # on by default at full scale


# ----------------------------------------------------------------------------- sources


def paper_text(paper: str) -> str:
    return " ".join((PAPERS_DIR / setups.PAPERS[paper]).read_text(encoding="utf-8").split())


def source_problems(path: str, value: float, source) -> list:
    """What is wrong with ``source`` as the source of ``value``: a quote that is not in its
    paper, a paper source that does not write the value, a source without a reason."""
    problems = []
    if source.kind not in ("paper", "outside", "choice"):
        problems.append(f"{path}: unknown kind {source.kind!r}")
    for paper, quote in source.quotes:
        if " ".join(quote.split()) not in paper_text(paper):
            problems.append(f"{path}: not in {setups.PAPERS[paper]}: {quote!r}")
    if source.kind == "paper":
        if not source.quotes or source.as_written not in source.quotes[0][1]:
            problems.append(f"{path}: {source.as_written!r} is not in its quote")
        elif setups.written_value(source.as_written) != pytest.approx(value):
            problems.append(f"{path}: the quote writes {source.as_written!r}, the set-up has {value}")
    elif not source.why.strip():
        problems.append(f"{path}: a {source.kind} source says no why")
    return problems


needs_papers = pytest.mark.skipif(not PAPERS_DIR.is_dir(), reason="the papers are in ../shared/papers")


@needs_papers
@pytest.mark.parametrize("name", sorted(setups.SETUPS))
def test_every_number_of_a_full_scale_setup_has_a_source_and_every_quote_is_the_papers(name):
    setup, sources = setups.SETUPS[name], setups.SOURCES[name]
    numbers = dict(setups.numeric_fields(setup))
    assert "teacher.lr" in numbers and "hrt_chunk_sizes[0]" in numbers and "at.adam_betas[1]" in numbers
    assert sorted(set(numbers) - set(sources)) == [], "numbers without a source"
    assert sorted(set(sources) - set(numbers)) == [], "sources of no number"
    problems = [p for path, value in numbers.items() for p in source_problems(path, value, sources[path])]
    assert not problems, "\n".join(problems)
    quoted = [path for path, source in sources.items() if source.kind == "paper"]
    assert len(quoted) >= 6, quoted


@needs_papers
def test_a_quote_that_is_not_in_the_paper_or_does_not_write_the_value_fails():
    real = setups.SOURCES["wmt22_e12d1"]["at.max_update"]
    assert source_problems("at.max_update", 300_000, real) == []
    invented = setups.paper("WMT22", "All AT models are trained from scratch for 200k steps", "200k")
    assert "not in royalflush" in source_problems("at.max_update", 200_000, invented)[0]
    assert "the set-up has 100000" in source_problems("at.max_update", 100_000, real)[0]
    assert "says no why" in source_problems("lenpen", 1.0, setups.choice(""))[0]


def test_the_hrt_papers_schedule_is_vaswani_et_als_transformer_base():
    """The HRT set-ups' training follows the pointer "Other training hyperparameters are the same
    as Vaswani et al. (2017)": the peak lr is the one its formula reaches at the end of warm-up."""
    for name in ("wmt16_en_ro", "wmt14_en_de"):
        s = setups.SETUPS[name]
        for t in (s.teacher, s.at, s.hrt, s.mp):
            assert t.lr == pytest.approx(512**-0.5 * t.warmup**-0.5, rel=0.01)
            assert t.max_update == s.at.max_update  # HRT: "for the same training steps" as AT
    assert setups.vaswani_lr(1024, 4000) == pytest.approx(1024**-0.5 * 4000**-0.5, rel=0.02)
