"""The papers' WMT set-ups, one :class:`Setup` each, and the ``slice`` variant of each that
``recipe.py --slice`` runs on a CPU.

Every number of a full-scale set-up has a :class:`Source` in ``SOURCES[setup][field]``:

- ``paper``: a sentence of one of the two papers in ``shared/papers`` that states it, quoted
  verbatim (tests/test_wmt_prepare.py finds every quote in the paper's text);
- ``outside``: a source that is not in ``shared/papers``, cited by section or file: Vaswani et
  al. 2017 (the HRT paper's "Other training hyperparameters are the same as Vaswani et al.
  (2017)"), Wang et al. 2019 (DLCL, the WMT'22 paper's "same as Wang et al. (2019)") through its
  public training script, and Mask-Predict's public data script (the HRT paper's "same data
  processing as Ghazvininejad et al. (2019)");
- ``choice``: no source states it; ``why`` says why this value.

The papers:

- [HRT] Wang et al., *Hybrid-Regressive Neural Machine Translation* (ICLR 2022 submission;
  ``shared/papers/hybrid-regressive-nmt.txt``). Its hyper-parameter paragraph survives only in
  part: fine-tuning "for the same training steps" as AT, RPR window 16, and "Other training
  hyperparameters are the same as Vaswani et al. (2017)". So the schedule is Transformer-base's
  of Vaswani et al. 2017 (Sec. 5.1-5.4 and 6.1 of that paper, not in shared/papers: cited as
  public facts), in fairseq's words: ``--optimizer adam --adam-betas '(0.9, 0.98)' --adam-eps
  1e-09``, ``--lr-scheduler inverse_sqrt --warmup-updates 4000 --lr`` d^-0.5 x 4000^-0.5 (the
  paper's formula, whose peak at step 4000 is that value; fairseq's inverse_sqrt decays as
  lr x sqrt(warmup / step), the same curve), 25,000 tokens per update, 100k updates, dropout 0.1,
  label smoothing 0.1, the last 5 checkpoints averaged. Its App. E trains Mask-Predict "with
  100k steps" the same way.
- [WMT22] Qin, Jia, Wang et al., *The RoyalFlush System for the WMT 2022 Efficiency Task*
  (``shared/papers/royalflush-wmt22-efficiency-hrt.txt``): E12D1 pre-norm students, 300k steps
  each; the rest "the same as Wang et al. (2019)" [DLCL], whose public script
  (github.com/wangqiangneu/dlcl, runs/train-wmt-en2de-deep-prenorm-baseline.sh) gives lr 0.002,
  16k warm-up, 4096 tokens per GPU x update-freq 2 on 8 GPUs, Adam betas (0.9, 0.997).

Every set-up uses SentencePiece (BPE model type, joint) where the HRT paper's data has Moses
tokens + subword-nmt BPE: SentencePiece detokenizes exactly for sacreBLEU, and
``fairseq_hrt.evaluate`` Moses-tokenizes the detokenized output for the tokenized BLEU the
paper reports (multi-bleu.perl style). The training pairs are cleaned first (prepare.py
``--clean-max-len`` / ``--clean-ratio``) as Moses' clean-corpus-n.perl cleaned the data the
HRT paper reused.
"""

import re
from dataclasses import dataclass, field, fields, replace
from typing import Dict, Iterator, Tuple

# the papers of shared/papers a ``paper`` source quotes
PAPERS = {"HRT": "hybrid-regressive-nmt.txt", "WMT22": "royalflush-wmt22-efficiency-hrt.txt"}


@dataclass(frozen=True)
class Training:
    """One fairseq-train budget and schedule."""

    arch: str
    max_update: int
    lr: float  # the peak of --lr-scheduler inverse_sqrt
    warmup: int
    dropout: float
    max_tokens: int  # per GPU
    tokens_per_update: int  # the paper's batch; --update-freq = this / (GPUs x max_tokens)
    extra: Tuple[str, ...] = ()  # arch options beside --arch (e.g. the teacher's decoder depth)
    adam_betas: Tuple[float, float] = (0.9, 0.98)  # --adam-betas
    adam_eps: float = 1e-8  # --adam-eps (fairseq's default)


