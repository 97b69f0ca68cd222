"""The recipe's steps as commands: one function per step, each turning a :class:`plan.Plan`
into the jobs the step runs and the files it reads. Nothing here runs anything
(recipe.py submits the jobs; ``--print-commands`` prints them)."""

import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import launch
from plan import Plan
from results import BENCH_BATCH_SIZES
from setups import Training

SCRIPT_DIR = Path(__file__).resolve().parent
REPO = SCRIPT_DIR.parents[1]

STEPS = (
    "download prepare binarize teacher distill merge distill_bin at_student hrt mp average evaluate benchmark export"
).split()
# the steps whose outputs each step reads: one of them done again makes it run again
UPSTREAM = {
    "download": (),
    "prepare": ("download",),
    "binarize": ("prepare",),
    "teacher": ("binarize",),
    "distill": ("teacher", "prepare", "binarize"),
    "merge": ("distill",),
    "distill_bin": ("merge", "binarize", "prepare"),
    "at_student": ("distill_bin", "binarize"),
    "hrt": ("at_student", "distill_bin", "binarize"),
    "mp": ("at_student", "distill_bin", "binarize"),
    "average": ("at_student", "hrt", "mp"),
    "evaluate": ("average", "teacher", "prepare", "binarize"),
    "benchmark": ("average", "prepare", "binarize"),
    "export": ("average", "prepare", "binarize"),
}


@dataclass
class Job:
    label: str  # its log and marker name
    command: str  # one shell command line
    train: bool = False  # a fairseq-train: the step's nodes x GPUs, distributed
    gpu: Optional[int] = None  # a single-GPU job pinned to this GPU (distillation shards, locally)


@dataclass
class Step:
    name: str
    jobs: List[Job]
    needs: List[Tuple[Path, str]] = field(default_factory=list)  # (input, the step that makes it)
    parallel: bool = False  # jobs run at the same time (the distillation shards)
    skip_reason: str = ""  # why this set-up has no such step


def sh(words: Sequence) -> str:
    return shlex.join(str(w) for w in words)


def max_tokens(plan: Plan) -> int:
    """Decoding's --max-tokens (distillation, evaluation)."""
    return 4096 if plan.cpu else 16384


# ---------------------------------------------------------------------- training


def train_launcher(plan: Plan) -> List[str]:
    """The program of a training job: torchrun over the local GPUs, or fairseq-train (one per
    SLURM task, or alone)."""
    if plan.args.launcher != "slurm" and plan.gpus > 1:
        return ["torchrun", "--nproc-per-node", plan.gpus, "-m", "fairseq_cli.train"]
    if plan.args.launcher == "slurm" and plan.cpu and plan.nodes > 1:
        # fairseq's SLURM init counts GPUs for ranks: on CPU one rank per task (launch.py)
        return ["python", plan.path(SCRIPT_DIR / "launch.py"), "fairseq-train"]
    return ["fairseq-train"]


def train(plan: Plan, name: str, training: Training, extra: Sequence) -> Job:
    s, p = plan.setup, plan.path
    words = [
        *train_launcher(plan), p(plan.data_bin), "--user-dir", p(REPO / "fairseq_hrt"),
        "--task", "hrt_translation", "--source-lang", s.src, "--target-lang", s.tgt,
        "--arch", training.arch, *training.extra, "--share-all-embeddings",
        "--criterion", "hrt_loss", "--label-smoothing", s.label_smoothing,
        "--optimizer", "adam", "--adam-betas", str(training.adam_betas), "--adam-eps", training.adam_eps,
        "--clip-norm", "0.0",
        "--lr", training.lr, "--lr-scheduler", "inverse_sqrt", "--warmup-updates", training.warmup,
        "--warmup-init-lr", "1e-07", "--dropout", training.dropout, "--weight-decay", "0.0",
        "--max-tokens", training.max_tokens, "--update-freq", plan.update_freq_for(training),
        "--max-update", training.max_update, "--save-dir", p(plan.model_dir(name)),
        "--save-interval-updates", s.save_interval_updates, "--keep-interval-updates", s.average_last,
        "--no-epoch-checkpoints", "--log-format", "simple", "--log-interval", s.log_interval,
        "--seed", plan.args.seed, *extra, *plan.device_words(),
    ]  # fmt: skip
    if plan.args.slice:
        # the slice's valid set is tiny and its numbers mean nothing: no validation passes
        words += ["--disable-validation", "--num-workers", "0"]
    words += launch.distributed_words(plan.args.launcher, plan.nodes, plan.gpus, plan.cpu)
    return Job(name, sh(words), train=True)


