"""What a model is comes from its class's declaration (models/kinds.py); what a decoding
option is, from one definition (generation/options.py); which strategy ``auto`` picks, from
declared priorities; what an engine or strategy does, from flags that are true."""

import dataclasses
import typing

import pytest
from fairseq.dataclass.configs import GenerationConfig
from fairseq.models.transformer import TransformerModel

from fairseq_hrt.export.exporter import check_exportable, unsupported
from fairseq_hrt.generation import strategies
from fairseq_hrt.generation.engines import ENGINES
from fairseq_hrt.generation.options import DecodingOptions, fairseq_values, search_config, task_defaults
from fairseq_hrt.generation.strategies import DECODING_STRATEGIES, DecodingStrategy, register_decoding
from fairseq_hrt.models import kinds
from fairseq_hrt.models.cmlm_transformer import CMLMTransformerModel
from fairseq_hrt.models.hrt_transformer import HRTTransformerModel
from fairseq_hrt.models.kinds import AT, FAMILIES, HRT, MASK_PREDICT, ModelFamily, declare, family_of
from fairseq_hrt.models.ssru_transformer import SSRUTransformerModel
from fairseq_hrt.passes.decoder_pass import DecoderPass
from fairseq_hrt.tasks.hrt_translation import HRTTranslationConfig
from hrt_runtime.search import SearchConfig
from tests.hrt_fixtures import build_generator, build_task_and_model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    data_dir = str(tmp_path_factory.mktemp("model_families"))
    built = {
        arch: build_task_and_model(data_dir, arch=arch, seed=5)[1] for arch in ("hrt_tiny", "at_tiny", "cmlm_tiny")
    }
    return data_dir, built


def test_every_model_class_declares_its_family():
    assert {cls: f.kind for cls, f in FAMILIES.items()} == {
        TransformerModel: AT,
        SSRUTransformerModel: AT,
        HRTTransformerModel: HRT,
        CMLMTransformerModel: MASK_PREDICT,
    }
    assert FAMILIES[SSRUTransformerModel].recurrent_decoder and not FAMILIES[SSRUTransformerModel].non_causal
    assert FAMILIES[HRTTransformerModel].chunk_sizes and FAMILIES[HRTTransformerModel].non_causal
    assert FAMILIES[CMLMTransformerModel].length_predictor and not FAMILIES[CMLMTransformerModel].left_to_right


def test_an_undeclared_model_is_refused_by_name_never_taken_for_at(models):
    data_dir, built = models
    at = built["at_tiny"]

    class MyTransformer(TransformerModel):  # a subclass may compute otherwise: it declares itself
        pass

    at.__class__ = MyTransformer
    try:
        for ask in (family_of, lambda model: family_of(model).kind):
            with pytest.raises(ValueError, match="MyTransformer is not a model family of fairseq-hrt"):
                ask(at)
        with pytest.raises(ValueError, match="MyTransformer is not a model family"):
            build_generator(data_dir, at)

        with pytest.raises(ValueError, match="cannot export this model to ONNX: .*MyTransformer is not a model family"):
            check_exportable(at)
    finally:
        at.__class__ = TransformerModel


def test_a_new_family_of_a_new_decoder_class_is_read_by_its_declaration(models, monkeypatch):
    """A new family (a declared model class) with a new decoder class: what reads a model
    reads its declaration (the criterion's decoder call, the strategies, the exporter), and
    what the planned pass and the exported graphs do not compute is refused by name: a decoder
    class outside the allow-list, a length predictor other than the one the graphs write."""
    data_dir, built = models
    cmlm = built["cmlm_tiny"]
    monkeypatch.setattr(kinds, "FAMILIES", dict(FAMILIES))  # the declarations below are this test's

    class MyDecoder(type(cmlm.decoder)):  # a subclass may compute otherwise
        pass

    @declare(ModelFamily("mask-predict", left_to_right=False, non_causal=True, length_predictor=True))
    class MyModel(CMLMTransformerModel):
        pass

    class MyLengthModel(MyModel):
        def forward_length(self, encoder_out, normalize=True):
            return super().forward_length(encoder_out, normalize)

    declare(family_of(MyModel))(MyLengthModel)
    decoder_class, model_class = cmlm.decoder.__class__, cmlm.__class__
    try:
        cmlm.__class__ = MyModel
        assert family_of(cmlm).length_predictor and strategies.pick_strategy("auto", cmlm).name == "mask-predict"
        assert unsupported(cmlm) == []
        cmlm.__class__ = MyLengthModel
        assert unsupported(cmlm) == [
            "MyLengthModel.forward_length: the exported encoder computes CMLMTransformerModel's length predictor only"
        ]
        cmlm.__class__ = MyModel
        cmlm.decoder.__class__ = MyDecoder
        assert any("decoder.(itself) (MyDecoder)" in reason for reason in unsupported(cmlm))
        with pytest.raises(ValueError, match=r"does not know the module\(s\) decoder.\(itself\) \(MyDecoder\)"):
            DecoderPass(cmlm.decoder)
    finally:
        cmlm.__class__, cmlm.decoder.__class__ = model_class, decoder_class


