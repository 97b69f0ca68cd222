"""Sequence-level knowledge distillation of a training set with a teacher checkpoint.

Translates a source file, as the model reads it (e.g. SentencePiece pieces, like the input of
``fairseq-preprocess``), with beam search and writes the teacher's translations line-aligned
in the same token format, ready for ``fairseq-preprocess --srcdict/--tgtdict`` and the
task's ``--distill-data`` (MixDistill, SPEC section 2).

* default: keep the teacher's top hypothesis (Kim & Rush 2016, sequence-level KD);
* ``--select-by-bleu REF``: keep, out of the teacher's ``--nbest`` list, the hypothesis with
  the highest sentence-BLEU against the reference (interpolated KD, as in Marian's WNGT 2019
  students). Hypotheses are detokenised with ``--post-process`` (fairseq's option, e.g.
  ``sentencepiece``) and compared with the raw reference by sacreBLEU's sentence BLEU
  (effective order, exponential smoothing). Ties go to the better model score.

Empty source lines give empty output lines without being decoded; line counts are checked.

Example::

    python -m fairseq_hrt.distill --data work/multi30k/data-bin --path teacher.pt \\
        --src work/multi30k/spm/train.en --out distill/train.de \\
        --beam 5 --nbest 5 --select-by-bleu work/multi30k/raw/train.de --post-process sentencepiece
"""

import argparse
import logging
import os
import time
from typing import List, Optional, Sequence

import torch
from fairseq import checkpoint_utils, utils
from fairseq.data import data_utils
from fairseq.dataclass.configs import GenerationConfig
from sacrebleu.metrics import BLEU
from tqdm import tqdm

import fairseq_hrt  # noqa: F401  (registers the plugin, applies compat)
from fairseq_hrt.cli_logging import RefusedOptions, install_refusal_hook, setup_logging
from fairseq_hrt.generation.engines import engine_choices
from hrt_runtime import text_input
from hrt_runtime.text_input import InputTextError

logger = logging.getLogger("fairseq_hrt.distill")


# --------------------------------------------------------------------------- pure parts


def sentence_bleu_scores(candidates: Sequence[str], reference: str) -> List[float]:
    """Sentence-BLEU of every candidate against one reference (detokenised text)."""
    # effective_order: short sentences are not all zero for lack of 4-gram matches
    bleu = BLEU(effective_order=True)
    return [bleu.sentence_score(c, [reference]).score for c in candidates]


def select_by_sentence_bleu(candidates: Sequence[str], reference: str) -> int:
    """Index of the candidate with the highest sentence-BLEU against ``reference``.

    ``candidates`` is an n-best list in model-score order, so on a tie the earlier (better
    scored) hypothesis wins.
    """
    if not candidates:
        raise ValueError("empty n-best list")
    scores = sentence_bleu_scores(candidates, reference)
    return max(range(len(scores)), key=lambda i: (scores[i], -i))


def read_lines(path: str, errors: str = "replace") -> List[str]:
    """The lines of ``path`` as every entry point reads input (:mod:`hrt_runtime.text_input`):
    bytes that are not valid UTF-8 become U+FFFD (or stop the run, ``errors="strict"``) and
    control characters are handled, with a warning naming the file and line; never a line
    more or less, so the output stays aligned."""
    return text_input.read_lines(path, errors=errors)


