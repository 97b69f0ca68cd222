"""benchmarks/hrt_quality.py: the stage-II oracle, length buckets and limit counting."""

import pytest
import torch
from fairseq.sequence_generator import SequenceGenerator

from benchmarks import hrt_quality
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
