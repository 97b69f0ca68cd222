"""What the HRT task reads and how it batches it: the training set with MixDistill's distilled
targets (:mod:`fairseq_hrt.data.mixdistill`), sources repaired and cut at
``--max-source-positions`` (:mod:`fairseq_hrt.data.source_input`) for fairseq-generate,
fairseq-interactive, validation and the hub, and every sentence batched outside training."""

import inspect

from fairseq.tasks import FairseqTask

from fairseq_hrt.cli_logging import RefusedOptions
from fairseq_hrt.data import mixdistill, source_input
from fairseq_hrt.tasks.cpu_training import refuse_fp16_without_cuda


class DataLoading:
    """fairseq's data hooks of :class:`~fairseq_hrt.tasks.hrt_translation.HRTTranslationTask`
    (placed before ``TranslationTask`` among its bases: ``super()`` is fairseq's). Reads the
    task's ``cfg``, ``p_raw`` and dictionaries; keeps ``interactive_lines_seen``."""

    interactive_lines_seen = 0  # line numbers in fairseq-interactive's warnings

    def load_dataset(self, split, epoch=1, combine=False, **kwargs):
        if split == self.cfg.train_subset:
            self.check_training_options()
        super().load_dataset(split, epoch=epoch, combine=combine, **kwargs)
        if self.cfg.distill_data and split == self.cfg.train_subset:
            self.datasets[split] = self._with_distilled_targets(split, self.datasets[split])
        elif split != self.cfg.train_subset:  # fairseq-generate's (and validation's) sources
            source_input.truncate_split(
                split, self.datasets[split], self.cfg.max_source_positions, self.source_dictionary.eos()
            )

    def check_training_options(self):
        """Options that only training reads, checked when the training set is loaded (a
        checkpoint's saved options, read again to decode, are not training's business)."""
        refuse_fp16_without_cuda(self.cfg)
        if self.cfg.p_raw is not None and not self.cfg.distill_data:
            raise RefusedOptions(
                f"--p-raw {self.cfg.p_raw} mixes raw and distilled targets, but there is no --distill-data: "
                "add --distill-data FOLDER or drop --p-raw"
            )

    def _with_distilled_targets(self, split, pair_dataset):
        """MixDistill: the split with its aligned distilled targets (:mod:`fairseq_hrt.data.mixdistill`)."""
        return mixdistill.with_distilled_targets(
            pair_dataset,
            split,
            self.cfg.distill_data,
            self.cfg.source_lang,
            self.cfg.target_lang,
            self.tgt_dict,
            self.cfg.dataset_impl,
            p_raw=self.p_raw,
            p_raw_chunked=self.cfg.p_raw_chunked,
        )

    def get_batch_iterator(self, dataset, *args, **kwargs):
        """fairseq's, except that only the training set is batched in multiples of
        ``--required-batch-size-multiple``.

        fairseq 0.12's ``batch_by_size`` drops the last batch when its size is not a multiple
        of it (8 by default): ``fairseq-generate --batch-size 1`` translated 999 of 1000 test
        sentences and other batch sizes lost up to 7 without a word. The multiple only aligns
        training batches for throughput, so generation, validation and the Python API batch
        with multiple 1 and see every sentence; training keeps fairseq's batching.
        """
        bound = inspect.signature(FairseqTask.get_batch_iterator).bind(self, dataset, *args, **kwargs)
        if dataset is not self.datasets.get(self.cfg.train_subset):
            bound.arguments["required_batch_size_multiple"] = 1
        return super().get_batch_iterator(*bound.args[1:], **bound.kwargs)

    def get_interactive_tokens_and_lengths(self, lines, encode_fn):
        """fairseq-interactive: one line that cannot be encoded never ends the session; lines are
        repaired and cut at --max-source-positions (:func:`source_input.encode_interactive_lines`)."""
        tokens = source_input.encode_interactive_lines(
            lines, self.interactive_lines_seen + 1, encode_fn, self.source_dictionary, self.cfg.max_source_positions
        )
        self.interactive_lines_seen += len(lines)
        return tokens, [t.numel() for t in tokens]

    def build_dataset_for_inference(self, src_tokens, src_lengths, constraints=None):
        """fairseq-interactive and the hub: truncate over-long sources at --max-source-positions
        (as the papers do, with L = 200) instead of failing on them."""
        source_input.truncate_inference_sources(
            src_tokens, src_lengths, self.cfg.max_source_positions, self.source_dictionary.eos()
        )
        return super().build_dataset_for_inference(src_tokens, src_lengths, constraints=constraints)