def test_auto_takes_the_claim_of_highest_priority_and_refuses_a_tie(models, monkeypatch):
    _, built = models
    assert [strategies.pick_strategy("auto", built[a]).name for a in ("at_tiny", "hrt_tiny", "cmlm_tiny")] == [
        "beam",
        "hrt",
        "mask-predict",
    ]
    monkeypatch.setattr(strategies, "DECODING_STRATEGIES", DECODING_STRATEGIES.copy())

    @register_decoding("also-hrt")
    class AlsoHRT(DecodingStrategy):
        priority = DECODING_STRATEGIES["hrt"].priority

        @classmethod
        def is_default_for(cls, model):
            return family_of(model).chunk_sizes

    with pytest.raises(
        ValueError, match="strategies also-hrt, hrt all claim a HRTTransformerModel with priority 1"
    ):  # by name
        strategies.pick_strategy("auto", built["hrt_tiny"])
    assert strategies.pick_strategy("auto", built["at_tiny"]).name == "beam"  # no claim on AT models
    AlsoHRT.priority = 2
    assert strategies.pick_strategy("auto", built["hrt_tiny"]) is AlsoHRT


def test_flags_are_true_only_where_true(models):
    """Jacobi decoding runs its own passes: an engine that would quantize its own graphs leaves
    the model in float, so pgj + onnxruntime + int8 would decode in float PyTorch; refused."""
    data_dir, built = models
    jacobi = DECODING_STRATEGIES["pgj"]
    assert not any(jacobi.uses_engine(e) for e in ENGINES.values())
    # Mask-Predict runs on every engine: onnxruntime's own generator, the others' backend
    assert all(DECODING_STRATEGIES["mask-predict"].uses_engine(e) for e in ENGINES.values())
    assert all(DECODING_STRATEGIES["beam"].uses_engine(e) for e in ENGINES.values())
    with pytest.raises(
        ValueError,
        match="--decoding pgj decodes the PyTorch model itself, not with --decoder-engine "
        "onnxruntime.*it would decode in float; use --decoder-engine lean --quantize int8",
    ):
        build_generator(
            data_dir,
            built["at_tiny"],
            "--decoding",
            "pgj",
            "--beam",
            "1",
            "--decoder-engine",
            "onnxruntime",
            "--quantize",
            "int8",
        )
    with pytest.raises(ValueError, match="--decoding pgj does not decode with an engine"):
        build_generator(data_dir, built["at_tiny"], "--decoding", "pgj", "--beam", "1", "--onnx-model", "/nowhere")


def test_each_decoding_option_is_defined_once():
    """The task's decoding options are DecodingOptions' fields: the same defaults, help and
    types (quantize: fairseq's ChoiceEnum of the same choices); --decoding's and
    --decoder-engine's help name every registered strategy and engine."""
    task = {f.name: f for f in dataclasses.fields(HRTTranslationConfig)}
    ours = {f.name: f for f in dataclasses.fields(DecodingOptions)}
    hints, task_hints = typing.get_type_hints(DecodingOptions), typing.get_type_hints(HRTTranslationConfig)
    assert set(task_defaults()) <= set(task)
    for name, default in task_defaults().items():
        assert task[name].default == default == ours[name].default, name
        if name not in ("decoding", "decoder_engine"):
            assert task[name].metadata["help"] == ours[name].metadata["help"], name
        if name != "quantize":
            assert task_hints[name] == hints[name], name
    assert all(f"'{n}' = " in task["decoding"].metadata["help"] for n in DECODING_STRATEGIES)
    assert all(f"'{n}' = " in task["decoder_engine"].metadata["help"] for n in ENGINES)
    assert all(s.summary for s in DECODING_STRATEGIES.values()) and all(e.summary for e in ENGINES.values())


def test_search_settings_have_fairseqs_defaults():
    fairseq = GenerationConfig()
    assert search_config(fairseq) == SearchConfig() == search_config(object())
    assert DecodingOptions.from_fairseq(None, fairseq) == DecodingOptions()
    for flag, value in fairseq_values(SearchConfig(), DecodingOptions.temperature).items():
        assert getattr(fairseq, flag) == value, flag
