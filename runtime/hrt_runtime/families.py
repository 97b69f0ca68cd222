"""The model families an exported folder may hold (``config.json``'s ``"kind"``), named once:
the exporter writes these names (:mod:`fairseq_hrt.models.kinds` takes them from here) and
the runtime's :class:`~hrt_runtime.translator.Translator` chooses its search by them."""

AT, HRT, MASK_PREDICT = "at", "hrt", "mask-predict"

# how a message names each family
DESCRIPTION = {AT: "an AT model", HRT: "an HRT model", MASK_PREDICT: "a Mask-Predict model"}
