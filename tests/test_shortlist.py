"""Lexical shortlists: the builder (fairseq-hrt-shortlist) and decoding with --shortlist."""

import ast
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from fairseq.data import Dictionary

from benchmarks import measure
from fairseq_hrt import shortlist as sl
from fairseq_hrt.generation.lean import LeanSequenceGenerator
from fairseq_hrt.symbols import add_hrt_symbols, dictionary_fingerprint
from fairseq_hrt.testing.tiny_runs import make_tiny_data, run_cli
from hrt_runtime.search import SearchConfig
from tests.hrt_fixtures import build_generator, build_task_and_model, make_sample, random_tiny_models
from tests.tiny_data import hyp_lines

random.seed(5)
RAGGED = [[random.randrange(0, 40) for _ in range(random.randint(1, 12))] for _ in range(12)]

# ----------------------------------------------------------------- a hand-made corpus

CORPUS = [
    ("la maison", "the house"),
    ("la fleur", "the flower"),
    ("maison bleue", "blue house"),
    ("la fleur bleue", "the blue flower"),
]


def corpus_dictionaries():
    dicts = []
    for side in (0, 1):
        d = Dictionary()
        for src_tgt in CORPUS:
            for w in src_tgt[side].split():
                d.add_symbol(w)
        d.finalize(padding_factor=1)
        dicts.append(add_hrt_symbols(d))
    return dicts


def corpus_ids(src_dict, tgt_dict):
    src = [np.array([src_dict.index(w) for w in s.split()]) for s, _ in CORPUS]
    tgt = [np.array([tgt_dict.index(w) for w in t.split()]) for _, t in CORPUS]
    return src, tgt


def words(dictionary, ids):
    return [dictionary[i] for i in ids if i >= 0]


def test_pair_entries_pair_every_source_position_with_every_target_position():
    src, tgt, group = sl.pair_entries([np.array([5, 6]), np.array([7])], [np.array([1, 2, 3]), np.array([4])], null=9)
    assert group.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3]
    assert src.tolist() == [5, 6, 9] * 3 + [7, 9]
    assert tgt.tolist() == [1, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4]


def test_top_targets_best_first_ties_to_the_smaller_id_padded_with_minus_one():
    src = np.array([0, 0, 0, 2, 2])
    tgt = np.array([7, 5, 6, 9, 8])
    score = np.array([0.1, 0.5, 0.5, 0.3, 0.2])
    assert sl.top_targets(src, tgt, score, 3, 2).tolist() == [[5, 6], [-1, -1], [9, 8]]
    with pytest.raises(ValueError, match="--per-source must be >= 1"):
        sl.top_targets(src, tgt, score, 3, 0)


def test_most_frequent_skips_excluded_ids():
    sentences = [np.array([4, 4, 5]), np.array([6, 5, 4, 2])]
    assert sl.most_frequent(sentences, 8, 2).tolist() == [4, 5]
    assert sl.most_frequent(sentences, 8, 3, exclude=[4]).tolist() == [5, 2, 6]


@pytest.mark.parametrize("method", ["ibm1", "dice"])
def test_built_shortlist_of_a_tiny_corpus(method):
    src_dict, tgt_dict = corpus_dictionaries()
    src, tgt = corpus_ids(src_dict, tgt_dict)
    short = sl.build_shortlist(src, tgt, src_dict, tgt_dict, per_source=1, frequent=1, method=method)
    best = {
        w: words(tgt_dict, short.translations[src_dict.index(w)].tolist()) for w in ("la", "maison", "fleur", "bleue")
    }
    assert best == {"la": ["the"], "maison": ["house"], "fleur": ["flower"], "bleue": ["blue"]}
    # the most frequent target word and every special symbol
    specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"] + [f"<s{k}>" for k in range(2, 9)]
    assert sorted(words(tgt_dict, short.always.tolist())) == sorted(["the"] + specials)
    assert short.fingerprint == dictionary_fingerprint(src_dict, tgt_dict)
    # a batch "la maison": its translations plus the frequent/special tokens
    batch = torch.tensor([[src_dict.pad(), src_dict.index("la"), src_dict.index("maison"), src_dict.eos()]])
    assert sorted(words(tgt_dict, short.candidates(batch, src_dict.pad()).tolist())) == sorted(
        ["the", "house"] + specials
    )


