"""Python API: fairseq's hub interface for this plugin's models.

fairseq users translate from Python with ``from_pretrained(...).translate(...)``
(:mod:`fairseq.hub_utils`). The same works here, with the plugin's decoding options as
arguments::

    from fairseq_hrt import from_pretrained

    hrt = from_pretrained("work/quickstart/checkpoints",
                          data_name_or_path="work/multi30k-sp4000/data-bin",
                          sentencepiece_model="work/multi30k-sp4000/spm/spm.model")
    hrt.translate(["A man is riding a bike."], chunk_size=2, beam=1)   # HRT k = 2
    hrt.translate("Two dogs play in the snow.", chunk_size=1, beam=5)  # AT mode, beam 5

Raw text in, raw text out: SentencePiece encodes the input and decodes the output. Empty
strings give empty translations and over-long inputs are truncated at
``--max-source-positions`` with a warning, as in ``fairseq-interactive`` (both done by the task,
so the API and the command line cannot differ).
"""

import copy
import difflib
import json
import logging
import os
from collections import OrderedDict
from typing import Dict, List, Optional, Union

import torch
from fairseq import hub_utils, utils
from omegaconf import OmegaConf, open_dict

from fairseq_hrt import compat
from fairseq_hrt.cli_logging import RefusedOptions
from fairseq_hrt.generation.options import task_defaults
from fairseq_hrt.symbols import find_sentencepiece_model
from hrt_runtime.text_input import check_sentences, repair_lines

logger = logging.getLogger(__name__)

USER_DIR = os.path.dirname(os.path.abspath(__file__))
GENERATORS_KEPT = 8  # the generators a hub keeps, the most recently used


def _dictionary_folder(model_dir: str, data_name_or_path: Optional[str]) -> str:
    """The folder with the dictionaries: ``data_name_or_path`` as given (or relative to
    ``model_dir``, as fairseq's hub reads it), else ``model_dir``."""
    wanted = data_name_or_path or model_dir
    for folder in (wanted, os.path.join(model_dir, wanted)):
        if os.path.isdir(folder) and any(n.startswith("dict.") and n.endswith(".txt") for n in os.listdir(folder)):
            return os.path.abspath(folder)
    raise FileNotFoundError(
        f"no dictionary (dict.<lang>.txt) in {wanted}: pass data_name_or_path= the "
        "data-bin folder the model was trained on (fairseq-train saves checkpoints only)"
    )


def _check_checkpoint_folder(model_dir, checkpoint_file: str):
    """``model_dir`` must be a folder holding ``checkpoint_file`` (several joined by ``:`` for an
    ensemble, as in fairseq); say so, and what the folder holds, instead of fairseq's errors."""
    if not isinstance(model_dir, (str, os.PathLike)):
        raise TypeError(f"from_pretrained: model_dir must be a folder path (str), got {type(model_dir).__name__}")
    model_dir = os.fspath(model_dir)
    if not os.path.isdir(model_dir):
        raise FileNotFoundError(
            f"from_pretrained: model folder {model_dir!r} does not exist (expected the folder of a trained "
            f"checkpoint, fairseq-train's --save-dir, holding {checkpoint_file})"
        )
    missing = [
        name for name in str(checkpoint_file).split(os.pathsep) if not os.path.isfile(os.path.join(model_dir, name))
    ]
    if missing:
        found = sorted(n for n in os.listdir(model_dir) if n.endswith(".pt"))
        raise FileNotFoundError(
            f"from_pretrained: no checkpoint file {', '.join(missing)} in the model folder {model_dir!r} "
            f"(expected fairseq-train's --save-dir with a checkpoint in it); "
            + (
                f"checkpoints there: {', '.join(found)} (choose one with checkpoint_file=)"
                if found
                else "it holds no *.pt checkpoint"
            )
        )