def write_lines_atomic(path: str, lines: Sequence[str]) -> None:
    """Write ``path`` through ``path.part`` so an interrupted run leaves no partial output."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    part = path + ".part"
    with open(part, "w", encoding="utf-8") as f:
        for line in lines:
            f.write(line + "\n")
    os.replace(part, path)


# --------------------------------------------------------------------------- decoding


def translate_nbest(
    task,
    model,
    lines: Sequence[str],
    beam: int,
    nbest: int,
    max_tokens: Optional[int],
    batch_size: Optional[int],
    max_len_a: float,
    max_len_b: int,
    lenpen: float,
    use_cuda: bool,
    progress: bool = True,
) -> List[List[str]]:
    """The ``nbest`` best translations (model token strings, best first) of every line.

    Lines are batched by fairseq's length-sorted batching; empty lines get ``[""]`` and are
    not decoded.
    """
    src_dict, tgt_dict = task.source_dictionary, task.target_dictionary
    todo = [i for i, line in enumerate(lines) if line.strip()]
    results: List[List[str]] = [[""] for _ in lines]
    if not todo:
        return results
    tokens = [src_dict.encode_line(lines[i], add_if_not_exist=False).long() for i in todo]
    dataset = task.build_dataset_for_inference(tokens, [t.numel() for t in tokens])
    itr = task.get_batch_iterator(
        dataset=dataset,
        max_tokens=max_tokens,
        max_sentences=batch_size,
        max_positions=utils.resolve_max_positions(task.max_positions(), model.max_positions()),
        ignore_invalid_inputs=False,
    ).next_epoch_itr(shuffle=False)
    generator = task.build_generator(
        [model], GenerationConfig(beam=beam, nbest=nbest, max_len_a=max_len_a, max_len_b=max_len_b, lenpen=lenpen)
    )
    # symbols the teacher must not write into a training target (eos ends every line anyway)
    ignore = {tgt_dict.eos(), tgt_dict.bos()}
    bar = tqdm(total=len(todo), desc="distill", unit="sent", disable=None if progress else True)
    with torch.no_grad():
        for sample in itr:
            if use_cuda:
                sample = utils.move_to_cuda(sample)
            hypos = task.inference_step(generator, [model], sample)
            for j, sid in enumerate(sample["id"].tolist()):
                results[todo[sid]] = [
                    tgt_dict.string(h["tokens"].int().cpu(), extra_symbols_to_ignore=ignore) for h in hypos[j][:nbest]
                ]
            bar.update(len(hypos))
    bar.close()
    return results


def check_nbest(task, model, lines: Sequence[str], args, use_cuda: bool) -> None:
    """Refuse ``--nbest N > 1`` for a teacher whose decoding gives one candidate a sentence (an
    HRT model decodes in HRT mode: stage II fills one skeleton), found on the first non-empty
    line before the whole file is decoded: --select-by-bleu would have nothing to choose from."""
    first = next((line for line in lines if line.strip()), None)
    if args.nbest <= 1 or first is None:
        return
    found = translate_nbest(
        task,
        model,
        [first],
        args.beam,
        args.nbest,
        None,
        1,
        args.max_len_a,
        args.max_len_b,
        args.lenpen,
        use_cuda,
        progress=False,
    )[0]
    if len(found) < 2:
        raise RefusedOptions(
            f"--nbest {args.nbest}: this teacher's decoding gives {len(found)} candidate a sentence "
            "(HRT decoding fills one skeleton), so --select-by-bleu has nothing to choose from; "
            "drop --nbest and --select-by-bleu, or distil with an AT teacher"
        )


# --------------------------------------------------------------------------- CLI


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m fairseq_hrt.distill",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--data", required=True, help="binarized data dir of the teacher (its dictionaries)")
    p.add_argument("--path", required=True, help="teacher checkpoint")
    p.add_argument("--src", required=True, help="source file as the model reads it (e.g. SentencePiece pieces)")
    p.add_argument("--out", required=True, help="output: distilled targets, same token format, line-aligned")
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--nbest", type=int, default=1, help="n-best list size (<= --beam) for --select-by-bleu")
    p.add_argument(
        "--select-by-bleu",
        metavar="REF",
        help="raw (detokenised) reference file: keep the n-best hypothesis with the best sentence-BLEU against it",
    )
    p.add_argument(
        "--post-process",
        default="sentencepiece",
        help="fairseq's --post-process used to detokenise hypotheses for --select-by-bleu (default: sentencepiece)",
    )
    p.add_argument(
        "--input-errors",
        choices=("replace", "strict"),
        default="replace",
        help="lines of --src / --select-by-bleu with bytes that are not valid UTF-8: 'replace' them by U+FFFD "
        "with a warning naming file and line (default), or 'strict': stop at the first one with that message",
    )
    p.add_argument("--max-tokens", type=int, default=6000, help="source tokens per batch")
    p.add_argument("--batch-size", type=int, default=None, help="sentences per batch (default: no limit)")
    p.add_argument("--max-len-a", type=float, default=0, help="max target length = a * source length + b")
    p.add_argument("--max-len-b", type=int, default=200)
    p.add_argument("--lenpen", type=float, default=1.0)
    p.add_argument(
        "--decoder-engine",
        default="lean",
        help="the engine that decodes (as fairseq-generate's --decoder-engine: lean, fairseq, "
        "onnxruntime); the same search and translations, at the engine's speed",
    )
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    p.add_argument("--cpu", action="store_true", help="decode on CPU even if a GPU is present")
    p.add_argument("--fp16", action="store_true", help="half precision (GPU only)")
    p.add_argument("--log-file", help="write the log to this file instead of stderr")
    p.add_argument("--no-progress-bar", action="store_true")
    args = p.parse_args(argv)
    if args.beam < 1 or not 1 <= args.nbest <= args.beam:
        p.error(f"need 1 <= --nbest <= --beam, got --nbest {args.nbest} --beam {args.beam}")
    if args.nbest > 1 and not args.select_by_bleu:
        p.error("--nbest > 1 only makes sense with --select-by-bleu REF (otherwise the top hypothesis is kept)")
    return args


def main(argv=None):
    install_refusal_hook()  # under `python -m fairseq_hrt.distill` only: a refusal is one line
    args = parse_args(argv)
    setup_logging(args.log_file)

    if args.threads:
        torch.set_num_threads(args.threads)
    use_cuda = torch.cuda.is_available() and not args.cpu
    if args.fp16 and not use_cuda:
        raise SystemExit("--fp16 needs a GPU")

    try:
        src = read_lines(args.src, args.input_errors)
        refs = read_lines(args.select_by_bleu, args.input_errors) if args.select_by_bleu else None
    except InputTextError as e:
        raise SystemExit(f"{e} (--input-errors strict; 'replace' translates such lines with U+FFFD instead)")
    if refs is not None and len(refs) != len(src):
        raise SystemExit(
            f"--select-by-bleu {args.select_by_bleu} has {len(refs)} lines but --src {args.src} has {len(src)}; "
            "they must be aligned line by line"
        )

    if args.decoder_engine not in engine_choices():
        raise SystemExit(f"--decoder-engine must be one of {', '.join(engine_choices())}, got {args.decoder_engine!r}")
    models, _, task = checkpoint_utils.load_model_ensemble_and_task(
        [args.path], arg_overrides={"data": args.data, "decoder_engine": args.decoder_engine}
    )
    model = models[0].eval()
    if args.fp16:
        model.half()
    if use_cuda:
        model.cuda()
    logger.info(
        "distilling %d lines of %s with %s: beam %d, n-best %d, %s; %s, %d thread(s)",
        len(src),
        args.src,
        args.path,
        args.beam,
        args.nbest,
        f"select by sentence-BLEU against {args.select_by_bleu}" if refs else "keep the top hypothesis",
        "GPU" if use_cuda else "CPU",
        torch.get_num_threads(),
    )
    check_nbest(task, model, src, args, use_cuda)
    start = time.perf_counter()
    nbest = translate_nbest(
        task,
        model,
        src,
        args.beam,
        args.nbest,
        args.max_tokens,
        args.batch_size,
        args.max_len_a,
        args.max_len_b,
        args.lenpen,
        use_cuda,
        progress=not args.no_progress_bar,
    )
    seconds = time.perf_counter() - start

    out, changed = [], 0
    for i, cands in enumerate(nbest):
        best = 0
        if refs is not None and len(cands) > 1:
            best = select_by_sentence_bleu([data_utils.post_process(c, args.post_process) for c in cands], refs[i])
            changed += best != 0
        out.append(cands[best])
    if len(out) != len(src):  # translate_nbest returns one entry per line; never write a misaligned file
        raise RuntimeError(f"internal error: {len(out)} outputs for {len(src)} source lines")
    write_lines_atomic(args.out, out)
    logger.info(
        "wrote %s: %d lines (%d empty) in %.1fs, %.1f sentences/s%s",
        args.out,
        len(out),
        sum(1 for line in out if not line),
        seconds,
        len(src) / max(seconds, 1e-9),
        f"; sentence-BLEU picked a hypothesis other than the top one for {changed} lines" if refs else "",
    )


if __name__ == "__main__":
    main()
