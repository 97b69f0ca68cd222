# importing the strategies registers them (--decoding)
from fairseq_hrt.generation import hrt_generator, jacobi, mask_predict  # noqa: F401