def from_pretrained(
    model_dir: str,
    checkpoint_file: str = "checkpoint_last.pt",
    data_name_or_path: Optional[str] = None,
    sentencepiece_model: Optional[str] = None,
    **overrides,
) -> "HRTHubInterface":
    """Load a checkpoint of this plugin (HRT, AT or Mask-Predict) for translation.

    ``model_dir``: the folder of the checkpoint (fairseq-train's ``--save-dir``);
    ``data_name_or_path``: the data-bin folder with the dictionaries (default: ``model_dir``);
    ``sentencepiece_model``: the SentencePiece model of the data (default: found beside the
    data, see :func:`find_sentencepiece_model`; without one, input and output are pieces as
    in the data-bin, e.g. for pre-tokenised data). Further keywords override the checkpoint's
    options as in fairseq (e.g. ``max_source_positions=64``, ``quantize="int8"``: dynamic int8
    quantization when the model is loaded).
    """
    _check_checkpoint_folder(model_dir, checkpoint_file)
    checkpoints = [os.path.join(model_dir, name) for name in str(checkpoint_file).split(os.pathsep)]
    compat.refuse_unsafe_checkpoint(checkpoints, "from_pretrained:")  # before fairseq unpickles them
    data = _dictionary_folder(model_dir, data_name_or_path)
    spm = sentencepiece_model or find_sentencepiece_model(data, model_dir)
    if sentencepiece_model and not os.path.isfile(sentencepiece_model):
        raise FileNotFoundError(f"sentencepiece_model {sentencepiece_model}: no such file")
    if spm:
        overrides.update(bpe="sentencepiece", sentencepiece_model=os.path.abspath(spm))
    else:
        logger.info("no SentencePiece model found beside %s: input and output are taken as pieces", data)
    loaded = hub_utils.from_pretrained(
        model_dir, checkpoint_file=checkpoint_file, data_name_or_path=data, user_dir=USER_DIR, **overrides
    )
    if loaded["task"].__class__.__name__ != "HRTTranslationTask":
        raise RefusedOptions(f"{checkpoint_file} was not trained with --task hrt_translation")
    return HRTHubInterface(loaded["args"], loaded["task"], loaded["models"])


