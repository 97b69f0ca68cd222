"""The backend contract of the one search (:mod:`hrt_runtime.backend`) is what the three
backends implement: ``ExportedModel`` (and ``StoppableBackend`` around it), the lean engine's
``TorchBackend`` and the cuda-graph engine's ``CudaGraphBackend``, and their rows. Not only
``isinstance`` of a ``runtime_checkable`` protocol (names only): every member of the protocol is
there, and every method has the protocol's parameters, by name, in order, with its defaults."""

import inspect
import re
from pathlib import Path
from typing import Dict, List, Set, Tuple

import numpy as np
import pytest

from fairseq_hrt.generation.cuda_graph import CudaGraphBackend
from fairseq_hrt.generation.lean import TorchBackend
from hrt_runtime import search
from hrt_runtime.backend import Backend, Rows, SourceBackend
from hrt_runtime.model import ExportedModel
from hrt_runtime.work import StoppableBackend
from tests.hrt_fixtures import build_task_and_model


class EagerGraphBackend(CudaGraphBackend):
    captures = False  # the graphs' bodies run as they are, on any device (as in tests/test_cuda_graph.py)


def members(protocol) -> Tuple[Set[str], Dict[str, List[inspect.Parameter]]]:
    """The data members and the methods (their parameters but ``self``) of a protocol, its
    protocol bases' included."""
    data, methods = set(), {}
    for klass in reversed(protocol.__mro__):
        if not getattr(klass, "_is_protocol", False) or klass.__module__ == "typing":
            continue
        data |= set(vars(klass).get("__annotations__", {}))
        for name, value in vars(klass).items():
            if inspect.isfunction(value) and not name.startswith("_"):
                methods[name] = list(inspect.signature(value).parameters.values())[1:]
    return data, methods


def assert_satisfies(obj, protocol):
    data, methods = members(protocol)
    name = type(obj).__name__
    missing = sorted(m for m in data | set(methods) if not hasattr(obj, m))
    assert missing == [], f"{name} lacks {missing} of {protocol.__name__}"
    assert isinstance(obj, protocol), name
    for method, expected in methods.items():
        found = list(inspect.signature(getattr(obj, method)).parameters.values())  # bound: no self
        assert [p.name for p in found] == [p.name for p in expected], f"{name}.{method}"
        assert [p.kind for p in found] == [p.kind for p in expected], f"{name}.{method}"
        assert [p.default for p in found] == [p.default for p in expected], f"{name}.{method}"


@pytest.fixture(scope="module")
def torch_backends(tmp_path_factory):
    task, model = build_task_and_model(str(tmp_path_factory.mktemp("backend_contract")), arch="hrt_tiny")
    made = [
        backend_class(model, task.target_dictionary, task.chunk_start_idx, task.mask_idx)
        for backend_class in (TorchBackend, EagerGraphBackend)
    ]
    return made, task


def test_the_protocols_name_what_the_search_reads():
    """Every ``model.X`` and ``rows.X`` the search reads is a member of the contract."""
    source = Path(search.__file__).read_text()
    data, methods = members(Backend)
    used = set(re.findall(r"(?<![\w.])model\.(\w+)", source))
    assert used <= data | methods.keys(), used - (data | methods.keys())
    rows_data, rows_methods = members(Rows)
    assert set(re.findall(r"(?<![\w.])rows\.(\w+)", source)) <= rows_data | rows_methods.keys()
    assert {"pad", "eos", "unk", "bos", "mask", "vocab_size", "max_target_positions", "chunk_start"} <= data
    assert {"rows", "stride_of", "begin", "step", "reorder", "greedy_loop", "parallel"} <= methods.keys()
    assert set(members(SourceBackend)[1]) == set(methods) | {"encode"}


def test_the_torch_backends_satisfy_the_contract(torch_backends):
    made, task = torch_backends
    for backend in made:
        assert_satisfies(backend, Backend)
        assert_satisfies(backend.rows(None), Rows)
        assert_satisfies(backend.rows(np.array([task.target_dictionary.eos(), 7], np.int64)), Rows)


def test_the_exported_model_and_its_stoppable_wrapper_satisfy_the_contract(exported_tiny):
    model = ExportedModel(exported_tiny["hrt"])
    for backend in (model, StoppableBackend(model, lambda: False)):
        assert_satisfies(backend, SourceBackend)
        assert_satisfies(backend.rows(None), Rows)
        assert_satisfies(backend.rows(np.array([model.eos, 7], np.int64)), Rows)


def test_a_missing_member_or_a_renamed_parameter_is_seen(torch_backends):
    made, _ = torch_backends

    class Renamed(TorchBackend):
        def parallel(self, encoded, tokens, positions, queries, select, logit_bias, rows):  # not out_rows
            return super().parallel(encoded, tokens, positions, queries, select, logit_bias, rows)

    renamed = Renamed.__new__(Renamed)
    renamed.__dict__.update(made[0].__dict__)
    with pytest.raises(AssertionError, match="Renamed.parallel"):
        assert_satisfies(renamed, Backend)
    del renamed.__dict__["max_target_positions"]
    with pytest.raises(AssertionError, match="max_target_positions"):
        assert_satisfies(renamed, Backend)
