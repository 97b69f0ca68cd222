"""How the HRT task decodes: the generator of ``--decoding`` / ``--decoder-engine`` /
``--shortlist`` / ... (:func:`fairseq_hrt.generation.strategies.build_generator`), the
``--eval-bleu`` validation generator, ``--quantize`` applied before a model's first generator
(:mod:`fairseq_hrt.tasks.deferred_quantization`), the ``--shortlist`` read once
(:mod:`fairseq_hrt.shortlist`), and empty sources translated without decoding.

The strategies and engines are imported when a generator of theirs is built (their registries
name the modules), not when the plugin is: training without ``--eval-bleu`` loads none."""

import json
from argparse import Namespace
from typing import Optional

import torch
from fairseq.data import encoders

from fairseq_hrt import shortlist as shortlists
from fairseq_hrt.generation import hypotheses, strategies
from fairseq_hrt.generation.options import DecodingOptions


class GeneratorBuilding:
    """fairseq's decoding hooks of :class:`~fairseq_hrt.tasks.hrt_translation.HRTTranslationTask`
    (placed before ``TranslationTask`` among its bases: ``super()`` is fairseq's). Reads the
    task's ``cfg``, dictionaries and ``deferred_quantization``."""

    def build_validation_generator(self, model):
        """TranslationTask.build_model's validation generator (fairseq-train --eval-bleu), built
        once an HRT model knows its chunk sizes, so that it validates with HRT decoding."""
        detok_args = json.loads(self.cfg.eval_bleu_detok_args)
        self.tokenizer = encoders.build_tokenizer(Namespace(tokenizer=self.cfg.eval_bleu_detok, **detok_args))
        self.sequence_generator = self.build_generator([model], Namespace(**json.loads(self.cfg.eval_bleu_args)))

    def build_generator(self, models, args, seq_gen_cls=None, extra_gen_cls_kwargs=None, **kwargs):
        """The generator of ``--decoding`` / ``--decoder-engine`` / ``--shortlist`` / ...: the
        task's options with the per-call ones of ``args`` (:class:`DecodingOptions`), built by
        :func:`fairseq_hrt.generation.strategies.build_generator`."""
        options = DecodingOptions.from_fairseq(self.cfg, args)
        if kwargs.get("prefix_allowed_tokens_fn") is not None:  # fairseq's hub passes it beside args
            options = options.replace(
                sequence_generator_only=(*options.sequence_generator_only, "--prefix-allowed-tokens-fn")
            )
        return self.build_decoding(models, options, self.fairseq_generator(seq_gen_cls, extra_gen_cls_kwargs, **kwargs))

    def fairseq_generator(self, seq_gen_cls=None, extra_gen_cls_kwargs=None, **kwargs):
        """fairseq's own ``build_generator`` (``SequenceGenerator``), as the strategies call it:
        ``(models, args, seq_gen_cls=..., extra_gen_cls_kwargs=...)``, the given values the defaults."""

        def build(models, args, seq_gen_cls=seq_gen_cls, extra_gen_cls_kwargs=extra_gen_cls_kwargs):
            return super(GeneratorBuilding, self).build_generator(
                models, args, seq_gen_cls, extra_gen_cls_kwargs, **kwargs
            )

        return build

    def build_decoding(self, models, options: DecodingOptions, fairseq_generator=None):
        """The generator of ``options`` for ``models`` (loaded for decoding). A model this task
        loaded from a checkpoint under ``--quantize int8`` is quantized here, once, before its
        first generator (:mod:`fairseq_hrt.tasks.deferred_quantization`)."""
        self.deferred_quantization.before_decoding(models)
        return strategies.build_generator(
            self,
            models,
            options,
            fairseq_generator or self.fairseq_generator(),
            shortlist=self.load_shortlist(options.shortlist),
        )

    def prepare_models_for_decoding(self, models):
        """What loading for decoding does to the models (``--quantize``), for models built
        elsewhere (those this task loads from a checkpoint are prepared by :meth:`build_decoding`)."""
        for model in models:
            self.deferred_quantization.prepare(model)
        return models

    def load_shortlist(self, path: Optional[str] = None):
        """The :class:`~fairseq_hrt.shortlist.Shortlist` of ``path`` (default ``--shortlist``;
        ``None`` without one), checked against this task's dictionaries; read once per path."""
        path = path if path is not None else getattr(self.cfg, "shortlist", None)
        if not path:
            return None
        cached = getattr(self, "_shortlist", None)
        if cached is not None and cached[0] == path:
            return cached[1]
        shortlist = shortlists.load_for_decoding(
            path, self.source_dictionary, self.target_dictionary, self.dictionary_fingerprint(), self.cfg.data
        )
        self._shortlist = (path, shortlist)
        return shortlist

    def inference_step(self, generator, models, sample, prefix_tokens=None, constraints=None):
        """Empty source sentences (only </s>) get an empty translation without decoding."""
        src = sample["net_input"]["src_tokens"]
        empty = src.ne(self.source_dictionary.pad()).long().sum(dim=1) <= 1
        if not empty.any():
            return super().inference_step(generator, models, sample, prefix_tokens, constraints)
        results = [None] * src.size(0)
        eos = self.target_dictionary.eos()
        for i in empty.nonzero().view(-1).tolist():
            results[i] = [hypotheses.hypothesis(src.new_tensor([eos]), torch.tensor(0.0), torch.zeros(1))]
        rest = (~empty).nonzero().view(-1).tolist()
        if rest:
            sub = hypotheses.select_rows(sample, rest)
            sub_prefix = prefix_tokens[rest] if prefix_tokens is not None else None
            sub_constraints = constraints[rest] if constraints is not None else None
            for i, hypos in zip(rest, super().inference_step(generator, models, sub, sub_prefix, sub_constraints)):
                results[i] = hypos
        return results
