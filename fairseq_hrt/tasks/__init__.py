from fairseq_hrt.tasks import hrt_translation  # noqa: F401
