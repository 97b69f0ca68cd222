from fairseq_hrt.models import at_transformer, cmlm_transformer, hrt_transformer, ssru_transformer  # noqa: F401