@dataclass(frozen=True)
class Setup:
    name: str
    paper: str
    src: str
    tgt: str
    download_setup: str  # download.py --setup (helper C's names)
    slice_data: str  # the folder of /work/shared/data (../shared/data) the slice is cut from
    vocab_size: int  # joint SentencePiece BPE pieces
    teacher: Training
    at: Training  # the AT student, trained from scratch on MixDistill data
    hrt: Training  # HRT, fine-tuned from the AT student
    mp: Training  # Mask-Predict, fine-tuned from the AT student; unused where mp_student is False
    hrt_chunk_sizes: Tuple[int, ...]  # one HRT model per k
    mp_student: bool
    p_raw: float  # MixDistill: probability of the raw target
    distill_beam: int
    average_last: int  # --num-update-checkpoints of the average step
    save_interval_updates: int
    at_beam: int  # AT rows of the evaluate step (the speed baseline is greedy in every set-up)
    hrt_beam: int  # b_at; b_nat = 1
    lenpen: float
    mp_iterations: int
    mp_length_beam: int
    compound_split: bool  # tokenized BLEU with compound splitting (En-De, as Vaswani et al.)
    remove_ro_diacritics: bool  # tokenized BLEU on Romanian without diacritics (the En-Ro NAT papers)
    label_smoothing: float = 0.1
    # every decoder (distill, evaluate, benchmark) stops at a x source length + b pieces
    max_len_a: float = 1.2
    max_len_b: int = 10
    # prepare.py: training pairs with an empty side or more than clean_max_len words on a side,
    # or a length ratio over clean_ratio, are dropped before SentencePiece (0: that rule off)
    clean_max_len: int = 80
    clean_ratio: float = 9.0
    # the slice's own cut of slice_data (train / valid / test line ranges); empty at full scale
    slice_splits: Dict[str, Tuple[str, int, int]] = field(default_factory=dict)
    bench_sentences: int = 0  # 0: the whole test set
    bench_bs1_sentences: int = 100
    log_interval: int = 100

    @property
    def pair(self) -> str:
        return f"{self.src}-{self.tgt}"


# ------------------------------------------------------------------------------ sources


@dataclass(frozen=True)
class Source:
    """Where one value comes from (module docstring): ``kind`` is paper, outside or choice;
    ``quotes`` are (paper, verbatim sentence) pairs, ``paper`` a key of PAPERS; a ``paper``
    source writes its value in its first quote as ``as_written`` (e.g. "300k")."""

    kind: str
    why: str = ""
    quotes: Tuple[Tuple[str, str], ...] = ()
    as_written: str = ""


def paper(name: str, quote: str, as_written: str, why: str = "") -> Source:
    return Source("paper", why, ((name, quote),), as_written)


def outside(why: str, *quotes: Tuple[str, str]) -> Source:
    return Source("outside", why, tuple(quotes))


def choice(why: str, *quotes: Tuple[str, str]) -> Source:
    return Source("choice", why, tuple(quotes))


def written_value(as_written: str) -> float:
    """The number a quote writes: its last number, "300k" as 300000."""
    number, thousands = re.findall(r"(\d+(?:\.\d+)?)(k?)", as_written)[-1]
    return float(number) * (1000 if thousands else 1)


def numeric_fields(setup: Setup) -> Iterator[Tuple[str, float]]:
    """(path, value) of every number of ``setup``: "lenpen", "at.lr", "at.adam_betas[1]",
    "hrt_chunk_sizes[0]" (booleans, names and the slice's cut are no numbers)."""
    for f in fields(setup):
        value = getattr(setup, f.name)
        if isinstance(value, Training):
            for g in fields(value):
                yield from _numbers(f"{f.name}.{g.name}", getattr(value, g.name))
        elif f.name != "slice_splits":
            yield from _numbers(f.name, value)


