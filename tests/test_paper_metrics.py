"""The papers' tokenized BLEU (fairseq_hrt.scoring.tokenized_bleu) and python -m fairseq_hrt.evaluate.

multi-bleu.perl is LGPL and not in this repository: :func:`multi_bleu_by_hand` below counts the
n-grams as that script does, written out independently of the code under test. On the fixed pair
of this file the real script was run once by hand (mosesdecoder's scripts/generic/multi-bleu.perl,
see the report of the change that added this file); it printed the same numbers as both.
"""

import json
import math
from collections import Counter

import pytest

from fairseq_hrt.evaluate import evaluate, format_report
from fairseq_hrt.scoring.comet import comet_score
from fairseq_hrt.scoring.metrics import chrf_score, sacrebleu_score
from fairseq_hrt.scoring.tokenized_bleu import (
    COMPOUND_MARK,
    moses_tokenize,
    multi_bleu,
    remove_romanian_diacritics,
    split_compounds,
    tokenized_bleu,
)
from fairseq_hrt.testing.tiny_runs import run_cli, write_lines
from tests.comet_tiny import build_tiny_comet

EVALUATE = "fairseq_hrt.evaluate"

# Moses-tokenized German with hyphenated compounds, one hypothesis shorter than its reference
TOKENIZED_HYPS = [
    "Die Katze sitzt auf der Matte-Decke .",
    "Ein Mann-Frau-Team fährt mit dem Fahrrad die Straße entlang .",
    "Das ist gut",
    "Zwei Hunde spielen im Schnee-Garten , und ein Kind lacht laut .",
]
TOKENIZED_REFS = [
    "Die Katze saß auf der Matte-Decke .",
    "Ein Mann-Frau-Team fährt mit dem Rad die Straße hinunter .",
    "Das ist sehr gut .",
    "Zwei Hunde spielen im Schnee , und ein Kind lacht .",
]
# the same sentences as a system writes them (detokenized), and their sources
HYPS = [
    "Die Katze sitzt auf der Matte-Decke.",
    "Ein Mann-Frau-Team fährt mit dem Fahrrad die Straße entlang.",
    "Das ist gut",
    "Zwei Hunde spielen im Schnee-Garten, und ein Kind lacht laut.",
]
REFS = [
    "Die Katze saß auf der Matte-Decke.",
    "Ein Mann-Frau-Team fährt mit dem Rad die Straße hinunter.",
    "Das ist sehr gut.",
    "Zwei Hunde spielen im Schnee, und ein Kind lacht.",
]
SRCS = [
    "The cat sits on the mat blanket.",
    "A man-woman team rides the bike down the street.",
    "That is very good.",
    "Two dogs play in the snow, and a child laughs.",
]


def multi_bleu_by_hand(hyps, refs):
    """multi-bleu.perl's arithmetic: whitespace tokens, clipped 1-4-gram matches summed over the
    corpus, brevity penalty from the corpus lengths, 0 when any precision is 0. ``(score in
    0-100, [precisions in %], hyp length, ref length)``."""
    correct, total, hyp_len, ref_len = [0] * 4, [0] * 4, 0, 0
    for hyp, ref in zip(hyps, refs):
        h, r = hyp.split(), ref.split()
        hyp_len, ref_len = hyp_len + len(h), ref_len + len(r)
        for n in range(1, 5):
            h_grams = Counter(tuple(h[i : i + n]) for i in range(len(h) - n + 1))
            r_grams = Counter(tuple(r[i : i + n]) for i in range(len(r) - n + 1))
            total[n - 1] += sum(h_grams.values())
            correct[n - 1] += sum(min(count, r_grams[gram]) for gram, count in h_grams.items())
    precisions = [c / t if t else 0.0 for c, t in zip(correct, total)]
    if min(precisions) == 0:
        return 0.0, [100 * p for p in precisions], hyp_len, ref_len
    penalty = math.exp(1 - ref_len / hyp_len) if hyp_len < ref_len else 1.0
    score = penalty * math.exp(sum(math.log(p) for p in precisions) / 4)
    return 100 * score, [100 * p for p in precisions], hyp_len, ref_len


def _assert_same_as_by_hand(result, hyps, refs):
    score, precisions, hyp_len, ref_len = multi_bleu_by_hand(hyps, refs)
    assert result["score"] == pytest.approx(score, abs=1e-9)
    assert result["precisions"] == pytest.approx(precisions, abs=1e-9)
    assert (result["sys_len"], result["ref_len"]) == (hyp_len, ref_len)
    penalty = math.exp(1 - ref_len / hyp_len) if hyp_len < ref_len else 1.0
    # the line multi-bleu.perl prints (its printf format)
    assert result["multi_bleu"] == (
        f"BLEU = {score:.2f}, {'/'.join(f'{p:.1f}' for p in precisions)} (BP={penalty:.3f}, "
        f"ratio={hyp_len / ref_len:.3f}, hyp_len={hyp_len}, ref_len={ref_len})"
    )