def test_ibm1_explains_away_the_frequent_word():
    """'the' co-occurs with 'fleur' as often as 'flower' does: one EM iteration (co-occurrence
    shares) scores them alike; further iterations give 'the' to 'la', and 'fleur' -> 'flower'."""
    src_dict, tgt_dict = corpus_dictionaries()
    src, tgt = corpus_ids(src_dict, tgt_dict)

    def table(iterations):
        s, t, p = sl.ibm1_table(src, tgt, len(src_dict), len(tgt_dict), iterations=iterations)
        return {(src_dict[a], tgt_dict[b]): q for a, b, q in zip(s, t, p)}

    first, tenth = table(1), table(10)
    assert first[("fleur", "flower")] == pytest.approx(first[("fleur", "the")])
    assert tenth[("fleur", "flower")] > 10 * tenth[("fleur", "the")]
    assert tenth[("la", "the")] > 0.8
    totals = {}
    for (a, _), q in tenth.items():
        totals[a] = totals.get(a, 0.0) + q
    assert all(v == pytest.approx(1.0) for v in totals.values())  # p(. | s) sums to one


def test_min_score_drops_unlikely_translations():
    src_dict, tgt_dict = corpus_dictionaries()
    src, tgt = corpus_ids(src_dict, tgt_dict)
    every = sl.build_shortlist(src, tgt, src_dict, tgt_dict, per_source=3, frequent=1)
    likely = sl.build_shortlist(src, tgt, src_dict, tgt_dict, per_source=3, frequent=1, min_score=0.5)
    la = src_dict.index("la")
    assert words(tgt_dict, every.translations[la].tolist())[:2] == ["the", "flower"]
    assert words(tgt_dict, likely.translations[la].tolist()) == ["the"]
    assert likely.settings["min_score"] == 0.5
    with pytest.raises(ValueError, match="--min-score"):
        sl.build_shortlist(src, tgt, src_dict, tgt_dict, min_score=1.0)


def test_benchmark_rows_set_or_clear_the_shortlist():
    """Rows of one checkpoint share its task: a row without a shortlist must clear the option
    a '+shortlist' row set before it."""
    args = SimpleNamespace(
        at="at.pt",
        at_beams="1,5",
        hrt="hrt.pt",
        hrt_chunk_sizes="2",
        hrt_beams="1/1",
        mp="mp.pt",
        mp_iterations="1",
        mp_length_beam=5,
        ctranslate2="no",
        engines="lean",
        int8="no",
        shortlist="s.pt",
    )
    systems, _ = measure.systems_from_args(args)
    assert sum(s.name.endswith("+shortlist") for s in systems) == 5  # AT x 2, HRT x 2, MP
    for s in systems:
        _, options = measure.adapter_of(s).generation(s)
        assert options["shortlist"] == ("s.pt" if s.name.endswith("+shortlist") else None)


def test_builder_refuses_options_below_one():
    src_dict, tgt_dict = corpus_dictionaries()
    src, tgt = corpus_ids(src_dict, tgt_dict)
    for kwargs, flag in (
        ({"per_source": 0}, "--per-source"),
        ({"frequent": 0}, "--frequent"),
        ({"iterations": 0}, "--iterations"),
    ):
        with pytest.raises(ValueError, match=f"{flag} must be >= 1"):
            sl.build_shortlist(src, tgt, src_dict, tgt_dict, **kwargs)


# ---------------------------------------------------------------------- file format


def test_file_round_trip_and_bad_files(tmp_path):
    src_dict, tgt_dict = corpus_dictionaries()
    short = sl.build_shortlist(*corpus_ids(src_dict, tgt_dict), src_dict, tgt_dict, per_source=2, frequent=1)
    short.save(str(tmp_path / "s.pt"))
    loaded = sl.Shortlist.load(str(tmp_path / "s.pt"))
    assert loaded.translations.equal(short.translations) and loaded.always.equal(short.always)
    assert loaded.fingerprint == short.fingerprint and loaded.settings["per_source"] == 2
    with pytest.raises(FileNotFoundError, match="no such file"):
        sl.Shortlist.load(str(tmp_path / "missing.pt"))
    (tmp_path / "garbled.pt").write_bytes(b"not a torch file")
    with pytest.raises(ValueError, match="not a shortlist file"):
        sl.Shortlist.load(str(tmp_path / "garbled.pt"))
    torch.save({"format": "something else"}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="not a shortlist file"):
        sl.Shortlist.load(str(tmp_path / "other.pt"))


