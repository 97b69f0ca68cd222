"""Export to ONNX: the model's passes as graphs (:mod:`.graphs`) and the folder that
``--decoder-engine onnxruntime`` and the deployed runtime (:mod:`hrt_runtime`) decode
(:mod:`.exporter`, ``fairseq-hrt-export``)."""