def _numbers(path: str, value) -> Iterator[Tuple[str, float]]:
    if isinstance(value, tuple):
        for i, item in enumerate(value):
            yield from _numbers(f"{path}[{i}]", item)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        yield path, value


def vaswani_lr(d_model: int, warmup: int) -> float:
    """Vaswani et al. 2017's peak learning rate d^-0.5 x warmup^-0.5 (its Sec. 5.3 formula at
    step = warmup) to one significant digit: fairseq's --lr of inverse_sqrt."""
    return float(f"{d_model**-0.5 * warmup**-0.5:.0e}")


# ---------------------------------------------------------------- the HRT paper's set-ups

# [HRT] "Other training hyperparameters are the same as Vaswani et al. (2017)": Transformer-base
_VASWANI_BASE = dict(
    max_update=100_000,
    lr=vaswani_lr(512, 4000),  # 7e-4
    warmup=4000,
    dropout=0.1,
    max_tokens=3125,  # 25,000 / 8: Vaswani et al.'s 8 GPUs; --update-freq reaches 25,000 on 1-8
    tokens_per_update=25_000,
    adam_betas=(0.9, 0.98),
    adam_eps=1e-9,
)
_PRE_NORM = ("--encoder-normalize-before", "--decoder-normalize-before")

# each value's source, quoted where a paper states it: SOURCES["wmt16_en_ro"] below
WMT16_EN_RO = Setup(
    name="wmt16_en_ro",
    paper="HRT (Wang et al.), WMT'16 En-Ro, 610k pairs (Sec. 5)",
    src="en",
    tgt="ro",
    download_setup="wmt16_en_ro",
    slice_data="wmt16-en-ro-newstest",
    vocab_size=40_000,
    # [HRT] Sec. 3: AT models "with the standard Transformer-Base configuration"; footnote 3: the
    # AT model is "the autoregressive teacher model that generates the distillation data"
    teacher=Training(arch="transformer", **_VASWANI_BASE),
    # paper silent on a separate AT student: the AT model HRT is fine-tuned from ([HRT] Alg. 1,
    # "M_hrt <- M_at"), trained on MixDistill like HRT; base shape, pre-norm as hrt_base and
    # cmlm_base are (SPEC sec. 5), or their fine-tuning could not load its weights
    at=Training(arch="transformer", extra=_PRE_NORM, **_VASWANI_BASE),
    hrt=Training(arch="hrt_base", **_VASWANI_BASE),  # [HRT] Sec. 4: base + decoder RPR; same steps as AT
    mp=Training(arch="cmlm_base", **_VASWANI_BASE),  # [HRT] App. E: MP with FT+RPR+MD, 100k steps
    hrt_chunk_sizes=(2,),
    mp_student=True,  # [HRT] Table 2 / App. E compare Mask-Predict
    p_raw=0.5,  # [HRT] footnote 7 defines p_raw; its value is lost from the extracted text: even odds
    distill_beam=5,
    average_last=5,
    save_interval_updates=1500,  # Vaswani et al.'s 10-minute checkpoints at their 0.4 s a step
    at_beam=5,
    hrt_beam=1,
    lenpen=1.0,
    mp_iterations=10,
    mp_length_beam=5,
    compound_split=False,
    # [MP] scores En-Ro as Lee et al. 2018 (Sennrich's WMT16 scripts: diacritics removed on both
    # sides before multi-bleu.perl); [HRT] compares with [MP]'s numbers, so the same
    remove_ro_diacritics=True,
)

WMT14_EN_DE = replace(
    WMT16_EN_RO,
    name="wmt14_en_de",
    paper="HRT (Wang et al.), WMT'14 En-De, 4.5M pairs (Sec. 5)",
    tgt="de",
    download_setup="wmt14_en_de",
    slice_data="wmt14-en-de-newstest",
    vocab_size=32_000,
    compound_split=True,  # tokenized BLEU with compound splitting, as [MP] and Vaswani et al.
    remove_ro_diacritics=False,
)

