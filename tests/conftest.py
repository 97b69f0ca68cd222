import os

import pytest

# The tests' models are tiny: one thread per op is faster than two (thread start-up and
# barriers cost more than the work), and it keeps this process from fighting the fairseq
# commands it runs next to it on a 2-core machine. Set before anything imports torch.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: end-to-end test that trains tiny models (deselect with -m 'not slow')")


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    """Tiny AT and HRT (k = 2, 3) models trained for 40 updates on the tiny corpus: their
    sentences end at different steps. ``(TinyData, {arch: checkpoint})``; the lean-engine and
    Jacobi tests share them."""
    from tests.tiny_data import make_tiny_data, run_cli, train_args

    root = tmp_path_factory.mktemp("lean_trained")
    data = make_tiny_data(root, n_train=300, n_valid=40)
    ckpts = {}
    for arch, extra in (("hrt_tiny", ["--chunk-sizes", "2,3"]), ("at_tiny", ["--hrt-mode", "at"])):
        run_cli(train_args(data.bin_dir, root / arch, *extra, arch=arch, max_update=40))
        ckpts[arch] = root / arch / "checkpoint_last.pt"
    return data, ckpts
