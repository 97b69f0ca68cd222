"""``ExportedModel(folder, memory_arena=True)``: the sessions keep ONNX Runtime's CPU memory arena
(off by default, as hrt-serve needs it) and decode exactly what the default sessions decode."""

import numpy as np
import pytest

from hrt_runtime.model import ExportedModel
from hrt_runtime.search import SearchConfig, hrt, left_to_right


def ragged_sources(model, rows: int, seed: int) -> np.ndarray:
    """Left-padded sources of different lengths ending in ``</s>``, as fairseq batches them."""
    rng = np.random.RandomState(seed)
    config = model.config
    width = 9
    src = np.full((rows, width), config["source_pad"], np.int64)
    for i in range(rows):
        n = rng.randint(2, width + 1)
        src[i, width - n :] = rng.randint(4 + 2, model.vocab_size - 2, n)
        src[i, -1] = config["source_eos"]
    return src


def test_the_arena_is_off_unless_asked_for(exported_tiny):
    default = ExportedModel(exported_tiny["at"])
    arena = ExportedModel(exported_tiny["at"], memory_arena=True)
    for graph in ("encoder", "step"):
        assert default.session(graph).get_session_options().enable_cpu_mem_arena is False
        assert arena.session(graph).get_session_options().enable_cpu_mem_arena is True


@pytest.mark.parametrize("beam", [1, 3])
def test_an_at_search_decodes_the_same_with_the_arena(exported_tiny, beam):
    default = ExportedModel(exported_tiny["at"])
    arena = ExportedModel(exported_tiny["at"], memory_arena=True)
    src = ragged_sources(default, 7, seed=beam)
    config = SearchConfig(beam=beam, max_len_a=1.2, max_len_b=5)
    banned = default.config["banned"]
    found = [left_to_right(m, m.encode(src), src.shape[1], config, banned) for m in (default, arena, arena)]
    assert_same_hypotheses(found[0], found[1])
    assert_same_hypotheses(found[0], found[2])  # the arena's reused memory, a second search


@pytest.mark.parametrize("k", [2, 3])
def test_an_hrt_search_decodes_the_same_with_the_arena(exported_tiny, k):
    default = ExportedModel(exported_tiny["hrt"])
    arena = ExportedModel(exported_tiny["hrt"], memory_arena=True)
    src = ragged_sources(default, 6, seed=k)
    config = SearchConfig(beam=1, max_len_a=1.2, max_len_b=5)
    banned = default.config["banned"]
    found = [hrt(m, m.encode(src), src.shape[1], config, k, banned) for m in (default, arena, arena)]
    assert_same_hypotheses(found[0], found[1])
    assert_same_hypotheses(found[0], found[2])


def assert_same_hypotheses(a, b):
    assert len(a) == len(b)
    for sentence_a, sentence_b in zip(a, b):
        assert len(sentence_a) == len(sentence_b)
        for x, y in zip(sentence_a, sentence_b):
            np.testing.assert_array_equal(x["tokens"], y["tokens"])
            np.testing.assert_array_equal(x["positional_scores"], y["positional_scores"])
            assert x["score"] == y["score"]