# ------------------------------------------------------------------------- decoding


@pytest.fixture(scope="module")
def random_models(tmp_path_factory):
    return random_tiny_models(tmp_path_factory, "shortlist")


def shortlist_file(task, path, keep_per_source=None, always=None, seed=0):
    """A shortlist for the task's dictionaries: every token (default), or ``keep_per_source``
    random targets per source token plus ``always``."""
    vs, vt = len(task.source_dictionary), len(task.target_dictionary)
    if keep_per_source is None:
        translations, kept = torch.full((vs, 1), -1), torch.arange(vt)
    else:
        g = torch.Generator().manual_seed(seed)
        translations = torch.stack([torch.randperm(vt - 13, generator=g)[:keep_per_source] + 4 for _ in range(vs)])
        kept = torch.tensor(sorted(set(always) | set(sl.special_ids(task.target_dictionary))))
    sl.Shortlist(translations, kept, task.dictionary_fingerprint(), vs, vt).save(str(path))
    return str(path)


def assert_same_hypotheses(ref, ours):
    assert len(ref) == len(ours)
    for r_hypos, o_hypos in zip(ref, ours):
        assert [h["tokens"].tolist() for h in r_hypos] == [h["tokens"].tolist() for h in o_hypos]
        for r, o in zip(r_hypos, o_hypos):
            assert float(o["score"]) == pytest.approx(float(r["score"]), abs=1e-5)
            assert torch.allclose(o["positional_scores"], r["positional_scores"], atol=1e-5)


DECODES = {
    "at-greedy": ("at", ("--beam", "1")),
    "at-beam": ("at", ("--beam", "4", "--lenpen", "0.6")),
    "hrt-k2": ("hrt", ("--decode-chunk-size", "2", "--beam", "1")),
    "hrt-k2-b3-nat2": ("hrt", ("--decode-chunk-size", "2", "--beam", "3", "--b-nat", "2")),
    "hrt-at-mode": ("hrt", ("--decode-chunk-size", "1", "--beam", "2")),
}


@pytest.mark.parametrize("name", DECODES)
def test_shortlist_of_every_token_decodes_as_without(random_models, tmp_path, name):
    data_dir, task, hrt, at = random_models
    which, flags = DECODES[name]
    model = at if which == "at" else hrt
    full = shortlist_file(task, tmp_path / "all.pt")
    sample = make_sample(task, RAGGED)
    _, ref = build_generator(data_dir, model, "--max-len-b", "12", *flags)
    _, ours = build_generator(data_dir, model, "--max-len-b", "12", *flags, "--shortlist", full)
    assert_same_hypotheses(ref.generate([model], sample), ours.generate([model], sample))


@pytest.mark.parametrize("name", DECODES)
def test_outputs_lie_in_the_batch_candidates(random_models, tmp_path, name):
    data_dir, task, hrt, at = random_models
    which, flags = DECODES[name]
    model = at if which == "at" else hrt
    always = [task.target_dictionary.index(f"w{i}") for i in (0, 1)]
    path = shortlist_file(task, tmp_path / "small.pt", keep_per_source=1, always=always)
    short = sl.Shortlist.load(path)
    gen_task, gen = build_generator(data_dir, model, "--max-len-b", "12", *flags, "--shortlist", path)
    _, unrestricted = build_generator(data_dir, model, "--max-len-b", "12", *flags)
    outside = 0  # tokens the unrestricted search produces outside the candidates
    for batch in (RAGGED[:1], RAGGED[1:4], RAGGED[4:8]):
        sample = make_sample(task, batch)
        allowed = set(short.candidates(sample["net_input"]["src_tokens"], task.source_dictionary.pad()).tolist())
        assert len(allowed) < len(task.target_dictionary) - 13  # a real restriction
        for hypos in gen.generate([model], sample):
            for h in hypos:
                assert set(h["tokens"].tolist()) <= allowed
                assert h["positional_scores"].le(1e-6).all()  # log-probabilities over the candidates
        outside += sum(
            len(set(h["tokens"].tolist()) - allowed) for hypos in unrestricted.generate([model], sample) for h in hypos
        )
    assert outside > 0  # the shortlist changed the output


