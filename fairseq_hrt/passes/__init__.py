"""What both decoding (:mod:`fairseq_hrt.generation`) and export (:mod:`fairseq_hrt.export`)
build on, below both: the planned decoder pass (:mod:`.decoder_pass`), the search rules
(:mod:`.search_rules`) and the output rows of a shortlist (:mod:`.output_vocab`). This package
imports nothing of its own when imported (unlike ``generation/``, whose ``__init__`` imports
every engine, ``onnxruntime``'s and so ``export/`` too), so ``export/`` sits above it with no
cycle."""
