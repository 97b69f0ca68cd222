"""``--scoring sacrebleu_signature``: fairseq's ``--scoring sacrebleu`` with sacreBLEU's signature.

fairseq 0.12's ``--scoring sacrebleu`` prints ``BLEU = 35.2 ...`` without the signature that says
how the number was computed (it calls sacreBLEU's ``format()`` without one). This scorer, a
plugin option like the task's, prints sacreBLEU's own ``BLEU|nrefs:1|case:mixed|eff:no|tok:13a|
smooth:exp|version:2.6.0 = 35.2 ...`` for the same score; fairseq's ``sacrebleu`` is unchanged.
It takes ``--scoring sacrebleu``'s options (``--sacrebleu-tokenizer``, ``--sacrebleu-lowercase``,
``--sacrebleu-char-level``).
"""

from fairseq.scoring import register_scorer
from fairseq.scoring.bleu import SacrebleuConfig, SacrebleuScorer
from sacrebleu.metrics import BLEU

SCORER_NAME = "sacrebleu_signature"


def sacrebleu_signature(cfg) -> str:
    """sacreBLEU's signature of what fairseq's ``--scoring sacrebleu`` computes: fairseq
    tokenizes both sides with sacreBLEU's tokenizer ``--sacrebleu-tokenizer`` (lowercased with
    ``--sacrebleu-lowercase``) and scores the tokens with ``tokenize='none'``, which is sacreBLEU
    with that tokenizer; ``--sacrebleu-char-level`` splits into characters after it (``+char``)."""
    tokenizer = str(cfg.sacrebleu_tokenizer)
    bleu = BLEU(tokenize=tokenizer, lowercase=bool(cfg.sacrebleu_lowercase))
    bleu.num_refs = 1  # fairseq scores against one reference per sentence
    signature = bleu.get_signature().format()
    return signature.replace(f"tok:{tokenizer}", f"tok:{tokenizer}+char") if cfg.sacrebleu_char_level else signature


@register_scorer(SCORER_NAME, dataclass=SacrebleuConfig)
class SignedSacrebleuScorer(SacrebleuScorer):
    def result_string(self, order=4):
        if order != 4:
            return super().result_string(order)
        return self._score(order).format(signature=sacrebleu_signature(self.cfg))