@pytest.mark.parametrize("compound_split", [False, True])
def test_multi_bleu_counts_as_multi_bleu_perl(compound_split):
    hyps, refs = TOKENIZED_HYPS, TOKENIZED_REFS
    if compound_split:
        hyps, refs = [split_compounds(h) for h in hyps], [split_compounds(r) for r in refs]
    result = multi_bleu(hyps, refs)
    _assert_same_as_by_hand(result, hyps, refs)
    assert "tok:none" in result["signature"] and "smooth:none" in result["signature"]
    assert 0 < result["score"] < 100


def test_multi_bleu_is_zero_when_a_precision_is_zero():
    # no 4-gram of the hypothesis is in the reference: multi-bleu.perl does not smooth, BLEU is 0
    # (sacreBLEU's default smoothing gives a positive score)
    hyps, refs = ["a b c d e"], ["a b c x d e"]
    assert multi_bleu(hyps, refs)["score"] == 0.0 == multi_bleu_by_hand(hyps, refs)[0]
    assert multi_bleu(hyps, refs)["precisions"][:3] == pytest.approx(multi_bleu_by_hand(hyps, refs)[1][:3])
    assert sacrebleu_score(hyps, refs)["score"] > 0
    # a corpus without 4-grams (lines of three tokens) is 0 as well
    assert multi_bleu(["the cat sat"], ["the cat sat"])["score"] == 0.0
    # case-sensitive: one changed capital is one unmatched token
    lower = multi_bleu(["die Katze sitzt auf der Matte ."], ["Die Katze sitzt auf der Matte ."])
    assert lower["precisions"][0] == pytest.approx(100 * 6 / 7)


def test_compound_splitting_as_fairseq_perl_substitution():
    assert split_compounds("Matte-Decke") == f"Matte {COMPOUND_MARK} Decke"
    # perl's s///g resumes after a match: a one-letter part between two hyphens stays joined
    assert (
        split_compounds("a-b-c Mann-Frau-Team")
        == f"a {COMPOUND_MARK} b-c Mann {COMPOUND_MARK} Frau {COMPOUND_MARK} Team"
    )
    # a dash between spaces, or at a word's edge, is not a compound
    assert split_compounds("gut - schlecht -a b-") == "gut - schlecht -a b-"

    off = tokenized_bleu(HYPS, REFS, "de")
    on = tokenized_bleu(HYPS, REFS, "de", compound_split=True)
    compounds = sum(line.count("-") for line in HYPS)
    # each compound adds two tokens (the mark and the second part) to the hypothesis
    assert on["sys_len"] == off["sys_len"] + 2 * compounds
    assert on["score"] != off["score"]
    assert on["compound_split"] and not off["compound_split"]
    assert "compounds split" in on["processing"] and "no compound splitting" in off["processing"]


def test_tokenized_bleu_scores_moses_tokens():
    assert moses_tokenize(HYPS, "de") == TOKENIZED_HYPS
    assert moses_tokenize(['Ein "Test" & mehr.'], "de") == ["Ein &quot; Test &quot; &amp; mehr ."]  # escaped
    result = tokenized_bleu(HYPS, REFS, "de", compound_split=True)
    _assert_same_as_by_hand(
        result, [split_compounds(h) for h in TOKENIZED_HYPS], [split_compounds(r) for r in TOKENIZED_REFS]
    )
    assert "Moses tokenizer -l de (sacremoses" in result["processing"]
    assert "case-sensitive multi-bleu.perl" in result["processing"]


def test_romanian_diacritics_only_when_asked():
    # s/t with cedilla (the older spelling) as well as with comma below
    assert remove_romanian_diacritics("Ştiu că ţara, ȘȚĂÎÂ șțăîâ.") == "Stiu ca tara, STAIA staia."
    refs = ["Ştiu că ţara este frumoasă și mare.", "Învățăm în fiecare zi câte ceva nou."]
    hyps = [remove_romanian_diacritics(r) for r in refs]  # a system trained without diacritics
    kept = tokenized_bleu(hyps, refs, "ro")
    removed = tokenized_bleu(hyps, refs, "ro", remove_ro_diacritics=True)
    assert kept["score"] < 100 and removed["score"] == pytest.approx(100)
    assert removed["remove_ro_diacritics"] and "Romanian diacritics removed" in removed["processing"]
    assert "diacritics" not in kept["processing"]


