from fairseq_hrt.criterions import hrt_loss  # noqa: F401