# ------------------------------------------------------------------- the WMT'22 system

# [DLCL] via [WMT22] Sec. 4 "Other training hyper-parameters are the same as Wang et al. (2019)"
_DLCL_SCHEDULE = dict(
    lr=2e-3,
    warmup=16_000,
    dropout=0.1,
    max_tokens=4096,
    tokens_per_update=8 * 4096 * 2,  # 8 GPUs ([WMT22]: 8 RTX 3090) x 4096 x update-freq 2
    adam_betas=(0.9, 0.997),
)
# the teacher: one Transformer-big (Vaswani et al. 2017's big En-De model) in place of the
# organisers' four, whose Marian weights fairseq cannot load
_VASWANI_BIG = dict(_VASWANI_BASE, max_update=300_000, lr=vaswani_lr(1024, 4000), dropout=0.3)

# each value's source, quoted where a paper states it: SOURCES["wmt22_e12d1"] below
WMT22_E12D1 = Setup(
    name="wmt22_e12d1",
    paper="RoyalFlush WMT'22 efficiency task (Qin, Jia, Wang et al.), En-De, E12D1 students (Sec. 3-4)",
    src="en",
    tgt="de",
    download_setup="wmt22_en_de",
    slice_data="wmt14-en-de-newstest",  # the only En-De text in shared/data
    vocab_size=32_000,
    teacher=Training(arch="transformer_vaswani_wmt_en_de_big", **_VASWANI_BIG),
    at=Training(arch="at_e12d1", max_update=300_000, **_DLCL_SCHEDULE),  # [WMT22] Sec. 4: from scratch
    hrt=Training(arch="hrt_e12d1", max_update=300_000, **_DLCL_SCHEDULE),  # [WMT22] Sec. 4: fine-tuned
    mp=Training(arch="cmlm_base", max_update=0, **_DLCL_SCHEDULE),  # no Mask-Predict in [WMT22]
    hrt_chunk_sizes=(2, 4),  # [WMT22] Table 4: k = 2 (quality) and k = 4 (the fastest system)
    mp_student=False,
    p_raw=0.0,  # [WMT22] Sec. 3: sequence-level KD, the teacher's translations only
    distill_beam=5,
    average_last=5,
    save_interval_updates=2_000,
    at_beam=1,  # [WMT22] Sec. 3 "Fully greedy search": b_at = b_nat = 1 for every model
    hrt_beam=1,
    lenpen=0.6,
    mp_iterations=10,
    mp_length_beam=5,
    compound_split=False,  # [WMT22] reports sacreBLEU only; the tokenized BLEU is plain Moses
    remove_ro_diacritics=False,
    max_len_a=0.0,  # [WMT22] Sec. 3: a fixed maximum length L = 200 pieces
    max_len_b=200,
    bench_bs1_sentences=100,
)

SETUPS: Dict[str, Setup] = {s.name: s for s in (WMT16_EN_RO, WMT14_EN_DE, WMT22_E12D1)}

# ---------------------------------------------------------------- the sources, per value

_TRAININGS = ("teacher", "at", "hrt", "mp")
# verbatim, the extraction's missing spaces ("asVaswani") included
_HRT_POINTER = ("HRT", "Other training hyperparameters are the same asVaswani et al. (2017) orWang et al. (2019a)")
_DLCL_POINTER = ("WMT22", "Other training hyper-parameters are the same as Wang et al. (2019)")
_DLCL_SCRIPT = "Wang et al. 2019 (DLCL), github.com/wangqiangneu/dlcl runs/train-wmt-en2de-deep-prenorm-baseline.sh"
_MP_DATA = ("HRT", "We replicated the same data processing as Ghazvininejad et al. (2019)")
_RECIPE_OWN = "the recipe's own benchmark and logging, not a model setting"


def _each(trainings, **sources: Source) -> Dict[str, Source]:
    return {f"{t}.{name}": source for t in trainings for name, source in sources.items()}


