"""The folder a runtime serves is fixed when it is opened (issue 88, item 4).

A re-export into the folder of a running ``Translator`` (what ``hrt-translate`` and ``hrt-serve``
hold) once gave, for options needing graphs not used before (beam 5, chunk 1), lines of neither
model. Now every file is opened and checked at start and read from those handles only:

* a re-export by ``fairseq-hrt-export`` (files renamed in) changes nothing the running
  translator decodes: every option gives the first model's output, while a new one gives the
  second model's;
* files written over in place are refused in one message (503 in ``hrt-serve``), never mixed;
* a FIFO or a link to ``/dev/zero`` in a file's place is named for what it is, not "missing".
"""

import json
import os
import re
import shutil

import pytest

pytest.importorskip("onnxruntime")

from fairseq_hrt.export.exporter import export_model  # noqa: E402
from hrt_runtime import Translator  # noqa: E402
from hrt_runtime.errors import Refused  # noqa: E402
from hrt_runtime.integrity import DamagedFolderError, FolderChanged, FolderFiles  # noqa: E402
from hrt_runtime.model import read_config  # noqa: E402
from tests.hrt_fixtures import build_task_and_model, random_tiny_models  # noqa: E402

LINES = ["w1 w2 w3", "w4 w5 w6 w7 w8", "w9 w2", "w3 w3 w7 w1 w5 w6"]
# beam 1 is what the running translator has decoded before the re-export; the others need graphs
# it had not made a session of yet (the top-k step, the non-causal pass)
LATER = ({"beam": 5, "chunk_size": 1}, {"beam": 5}, {"beam": 2, "chunk_size": 3})


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two untrained tiny HRT models of one dictionary and their exports: ``(task, first,
    second, first folder, second folder)``."""
    data_dir, task, first, _ = random_tiny_models(tmp_path_factory, "folder_fixed")
    _, second = build_task_and_model(data_dir, arch="hrt_tiny", seed=5)
    root = tmp_path_factory.mktemp("folder_fixed_onnx")
    for name, model in (("first", first), ("second", second)):
        export_model(model, task, str(root / name), restricted=False)
    return task, first, second, str(root / "first"), str(root / "second")


def _outputs(translator):
    return [translator.translate(LINES, max_len_b=6, **options) for options in LATER]


def _hash(folder):
    with open(os.path.join(folder, "config.json")) as f:
        return json.load(f)["parameters_sha256"]


def test_a_re_export_into_the_folder_changes_nothing_a_running_translator_decodes(models, tmp_path):
    task, _, second, first_folder, second_folder = models
    want_first, want_second = _outputs(Translator(first_folder)), _outputs(Translator(second_folder))
    assert all(a != b for a, b in zip(want_first, want_second))  # else the test could not tell them apart
    served = str(tmp_path / "served")
    shutil.copytree(first_folder, served)
    running = Translator(served)
    running.translate(LINES, beam=1, max_len_b=6)
    export_model(second, task, served, restricted=False)  # the real exporter: files renamed in
    assert _hash(served) == _hash(second_folder) != _hash(first_folder)
    assert _outputs(running) == want_first
    assert running.model.config["parameters_sha256"] == _hash(first_folder)
    assert _outputs(Translator(served)) == want_second  # a restart serves the new export


def _written_over(first_folder, second_folder, served):
    """``first_folder`` copied to ``served``, a translator opened on it, then ``second_folder``'s
    files copied over it in place (as ``cp`` does: the same files, new bytes)."""
    shutil.copytree(first_folder, served)
    running = Translator(served)
    want = running.translate(LINES, beam=1, max_len_b=6)
    for name in os.listdir(second_folder):
        shutil.copyfile(os.path.join(second_folder, name), os.path.join(served, name))
    return running, want


CHANGED = r"served: weights.bin was written over since the folder was opened \(it is not the file checked then\)"


def test_a_folder_written_over_in_place_is_refused_never_mixed(models, tmp_path):
    running, want = _written_over(models[3], models[4], str(tmp_path / "served"))
    with pytest.raises(Refused, match=CHANGED) as e:  # hrt-translate's one line, exit 2
        running.translate(LINES, beam=5, chunk_size=1, max_len_b=6)
    assert "\n" not in str(e.value)
    with pytest.raises(FolderChanged, match=CHANGED):  # the service's call: the type kept for its 503
        running.translate_sources(running.encode_lines(LINES, None), running.options(beam=2, chunk_size=1), name=None)
    assert running.translate(LINES, beam=1, max_len_b=6) == want  # its sessions made at start still serve


def test_the_service_answers_503_for_a_folder_written_over_and_info_keeps_the_served_hash(models, tmp_path):
    pytest.importorskip("aiohttp")
    from tests.test_serve import Server, get, post  # noqa: PLC0415 - needs aiohttp

    running, want = _written_over(models[3], models[4], str(tmp_path / "served"))
    server = Server(running)
    try:
        assert post(server.url, {"text": LINES, "beam": 1, "max_len_b": 6}) == (200, {"translations": want})
        status, answer = post(server.url, {"text": LINES, "beam": 5, "chunk_size": 1, "max_len_b": 6})
        assert status == 503 and re.search(CHANGED, answer["error"])
        info = get(server.url, "/info")
        assert info["parameters_sha256"] == _hash(models[3]) != _hash(str(tmp_path / "served"))
        assert info["folder"] == "served"
    finally:
        server.close()


@pytest.mark.parametrize("odd", ["fifo", "dev_zero"])
def test_a_weights_file_that_is_not_a_regular_file_is_named_for_what_it_is(models, tmp_path, odd):
    folder = str(tmp_path / "odd")
    shutil.copytree(models[3], folder)
    weights = os.path.join(folder, "weights.bin")
    os.unlink(weights)
    if odd == "fifo":
        os.mkfifo(weights)
        said = r"weights.bin is a FIFO, not a regular file"
    else:
        os.symlink("/dev/zero", weights)
        said = r"weights.bin is a link to /dev/zero, a character device, not a regular file"
    with pytest.raises(Refused, match=rf"odd: {said}; copy the whole folder again, or export again$") as e:
        Translator(folder)
    assert "missing" not in str(e.value) and "\n" not in str(e.value)


def test_a_file_renamed_in_between_the_check_and_the_open_is_refused(models, tmp_path):
    folder = str(tmp_path / "swapped")
    shutil.copytree(models[3], folder)
    config = read_config(folder)  # checked through the paths
    os.replace(os.path.join(models[4], "weights.bin"), os.path.join(folder, "weights.bin"))
    shutil.copyfile(os.path.join(folder, "weights.bin"), os.path.join(models[4], "weights.bin"))
    with pytest.raises(DamagedFolderError, match=r"swapped: weights.bin changed while the folder was opened"):
        FolderFiles(folder, config)  # what is served is checked through the handles it is read from
