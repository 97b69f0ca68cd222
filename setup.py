from setuptools import find_packages, setup

# fairseq is deliberately NOT in install_requires: the distribution that works on
# Python 3.11 (ve-fairseq) declares torchaudio, which would pull a CUDA torch.
# See README.md, "Install".
setup(
    name="fairseq-hrt",
    version="0.1.0",
    description="Hybrid-Regressive Translation, Mask-Predict and deep-encoder/shallow-decoder "
    "AT models as a fairseq plugin",
    packages=find_packages(include=["fairseq_hrt", "fairseq_hrt.*"]),
    # the torch-only console scripts start here: they check for PyTorch and fairseq first
    py_modules=["hrt_commands"],
    python_requires=">=3.11",
    # hrt-runtime (runtime/, its own distribution: what a translating machine installs) is not declared
    # either: no index holds it; requirements-fairseq.txt installs it from runtime/ before this one
    install_requires=["sacrebleu>=2.3", "sentencepiece"],
    entry_points={
        "console_scripts": [
            "fairseq-hrt-comet=hrt_commands:comet",
            "fairseq-hrt-shortlist=hrt_commands:shortlist",
            "fairseq-hrt-export=hrt_commands:export",
        ]
    },
)