def test_greedy_with_a_shortlist_picks_what_a_ban_of_the_other_tokens_picks(random_models, tmp_path):
    """Greedy search over the candidates = greedy search over the vocabulary with every other
    token banned (the same argmax; only the normaliser of the scores differs)."""
    data_dir, task, _, at = random_models
    d = task.target_dictionary
    short = sl.Shortlist.load(shortlist_file(task, tmp_path / "s.pt", keep_per_source=3, always=[d.index("w3")]))
    for sentences in (RAGGED[:1], RAGGED[2:3], RAGGED):
        sample = make_sample(task, sentences)
        allowed = short.candidates(sample["net_input"]["src_tokens"], d.pad())
        banned = sorted(set(range(len(d))) - set(allowed.tolist()))
        options = SearchConfig(beam=1, max_len_b=10)
        ours = LeanSequenceGenerator(at, d, options, shortlist=short).generate([at], sample)
        ref = LeanSequenceGenerator(at, d, options, banned=banned).generate([at], sample)
        for o, r in zip(ours, ref):
            assert o[0]["tokens"].tolist() == r[0]["tokens"].tolist()
            # normalised over fewer tokens: higher (or equal) log-probabilities, still <= 0
            assert (o[0]["positional_scores"] >= r[0]["positional_scores"] - 1e-6).all()


def test_shortlist_with_int8_quantization(tmp_path):
    """The int8 output layer is dequantized for the candidates' rows (Marian, too, runs the
    shortlisted product in 32-bit)."""
    task, model = build_task_and_model(str(tmp_path), arch="at_tiny")
    path = shortlist_file(task, tmp_path / "small.pt", keep_per_source=2, always=[task.target_dictionary.index("w0")])
    short = sl.Shortlist.load(path)
    sample = make_sample(task, RAGGED[:4])
    _, gen = build_generator(
        str(tmp_path), model, "--quantize", "int8", "--beam", "2", "--max-len-b", "8", "--shortlist", path
    )
    assert "quantized" in type(model.decoder.output_projection).__module__
    allowed = set(short.candidates(sample["net_input"]["src_tokens"], task.source_dictionary.pad()).tolist())
    hypos = gen.generate([model], sample)
    assert len(hypos) == 4 and all(set(h[0]["tokens"].tolist()) <= allowed for h in hypos)


# ----------------------------------------------------------------------------- refusals


def test_shortlist_of_another_dictionary_is_refused(random_models, tmp_path):
    data_dir, task, hrt, _ = random_models
    src_dict, tgt_dict = corpus_dictionaries()
    foreign = sl.build_shortlist(*corpus_ids(src_dict, tgt_dict), src_dict, tgt_dict, per_source=1, frequent=1)
    foreign.save(str(tmp_path / "foreign.pt"))
    with pytest.raises(ValueError, match="built for another dictionary") as e:
        build_generator(data_dir, hrt, "--shortlist", str(tmp_path / "foreign.pt"))
    assert foreign.fingerprint in str(e.value) and task.dictionary_fingerprint() in str(e.value)
    with pytest.raises(FileNotFoundError, match="no such file"):
        build_generator(data_dir, hrt, "--shortlist", str(tmp_path / "missing.pt"))


@pytest.mark.parametrize(
    "flags,message",
    [
        (("--decoder-engine", "fairseq"), "--decoder-engine lean"),
        (("--decoding", "pgj", "--beam", "1"), "not supported by --decoding pgj"),
        (("--decoding", "hrt-spec", "--beam", "1"), "not supported by --decoding hrt-spec"),
    ],
)
def test_decoders_without_shortlist_support_refuse_it(random_models, tmp_path, flags, message):
    data_dir, task, hrt, _ = random_models
    path = shortlist_file(task, tmp_path / "all.pt")
    with pytest.raises(ValueError, match=message):
        build_generator(data_dir, hrt, *flags, "--shortlist", path)


@pytest.fixture(scope="module")
def cmlm_model(tmp_path_factory):
    data_dir = str(tmp_path_factory.mktemp("shortlist_cmlm"))
    task, model = build_task_and_model(data_dir, arch="cmlm_tiny", extra=("--hrt-mode", "cmlm"))
    return data_dir, task, model


