"""The greedy step without its score (``step_tokens.onnx``, format version 6): the same rows as the
scored step, with no log-softmax; the translator's greedy searches use it (they return text),
the search with ``scores`` on (the ``onnxruntime`` engine, beam search) the scored step; a folder
of version 5 decodes with the scored step."""

import json
import shutil
from dataclasses import replace

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from hrt_runtime import Translator  # noqa: E402
from hrt_runtime.model import ExportedModel  # noqa: E402


def _ops(folder, graph):
    return {node.op_type for node in onnx.load(f"{folder}/{graph}", load_external_data=False).graph.node}


def _ragged_sources(model, lengths, seed=0):
    """Left-padded sources of ``lengths`` tokens (``</s>`` included), as fairseq batches them."""
    rng = np.random.default_rng(seed)
    src = np.full((len(lengths), max(lengths)), model.source_pad, np.int64)
    for row, n in enumerate(lengths):
        src[row, -n:-1] = rng.integers(4, 40, n - 1)
        src[row, -1] = model.source_eos
    return src


@pytest.mark.parametrize("kind,stride", [("at", 1), ("hrt", 1), ("hrt", 2)])
def test_the_step_without_scores_chooses_the_scored_steps_rows(exported_tiny, kind, stride):
    """Step by step over a ragged batch, under banned rows and an ``<unk>`` penalty: the same
    rows and the same keys and values; the score ``None``. Its graph has no log-softmax."""
    folder = exported_tiny[kind]
    assert "LogSoftmax" in _ops(folder, "step.onnx") and "LogSoftmax" not in _ops(folder, "step_tokens.onnx")
    model = ExportedModel(folder)
    encoded = model.encode(_ragged_sources(model, [3, 7, 5, 2, 6]))
    bias = np.zeros(model.vocab_size, np.float32)
    bias[model.config["banned"]] = -np.inf
    bias[model.unk] = -1.5
    start = model.eos if stride == 1 else model.chunk_start[stride]
    scored, unscored = (model.begin(encoded, 5, 8, start, model.rows(None)) for _ in range(2))
    prev = [np.full(5, start, np.int64)] * 2
    for step in range(6):
        score, rows = model.step(scored, prev[0], step, bias)
        none, same = model.step(unscored, prev[1], step, bias, scores=False)
        assert none is None and np.isfinite(score).all()
        assert np.array_equal(rows, same), step
        prev = [rows, same]
    assert all(np.array_equal(a, b) for a, b in zip(scored.past, unscored.past))


def _graphs_run(translator):
    """The graph names the translator's model runs, recorded."""
    ran = []
    runner = translator.model.runner

    def recording(graph):
        ran.append(graph)
        return runner(graph)

    translator.model.runner = recording
    return ran


@pytest.mark.parametrize("kind,chunk_size", [("at", 1), ("hrt", 2)])
def test_translations_read_no_scores_and_decode_the_scored_tokens(exported_tiny, kind, chunk_size):
    """The translator returns text, so its greedy steps run without scores: the same
    hypotheses' tokens as the search with scores, their scores NaN. Beam search keeps the
    scored step (it ranks by the scores)."""
    translator = Translator(exported_tiny[kind])
    ran = _graphs_run(translator)
    lines = ["w1 w2 w3", "w4 w5 w6 w7 w8", "w9", "w10 w11 w12 w13", "w14 w15"]  # more rows than the loop's
    options = translator.options(beam=1, chunk_size=chunk_size, max_len_b=12)
    assert options.search.scores is False
    sources = [translator.encode(line) for line in lines]
    without = translator.search(sources, options.search, chunk_size)
    assert "step_tokens" in ran and "step" not in ran
    ran.clear()
    scored = translator.search(sources, replace(options.search, scores=True), chunk_size)
    assert "step" in ran and "step_tokens" not in ran
    assert [h[0]["tokens"].tolist() for h in without] == [h[0]["tokens"].tolist() for h in scored]
    if chunk_size == 1:  # stage II scores the filled slots; stage I's part of them is missing
        assert all(np.isnan(h[0]["score"]) for h in without) and all(np.isfinite(h[0]["score"]) for h in scored)
    ran.clear()
    translator.translate(lines, beam=2, chunk_size=chunk_size, max_len_b=12)
    assert "step_top" in ran and "step_tokens" not in ran


def test_a_folder_of_version_5_decodes_with_the_scored_step(exported_tiny, tmp_path):
    """Exported before the step without scores: the same translations, from step.onnx."""
    folder = tmp_path / "version-5"
    shutil.copytree(exported_tiny["at"], folder)
    (folder / "step_tokens.onnx").unlink()
    config = json.loads((folder / "config.json").read_text())
    del config["graphs"]["step_tokens"], config["files"]["step_tokens.onnx"]
    (folder / "config.json").write_text(json.dumps({**config, "version": 5}))
    lines = ["w1 w2 w3", "w4 w5 w6 w7 w8", "w9", "w10 w11 w12 w13", "w14 w15"]
    previous = Translator(str(folder))
    ran = _graphs_run(previous)
    assert previous.translate(lines, beam=1) == Translator(exported_tiny["at"]).translate(lines, beam=1)
    assert "step" in ran and "step_tokens" not in ran