def mix_distill(plan: Plan) -> List:
    return ["--distill-data", plan.path(plan.work / "distill-bin"), "--p-raw", plan.setup.p_raw]


def dictionary(plan: Plan) -> Path:
    return plan.data_bin / f"dict.{plan.setup.src}.txt"


# ---------------------------------------------------------------------- data


def download(plan: Plan) -> Step:
    s, p, args = plan.setup, plan.path, plan.args
    if plan.corpus:
        return Step("download", [], skip_reason=f"--corpus: {p(plan.corpus)} is read where it is")
    if args.slice:
        words = ["python", p(SCRIPT_DIR / "make_slice.py"), "--setup", s.name, "--size", args.slice_size]
        words += ["--data", p(args.data), "--dest", p(plan.work / "download")]
        words += ["--train-lines", args.slice_train_lines] if args.slice_train_lines else []
        words += ["--test-lines", args.slice_test_lines] if args.slice_test_lines else []
    else:
        words = ["python", p(SCRIPT_DIR / "download.py"), "--setup", s.download_setup]
        words += ["--dest", p(plan.work / "download")]
    return Step("download", [Job("download", sh(words))])


def prepare(plan: Plan) -> Step:
    s, p = plan.setup, plan.path
    words = ["python", p(SCRIPT_DIR / "prepare.py"), "--raw", p(plan.raw), "--out", p(plan.data)]
    words += ["--src", s.src, "--tgt", s.tgt, "--vocab-size", s.vocab_size, "--threads", plan.threads]
    words += ["--clean-max-len", s.clean_max_len, "--clean-ratio", s.clean_ratio]
    return Step("prepare", [Job("prepare", sh(words))], [(plan.raw / f"train.{s.src}", "download")])


def binarize(plan: Plan) -> Step:
    s, p = plan.setup, plan.path
    spm = plan.data / "spm"
    words = [
        "fairseq-preprocess", "--source-lang", s.src, "--target-lang", s.tgt, "--joined-dictionary",
        "--trainpref", p(spm / "train"), "--validpref", p(spm / "valid"), "--testpref", p(spm / "test"),
        "--destdir", p(plan.data_bin), "--workers", plan.threads,
    ]  # fmt: skip
    return Step("binarize", [Job("binarize", sh(words))], [(spm / f"train.{s.tgt}", "prepare")])


# ---------------------------------------------------------------------- the teacher and its distillation


def teacher(plan: Plan) -> Step:
    extra = ["--hrt-mode", "at"]
    if not plan.args.slice:  # validation BLEU picks the teacher, as fairseq's translation examples
        extra += [
            "--eval-bleu", "--eval-bleu-args", '{"beam": 5, "max_len_a": 1.2, "max_len_b": 10}',
            "--eval-bleu-remove-bpe", "sentencepiece", "--best-checkpoint-metric", "bleu",
            "--maximize-best-checkpoint-metric",
        ]  # fmt: skip
    job = train(plan, "teacher", plan.setup.teacher, extra)
    return Step("teacher", [job], [(dictionary(plan), "binarize")])


def distill(plan: Plan) -> Step:
    s, p = plan.setup, plan.path
    jobs = []
    for shard in range(plan.shards):
        words = [
            "python", "-m", "fairseq_hrt.distill", "--data", p(plan.data_bin),
            "--path", p(plan.last("teacher")), "--src", p(plan.data / "spm" / f"train.{s.src}"),
            "--out", p(plan.distill_out), "--beam", s.distill_beam, "--nbest", 1,
            "--max-len-a", s.max_len_a, "--max-len-b", s.max_len_b, "--max-tokens", max_tokens(plan),
            "--num-shards", plan.shards, "--shard-id", shard, "--threads", 1 if plan.cpu else 0,
            *plan.device_words(),
        ]  # fmt: skip
        gpu = shard if (not plan.cpu and plan.args.launcher != "slurm") else None
        jobs.append(Job(f"distill-shard-{shard}", sh(words), gpu=gpu))
    return Step("distill", jobs, [(plan.last("teacher"), "teacher")], parallel=True)


def merge(plan: Plan) -> Step:
    words = ["python", "-m", "fairseq_hrt.distill", "--merge", "--out", plan.path(plan.distill_out)]
    words += ["--num-shards", plan.shards]
    first_shard = Path(f"{plan.distill_out}.shard-0-of-{plan.shards}")
    return Step("merge", [Job("merge", sh(words))], [(first_shard, "distill")])


