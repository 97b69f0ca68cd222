"""What the tests and the fault table build on (:mod:`fairseq_hrt.testing.tiny_runs`: tiny corpora
and fairseq command lines run as child processes); never imported by the plugin itself."""