def test_mask_predict_with_shortlist(cmlm_model, tmp_path):
    data_dir, task, model = cmlm_model
    flags = ("--iter-decode-max-iter", "3", "--iter-decode-with-beam", "2", "--max-len-b", "10")
    sample = make_sample(task, RAGGED[:5])
    _, ref = build_generator(data_dir, model, *flags)
    _, ours = build_generator(data_dir, model, *flags, "--shortlist", shortlist_file(task, tmp_path / "all.pt"))
    assert_same_hypotheses(ref.generate([model], sample), ours.generate([model], sample))
    path = shortlist_file(task, tmp_path / "small.pt", keep_per_source=1, always=[task.target_dictionary.index("w0")])
    allowed = set(
        sl.Shortlist.load(path).candidates(sample["net_input"]["src_tokens"], task.source_dictionary.pad()).tolist()
    )
    _, small = build_generator(data_dir, model, *flags, "--shortlist", path)
    for hypos in small.generate([model], sample):
        assert all(set(h["tokens"].tolist()) <= allowed for h in hypos)
    # --decoder-engine does not apply to Mask-Predict, so it does not stand in the way
    build_generator(data_dir, model, *flags, "--decoder-engine", "fairseq", "--shortlist", path)


# ------------------------------------------------------------------------ end to end


def test_builder_cli_on_binarized_and_text_data(tmp_path):
    data = make_tiny_data(tmp_path, n_train=60, n_valid=10, prefer="synthetic")
    out_bin, out_text = tmp_path / "bin.pt", tmp_path / "text.pt"
    run_cli(["fairseq_hrt.shortlist", data.bin_dir, "-o", out_bin, "--per-source", "3", "--frequent", "5"])
    run_cli(
        [
            "fairseq_hrt.shortlist",
            data.bin_dir,
            "-o",
            out_text,
            "--per-source",
            "3",
            "--frequent",
            "5",
            "--source-text",
            data.raw("train", "en"),
            "--target-text",
            data.raw("train", "de"),
        ]
    )
    a, b = sl.Shortlist.load(str(out_bin)), sl.Shortlist.load(str(out_text))
    assert a.translations.equal(b.translations) and a.always.equal(b.always)
    # the synthetic corpus translates w_i as W_i: the best translation of every source word
    d = Dictionary.load(str(data.dict_path))
    for i in range(24):
        if f"w{i}" in d.indices:
            assert d[int(a.translations[d.index(f"w{i}"), 0])] == f"W{i}"
    bad = run_cli(["fairseq_hrt.shortlist", data.bin_dir, "-o", tmp_path / "x.pt", "--per-source", "0"], check=False)
    assert bad.returncode == 1 and "--per-source must be >= 1" in bad.stdout


@pytest.mark.slow
def test_fairseq_generate_with_shortlist(trained, tmp_path):
    data, ckpts = trained
    path = tmp_path / "short.pt"
    run_cli(["fairseq_hrt.shortlist", data.bin_dir, "-o", path, "--per-source", "4", "--frequent", "10"])
    short = sl.Shortlist.load(str(path))
    common = [
        "generate",
        data.bin_dir,
        "--gen-subset",
        "valid",
        "--batch-size",
        "8",
        "--user-dir",
        "fairseq_hrt",
        "--task",
        "hrt_translation",
        "--source-lang",
        "en",
        "--target-lang",
        "de",
        "--cpu",
        "--beam",
        "2",
    ]
    for arch, flags in (("at_tiny", []), ("hrt_tiny", ["--decode-chunk-size", "2"])):
        out = run_cli(common + ["--path", ckpts[arch], "--shortlist", path] + flags).stdout
        assert "--shortlist" in out and len(hyp_lines(out)) == 40
        d = Dictionary.load(str(data.dict_path))
        allowed = set(short.translations[short.translations >= 0].tolist()) | set(short.always.tolist())
        assert all(d.index(w) in allowed for line in hyp_lines(out).values() for w in line.split())


def test_shortlist_module_does_not_import_the_task():
    """The task reads --shortlist through shortlist.load_for_decoding; shortlist.py itself must
    not import the task module (no import cycle)."""
    with open(sl.__file__, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)] + [
        a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
    ]
    assert not [m for m in imported if m and m.startswith("fairseq_hrt.tasks")], imported