class HRTHubInterface(hub_utils.GeneratorHubInterface):
    """fairseq's ``GeneratorHubInterface`` with the plugin's decoding options per call; a
    generator is built once per model and options (fairseq's hub builds one per call)."""

    def __init__(self, cfg, task, models):
        super().__init__(cfg, task, models)
        self._generators: "OrderedDict[tuple, object]" = OrderedDict()  # see generator()

    def translate(
        self,
        sentences: Union[str, List[str]],
        chunk_size: Optional[Union[int, str]] = None,
        beam: int = 1,
        batch_size: Optional[int] = None,
        b_nat: Optional[int] = None,
        decoding: Optional[str] = None,
        engine: Optional[str] = None,
        verbose: bool = False,
        **generation_options,
    ) -> Union[str, List[str]]:
        """Translate raw sentences (one string or a list) and return detokenised strings.

        ``chunk_size``: HRT's k (1 = AT mode, ``'auto-trained'`` / ``'by-length'`` as
        ``--decode-chunk-size``; default: the checkpoint's setting); ``beam`` (= b_at for HRT),
        ``b_nat``, ``decoding`` (``--decoding``: auto, beam, hrt, mask-predict, ...),
        ``engine`` (``--decoder-engine``: lean, fairseq, onnxruntime, ...), ``batch_size`` (sentences per
        batch). Other keywords are fairseq generation options (``max_len_a``, ``iter_decode_max_iter``, ...).
        """
        check_sentences(sentences)
        self._check_option_names(generation_options)
        # repaired as every entry point repairs input (NUL removed, control characters to
        # spaces, lone surrogates to U+FFFD), with the same warning naming the line
        if isinstance(sentences, str):
            sentences = list(repair_lines([sentences]))[0]
        else:
            sentences = list(repair_lines(sentences))
        # decoding options of this call: they travel with fairseq's generation options (the
        # hub copies its keywords there) into DecodingOptions; the task's configuration is
        # never changed
        call_options = {
            "decode_chunk_size": None if chunk_size is None else str(chunk_size),
            "b_nat": b_nat,
            "decoding": decoding,
            "decoder_engine": engine,
        }
        generation_options.update({k: v for k, v in call_options.items() if v is not None})
        if "quantize" in generation_options and generation_options["quantize"] != str(self.task.cfg.quantize):
            raise RefusedOptions(
                "quantize is applied when the model is loaded: pass it to from_pretrained(..., quantize=...)"
            )
        if batch_size is not None and batch_size < 1:
            raise RefusedOptions(f"batch_size must be >= 1, got {batch_size}")
        return self.sample(sentences, beam=beam, verbose=verbose, batch_size=batch_size, **generation_options)

    # fairseq's hub.generate() takes these besides the generation options
    HUB_GENERATE_OPTIONS = ("skip_invalid_size_inputs", "inference_step_args", "prefix_allowed_tokens_fn")

    def _check_option_names(self, options: Dict[str, object]):
        """A keyword that is neither a decoding option nor fairseq's is a mistake (fairseq's hub
        would set it and nothing would read it): refused by name, as Python refuses one."""
        known = {*self.cfg.generation.keys(), *task_defaults(), *self.HUB_GENERATE_OPTIONS}
        unknown = sorted(set(options) - known)
        if unknown:
            close = difflib.get_close_matches(unknown[0], [*known, "chunk_size", "b_nat", "engine", "decoding"], 1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise TypeError(f"translate() got unexpected keyword argument(s) {', '.join(map(repr, unknown))}{hint}")

    def generate(
        self,
        tokenized_sentences: List[torch.LongTensor],
        beam: int = 5,
        verbose: bool = False,
        skip_invalid_size_inputs: bool = False,
        inference_step_args=None,
        prefix_allowed_tokens_fn=None,
        batch_size: Optional[int] = None,
        **kwargs,
    ) -> List[List[Dict[str, torch.Tensor]]]:
        """fairseq's ``generate``, with the generator of these options built once
        (:meth:`generator`) and ``batch_size`` sentences a batch (default: the hub's setting)."""
        if torch.is_tensor(tokenized_sentences) and tokenized_sentences.dim() == 1:
            return self.generate(
                tokenized_sentences.unsqueeze(0),
                beam=beam,
                verbose=verbose,
                skip_invalid_size_inputs=skip_invalid_size_inputs,
                inference_step_args=inference_step_args,
                prefix_allowed_tokens_fn=prefix_allowed_tokens_fn,
                batch_size=batch_size,
                **kwargs,
            )[0]
        generator = self.generator(beam, kwargs, prefix_allowed_tokens_fn)
        results = []
        for batch in self._batches(tokenized_sentences, skip_invalid_size_inputs, batch_size):
            batch = utils.apply_to_sample(lambda t: t.to(self.device), batch)
            translations = self.task.inference_step(generator, self.models, batch, **(inference_step_args or {}))
            results.extend(zip(batch["id"].tolist(), translations))
        outputs = [hypos for _, hypos in sorted(results, key=lambda x: x[0])]
        if verbose:
            for source_tokens, hypos in zip(tokenized_sentences, outputs):
                logger.info("S\t%s", self.string(source_tokens))
                for hypo in hypos:
                    logger.info("H\t%s\t%s", hypo["score"], self.decode(hypo["tokens"]))
                    logger.info("P\t%s", " ".join(f"{x:.4f}" for x in hypo["positional_scores"].tolist()))
        return outputs

    def generator(self, beam: int, options: Dict[str, object], prefix_allowed_tokens_fn=None):
        """The task's generator of the hub's generation options with ``beam`` and ``options``
        (fairseq's names), built once per options and the models' device and precision: an
        engine's set-up (an ``onnxruntime`` engine hashes the parameters and opens its sessions)
        is paid on the first call, not on every call. The :data:`GENERATORS_KEPT` most recently
        used are kept."""
        weight = next(self.models[0].parameters())
        key = (
            json.dumps(OmegaConf.to_container(self.cfg.generation, resolve=True), sort_keys=True, default=repr),
            beam,
            json.dumps(options, sort_keys=True, default=repr),
            str(weight.device),
            str(weight.dtype),
        )
        if prefix_allowed_tokens_fn is None and key in self._generators:
            self._generators.move_to_end(key)
            return self._generators[key]
        gen_args = copy.deepcopy(self.cfg.generation)
        with open_dict(gen_args):
            gen_args.beam = beam
            for name, value in options.items():
                setattr(gen_args, name, value)
        if prefix_allowed_tokens_fn is not None:  # a function: built for this call
            return self.task.build_generator(self.models, gen_args, prefix_allowed_tokens_fn=prefix_allowed_tokens_fn)
        found = self._generators[key] = self.task.build_generator(self.models, gen_args)
        while len(self._generators) > GENERATORS_KEPT:  # an engine's generator may hold sessions: the oldest go
            self._generators.popitem(last=False)
        return found

    def _batches(self, tokens, skip_invalid_size_inputs: bool, batch_size: Optional[int]):
        """fairseq's ``_build_batches`` with this call's batch size (default: the hub's)."""
        lengths = torch.LongTensor([t.numel() for t in tokens])
        return self.task.get_batch_iterator(
            dataset=self.task.build_dataset_for_inference(tokens, lengths),
            max_tokens=self.cfg.dataset.max_tokens,
            max_sentences=batch_size or self.cfg.dataset.batch_size,
            max_positions=self.max_positions,
            ignore_invalid_inputs=skip_invalid_size_inputs,
            disable_iterator_cache=True,
        ).next_epoch_itr(shuffle=False)