def _vaswani_base_sources(trainings, pointer=_HRT_POINTER) -> Dict[str, Source]:
    """Vaswani et al. 2017's Transformer-base schedule: the HRT set-ups' ([HRT]'s pointer to it)
    and, with its big-model values over it, the WMT'22 set-up's stand-in teacher's."""
    v = "Vaswani et al. 2017 (not in shared/papers), "
    q = (pointer,) if pointer else ()  # the quote each value names
    return _each(
        trainings,
        max_update=outside(v + "Sec. 5.2: the base models trained 100,000 steps", *q),
        lr=outside(
            v + "Sec. 5.3: lrate = d^-0.5 min(step^-0.5, step warmup^-1.5), peak 512^-0.5 x 4000^-0.5 = 7e-4",
            *q,
        ),
        warmup=outside(v + "Sec. 5.3: warmup_steps = 4000", *q),
        dropout=outside(v + "Sec. 5.4: P_drop = 0.1 for the base model", *q),
        tokens_per_update=outside(
            v + "Sec. 5.1: about 25,000 source and 25,000 target tokens a batch (fairseq's "
            "--max-tokens bounds the longer, padded side of each pair: 25,000)",
            *q,
        ),
        max_tokens=choice(
            "25,000 / 8, the 8 GPUs of Vaswani et al.'s Sec. 5.2: --update-freq reaches 25,000 exactly "
            "on 1, 2, 4 or 8 GPUs"
        ),
        **{"adam_betas[0]": outside(v + "Sec. 5.3: Adam, beta1 = 0.9", *q)},
        **{"adam_betas[1]": outside(v + "Sec. 5.3: beta2 = 0.98", *q)},
        adam_eps=outside(v + "Sec. 5.3: epsilon = 1e-9", *q),
    )


def _hrt_paper_sources(vocab: Source) -> Dict[str, Source]:
    sources = _vaswani_base_sources(_TRAININGS)
    sources["hrt.max_update"] = Source(
        "outside",
        "as AT's (Vaswani et al.'s 100,000); one HRT update holds each pair twice (App. C)",
        (
            ("HRT", "HRT models are finetuned on pretrained AT models for the same training steps"),
            ("HRT", "which results in the batch size being twice that of standard training"),
        ),
    )
    sources["mp.max_update"] = paper(
        "HRT", "our MP model with 100k steps", "100k", "App. E: MP with FT, RPR and MixDistill"
    )
    sources.update(
        {
            "vocab_size": vocab,
            "label_smoothing": outside("Vaswani et al. 2017, Sec. 5.4: label smoothing 0.1", _HRT_POINTER),
            "hrt_chunk_sizes[0]": paper("HRT", "k is generally 2", "2", "App. D; Table 4's main model"),
            "p_raw": choice(
                "footnote 7 defines p_raw; the value chosen 'according to validation sets' is lost from the "
                "extracted text: 0.5 weighs raw and distilled targets alike",
                ("HRT", "where p raw is a hyperparameter"),
                ("HRT", "En↔Ro according to validation sets"),
            ),
            "distill_beam": paper(
                "HRT",
                "AT models decode with beam sizes of 5 on both tasks",
                "5",
                "Sec. 3's AT models (Transformer-base on MP's data); the distillation beam itself is not stated",
            ),
            "average_last": outside("Vaswani et al. 2017, Sec. 6.1: base models average the last 5 checkpoints"),
            "save_interval_updates": choice(
                "Vaswani et al. wrote a checkpoint every 10 minutes, 1,500 steps at their 0.4 s a step (Sec. 5.2)"
            ),
            "at_beam": paper("HRT", "Unless otherwise stated, the used beam size is 5", "5", "Table 2 caption"),
            "hrt_beam": paper("HRT", "our small beam model (b at =b mp =1)", "1", "Sec. 5; b_mp = 1 always"),
            "lenpen": choice(
                "decoding's length penalty is not stated; fairseq's default. Vaswani et al.'s alpha = 0.6 is "
                "GNMT's length normalisation, not fairseq's --lenpen (score / length^lenpen)"
            ),
            "mp_iterations": paper("HRT", "iterates several times (e.g., 10)", "10", "Sec. 3: the standard MP"),
            "mp_length_beam": paper("HRT", "large beam size (e.g., 5)", "5", "Sec. 3: the standard MP"),
            "max_len_a": choice(
                "decoding length not stated (Vaswani et al.: source + 50): 1.2 x source + 10 pieces "
                "lies above nearly every reference and ends an under-trained model's repetitions"
            ),
            "max_len_b": choice("with max_len_a"),
            "clean_max_len": outside(
                "Mask-Predict's get_data.sh takes Google's train.tok.clean.bpe.32000 (En-De; google/seq2seq "
                "wmt16_en_de.sh: clean-corpus-n.perl ... 1 80) and Lee et al.'s corpus.bpe (En-Ro; named as "
                "the output of rsennrich/wmt16-scripts sample/preprocess.sh: clean-corpus-n.perl ... 1 80); "
                "here on words of the raw text, not Moses tokens",
                _MP_DATA,
            ),
            "clean_ratio": outside("clean-corpus-n.perl's default -ratio 9, which those scripts keep", _MP_DATA),
            "bench_sentences": choice(_RECIPE_OWN),
            "bench_bs1_sentences": choice(_RECIPE_OWN),
            "log_interval": choice(_RECIPE_OWN),
        }
    )
    return sources


