"""The papers' WMT set-ups, one :class:`Setup` each, and the ``slice`` variant of each that
``recipe.py --slice`` runs on a CPU.

Sources, cited per value below:

- [HRT] Wang et al., *Hybrid-Regressive Neural Machine Translation* (ICLR 2022 submission;
  ``shared/papers/hybrid-regressive-nmt.txt``). Its Sec. 5 says it "replicated the same data
  processing as Ghazvininejad et al. (2019)" (Mask-Predict) and Appendix E trains Mask-Predict
  with the HRT recipe; the extracted text has no hyper-parameter table, so the training
  values come from Mask-Predict's set-up, which HRT says it follows, and say so.
- [MP] Ghazvininejad et al. 2019, *Mask-Predict* (Sec. 4: 128k tokens per batch, 300k steps,
  Adam, lr 5e-4 with 10k warmup, average of the 5 best checkpoints; En-Ro data of Lee et al.
  2018 with 40k joint BPE, En-De data of Vaswani et al. 2017 with 32k joint BPE).
- [WMT22] Wang et al., *The RoyalFlush System for the WMT 2022 Efficiency Task*
  (``shared/papers/royalflush-wmt22-efficiency-hrt.txt``): E12D1 pre-norm students, Sec. 3
  and 4; "other training hyper-parameters are the same as Wang et al. (2019)" [DLCL], the deep
  pre-norm Transformer paper (lr 2e-3, 16k warmup, 8 GPUs x 4096 tokens x 2 accumulation).

Every set-up here uses SentencePiece (BPE model type, joint) where the HRT paper uses Moses
tokenization + subword-nmt BPE: SentencePiece detokenizes exactly for sacreBLEU, and
``fairseq_hrt.evaluate`` Moses-tokenizes the detokenized output for the tokenized BLEU the
paper reports (multi-bleu.perl style).
"""

from dataclasses import dataclass, field, replace
from typing import Dict, Tuple


@dataclass(frozen=True)
class Training:
    """One fairseq-train budget and schedule."""

    arch: str
    max_update: int
    lr: float
    warmup: int
    dropout: float
    max_tokens: int  # per GPU
    tokens_per_update: int  # the paper's batch; --update-freq = this / (GPUs x max_tokens)
    extra: Tuple[str, ...] = ()  # arch options beside --arch (e.g. the teacher's decoder depth)


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
    label_smoothing: float = 0.1  # [MP] and [DLCL] alike
    # every decoder (distill, evaluate, benchmark) stops at a x source length + b pieces; papers
    # silent (fairseq's default is 200 pieces): 1.2 x + 10 lies above nearly every reference and
    # ends an under-trained model's repetitions early
    max_len_a: float = 1.2
    max_len_b: int = 10
    # the slice's own cut of slice_data (train / valid / test line ranges); empty at full scale
    slice_splits: Dict[str, Tuple[str, int, int]] = field(default_factory=dict)
    bench_sentences: int = 0  # 0: the whole test set
    bench_bs1_sentences: int = 100
    log_interval: int = 100

    @property
    def pair(self) -> str:
        return f"{self.src}-{self.tgt}"


# [MP] Sec. 4 (training): the schedule [HRT] follows for both of its tasks; the students share it
_MP_SCHEDULE = dict(
    max_update=300_000,  # [MP]: 300k steps; [HRT] Sec. 6: HRT fine-tunes as many steps as AT
    lr=5e-4,  # [MP]
    warmup=10_000,  # [MP]
    max_tokens=8192,  # paper silent per GPU: 8192 fits a 24 GB GPU at base size
    tokens_per_update=128_000,  # [MP]: 128k tokens per batch
)

_PRE_NORM = ("--encoder-normalize-before", "--decoder-normalize-before")

WMT16_EN_RO = Setup(
    name="wmt16_en_ro",
    paper="HRT (Wang et al.), WMT'16 En-Ro, 610k pairs (Sec. 5)",
    src="en",
    tgt="ro",
    download_setup="wmt16_en_ro",
    slice_data="wmt16-en-ro-newstest",
    vocab_size=40_000,  # [MP]: the 40k joint BPE of Lee et al. 2018's En-Ro data
    # [HRT] Sec. 3: the AT teacher is Transformer-Base (Vaswani et al.); dropout 0.3 is
    # fairseq's base setting for the small En-Ro corpus (paper silent)
    teacher=Training(arch="transformer", dropout=0.3, **_MP_SCHEDULE),
    # paper silent on a separate AT student: the AT counterpart HRT is fine-tuned from
    # ([HRT] Alg. 1, "M_hrt <- M_at"), trained on MixDistill like HRT; base shape, pre-norm as
    # hrt_base and cmlm_base are (SPEC sec. 5), or their fine-tuning could not load its weights
    at=Training(arch="transformer", dropout=0.3, extra=_PRE_NORM, **_MP_SCHEDULE),
    hrt=Training(arch="hrt_base", dropout=0.3, **_MP_SCHEDULE),  # [HRT] Sec. 4: base + decoder RPR
    mp=Training(arch="cmlm_base", dropout=0.3, **_MP_SCHEDULE),  # [HRT] App. E: MP with FT+RPR+MD
    hrt_chunk_sizes=(2,),  # [HRT] Sec. 6 / Table 4: k = 2 is the main model
    mp_student=True,  # [HRT] Table 2 / App. E compare Mask-Predict
    # [HRT] footnote 7 defines p_raw in [0, 1] but the text gives no value; 0.5 weighs raw and
    # distilled targets alike (the plugin's default, README "Reproduce the papers")
    p_raw=0.5,
    distill_beam=5,  # [HRT] Sec. 3: the AT models decode with beam 5
    average_last=5,  # [MP]: average of 5 checkpoints (here the last 5, evenly spaced)
    save_interval_updates=2_000,  # paper silent: 5 x 2k = the last 10k updates averaged
    at_beam=5,  # [HRT] Table 2: "unless otherwise stated, the beam size is 5"
    hrt_beam=1,  # [HRT] Table 2: b_at = b_mp = 1 is the fast row (b_at = 5 also reported)
    lenpen=1.0,  # paper silent: fairseq's default
    mp_iterations=10,  # [MP] / [HRT] Table 2: MP with I = 10
    mp_length_beam=5,  # [MP]: 5 length candidates
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
    vocab_size=32_000,  # [MP]: Vaswani et al.'s 32k joint BPE
    # dropout 0.1 for the 4.5M-pair corpus (Transformer-Base, Vaswani et al.; paper silent)
    teacher=Training(arch="transformer", dropout=0.1, **_MP_SCHEDULE),
    at=Training(arch="transformer", dropout=0.1, extra=_PRE_NORM, **_MP_SCHEDULE),
    hrt=Training(arch="hrt_base", dropout=0.1, **_MP_SCHEDULE),
    mp=Training(arch="cmlm_base", dropout=0.1, **_MP_SCHEDULE),
    compound_split=True,  # tokenized BLEU with compound splitting, as [MP] and Vaswani et al.
    remove_ro_diacritics=False,
)

