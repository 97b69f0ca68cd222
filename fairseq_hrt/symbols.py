"""Special symbols the HRT task adds to every dictionary (SPEC section 1).

They are appended in a fixed order after fairseq's dictionary is loaded, at training and at
inference alike, so AT, CMLM and HRT models trained on the same binarized data share one
vocabulary (an HRT model fine-tunes from an AT checkpoint only if they do).
"""
MASK_SYMBOL = "<mask>"
# <s2> .. <s8>: start symbols of Skip-AT for every chunk size a model may be trained with
MAX_CHUNK_SIZE = 8


def chunk_start_symbol(k: int) -> str:
    if not 2 <= k <= MAX_CHUNK_SIZE:
        raise ValueError(f"chunk size must be in 2..{MAX_CHUNK_SIZE}, got {k}")
    return f"<s{k}>"


def add_hrt_symbols(dictionary):
    """Add ``<mask>`` and ``<s2>``..``<s8>`` (idempotent); returns the dictionary."""
    dictionary.add_symbol(MASK_SYMBOL)
    for k in range(2, MAX_CHUNK_SIZE + 1):
        dictionary.add_symbol(chunk_start_symbol(k))
    return dictionary