def _wmt22_sources() -> Dict[str, Source]:
    sources = _vaswani_base_sources(["teacher"], pointer=None)
    big = "Vaswani et al. 2017 (not in shared/papers): the big En-De model, "
    sources.update(
        {
            "teacher.max_update": outside(big + "Sec. 5.2: 300,000 steps"),
            "teacher.lr": outside(big + "Sec. 5.3's formula with d = 1024: 1024^-0.5 x 4000^-0.5 = 5e-4"),
            "teacher.dropout": outside(big + "Sec. 6.1: P_drop 0.3 (the En-Fr big model used 0.1 'instead of 0.3')"),
        }
    )
    dlcl = _DLCL_SCRIPT + ": "
    students = ("at", "hrt", "mp")
    sources.update(
        _each(
            students,
            lr=outside(dlcl + "lr=0.002", _DLCL_POINTER),
            warmup=outside(dlcl + "warmup=16000", _DLCL_POINTER),
            dropout=outside(dlcl + "no --dropout: its arch's 0.1", _DLCL_POINTER),
            max_tokens=outside(dlcl + "batch_size=4096 (tokens per GPU)", _DLCL_POINTER),
            tokens_per_update=outside(dlcl + "8 GPUs x 4096 x update_freq=2", _DLCL_POINTER),
            adam_eps=outside(dlcl + "no --adam-eps: fairseq's 1e-8", _DLCL_POINTER),
            **{"adam_betas[0]": outside(dlcl + "adam_betas='(0.9, 0.997)'", _DLCL_POINTER)},
            **{"adam_betas[1]": outside(dlcl + "adam_betas='(0.9, 0.997)'", _DLCL_POINTER)},
        )
    )
    sources["at.max_update"] = paper("WMT22", "All AT models are trained from scratch for 300k steps", "300k")
    sources["hrt.max_update"] = paper(
        "WMT22", "fine-tuned based on the pre-trained AT counterparts for 300k steps", "300k"
    )
    sources["mp.max_update"] = choice("no Mask-Predict in [WMT22]: the mp step is skipped")
    greedy = ("WMT22", "we use $b_{at}=1$ and $b_{nat}=1$")
    sources.update(
        {
            "vocab_size": choice(
                "the teachers' SentencePiece vocabulary, whose size is not given: 32k, the usual joint En-De size",
                ("WMT22", "We use the same sentencepiece vocabulary as the teacher model to encode the text."),
            ),
            "label_smoothing": outside(dlcl + "--label-smoothing 0.1", _DLCL_POINTER),
            "hrt_chunk_sizes[0]": paper("WMT22", "When using $k=2$ for HRT", "$k=2$"),
            "hrt_chunk_sizes[1]": paper("WMT22", "Our fastest model, HRT_E12D1 ($k=4$)", "$k=4$"),
            "p_raw": paper(
                "HRT",
                "full distillation data can be regarded as the special case of MixDistill when praw=1 or praw=0",
                "praw=0",
                "[WMT22] Sec. 3 trains on its teachers' beam search output only",
            ),
            "distill_beam": choice(
                "the teachers' 'beam search results'; the width is not given: 5, as the HRT set-ups",
                ("WMT22", "whose beam search results are used as our distillation data"),
            ),
            "average_last": outside(dlcl + "ensemble=5 (the last 5 checkpoints averaged)", _DLCL_POINTER),
            "save_interval_updates": choice(
                "DLCL averages epoch checkpoints; 5 x 2,000 = the last 10k of 300k updates"
            ),
            "at_beam": paper("WMT22", greedy[1], "1"),
            "hrt_beam": paper("WMT22", greedy[1], "1"),
            "lenpen": paper("WMT22", "the length penalty is 0.6", "0.6"),
            "mp_iterations": choice("no Mask-Predict in [WMT22]: unused"),
            "mp_length_beam": choice("no Mask-Predict in [WMT22]: unused"),
            "max_len_a": choice(
                "a fixed maximum length (L below) is fairseq's a = 0",
                ("WMT22", "We predefine the maximum source/target sequence length L as 200"),
            ),
            "max_len_b": paper("WMT22", "We predefine the maximum source/target sequence length L as 200", "200"),
            "clean_max_len": choice(
                "the paper cleans nothing further of the organisers' distillation data; the recipe's stand-in "
                "teacher trains on raw WMT'19 corpora, cleaned as the HRT set-ups' data",
                ("WMT22", "We directly use the distillation data without further data cleaning."),
            ),
            "clean_ratio": choice("with clean_max_len"),
            "bench_sentences": choice(_RECIPE_OWN),
            "bench_bs1_sentences": choice(
                "the paper's WPS is newstest20 at batch 1, mean of 5 runs; the benchmark's "
                "batch-1 rows time the first 100 sentences"
            ),
            "log_interval": choice(_RECIPE_OWN),
        }
    )
    return sources


