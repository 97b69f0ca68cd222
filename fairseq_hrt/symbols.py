"""Special symbols the HRT task adds to every dictionary (SPEC section 1).

They are appended in a fixed order after fairseq's dictionary is loaded, at training and at
inference alike, so AT, CMLM and HRT models trained on the same binarized data share one
vocabulary (an HRT model fine-tunes from an AT checkpoint only if they do). The
SentencePiece model that segments a vocabulary's text is found here too (the hub and the
exporter look for it the same way).
"""

import os
import zlib
from typing import Optional

MASK_SYMBOL = "<mask>"
# <s2> .. <s8>: start symbols of Skip-AT for every chunk size a model may be trained with
MAX_CHUNK_SIZE = 8


def chunk_start_symbol(k: int) -> str:
    if not 2 <= k <= MAX_CHUNK_SIZE:
        raise ValueError(f"chunk size must be in 2..{MAX_CHUNK_SIZE}, got {k}")
    return f"<s{k}>"


def add_hrt_symbols(dictionary):
    """Add ``<mask>`` and ``<s2>``..``<s8>`` (idempotent); returns the dictionary."""
    for symbol in hrt_symbols():
        dictionary.add_symbol(symbol)
    return dictionary


def hrt_symbols():
    """The symbols :func:`add_hrt_symbols` adds, in order."""
    return [MASK_SYMBOL] + [chunk_start_symbol(k) for k in range(2, MAX_CHUNK_SIZE + 1)]


def dictionary_fingerprint(source_dictionary, target_dictionary) -> str:
    """CRC32 of the source and target symbols in order: two data directories binarized
    with different dictionaries (even of the same size) differ here. Checkpoints
    (:meth:`HRTTranslationTask.get_checkpoint_dict`) and shortlist files store it."""
    crc = 0
    for d in (source_dictionary, target_dictionary):
        crc = zlib.crc32("\n".join(d.symbols).encode("utf-8", "surrogatepass"), crc)
    return f"{crc:08x}"


SENTENCEPIECE_NAMES = ("spm.model", "sentencepiece.bpe.model", "sentencepiece.model")


def find_sentencepiece_model(*folders: Optional[str]) -> Optional[str]:
    """The first SentencePiece model in the given folders or a ``spm/`` folder beside them
    (the layout of ``examples/multi30k/prepare.sh``: ``DATA/data-bin`` and ``DATA/spm``)."""
    for folder in folders:
        if not folder:
            continue
        for place in (
            folder,
            os.path.join(folder, "spm"),
            os.path.join(os.path.dirname(os.path.abspath(folder)), "spm"),
        ):
            for name in SENTENCEPIECE_NAMES:
                path = os.path.join(place, name)
                if os.path.isfile(path):
                    return path
    return None