def distill_bin(plan: Plan) -> Step:
    s, p = plan.setup, plan.path
    # fairseq-preprocess reads the source beside the distilled target: a link to the pieces
    link = plan.work / "distill" / f"train.{s.src}"
    words = [
        "fairseq-preprocess", "--source-lang", s.src, "--target-lang", s.tgt,
        "--trainpref", p(plan.work / "distill" / "train"), "--srcdict", p(dictionary(plan)),
        "--tgtdict", p(dictionary(plan)), "--destdir", p(plan.work / "distill-bin"), "--workers", plan.threads,
    ]  # fmt: skip
    command = f"ln -sfn ../data/spm/train.{s.src} {shlex.quote(p(link))} && {sh(words)}"
    return Step(
        "distill_bin", [Job("distill_bin", command)], [(plan.distill_out, "merge"), (dictionary(plan), "binarize")]
    )


# ---------------------------------------------------------------------- the students


def at_student(plan: Plan) -> Step:
    job = train(plan, "at", plan.setup.at, ["--hrt-mode", "at", *mix_distill(plan)])
    return Step("at_student", [job], [(plan.work / "distill-bin" / f"dict.{plan.setup.tgt}.txt", "distill_bin")])


def hrt(plan: Plan) -> Step:
    jobs = []
    for k in plan.setup.hrt_chunk_sizes:
        # the curriculum (p_k from 0 to 1 over --max-update) and fine-tuning from AT: [HRT] Sec. 4
        extra = ["--hrt-mode", "hrt", "--chunk-sizes", k, "--finetune-from-model", plan.path(plan.last("at"))]
        jobs.append(train(plan, f"hrt-k{k}", plan.setup.hrt, extra + mix_distill(plan)))
    return Step("hrt", jobs, [(plan.last("at"), "at_student")])


def mp(plan: Plan) -> Step:
    s = plan.setup
    if not s.mp_student:
        return Step("mp", [], skip_reason=f"{s.name}'s paper trains no Mask-Predict student")
    extra = ["--hrt-mode", "cmlm", "--finetune-from-model", plan.path(plan.last("at")), *mix_distill(plan)]
    return Step("mp", [train(plan, "mp", s.mp, extra)], [(plan.last("at"), "at_student")])


def average(plan: Plan) -> Step:
    jobs = []
    for model in plan.students():
        words = [
            "python", "-m", "fairseq_hrt.average_checkpoints", "--inputs", plan.path(plan.model_dir(model)),
            "--num-update-checkpoints", plan.setup.average_last, "--output", plan.path(plan.averaged(model)),
        ]  # fmt: skip
        jobs.append(Job(f"average-{model}", sh(words)))
    return Step("average", jobs, [(plan.last(m), plan.maker(m)) for m in plan.students()])


# ---------------------------------------------------------------------- what the averaged students give


def averaged_students(plan: Plan) -> List[Tuple[Path, str]]:
    return [(plan.averaged(m), "average") for m in plan.students()]


def evaluate(plan: Plan) -> Step:
    s = plan.setup
    rows = [("teacher", plan.last("teacher"), ["--beam", s.distill_beam])]
    rows.append(("at-greedy", plan.averaged("at"), ["--beam", 1]))
    if s.at_beam > 1:
        rows.append((f"at-beam{s.at_beam}", plan.averaged("at"), ["--beam", s.at_beam]))
    for k in s.hrt_chunk_sizes:
        rows.append((f"hrt-k{k}", plan.averaged(f"hrt-k{k}"), ["--decode-chunk-size", k, "--beam", s.hrt_beam]))
        rows[-1][2].extend(["--b-nat", 1])
    if s.mp_student:
        mp_options = ["--iter-decode-max-iter", s.mp_iterations, "--iter-decode-with-beam", s.mp_length_beam]
        rows.append((f"mp-i{s.mp_iterations}", plan.averaged("mp"), mp_options))
    jobs = [Job(f"evaluate-{row}", evaluate_command(plan, row, ckpt, opts)) for row, ckpt, opts in rows]
    return Step("evaluate", jobs, averaged_students(plan))