SOURCES: Dict[str, Dict[str, Source]] = {
    "wmt16_en_ro": _hrt_paper_sources(
        outside("Mask-Predict's get_data.sh: Lee et al.'s joint BPE, dictionary --nwordssrc 40000", _MP_DATA)
    ),
    "wmt14_en_de": _hrt_paper_sources(
        outside("Mask-Predict's get_data.sh: Google's joint BPE of 32,000 merges (train.tok.clean.bpe.32000)", _MP_DATA)
    ),
    "wmt22_e12d1": _wmt22_sources(),
}


SLICE_SIZES = ("smoke", "learn")  # slice_of's sizes; recipe.py --slice-size


def _slice_training(full: Training, arch: str, max_update: int, extra: Tuple[str, ...] = (), **schedule) -> Training:
    """A CPU-sized budget of ``full``: a small shape, one batch per update; ``schedule`` overrides
    the smoke slice's lr, warm-up and batch (and anything else of :class:`Training`)."""
    smoke = dict(lr=3e-3, warmup=10, dropout=0.1, max_tokens=1024)
    budget = {**smoke, **schedule}
    return replace(
        full, arch=arch, max_update=max_update, extra=extra, tokens_per_update=budget["max_tokens"], **budget
    )


def _smoke_slice(setup: Setup) -> Setup:
    """The tiny archs (d = 32) and tens of updates on newstest: every step runs in a few
    minutes; its models repeat one piece and its BLEU is 0, by design."""
    if setup.slice_data == "wmt16-en-ro-newstest":
        # only newstest2016 (1999 lines): the first 1500 train, the next 250 valid, the rest test
        splits = {"train": ("test", 0, 1500), "valid": ("test", 1500, 1750), "test": ("test", 1750, 1999)}
    else:
        # newstest2014 (3003 lines) trains, newstest2013 (3000) gives valid and test
        splits = {"train": ("test", 0, 3003), "valid": ("valid", 0, 250), "test": ("valid", 250, 500)}
    return replace(
        setup,
        vocab_size=500,
        teacher=_slice_training(setup.teacher, "at_tiny", 40, ("--decoder-layers", "2")),
        at=_slice_training(setup.at, "at_tiny", 30),
        hrt=_slice_training(setup.hrt, "hrt_tiny", 30),
        mp=_slice_training(setup.mp, "cmlm_tiny", 30),
        distill_beam=2,
        average_last=2,
        save_interval_updates=10,
        at_beam=min(setup.at_beam, 2),
        slice_splits=splits,
        bench_sentences=16,
        bench_bs1_sentences=4,
        # an under-trained model repeats one piece to the length limit: a fixed 40 pieces (about
        # a newstest sentence) keeps every decoding step of the slice short
        max_len_a=0.0,
        max_len_b=40,
        log_interval=10,
    )