def test_report_without_comet_weights(tmp_path, monkeypatch):
    monkeypatch.delenv("COMET_MODEL", raising=False)
    report = evaluate(HYPS, REFS, SRCS, "de", compound_split=True)
    assert set(report["comet"]) == {"available", "score", "reason"}
    assert report["comet"]["available"] is False and report["comet"]["score"] is None
    assert "no local model" in report["comet"]["reason"]
    missing = evaluate(HYPS, REFS, SRCS, "de", comet_model=str(tmp_path / "no-such-model"))
    assert missing["comet"]["score"] is None and "does not exist" in missing["comet"]["reason"]


def test_evaluate_command_json_and_table(tmp_path):
    hyp, ref, src = (write_lines(tmp_path / name, lines) for name, lines in (("h", HYPS), ("r", REFS), ("s", SRCS)))
    out_json = tmp_path / "report" / "test.json"
    out = run_cli(
        [EVALUATE, "--hyp", hyp, "--ref", ref, "--src", src, "--target-lang", "de", "--compound-split"]
        + ["--json", out_json],
        env={"COMET_MODEL": "", "COMET_ENCODER": ""},
    ).stdout
    report = json.loads(out_json.read_text())
    assert set(report) == {"files", "segments", "target_lang", "sacrebleu", "tokenized_bleu", "chrf", "comet"}
    assert report["segments"] == len(HYPS) and report["target_lang"] == "de"
    sacrebleu = sacrebleu_score(HYPS, REFS)
    assert report["sacrebleu"]["score"] == pytest.approx(sacrebleu["score"])
    assert report["sacrebleu"]["signature"] == sacrebleu["signature"]
    assert report["chrf"] == pytest.approx(chrf_score(HYPS, REFS))
    expected = tokenized_bleu(HYPS, REFS, "de", compound_split=True)
    assert report["tokenized_bleu"]["score"] == pytest.approx(expected["score"])
    for key in ("multi_bleu", "processing", "signature", "compound_split", "remove_ro_diacritics", "tokenizer"):
        assert report["tokenized_bleu"][key] == expected[key]
    assert report["comet"]["available"] is False and report["comet"]["score"] is None

    # the table: every metric on its line, sacreBLEU first with its signature, COMET not available
    lines = out.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("sacreBLEU"))
    assert sacrebleu["signature"] in lines[first]
    assert lines[first + 1].startswith("tokenized BLEU") and expected["multi_bleu"] in lines[first + 1]
    assert expected["processing"] in lines[first + 2]
    assert lines[first + 3].startswith("chrF") and report["chrf"]["signature"] in lines[first + 3]
    assert lines[first + 4].startswith("COMET           not available (no local model")


@pytest.mark.parametrize(
    "hyp_lines, expected",
    [
        (HYPS[:3], "the files differ in length (--hyp {h} has 3 lines, --ref {r} has 4 lines, --src {s} has 4 lines)"),
        ([], "--hyp {h} is empty: nothing to score"),
    ],
)
def test_unaligned_or_empty_files_are_one_line(tmp_path, hyp_lines, expected):
    hyp, ref, src = (
        write_lines(tmp_path / name, lines) for name, lines in (("h", hyp_lines), ("r", REFS), ("s", SRCS))
    )
    out_json = tmp_path / "test.json"
    out = run_cli(
        [EVALUATE, "--hyp", hyp, "--ref", ref, "--src", src, "--target-lang", "de", "--json", out_json], check=False
    )
    assert out.returncode == 1 and not out_json.exists()
    errors = [line for line in out.stdout.splitlines() if line.startswith(f"python -m {EVALUATE}: error: ")]
    assert len(errors) == 1 and expected.format(h=hyp, r=ref, s=src) in errors[0], out.stdout
    assert "Traceback" not in out.stdout


def test_romanian_option_needs_a_romanian_target(tmp_path):
    files = [write_lines(tmp_path / name, HYPS) for name in ("h", "r", "s")]
    out = run_cli(
        [EVALUATE, "--hyp", files[0], "--ref", files[1], "--src", files[2], "--target-lang", "de"]
        + ["--remove-ro-diacritics"],
        check=False,
    )
    assert out.returncode == 2 and "--remove-ro-diacritics is for Romanian targets (--target-lang ro)" in out.stdout


def test_report_with_a_local_comet_model(tmp_path):
    """The COMET row of a report from a local model: the tiny random COMET model of the scoring
    tests (its scores mean nothing; the number is what ``comet_score`` gives for it)."""
    ckpt = build_tiny_comet(tmp_path)
    report = evaluate(HYPS, REFS, SRCS, "de", comet_model=str(ckpt))
    expected = comet_score(SRCS, HYPS, REFS, model_path=str(ckpt))
    assert report["comet"]["available"] is True
    assert report["comet"]["score"] == pytest.approx(expected["score"])
    assert report["comet"]["model"] == expected["model"]
    comet_row = format_report(report).splitlines()[-1]
    assert comet_row == f"COMET           {expected['score']:.4f}  model: {expected['model']}"
