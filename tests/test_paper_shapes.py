"""benchmarks/paper_shapes.py: every row of the fixed-length benchmark does the same work
(the same decoder positions per sentence), and what it cannot measure is a line in the report."""

import json
import math
import random

import pytest
import torch

from benchmarks import ct2_reference, hrt_bound, paper_shapes
from fairseq_hrt.generation import cuda_graph


@pytest.mark.parametrize("source_tokens", range(1, 130))
def test_target_length_is_the_smallest_4q_plus_3_of_at_least_1_1_times_the_source(source_tokens):
    length = paper_shapes.target_length(source_tokens)
    wanted = math.ceil(1.1 * source_tokens)
    assert length >= wanted and (length + 1) % 4 == 0 and length - 4 < wanted
    # HRT k = 2 and 4 then run whole Skip-AT steps over AT's L + 1 positions
    for k in (2, 4):
        assert (length // k + 1) * k == length + 1


def test_buckets_cover_every_length_once():
    assert [paper_shapes.bucket_of(n) for n in (1, 10, 11, 20, 21, 30, 31, 50, 51, 500)] == [
        "1-10", "1-10", "11-20", "11-20", "21-30", "21-30", "31-50", "31-50", ">50", ">50",
    ]  # fmt: skip
    with pytest.raises(ValueError, match="no bucket"):
        paper_shapes.bucket_of(0)


def test_sentences_option_is_checked():
    assert paper_shapes.parse_sentences("1:8,128:64") == {1: 8, 128: 64}
    for bad in ("1", "0:4", "1:x", "8:0"):
        with pytest.raises(ValueError, match="BATCH:SENTENCES"):
            paper_shapes.parse_sentences(bad)


def test_same_positions_names_a_row_that_decoded_other_lengths():
    rows = [
        {"name": "AT greedy", "positions_by_bucket": {"1": {"1-10": [12, 8]}}},
        {"name": "HRT k=2", "positions_by_bucket": {"1": {"1-10": [12, 8]}}},
        {"name": "CTranslate2", "positions_by_bucket": {"1": {"1-10": [12, 9]}}},
    ]
    assert paper_shapes.same_positions(rows) == {"1": ["CTranslate2"]}
    assert paper_shapes.same_positions(rows[:2]) == {"1": []}


def _corpus(tmp_path, lengths):
    rng = random.Random(0)
    words = [chr(97 + i) * 3 for i in range(20)]  # "aaa", "bbb", ...: each one piece of the BPE, tokens = words
    src = tmp_path / "src.txt"
    src.write_text("".join(" ".join(rng.choice(words) for _ in range(n)) + "\n" for n in lengths))
    train = tmp_path / "train.txt"
    train.write_text("".join(" ".join(rng.choice(words) for _ in range(12)) + "\n" for _ in range(400)))
    return src, train


def _run(tmp_path, *extra, lengths=(3, 6, 14, 17, 25, 40, 44, 60)):
    src, train = _corpus(tmp_path, lengths)
    out = tmp_path / "out"
    paper_shapes.main(
        [
            "--shapes", "tiny", "--vocab", "200", "--src", str(src), "--spm-train", str(train), "--spm-vocab", "200",
            "--sentences", "1:2,4:2", "--runs", "1", "--bound-runs", "1", "--bound-batches", "1",
            "--workdir", str(tmp_path / "work"), "--out-dir", str(out), *extra,
        ]
    )  # fmt: skip
    return json.loads((out / "report.json").read_text()), (out / "report.md").read_text(), out


@pytest.fixture(scope="module")
def tiny_report(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("paper_shapes"))


def test_every_row_decodes_the_same_positions(tiny_report):
    report, md, out = tiny_report
    systems = report["systems"]
    names = {s["name"] for s in systems}
    expected = {
        "AT greedy", "HRT k=2 b_at=1 b_nat=1", "HRT k=4 b_at=1 b_nat=1",
        "AT greedy (onnxruntime)", "HRT k=2 b_at=1 b_nat=1 (onnxruntime)", "HRT k=4 b_at=1 b_nat=1 (onnxruntime)",
        "AT greedy (onnxruntime) int8", "HRT k=2 b_at=1 b_nat=1 (onnxruntime) int8",
        "HRT k=4 b_at=1 b_nat=1 (onnxruntime) int8", "AT greedy (fairseq SequenceGenerator)",
    }  # fmt: skip
    if ct2_reference.unavailable_reason() is None:
        expected |= {"CTranslate2 AT greedy", "CTranslate2 AT greedy int8"}
    assert names == expected
    assert report["shapes"]["tiny"]["positions_differ"] == {"1": [], "4": []}
    # and every sentence's positions are L + 1 of its batch (the longest source's L)
    expected = report["shapes"]["tiny"]["expected_positions"]
    assert all(p % 4 == 0 for per in expected.values() for ps in per.values() for p in ps)
    for s in systems:
        assert s["positions_by_bucket"] == expected, s["name"]
    assert "every row decoded the same positions" in md
    assert isinstance(report["meta"]["cpu_isa"], list) and report["meta"]["dtype"] == "float32"
    assert "CPU instruction sets:" in md
    assert (out / "speedup_by_length.png").stat().st_size > 0


def test_rows_keep_the_benchmark_schema_and_their_ratios(tiny_report):
    report, _, _ = tiny_report
    for s in report["systems"]:
        assert {"name", "family", "decoding", "speed", "shape", "model"} <= set(s)
        assert (s["model"]["encoder_layers"], s["model"]["decoder_layers"], s["model"]["embed_dim"]) == (2, 1, 32)
        assert s["model"]["arch"] == ("hrt_tiny" if s["family"] == "HRT" else "at_tiny")
        for bsz, speed in s["speed"].items():
            assert speed["words_per_second"] > 0 and speed["ratio_vs_baseline"] > 0
            assert set(speed["buckets"]) == {"1-10", "11-20", "21-30", "31-50", ">50"}
    for bsz in ("1", "4"):
        fastest = max(
            (s for s in report["systems"] if s["family"] in ("AT", "CTranslate2")),
            key=lambda s: s["speed"][bsz]["words_per_second"],
        )
        assert fastest["speed"][bsz]["ratio_vs_baseline"] == 1.0
    hrt = next(s for s in report["systems"] if s["name"] == "HRT k=2 b_at=1 b_nat=1 (onnxruntime)")
    at = next(s for s in report["systems"] if s["name"] == "AT greedy (onnxruntime)")
    assert hrt["speed"]["1"]["own_at"] == at["name"]
    assert hrt["speed"]["1"]["ratio_vs_own_at"] == pytest.approx(
        hrt["speed"]["1"]["words_per_second"] / at["speed"]["1"]["words_per_second"], abs=2e-3
    )
    assert all("bound" in c and "share_of_bound" in c for c in hrt["speed"]["1"]["buckets"].values())
    split = report["shapes"]["tiny"]["bounds"]["1"][hrt["name"]]["1-10"]
    assert {"encoder_ms", "at_steps_ms", "skip_at_steps_ms", "stage2_ms", "bound"} <= set(split)
    assert "bound" not in next(iter(hrt["speed"]["4"]["buckets"].values()))  # --bound-batches 1


def test_ctranslate2_is_timed_in_the_same_round_robin(tiny_report):
    report, md, _ = tiny_report
    if ct2_reference.unavailable_reason() is not None:
        pytest.skip("needs ctranslate2")
    ct2 = [s for s in report["systems"] if s["family"] == "CTranslate2"]
    assert {s["decoding"]["quantize"] for s in ct2} == {"float32", "int8"}
    for s in ct2:  # one pass per run and bucket (--runs 1), each timed by the child
        for speed in s["speed"].values():
            assert all(len(c["run_seconds"]) == 1 and c["seconds"] > 0 for c in speed["buckets"].values())
    assert report["shapes"]["tiny"]["ctranslate2"]["loaded"] == ["float32", "int8"]
    assert "### fixed-length split, batch 1" in md


def test_what_cannot_be_measured_is_a_line_and_the_rest_is_measured(tmp_path, monkeypatch):
    monkeypatch.setattr(ct2_reference, "unavailable_reason", lambda use_cuda=False: "no ctranslate2 here")
    real = hrt_bound.backend_of

    def no_int8(*a, int8=False):
        if int8:
            raise RuntimeError("this shape does not quantize\nsecond line")
        return real(*a)

    monkeypatch.setattr(hrt_bound, "backend_of", no_int8)
    # no source of more than 50 tokens: the >50 bucket is empty
    report, md, _ = _run(tmp_path, "--engines", "onnxruntime", lengths=(3, 14, 25, 40))
    block = report["shapes"]["tiny"]
    assert block["errors"]["CTranslate2 AT greedy"] == "no ctranslate2 here"
    assert block["errors"]["AT greedy (onnxruntime) int8"] == "RuntimeError: this shape does not quantize"
    assert block["empty_buckets"] == {"1": [">50"], "4": [">50"]}
    assert {s["name"] for s in report["systems"]} == {
        "AT greedy (onnxruntime)", "HRT k=2 b_at=1 b_nat=1 (onnxruntime)", "HRT k=4 b_at=1 b_nat=1 (onnxruntime)",
        "AT greedy (fairseq SequenceGenerator)",
    }  # fmt: skip
    assert "not measured: **CTranslate2 AT greedy**: no ctranslate2 here" in md
    assert "no sentence in bucket >50" in md


def test_options_are_checked(tmp_path, capsys):
    refused = {
        ("--shapes", "huge"): "'huge' is not one of",
        ("--engines", "cuda"): "'cuda' is not one of",
        ("--sentences", "1"): "expected BATCH:SENTENCES",
        ("--src", str(tmp_path / "none")): "no such file",
        ("--fp16",): "--fp16 is for --device cuda",
        ("--bf16",): "--bf16 is for --device cuda",
        ("--fp16", "--bf16"): "not allowed with argument",
        ("--fairseq-batches", "1,x"): "--fairseq-batches '1,x': batch sizes, comma-separated, or none",
        (
            "--engines",
            "cuda-graph",
        ): "--engines cuda-graph runs on cuda only here: with --device cpu use onnxruntime,lean",
    }
    if not torch.cuda.is_available():
        refused[("--device", "cuda", "--fp16")] = "--device cuda: torch"
    else:
        refused[("--device", "cuda", "--engines", "onnxruntime")] = "--engines onnxruntime runs on cpu only here"
    for argv, message in refused.items():
        with pytest.raises(SystemExit):
            paper_shapes.main([*argv, "--out-dir", str(tmp_path)])
        err = capsys.readouterr().err.strip().splitlines()
        assert message in err[-1], (argv, err)  # one line after the usage
    assert not (tmp_path / "report.json").exists()  # refused before anything was measured


def test_defaults_follow_the_device():
    args = paper_shapes.parse_args(["--out-dir", "x"])
    assert (args.dtype, args.engines, args.ct2_compute_types) == (
        "float32",
        ["onnxruntime", "lean"],
        ["float32", "int8"],
    )
    assert args.fairseq_batches == {1, 8, 128}
    assert paper_shapes.sync_of("cpu") is None and paper_shapes.sync_of("cuda") is torch.cuda.synchronize
    args = paper_shapes.parse_args(["--out-dir", "x", "--fairseq-batches", "8", "--ct2-compute-types", "int8"])
    assert args.fairseq_batches == {8} and args.ct2_compute_types == ["int8"]
    assert paper_shapes.parse_args(["--out-dir", "x", "--fairseq-batches", "none"]).fairseq_batches == set()


def test_fairseq_row_runs_at_the_batches_named_only(tmp_path):
    report, _, _ = _run(tmp_path, "--engines", "lean", "--fairseq-batches", "4", "--ct2-compute-types", "int8")
    fairseq = next(s for s in report["systems"] if s["name"] == "AT greedy (fairseq SequenceGenerator)")
    assert set(fairseq["speed"]) == {"4"}
    lean = next(s for s in report["systems"] if s["name"] == "AT greedy")
    assert set(lean["speed"]) == {"1", "4"}
    if ct2_reference.unavailable_reason() is None:  # its int8 only: named after it, beside float32 rows
        assert {s["name"] for s in report["systems"] if s["family"] == "CTranslate2"} == {"CTranslate2 AT greedy int8"}


def test_append_keeps_the_other_shapes_of_the_same_setting_only(tmp_path):
    meta = {"device": "CPU (x)", "threads": 1, "vocab": 32000, "src": "test.en", "spm_vocab": 24000, "sentences": 3003}
    earlier = {
        "meta": {**meta, "date": "then", "sentences_per_bucket": "1:6", "runs": 2, "bound_runs": 2},
        "shapes": {"base": {"title": "b"}, "e12d1": {"title": "e"}},
        "systems": [{"name": "AT greedy", "shape": "base"}, {"name": "AT greedy", "shape": "e12d1"}],
    }
    path = tmp_path / "report.json"
    path.write_text(json.dumps(earlier))
    now = {"meta": {**meta, "date": "now"}, "shapes": {}, "systems": []}
    merged = paper_shapes.appended(now, str(path), ["e12d1"])
    assert list(merged["shapes"]) == ["base"] and merged["systems"] == [{"name": "AT greedy", "shape": "base"}]
    assert merged["shapes"]["base"]["measured"]["date"] == "then"  # each shape says which run measured it
    with pytest.raises(SystemExit, match="another threads"):
        paper_shapes.appended({**now, "meta": {**now["meta"], "threads": 2}}, str(path), ["e12d1"])


def test_the_bound_is_taken_at_what_a_batch_decodes():
    """A batch decodes its longest sentence's L + 1 positions for every sentence, so the bound of
    a bucket is at its batches' widths, not at its mean sentence's."""
    batches = [
        paper_shapes.Batch([[5] * 3, [5] * 9], paper_shapes.target_length(9)),
        paper_shapes.Batch([[5] * 4, [5] * 5], paper_shapes.target_length(5)),
    ]
    source, target = paper_shapes.bound_lengths(batches)
    assert source == round((9 + 5) / 2) + 1
    assert target % 4 == 0 and target == 4 * round(
        (paper_shapes.target_length(9) + paper_shapes.target_length(5) + 2) / 8
    )
    one = [paper_shapes.Batch([[5] * 6], paper_shapes.target_length(6))]
    assert paper_shapes.bound_lengths(one) == (7, paper_shapes.target_length(6) + 1)


def failing_decoder(when, error, real=paper_shapes.search_decoder):
    """``paper_shapes.search_decoder`` whose rows raise ``error`` on the batches where
    ``when(k, batch)`` (the first of the pass's batches) holds, and decode the others."""

    def decoder(backend, encode, k, banned):
        decode = real(backend, encode, k, banned)

        def wrapped(sources, batches):
            if when(k, batches[0]):
                raise error
            return decode(sources, batches)

        return wrapped

    return decoder


def test_a_row_out_of_the_devices_memory_is_a_line_and_the_others_are_measured(tmp_path, monkeypatch):
    """A row whose warm-up (on the batch of the most positions) runs out of (GPU) memory at a
    batch size is a line in the report, the other rows and that row's other batch sizes are
    measured; a row that runs out later, in the timed passes, costs that batch size, a line too.
    (The error is raised by the rows' decoding here: a CPU has no device memory to run out of.)"""
    oom = torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore")

    def running_out(when):
        return failing_decoder(when, oom)

    lengths = (3, 6, 14, 17, 25, 40, 44)  # at batch 4 (2 sentences a bucket) the 40/44 pair is the largest
    options = ("--engines", "lean", "--fairseq-batches", "none", "--ct2-compute-types", "int8")
    in_warm_up = running_out(lambda k, batch: k == 4 and len(batch.tokens) > 1)
    monkeypatch.setattr(paper_shapes, "search_decoder", in_warm_up)
    (tmp_path / "warm-up").mkdir()
    report, md, _ = _run(tmp_path / "warm-up", *options, lengths=lengths)
    errors = report["shapes"]["tiny"]["errors"]
    assert (
        errors["HRT k=4 b_at=1 b_nat=1 at batch 4"]
        == "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    )
    k4 = next(s for s in report["systems"] if s["name"] == "HRT k=4 b_at=1 b_nat=1")
    assert set(k4["speed"]) == {"1"}
    k2 = next(s for s in report["systems"] if s["name"] == "HRT k=2 b_at=1 b_nat=1")
    assert set(k2["speed"]) == {"1", "4"}
    assert "not measured: **HRT k=4 b_at=1 b_nat=1 at batch 4**: OutOfMemoryError" in md

    in_timed = running_out(lambda k, batch: k == 2 and len(batch.tokens) > 1 and max(map(len, batch.tokens)) < 40)
    monkeypatch.setattr(paper_shapes, "search_decoder", in_timed)
    (tmp_path / "timed").mkdir()
    report, md, _ = _run(tmp_path / "timed", *options, lengths=lengths)
    assert report["shapes"]["tiny"]["errors"]["batch 4"].startswith(
        "out of memory in the timed passes: OutOfMemoryError"
    )
    assert all(set(s["speed"]) == {"1"} for s in report["systems"])


def test_a_row_that_fails_its_warm_up_is_a_line_with_no_bound(tmp_path, monkeypatch):
    """Any error of a row's warm-up (on a GPU: a kernel that a capture refuses) is a line for
    that row and batch size; the row has no bound there, and the other rows are measured."""
    refusing = RuntimeError("operation not permitted when stream is capturing\nmore")
    monkeypatch.setattr(paper_shapes, "search_decoder", failing_decoder(lambda k, batch: k == 4, refusing))
    options = ("--engines", "lean", "--fairseq-batches", "none", "--ct2-compute-types", "int8")
    report, md, _ = _run(tmp_path, *options, lengths=(3, 14, 25))
    block = report["shapes"]["tiny"]
    for bsz in (1, 4):
        assert block["errors"][f"HRT k=4 b_at=1 b_nat=1 at batch {bsz}"] == (
            "RuntimeError: operation not permitted when stream is capturing"
        )
    assert set(block["bounds"]["1"]) == {"HRT k=2 b_at=1 b_nat=1"}
    assert {s["name"] for s in report["systems"]} >= {"AT greedy", "HRT k=2 b_at=1 b_nat=1"}
    assert "HRT k=4 b_at=1 b_nat=1" not in {s["name"] for s in report["systems"]}


def test_the_cuda_graph_variants_are_the_graph_engine_with_one_change_each(tmp_path, monkeypatch):
    """``--engines cuda-graph,cuda-graph-stepped,cuda-graph-fused`` measures the CUDA-graph
    engine as it is, without its greedy device loop and with fused attention, in one run: the
    same positions decoded; only the plain and fused rows' searches are made by the loop (the
    stepped one's by the search, a host round trip a step); only the fused row's graphs fuse.
    The graphs' bodies run uncaptured on a CPU, as tests/test_cuda_graph.py runs them."""
    monkeypatch.setattr(cuda_graph.CudaGraphBackend, "captures", False)
    monkeypatch.setattr(paper_shapes, "ENGINE_DEVICES", {})
    backends = {}
    real = paper_shapes.engine_backend

    def recorded(engine, *args):
        backend, encode = real(engine, *args)
        backends.setdefault(engine, []).append(backend)
        return backend, encode

    monkeypatch.setattr(paper_shapes, "engine_backend", recorded)
    engines = "cuda-graph,cuda-graph-stepped,cuda-graph-fused"
    options = ("--engines", engines, "--fairseq-batches", "none", "--ct2-compute-types", "int8")
    report, md, _ = _run(tmp_path, *options, lengths=(3, 14, 25))
    names = {s["name"] for s in report["systems"]}
    assert {"AT greedy (cuda-graph-stepped)", "HRT k=2 b_at=1 b_nat=1 (cuda-graph-stepped)"} <= names
    assert {"AT greedy (cuda-graph)", "HRT k=4 b_at=1 b_nat=1 (cuda-graph-fused)"} <= names
    assert report["shapes"]["tiny"]["positions_differ"] == {"1": [], "4": []}
    assert [len(b) for b in backends.values()] == [2, 2, 2]  # AT and HRT each
    assert all(b.loop_runs > 0 for b in backends["cuda-graph"] + backends["cuda-graph-fused"])
    assert all(b.loop_runs == 0 and b._graphs for b in backends["cuda-graph-stepped"])
    kernels = {engine: {b.attention_kernel for b in found} for engine, found in backends.items()}
    assert kernels == {"cuda-graph": {None}, "cuda-graph-stepped": {None}, "cuda-graph-fused": {"fused"}}