def _learn_slice(setup: Setup) -> Setup:
    """The Multi30k quickstart's shape (d = 128, 3-1) and hundreds of updates: models that
    translate. A few thousand newstest pairs teach such a model next to nothing in minutes, so
    the En-De set-ups train on Multi30k (shared/data/multi30k-en-de) and score its test2016; En-Ro
    has no other corpus in shared/data and keeps newstest2016, whose BLEU stays near 0."""
    if setup.tgt == "de":
        data = "multi30k-en-de"
        # Multi30k's train (29,000 pairs), 100 valid pairs (unused: validation is off) and its
        # standard test2016 (Flickr, 1000 pairs)
        splits = {"train": ("train", 0, 29_000), "valid": ("valid", 0, 100), "test": ("test", 0, 1000)}
    else:
        data = setup.slice_data
        splits = {"train": ("test", 0, 1750), "valid": ("test", 1750, 1800), "test": ("test", 1800, 1999)}
    # the quickstart's schedule (examples/multi30k/quickstart.sh): lr 4e-3, 4096 tokens a batch
    scratch = dict(lr=4e-3, warmup=150, max_tokens=4096, adam_betas=(0.9, 0.98), adam_eps=1e-8)
    # fine-tuning starts from a trained AT student: a short warm-up to the same peak
    finetune = {**scratch, "warmup": 30}
    return replace(
        setup,
        slice_data=data,
        vocab_size=4000,
        teacher=_slice_training(setup.teacher, "at_mini", 300, ("--decoder-layers", "2"), **scratch),
        at=_slice_training(setup.at, "at_mini", 300, **scratch),
        hrt=_slice_training(setup.hrt, "hrt_mini", 150, **finetune),
        mp=_slice_training(setup.mp, "cmlm_mini", 150, **finetune),
        distill_beam=2,
        average_last=2,
        save_interval_updates=50,
        at_beam=min(setup.at_beam, 2),
        slice_splits=splits,
        bench_sentences=128,
        bench_bs1_sentences=10,
        log_interval=50,
    )


_SLICES = {"smoke": _smoke_slice, "learn": _learn_slice}


def slice_of(setup: Setup, size: str = "learn") -> Setup:
    """The ``--slice`` variant of ``setup`` at one of :data:`SLICE_SIZES`: the same steps on a
    CPU. ``smoke`` checks the path (BLEU 0 by design, the tests' size); ``learn`` trains models
    that translate (docs in the READMEs: what the slice's numbers mean)."""
    if size not in _SLICES:
        raise ValueError(f"unknown slice size {size!r}; the sizes: {', '.join(SLICE_SIZES)}")
    return _SLICES[size](setup)
