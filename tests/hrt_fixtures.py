"""In-process tiny HRT models (random weights) for decoding tests: no training needed,
since every property tested holds for any weights."""

import os

import torch
from fairseq import options, tasks
from fairseq.data import Dictionary

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
USER_DIR = os.path.join(REPO, "fairseq_hrt")


def write_dictionary(data_dir, n_words=40):
    d = Dictionary()
    for i in range(n_words):
        d.add_symbol(f"w{i}", n=1000 - i)
    d.finalize(padding_factor=1)
    for lang in ("src", "tgt"):
        d.save(os.path.join(data_dir, f"dict.{lang}.txt"))
    return d


def build_task_and_model(data_dir, arch="hrt_tiny", extra=(), seed=1):
    args = training_args(data_dir, arch, extra)
    torch.manual_seed(seed)
    task = tasks.setup_task(args)
    model = task.build_model(args)
    model.eval()
    return task, model


def training_args(data_dir, arch="hrt_tiny", extra=()):
    """fairseq-train's arguments of a tiny model on a fresh dictionary in ``data_dir``."""
    write_dictionary(data_dir)
    parser = options.get_training_parser()
    return options.parse_args_and_arch(
        parser,
        [
            data_dir,
            "--user-dir",
            USER_DIR,
            "--task",
            "hrt_translation",
            "--source-lang",
            "src",
            "--target-lang",
            "tgt",
            "--arch",
            arch,
            "--chunk-sizes",
            "2,3",
            "--share-all-embeddings",
            "--dropout",
            "0",
            *extra,
        ],
    )


def random_tiny_models(tmp_path_factory, name: str):
    """``(data_dir, task, hrt_tiny, at_tiny)``: untrained tiny HRT and AT models of one
    dictionary (seeds 3 and 4), the random models the decoding tests compare engines on.
    Each test module builds its own (some tests quantize or cast them in place)."""
    data_dir = str(tmp_path_factory.mktemp(name))
    task, hrt = build_task_and_model(data_dir, arch="hrt_tiny", seed=3)
    _, at = build_task_and_model(data_dir, arch="at_tiny", seed=4)
    return data_dir, task, hrt, at


def generation_args(data_dir, *extra):
    parser = options.get_generation_parser()
    return options.parse_args_and_arch(
        parser,
        [
            data_dir,
            "--user-dir",
            USER_DIR,
            "--task",
            "hrt_translation",
            "--source-lang",
            "src",
            "--target-lang",
            "tgt",
            "--path",
            "unused.pt",
            *extra,
        ],
    )


def build_generator(data_dir, model, *flags):
    """What fairseq-generate does: a task set up from the generation command line (decoding
    options are task options), the model prepared for decoding as loading does (``--quantize``),
    then ``task.build_generator``."""
    args = generation_args(data_dir, *flags)
    task = tasks.setup_task(args)
    task.prepare_models_for_decoding([model])
    return task, task.build_generator([model], args)


def make_sample(task, sentences):
    """Batch of source sentences (lists of word ids), left-padded as fairseq's collater does."""
    d = task.source_dictionary
    rows = [torch.tensor([d.index(f"w{i}") for i in s] + [d.eos()]) for s in sentences]
    width = max(len(r) for r in rows)
    src = torch.full((len(rows), width), d.pad(), dtype=torch.long)
    for i, r in enumerate(rows):
        src[i, width - len(r) :] = r  # left padding (fairseq's default for sources)
    return {
        "id": torch.arange(len(rows)),
        "net_input": {"src_tokens": src, "src_lengths": torch.tensor([len(r) for r in rows])},
    }