def evaluate_command(plan: Plan, row: str, checkpoint: Path, options: List) -> str:
    """fairseq-generate of the test set, its detokenized hypotheses in source order, and
    the paper's metrics of them (python -m fairseq_hrt.evaluate)."""
    s, p = plan.setup, plan.path
    out = plan.work / "evaluate"
    gen, hyp = p(out / f"{row}.gen"), p(out / f"{row}.{s.tgt}")
    words = [
        "fairseq-generate", p(plan.data_bin), "--user-dir", p(REPO / "fairseq_hrt"), "--task", "hrt_translation",
        "--source-lang", s.src, "--target-lang", s.tgt, "--gen-subset", "test", "--path", p(checkpoint),
        *options, "--lenpen", s.lenpen, "--max-len-a", s.max_len_a, "--max-len-b", s.max_len_b,
        "--max-tokens", max_tokens(plan), "--post-process", "sentencepiece", *plan.device_words(),
    ]  # fmt: skip
    scoring = [
        "python", "-m", "fairseq_hrt.evaluate", "--hyp", hyp, "--ref", p(plan.data / "raw" / f"test.{s.tgt}"),
        "--src", p(plan.data / "raw" / f"test.{s.src}"), "--target-lang", s.tgt,
        *(["--compound-split"] if s.compound_split else []),
        *(["--remove-ro-diacritics"] if s.remove_ro_diacritics else []), "--json", p(out / f"{row}.json"),
    ]  # fmt: skip
    return (
        f"mkdir -p {shlex.quote(p(out))} && {sh(words)} > {shlex.quote(gen)} && "
        f"grep ^D- {shlex.quote(gen)} | sed 's/^D-//' | sort -n -k1,1 | cut -f3 > {shlex.quote(hyp)} && "
        f"{sh(scoring)}"
    )


def benchmark(plan: Plan) -> Step:
    s, p = plan.setup, plan.path
    jobs = []
    for i, k in enumerate(s.hrt_chunk_sizes):
        words = [
            "python", p(REPO / "benchmarks" / "benchmark.py"), "--data", p(plan.data_bin),
            "--spm", p(plan.data / "spm" / "spm.model"), "--src", p(plan.data / "spm" / f"test.{s.src}"),
            "--raw-src", p(plan.data / "raw" / f"test.{s.src}"), "--raw-ref", p(plan.data / "raw" / f"test.{s.tgt}"),
            "--at", p(plan.averaged("at")), "--at-beams", "1", "--hrt", p(plan.averaged(f"hrt-k{k}")),
            "--hrt-chunk-sizes", k, "--hrt-beams", f"{s.hrt_beam}/1", "--hrt-at-mode", "no",
            "--engines", "lean", "--ctranslate2", "no", "--int8", "no", "--lenpen", s.lenpen,
            "--max-len-a", s.max_len_a, "--max-len-b", s.max_len_b,
            "--batch-sizes", ",".join(map(str, BENCH_BATCH_SIZES)),
            "--bs1-sentences", s.bench_bs1_sentences, "--max-sentences", s.bench_sentences,
            "--threads", plan.threads, "--out-dir", p(plan.work / "benchmark" / f"k{k}"),
        ]  # fmt: skip
        if i == 0 and s.mp_student:  # Mask-Predict once, beside the first k
            words += ["--mp", p(plan.averaged("mp")), "--mp-iterations", s.mp_iterations]
            words += ["--mp-length-beam", s.mp_length_beam]
        words += ["--cpu"] if plan.cpu else (["--fp16"] if plan.args.fp16 else [])
        jobs.append(Job(f"benchmark-k{k}", sh(words)))
    return Step("benchmark", jobs, averaged_students(plan))


def export(plan: Plan) -> Step:
    p = plan.path
    jobs = []
    for model in plan.students():
        words = ["fairseq-hrt-export", p(plan.averaged(model)), p(plan.work / "export" / model)]
        words += ["--data", p(plan.data_bin), "--sentencepiece-model", p(plan.data / "spm" / "spm.model")]
        jobs.append(Job(f"export-{model}", sh(words)))
    return Step("export", jobs, averaged_students(plan))


BUILDERS = {
    "download": download, "prepare": prepare, "binarize": binarize, "teacher": teacher, "distill": distill,
    "merge": merge, "distill_bin": distill_bin, "at_student": at_student, "hrt": hrt, "mp": mp,
    "average": average, "evaluate": evaluate, "benchmark": benchmark, "export": export,
}  # fmt: skip
assert list(BUILDERS) == STEPS


def build_step(plan: Plan, name: str) -> Step:
    """Step ``name`` of ``plan``: its jobs' commands and what it reads."""
    return BUILDERS[name](plan)
