"""benchmarks/hrt_quality.py: the stage-II oracle, length buckets, limit counting and the split of
the gap to an AT student (--skeleton-from)."""

import pytest
import torch
from fairseq.sequence_generator import SequenceGenerator

from benchmarks import hrt_quality
from fairseq_hrt.testing.tiny_runs import make_tiny_spm_data, run_cli, train_args
from tests.hrt_fixtures import build_generator, build_task_and_model, make_sample

SPECIALS = ["<s>", "<mask>"] + [f"<s{k}>" for k in range(2, 9)]
SENTENCES = [[1, 2, 3, 4, 5, 6, 7], [8, 9], [10, 11, 12, 13], [3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 14], [5]]


def test_reference_skeleton_is_every_kth_token_ending_in_eos():
    pad, eos = 1, 2
    ref = torch.tensor([10, 11, 12, 13, 14, eos])  # y1..y5 </s>
    assert hrt_quality.reference_skeletons([ref], 2, pad, eos)[0].tolist() == [11, 13, eos]
    assert hrt_quality.reference_skeletons([ref], 3, pad, eos)[0].tolist() == [12, eos]
    # N + 1 already a multiple of k: no extra </s>
    assert hrt_quality.reference_skeletons([ref[1:]], 5, pad, eos)[0].tolist() == [eos]
    assert hrt_quality.reference_skeletons([torch.tensor([eos])], 2, pad, eos)[0].tolist() == [eos]


def test_length_buckets_and_limit_hits():
    buckets = hrt_quality.length_buckets(["a " * 9, "a " * 10, "a " * 20, "a " * 21, ""])
    assert buckets == {"<10": [0, 4], "10-20": [1, 2], ">20": [3]}
    hyps = {0: torch.ones(200), 1: torch.ones(199), 2: torch.ones(12)}
    assert hrt_quality.limit_hits(hyps, 200, 1) == 1
    assert hrt_quality.limit_hits(hyps, 200, 2) == 2  # stage I stops after 100 steps of 2


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    data_dir = str(tmp_path_factory.mktemp("quality"))
    task, model = build_task_and_model(data_dir)
    return data_dir, task, model


def test_oracle_on_the_models_own_skeleton_reproduces_hrt_decoding(setup):
    """Stage II over the skeleton that stage I (Skip-AT greedy from <s_2>) produces gives
    exactly HRT k = 2 decoding: the oracle runs the model's own stage II."""
    data_dir, task, model = setup
    d = task.target_dictionary
    sample = make_sample(task, SENTENCES)
    _, gen = build_generator(data_dir, model, "--max-len-b", "24", "--decode-chunk-size", "2", "--beam", "1")
    hrt = gen.generate([model], sample)
    stage1 = SequenceGenerator([model], d, beam_size=1, max_len_b=12, tokens_to_suppress=SPECIALS).generate(
        [model], sample, bos_token=d.index("<s2>")
    )
    filled = hrt_quality.oracle_fill(model, task, sample, [h[0]["tokens"] for h in stage1], 2)
    for ours, theirs in zip(filled, hrt):
        assert torch.equal(ours, theirs[0]["tokens"])
    # stage II only fills the masks: the kept skeleton tokens are the given ones
    for f, s in zip(filled, stage1):
        n = f.numel() // 2
        assert torch.equal(f[1::2][:n], s[0]["tokens"][:n])


@pytest.fixture(scope="module")
def spm_pair(tmp_path_factory):
    """A tiny HRT (k = 2) and AT model on SentencePiece data of one dictionary, 30 updates each."""
    root = tmp_path_factory.mktemp("quality_pair")
    data = make_tiny_spm_data(root, n_train=300, n_valid=16)
    run_cli(train_args(data.bin_dir, root / "hrt", "--chunk-sizes", "2", arch="hrt_tiny", max_update=30))
    run_cli(train_args(data.bin_dir, root / "at", "--hrt-mode", "at", arch="at_tiny", max_update=30))
    return root, data


def _quality(root, data, path, *extra):
    spm = root / "spm"
    return hrt_quality.run(
        hrt_quality.parse_args(
            [
                "--data", str(data.bin_dir), "--spm", str(spm / "spm.model"),
                "--src", str(spm / "valid.en"), "--ref-pieces", str(spm / "valid.de"),
                "--raw-src", str(data.raw("valid", "en")), "--raw-ref", str(data.raw("valid", "de")),
                "--path", str(path), "--cpu", "--max-len-b", "24", *extra,
            ]
        )
    )  # fmt: skip


@pytest.mark.slow
def test_gap_to_the_at_student_splits_into_its_stages(spm_pair):
    """--skeleton-from: the AT student's greedy output (the same BLEU as that checkpoint's own
    greedy row), its skeleton filled by the HRT model's stage II; the gap to the AT student is
    stage II's part (student - fill) plus stage I's (fill - k = 2)."""
    root, data = spm_pair
    at = root / "at" / "checkpoint_last.pt"
    report = _quality(root, data, root / "hrt" / "checkpoint_last.pt", "--skeleton-from", str(at))
    alone = _quality(root, data, at)
    s = report["systems"]
    assert s["at_student_b1"]["bleu"] == pytest.approx(alone["systems"]["greedy"]["bleu"])
    assert report["at_student"] == "checkpoint_last.pt" and "at_student" in report["oracles"]
    gap = report["gap_to_at_student_b1"]
    assert gap == pytest.approx(s["at_student_b1"]["bleu"] - s["k2_b1"]["bleu"])
    split = report["stage_losses_vs_at_student_b1"]
    assert split["stage2"] == pytest.approx(s["at_student_b1"]["bleu"] - report["oracles"]["at_student"]["bleu"])
    assert split["stage1"] + split["stage2"] == pytest.approx(gap)
    # HRT k = 2 minus the AT student, with its paired-bootstrap interval over the test sentences
    paired = report["paired_bootstrap_vs_at_student_b1"]
    assert paired["difference"] == pytest.approx(-gap)
    assert paired["ci95"][0] <= paired["difference"] <= paired["ci95"][1] and paired["samples"] == 1000
    # without the option the report is as before: no student rows
    assert "at_student_b1" not in _quality(root, data, root / "hrt" / "checkpoint_last.pt")["systems"]


@pytest.mark.slow
def test_skeleton_from_refuses_an_hrt_model_another_dictionary_and_an_at_path(spm_pair, trained):
    root, data = spm_pair
    hrt = root / "hrt" / "checkpoint_last.pt"
    with pytest.raises(SystemExit, match="an HRT model; give the AT student"):
        _quality(root, data, hrt, "--skeleton-from", str(hrt))
    _, other = trained  # the tiny word-level corpus: another dictionary
    with pytest.raises(ValueError, match="checkpoint was trained with another dictionary"):
        _quality(root, data, hrt, "--skeleton-from", str(other["at_tiny"]))
    with pytest.raises(SystemExit, match="is an AT model"):
        _quality(root, data, root / "at" / "checkpoint_last.pt", "--skeleton-from", str(hrt))
