"""What the HRT task saves with a checkpoint and checks when fairseq-train resumes one: the
dictionaries' fingerprint and the curriculum's schedule (:mod:`fairseq_hrt.checkpoint_checks`),
and a truncated checkpoint refused before fairseq-train restores it
(:mod:`fairseq_hrt.checkpoint_files`)."""

from typing import Optional

from fairseq_hrt import checkpoint_checks, checkpoint_files, compat


class CheckpointState:
    """fairseq's checkpoint hooks of :class:`~fairseq_hrt.tasks.hrt_translation.HRTTranslationTask`
    (placed before ``TranslationTask`` among its bases: ``super()`` is fairseq's). Reads the
    task's ``cfg``, ``chunk_sizes`` and dictionaries."""

    def dictionary_fingerprint(self) -> str:
        """CRC32 of the source and target symbols in order (:func:`symbols.dictionary_fingerprint`):
        two data directories binarized with different dictionaries (even of the same size) differ here."""
        return checkpoint_checks.dictionary_fingerprint(self.source_dictionary, self.target_dictionary)

    def _schedule(self) -> dict:
        return checkpoint_checks.curriculum_schedule(
            self.cfg.hrt_mode,
            self.chunk_sizes,
            self.cfg.curriculum_updates,
            self.cfg.max_update,
            self.cfg.curriculum_lambda,
        )

    def get_checkpoint_dict(self):
        """Saved with every checkpoint (fairseq's task-state hook): the dictionary fingerprint
        and the curriculum's schedule. The curriculum position itself is the trainer's update
        count, which the checkpoint restores, so p_k continues where it was."""
        return {type(self).__name__: {"dictionary": self.dictionary_fingerprint(), **self._schedule()}}

    @classmethod
    def saved_dictionary_fingerprint(cls, checkpoint: dict) -> Optional[str]:
        """The fingerprint :meth:`get_checkpoint_dict` stored in a loaded checkpoint (``None`` for
        a checkpoint of another task)."""
        return (checkpoint.get("extra_state") or {}).get(cls.__name__, {}).get("dictionary")

    def set_checkpoint_dict(self, state):
        """On resume: refuse data binarized with another dictionary, and warn when the
        curriculum's schedule differs (:func:`checkpoint_checks.check_resumed_state`)."""
        checkpoint_checks.check_resumed_state(state, self.dictionary_fingerprint(), self._schedule(), self.cfg.data)

    def build_criterion(self, cfg, from_checkpoint=False):
        """fairseq's; fairseq-train builds the criterion just before it restores its checkpoint
        (decoding builds none), so a truncated one is refused here with the --restore-file to
        use instead of PyTorch's traceback (:mod:`fairseq_hrt.checkpoint_files`)."""
        save_dir = getattr(self.cfg, "save_dir", None)
        if save_dir is not None:
            finetune = getattr(self.cfg, "finetune_from_model", None)
            checkpoint_files.check_checkpoint_to_restore(save_dir, self.cfg.restore_file, finetune)
            compat.refuse_unsafe_restore(save_dir, self.cfg.restore_file, finetune)  # before fairseq unpickles it
        return super().build_criterion(cfg, from_checkpoint=from_checkpoint)
