"""What decoding (:mod:`fairseq_hrt.generation`), export (:mod:`fairseq_hrt.export`) and the
plugin's own training layers build on, below all three: the one statement of the decoder --
attention and relative buckets (:mod:`.attention`), projection fusion (:mod:`.projections`),
the decoder layer (:mod:`.layers`), the plan of a decoder's modules (:mod:`.plan`), the
encoder's pass (:mod:`.encoder_pass`), the token choice (:mod:`.token_choice`) -- the planned
decoder pass of the lean engines (:mod:`.decoder_pass`) and the fixed one that graphs hold
(:mod:`.fixed_pass`), the search rules (:mod:`.search_rules`) and the output rows of a
shortlist (:mod:`.output_vocab`). This package imports nothing of its own when imported
(unlike ``generation/``, whose ``__init__`` imports every engine, ``onnxruntime``'s and so
``export/`` too), so ``export/`` sits above it with no cycle."""
