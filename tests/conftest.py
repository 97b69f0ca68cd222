import os

import pytest

# The tests' models are tiny: one thread per op is faster than two (thread start-up and
# barriers cost more than the work), and it keeps this process from fighting the fairseq
# commands it runs next to it on a 2-core machine. Set before anything imports torch.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import tests.tiny_data  # noqa: E402,F401  (the fork server starts every fairseq command of the tests)
from fairseq_hrt.export.exporter import export_model  # noqa: E402
from fairseq_hrt.testing.tiny_runs import make_tiny_data, run_cli, train_args  # noqa: E402
from tests.hrt_fixtures import random_tiny_models  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: end-to-end test that trains tiny models (deselect with -m 'not slow')")


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    """Tiny AT and HRT (k = 2, 3) models trained for 40 updates on the tiny corpus: their
    sentences end at different steps. ``(TinyData, {arch: checkpoint})``; the lean-engine and
    Jacobi tests share them."""
    root = tmp_path_factory.mktemp("lean_trained")
    data = make_tiny_data(root, n_train=300, n_valid=40)
    ckpts = {}
    for arch, extra in (("hrt_tiny", ["--chunk-sizes", "2,3"]), ("at_tiny", ["--hrt-mode", "at"])):
        run_cli(train_args(data.bin_dir, root / arch, *extra, arch=arch, max_update=40))
        ckpts[arch] = root / arch / "checkpoint_last.pt"
    return data, ckpts


@pytest.fixture(scope="session")
def trained_ssru(tmp_path_factory):
    """Tiny SSRU students trained for 40 updates on the tiny corpus: ``at_tiny_ssru`` (one SSRU
    layer) and ``at_tiny_ssru_tied`` (two tied SSRU layers, Marian's tied student). ``(TinyData,
    {name: checkpoint}, {name: training log})``; the SSRU and tied-layer tests share them."""
    root = tmp_path_factory.mktemp("ssru_trained")
    data = make_tiny_data(root, n_train=300, n_valid=40)
    ckpts, logs = {}, {}
    runs = {
        "at_tiny_ssru": (),
        "at_tiny_ssru_tied": ("--decoder-layers", "2", "--decoder-tie-layers"),
    }
    for name, extra in runs.items():
        out = run_cli(
            train_args(data.bin_dir, root / name, "--hrt-mode", "at", *extra, arch="at_tiny_ssru", max_update=40)
        )
        ckpts[name], logs[name] = root / name / "checkpoint_last.pt", out.stdout
    return data, ckpts, logs


@pytest.fixture(scope="session")
def exported_tiny(tmp_path_factory):
    """Untrained tiny HRT (k = 2, 3) and AT models exported in-process: ``{"hrt": folder,
    "at": folder}`` (inputs are pieces ``w0``..``w39``: no SentencePiece model). Read-only:
    a test that damages a folder copies it first. The runtime and service tests share them."""
    _, task, hrt, at = random_tiny_models(tmp_path_factory, "exported_tiny_models")
    root = tmp_path_factory.mktemp("exported_tiny")
    for name, model in (("hrt", hrt), ("at", at)):
        export_model(model, task, str(root / name), restricted=False)
    return {"hrt": str(root / "hrt"), "at": str(root / "at")}