# [DLCL] via [WMT22] Sec. 4 "other hyper-parameters are the same as Wang et al. (2019)"
_DLCL_SCHEDULE = dict(
    lr=2e-3,  # [DLCL]: pre-norm deep models take a larger lr
    warmup=16_000,  # [DLCL]
    dropout=0.1,  # [DLCL]
    max_tokens=4096,  # [DLCL]: 4096 tokens per GPU
    tokens_per_update=8 * 4096 * 2,  # [DLCL]: 8 GPUs ([WMT22]: 8 RTX 3090) x 4096 x update-freq 2
)

WMT22_E12D1 = Setup(
    name="wmt22_e12d1",
    paper="RoyalFlush WMT'22 efficiency task (Wang et al.), En-De, E12D1 students (Sec. 3-4)",
    src="en",
    tgt="de",
    download_setup="wmt22_en_de",
    slice_data="wmt14-en-de-newstest",  # the only En-De text in shared/data
    # [WMT22] Sec. 3: "the same sentencepiece vocabulary as the teacher model" (the organizers'
    # teachers); its size is not given: 32k, the usual joint En-De size
    vocab_size=32_000,
    # [WMT22] Sec. 3: the organizers' ensemble of four Transformer-big teachers; the recipe
    # trains one Transformer-big (fairseq's transformer_vaswani_wmt_en_de_big) in their place
    # because those Marian models cannot be loaded by fairseq
    teacher=Training(arch="transformer_vaswani_wmt_en_de_big", max_update=300_000, **{**_DLCL_SCHEDULE, "lr": 1e-3}),
    at=Training(arch="at_e12d1", max_update=300_000, **_DLCL_SCHEDULE),  # [WMT22] Sec. 4: from scratch, 300k
    hrt=Training(arch="hrt_e12d1", max_update=300_000, **_DLCL_SCHEDULE),  # [WMT22] Sec. 4: fine-tuned, 300k
    mp=Training(arch="cmlm_base", max_update=0, **_DLCL_SCHEDULE),  # no Mask-Predict in [WMT22]
    hrt_chunk_sizes=(2, 4),  # [WMT22] Table 4: k = 2 (quality) and k = 4 (the fastest system)
    mp_student=False,
    p_raw=0.0,  # [WMT22] Sec. 3: plain sequence-level KD ("we directly use the distillation data")
    distill_beam=5,  # [WMT22] Sec. 3: the teachers' "beam search results"; width not given: 5
    average_last=5,  # paper silent: the last 5 interval checkpoints, as the HRT set-ups
    save_interval_updates=2_000,  # paper silent: as the HRT set-ups
    at_beam=1,  # [WMT22] Sec. 3 "Fully greedy search": b_at = b_nat = 1 for every model
    hrt_beam=1,
    lenpen=0.6,  # [WMT22] Sec. 4: "the length penalty is 0.6"
    mp_iterations=10,
    mp_length_beam=5,
    compound_split=False,  # [WMT22] reports sacreBLEU only; the tokenized BLEU is plain Moses
    remove_ro_diacritics=False,
    bench_bs1_sentences=100,
)

SETUPS: Dict[str, Setup] = {s.name: s for s in (WMT16_EN_RO, WMT14_EN_DE, WMT22_E12D1)}


def _slice_training(full: Training, arch: str, max_update: int, extra: Tuple[str, ...] = ()) -> Training:
    """A CPU-sized budget of ``full``: the tiny shape, tens of updates, one small batch."""
    return replace(
        full, arch=arch, max_update=max_update, lr=3e-3, warmup=10, dropout=0.1, max_tokens=1024,
        tokens_per_update=1024, extra=extra,
    )  # fmt: skip


def slice_of(setup: Setup) -> Setup:
    """The ``--slice`` variant: the same steps on a slice of shared/data's test sets, the tiny
    archs (d = 64) and tens of updates; its numbers say the path runs, not what it scores."""
    if setup.slice_data == "wmt16-en-ro-newstest":
        # only newstest2016 (1999 lines): the first 1500 train, the next 250 valid, the rest test
        splits = {"train": ("test", 0, 1500), "valid": ("test", 1500, 1750), "test": ("test", 1750, 1999)}
    else:
        # newstest2014 (3003 lines) trains, newstest2013 (3000) gives valid and test
        splits = {"train": ("test", 0, 3003), "valid": ("valid", 0, 250), "test": ("valid", 250, 500)}
    return replace(
        setup,
        name=setup.name,
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
