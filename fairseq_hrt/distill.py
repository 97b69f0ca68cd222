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

Many GPUs: ``--num-shards N --shard-id I`` (or, under torchrun, RANK / WORLD_SIZE, LOCAL_RANK
the GPU) decodes shard I of N into ``OUT.shard-I-of-N``, appended and flushed batch by batch,
so a rerun of the same command continues after the last complete batch; a finished shard
writes ``OUT.shard-I-of-N.done``. Every shard forms the batches of the whole file exactly as
one process does and decodes every N-th of them, so the merged output is byte for byte the
one-process output::

    torchrun --nproc_per_node 8 -m fairseq_hrt.distill ... --out distill/train.de
    python -m fairseq_hrt.distill --merge --out distill/train.de --num-shards 8
"""

import argparse
import fcntl
import json
import logging
import os
import shlex
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from fairseq import checkpoint_utils, tasks, utils
from fairseq.data import data_utils
from fairseq.dataclass.configs import GenerationConfig
from sacrebleu.metrics import BLEU
from tqdm import tqdm

import fairseq_hrt  # noqa: F401  (registers the plugin and the checkpoint types it loads safely)
from fairseq_hrt.cli_logging import RefusedOptions, install_refusal_hook, setup_logging
from fairseq_hrt.generation.engines import engine_choices
from hrt_runtime import text_input
from hrt_runtime.integrity import sha256_of
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


def choose_hypothesis(candidates: Sequence[str], reference: Optional[str], post_process: str) -> int:
    """Index of the kept hypothesis of an n-best list: the top one, or with a reference the
    best by sentence-BLEU of the detokenised candidates (the same choice in every shard)."""
    if reference is None or len(candidates) < 2:
        return 0
    return select_by_sentence_bleu([data_utils.post_process(c, post_process) for c in candidates], reference)


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


def plan_batches(task, model, lines: Sequence[str], max_tokens: Optional[int], batch_size: Optional[int]):
    """``(dataset, todo, batches)``: the non-empty lines (``todo``, line numbers), their
    inference dataset and fairseq's length-sorted batches of dataset indices, the same list
    in every process that plans the same file with the same options (shards pick from it)."""
    todo = [i for i, line in enumerate(lines) if line.strip()]
    if not todo:
        return None, todo, []
    src_dict = task.source_dictionary
    tokens = [src_dict.encode_line(lines[i], add_if_not_exist=False).long() for i in todo]
    dataset = task.build_dataset_for_inference(tokens, [t.numel() for t in tokens])
    itr = task.get_batch_iterator(
        dataset=dataset,
        max_tokens=max_tokens,
        max_sentences=batch_size,
        max_positions=utils.resolve_max_positions(task.max_positions(), model.max_positions()),
        ignore_invalid_inputs=False,
    )
    return dataset, todo, [list(batch) for batch in itr.frozen_batches]


def build_decoder(task, model, beam: int, nbest: int, max_len_a: float, max_len_b: int, lenpen: float):
    """``decode(sample) -> [(dataset index, n-best token strings)]`` for one collated batch."""
    tgt_dict = task.target_dictionary
    generator = task.build_generator(
        [model], GenerationConfig(beam=beam, nbest=nbest, max_len_a=max_len_a, max_len_b=max_len_b, lenpen=lenpen)
    )
    # symbols the teacher must not write into a training target (eos ends every line anyway)
    ignore = {tgt_dict.eos(), tgt_dict.bos()}

    def decode(sample) -> List[Tuple[int, List[str]]]:
        with torch.no_grad():
            hypos = task.inference_step(generator, [model], sample)
        return [
            (sid, [tgt_dict.string(h["tokens"].int().cpu(), extra_symbols_to_ignore=ignore) for h in hypos[j][:nbest]])
            for j, sid in enumerate(sample["id"].tolist())
        ]

    return decode


def collate(dataset, batch: Sequence[int], use_cuda: bool):
    """One batch as fairseq's batch iterator gives it (its DataLoader collates the same way)."""
    sample = dataset.collater([dataset[i] for i in batch])
    return utils.move_to_cuda(sample) if use_cuda else sample


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
    results: List[List[str]] = [[""] for _ in lines]
    dataset, todo, batches = plan_batches(task, model, lines, max_tokens, batch_size)
    if not todo:
        return results
    decode = build_decoder(task, model, beam, nbest, max_len_a, max_len_b, lenpen)
    bar = tqdm(total=len(todo), desc="distill", unit="sent", disable=None if progress else True)
    for batch in batches:
        for sid, cands in decode(collate(dataset, batch, use_cuda)):
            results[todo[sid]] = cands
        bar.update(len(batch))
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


def load_teacher(args):
    """``(model, task)`` of ``--path`` with the dictionaries of ``--data``. A teacher trained
    on another dictionary is refused before anything is decoded: with as many symbols it would
    load and silently write other words, with another count it would fail half-way through
    loading. The checkpoints of this plugin's task store their dictionary's fingerprint."""
    overrides = {"data": args.data, "decoder_engine": args.decoder_engine}
    state = checkpoint_utils.load_checkpoint_to_cpu(args.path, overrides)
    task = tasks.setup_task(state["cfg"].task, from_checkpoint=True)
    mismatch = None
    for name, dictionary in (
        ("encoder.embed_tokens.weight", task.source_dictionary),
        ("decoder.embed_tokens.weight", task.target_dictionary),
    ):
        weight = state["model"].get(name)
        if mismatch is None and weight is not None and weight.size(0) != len(dictionary):
            mismatch = f"its {name} has {weight.size(0)} entries, --data's dictionary {len(dictionary)}"
    fingerprinted = hasattr(task, "dictionary_fingerprint")
    saved = type(task).saved_dictionary_fingerprint(state) if fingerprinted else None
    if mismatch is None and saved is not None:
        if saved != task.dictionary_fingerprint():
            mismatch = f"its dictionary's fingerprint is {saved}, --data's {task.dictionary_fingerprint()}"
    if mismatch:
        raise RefusedOptions(
            f"the teacher --path {args.path} was trained with another dictionary than --data {args.data} "
            f"({mismatch}): pass as --data the binarized data directory the teacher was trained on"
        )
    models, _, task = checkpoint_utils.load_model_ensemble_and_task(
        [args.path], arg_overrides=overrides, task=task, state=state
    )
    return models[0].eval(), task


# --------------------------------------------------------------------------- shards


def shard_file(out: str, shard_id: int, num_shards: int) -> str:
    return f"{out}.shard-{shard_id}-of-{num_shards}"


def done_file(shard: str) -> str:
    return shard + ".done"


# A shard file: one header line, then per batch its records and a batch marker::
#
#     #fairseq_hrt.distill shard\t{"inputs": {...}, "info": {...}}
#     <line id>\t<hypothesis>
#     ...
#     #batch\t<batch index in the whole file>\t<records of the batch>
#
# A batch counts once its marker line is complete: what follows the last one (the records of
# a batch a kill interrupted, a half-written line) is cut off when the shard resumes. Line ids
# are digits and the marker starts with "#", so no hypothesis is taken for a marker; a
# hypothesis is whole symbols of the dictionary joined by spaces, never a newline.
SHARD_HEADER = "#fairseq_hrt.distill shard\t"
BATCH_MARKER = "#batch\t"


@dataclass
class ShardContents:
    """What a shard file holds up to its last complete batch."""

    header: Optional[dict] = None
    records: List[Tuple[int, str]] = field(default_factory=list)
    last_batch: int = -1  # index (in the whole file) of the last complete batch
    complete_bytes: int = 0  # the file's length up to the end of that batch
    dropped_bytes: int = 0  # after it: an interrupted batch


def read_shard(path: str) -> ShardContents:
    """The complete batches of a shard file (split on b"\\n" only: a hypothesis may hold other
    line-break characters that str.splitlines would split on)."""
    with open(path, "rb") as f:
        data = f.read()
    contents = ShardContents()
    end = data.find(b"\n")
    if end < 0 or not data.startswith(SHARD_HEADER.encode()):
        contents.dropped_bytes = len(data)
        return contents
    try:
        contents.header = json.loads(data[len(SHARD_HEADER) : end].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        contents.dropped_bytes = len(data)
        return contents
    contents.complete_bytes = pos = end + 1
    pending: List[Tuple[int, str]] = []
    while True:
        end = data.find(b"\n", pos)
        if end < 0:
            break
        try:
            line = data[pos:end].decode("utf-8")
            if line.startswith(BATCH_MARKER):
                _, batch, count = line.split("\t")
                if int(count) != len(pending):
                    break
                contents.records += pending
                contents.last_batch, pending = int(batch), []
                contents.complete_bytes = end + 1
            else:
                line_id, hyp = line.split("\t", 1)
                if not line_id.isdigit():
                    break
                pending.append((int(line_id), hyp))
        except (UnicodeDecodeError, ValueError):  # a line damaged by a crash: the batch is redone
            break
        pos = end + 1
    contents.dropped_bytes = len(data) - contents.complete_bytes
    return contents


def read_done(path: str) -> Optional[dict]:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


PATH_OPTIONS = ("data", "path", "src", "out", "select_by_bleu", "log_file")
SHARD_OPTIONS = ("num_shards", "shard_id", "merge", "help")


def shard_command(parser: argparse.ArgumentParser, args, shard_id: int, num_shards: int) -> List[str]:
    """The words of the command line that (re)runs one shard alone: every option given, with
    absolute paths (it runs from any folder), and explicit ``--num-shards N --shard-id I`` last
    (they win over a launcher's RANK / WORLD_SIZE)."""
    words = [sys.executable if os.path.isabs(sys.executable) else "python", "-m", "fairseq_hrt.distill"]
    for action in parser._actions:
        if not action.option_strings or action.dest in SHARD_OPTIONS:
            continue
        value = getattr(args, action.dest)
        if value is None or value == action.default:
            continue
        flag = action.option_strings[0]
        if isinstance(action, argparse._StoreTrueAction):
            words.append(flag)
            continue
        if action.dest in PATH_OPTIONS:
            value = os.path.abspath(value)
        words += [flag, str(value)]
    return words + ["--num-shards", str(num_shards), "--shard-id", str(shard_id)]


def rerun_command(header: dict, shard_id: int, out: Optional[str] = None) -> str:
    """The command of shard ``shard_id`` of the distillation a shard's ``header`` belongs to
    (writing ``out``: the merge's, should the shard files have been moved since)."""
    words = list(header["argv"])
    words[-1] = str(shard_id)
    if out is not None and "--out" in words:
        words[words.index("--out") + 1] = os.path.abspath(out)
    return shlex.join(words)


def shard_inputs(args, n_lines: int, task, num_shards: int) -> Dict[str, object]:
    """Everything a shard's records depend on: a rerun with another value refuses to append
    to the file instead of mixing two distillations in one output."""
    return {
        "num_shards": num_shards,
        "src_lines": n_lines,
        "src_bytes": os.path.getsize(args.src),
        "src_sha256": sha256_of(args.src),
        "teacher_bytes": os.path.getsize(args.path),
        "teacher_sha256": sha256_of(args.path),
        "dictionary": task.dictionary_fingerprint() if hasattr(task, "dictionary_fingerprint") else None,
        "select_by_bleu_sha256": sha256_of(args.select_by_bleu) if args.select_by_bleu else None,
        "post_process": args.post_process if args.select_by_bleu else None,
        "input_errors": args.input_errors,
        "beam": args.beam,
        "nbest": args.nbest,
        "max_tokens": args.max_tokens,
        "batch_size": args.batch_size,
        "max_len_a": args.max_len_a,
        "max_len_b": args.max_len_b,
        "lenpen": args.lenpen,
        "decoder_engine": args.decoder_engine,
        "fp16": args.fp16,
    }


def lock_shard(f, path: str) -> None:
    """Refuse a second process on the same shard (a requeued job while the first still runs, a
    rerun beside a live torchrun): both would append the same batches to one file."""
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise RefusedOptions(
            f"{path} is being written by another process (is this shard running twice?): let it finish, "
            "or stop it and rerun this command, which continues where it stopped"
        ) from None
    except OSError as e:  # a file system without locks (some network mounts): run unguarded
        logger.warning("cannot lock %s (%s): make sure no other process decodes this shard", path, e)


def refuse_other_inputs(path: str, header: dict, inputs: dict) -> None:
    """One line when ``path`` (its ``header``) was started with other ``inputs`` than this run's."""
    theirs = header.get("inputs", {})
    changed = [k for k in inputs if theirs.get(k) != inputs[k]]
    if changed:
        what = ", ".join(f"{k} {theirs.get(k)!r} -> {inputs[k]!r}" for k in changed)
        raise RefusedOptions(
            f"{path} was written with other options or inputs ({what}): rerun the command that started it "
            f"({header.get('command', '?')}), or delete {path} and its .done to start this shard afresh "
            "with the options given now"
        )


def shard_finished(path: str, inputs: dict) -> bool:
    """Whether ``path`` is complete already (its .done marker beside it) for these ``inputs``;
    a marker without its shard (deleted by hand) is removed: the shard is decoded afresh."""
    done = read_done(done_file(path))
    if done is not None and os.path.exists(path):
        refuse_other_inputs(path, done.get("header", {}), inputs)
        logger.info("%s is complete already (%d lines): nothing to do", path, done.get("lines", 0))
        return True
    if os.path.exists(done_file(path)):
        os.remove(done_file(path))
    return False


def resume_shard(f, path: str, header: dict) -> int:
    """The last complete batch of the shard file ``f`` (-1: none), dropping an interrupted
    batch; writes ``header`` when the file has none yet."""
    start_after = -1
    if os.path.getsize(path):
        contents = read_shard(path)
        if contents.header is None:  # killed while writing its header: nothing done yet
            f.truncate(0)
        else:
            refuse_other_inputs(path, contents.header, header["inputs"])
            start_after = contents.last_batch
            f.truncate(contents.complete_bytes)
            logger.info(
                "%s: resuming after batch %d (%d of %d lines done%s)",
                path,
                start_after,
                len(contents.records),
                header["shard_lines"],
                f"; dropped {contents.dropped_bytes} bytes of an interrupted batch" if contents.dropped_bytes else "",
            )
    if not os.path.getsize(path):
        f.write((SHARD_HEADER + json.dumps(header, sort_keys=True) + "\n").encode("utf-8"))
        f.flush()
    return start_after


def decode_shard_batches(f, args, task, model, plan, todo_batches: List[int], refs, use_cuda: bool) -> int:
    """Decode ``todo_batches`` of ``plan`` (:func:`plan_batches`) into the shard file ``f``,
    each batch followed by its marker; returns how many lines sentence-BLEU changed."""
    dataset, todo, batches = plan
    decode = build_decoder(task, model, args.beam, args.nbest, args.max_len_a, args.max_len_b, args.lenpen)
    bar = tqdm(
        total=sum(len(batches[b]) for b in todo_batches),
        desc=f"distill {args.shard_id}/{args.num_shards}",
        unit="sent",
        disable=True if args.no_progress_bar else None,
    )
    changed = 0
    for b in todo_batches:
        lines = []
        for sid, cands in decode(collate(dataset, batches[b], use_cuda)):
            line_id = todo[sid]
            best = choose_hypothesis(cands, refs[line_id] if refs is not None else None, args.post_process)
            changed += best != 0
            lines.append(f"{line_id}\t{cands[best]}\n")
        lines.append(f"{BATCH_MARKER}{b}\t{len(batches[b])}\n")
        f.write("".join(lines).encode("utf-8"))
        f.flush()  # a kill loses at most the batch being written
        bar.update(len(batches[b]))
    bar.close()
    return changed


def mark_shard_done(path: str, header: dict) -> None:
    """Check the finished shard holds its lines, then write its .done marker atomically."""
    contents = read_shard(path)
    shard_lines = header["shard_lines"]
    if len(contents.records) != shard_lines or contents.dropped_bytes:
        raise RuntimeError(f"internal error: {path} holds {len(contents.records)} lines, expected {shard_lines}")
    marker = done_file(path)
    with open(marker + ".part", "w", encoding="utf-8") as f:
        json.dump({"lines": shard_lines, "header": header}, f, sort_keys=True)
    os.replace(marker + ".part", marker)


def run_shard(args, parser, task, model, src: List[str], refs: Optional[List[str]], use_cuda: bool) -> None:
    """Decode shard ``args.shard_id`` of ``args.num_shards`` into ``OUT.shard-I-of-N``, resuming
    after the file's last complete batch."""
    shard_id, num_shards = args.shard_id, args.num_shards
    path = shard_file(args.out, shard_id, num_shards)
    argv = shard_command(parser, args, shard_id, num_shards)
    inputs = shard_inputs(args, len(src), task, num_shards)
    plan = plan_batches(task, model, src, args.max_tokens, args.batch_size)
    _, todo, batches = plan
    # Batch b goes to shard b % N, not contiguous ranges: fairseq's batches are sorted by
    # length, so a range would give the last shard all the longest sentences (the slowest
    # beam searches); taking every N-th batch gives each shard the same mix of lengths, and
    # the shards finish together.
    mine = [b for b in range(len(batches)) if b % num_shards == shard_id]
    shard_lines = sum(len(batches[b]) for b in mine)
    header = {
        "inputs": inputs,
        "shard_id": shard_id,
        "shard_lines": shard_lines,
        "shard_batches": len(mine),
        "decoded_lines": len(todo),
        "command": shlex.join(argv),
        "argv": argv,
    }
    if shard_finished(path, inputs):
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "ab") as f:  # appends go to the end, also after the truncation below
        lock_shard(f, path)
        start_after = resume_shard(f, path, header)
        todo_batches = [b for b in mine if b > start_after]
        logger.info(
            "shard %d of %d: %d of the file's %d batches (%d lines) to %s, %d left",
            shard_id,
            num_shards,
            len(mine),
            len(batches),
            shard_lines,
            path,
            len(todo_batches),
        )
        start = time.perf_counter()
        changed = decode_shard_batches(f, args, task, model, plan, todo_batches, refs, use_cuda)
    seconds = time.perf_counter() - start
    mark_shard_done(path, header)
    logger.info(
        "wrote %s: %d lines in %.1fs%s; merge with: python -m fairseq_hrt.distill --merge --out %s --num-shards %d",
        path,
        shard_lines,
        seconds,
        f"; sentence-BLEU picked a hypothesis other than the top one for {changed} lines" if refs else "",
        shlex.quote(args.out),
        num_shards,
    )


def merge_shards(out: str, num_shards: int) -> None:
    """Write ``out`` in source order from the complete shards ``out.shard-I-of-N``, or refuse
    in one line naming the first missing or incomplete shard and the command that (re)runs it."""
    headers: Dict[int, dict] = {}
    problems: List[Tuple[int, str]] = []
    for i in range(num_shards):
        path = shard_file(out, i, num_shards)
        done = read_done(done_file(path))
        if not os.path.exists(path):
            problems.append((i, f"{path} is missing"))
            continue
        contents = read_shard(path)
        if contents.header is not None:
            headers[i] = contents.header
        if done is None:
            have = len(contents.records)
            total = contents.header.get("shard_lines", "?") if contents.header else "?"
            problems.append(
                (i, f"{path} is incomplete ({have} of {total} lines, no {os.path.basename(done_file(path))})")
            )
        elif len(contents.records) != done.get("lines"):
            problems.append((i, f"{path} holds {len(contents.records)} lines, its .done says {done.get('lines')}"))
    if problems:
        shard_id, what = problems[0]
        others = [str(i) for i, _ in problems[1:]]
        more = f" (shard{'s' if len(others) > 1 else ''} {', '.join(others)} too: the same with their --shard-id)"
        if headers:
            command = rerun_command(next(iter(headers.values())), shard_id, out)
            run = f"run shard {shard_id} of {num_shards} (a rerun continues where it stopped): {command}"
        else:
            run = (
                f"run every shard first: python -m fairseq_hrt.distill --data DATA --path TEACHER --src SRC "
                f"--out {shlex.quote(out)} --num-shards {num_shards} --shard-id I, for I = 0..{num_shards - 1}"
            )
        raise RefusedOptions(f"cannot merge {out}: {what}; {run}{more if others else ''}")

    if len(headers) != num_shards:
        raise RefusedOptions(
            f"cannot merge {out}: shards {sorted(set(range(num_shards)) - set(headers))} have no header"
        )
    inputs = headers[0]["inputs"]
    for i, header in headers.items():
        if header["inputs"] != inputs:
            changed = [k for k in inputs if header["inputs"].get(k) != inputs[k]]
            raise RefusedOptions(
                f"cannot merge {out}: shard {i} was distilled with other options or inputs than shard 0 "
                f"({', '.join(changed)}); delete it and its .done and rerun it with shard 0's options: "
                f"{rerun_command(headers[0], i, out)}"
            )
    lines: List[Optional[str]] = [None] * inputs["src_lines"]
    decoded = 0
    for i in range(num_shards):
        for line_id, hyp in read_shard(shard_file(out, i, num_shards)).records:
            if line_id >= len(lines) or lines[line_id] is not None:
                raise RuntimeError(f"internal error: line {line_id} twice or out of range in shard {i}")
            lines[line_id] = hyp
            decoded += 1
    if decoded != headers[0]["decoded_lines"]:
        raise RuntimeError(f"internal error: the shards hold {decoded} lines, expected {headers[0]['decoded_lines']}")
    # the lines no shard holds are the empty source lines, never decoded: empty, as in one process
    write_lines_atomic(out, [line if line is not None else "" for line in lines])
    logger.info("merged %d shards into %s: %d lines (%d decoded)", num_shards, out, len(lines), decoded)


# --------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m fairseq_hrt.distill",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--data", help="binarized data dir of the teacher (its dictionaries)")
    p.add_argument("--path", help="teacher checkpoint")
    p.add_argument("--src", help="source file as the model reads it (e.g. SentencePiece pieces)")
    p.add_argument("--out", help="output: distilled targets, same token format, line-aligned")
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
    p.add_argument(
        "--num-shards",
        type=int,
        default=None,
        help="decode shard --shard-id of N into OUT.shard-I-of-N (resumable; default 1: OUT itself); "
        "under torchrun WORLD_SIZE",
    )
    p.add_argument("--shard-id", type=int, default=None, help="the shard to decode, 0..N-1 (under torchrun: RANK)")
    p.add_argument(
        "--merge",
        action="store_true",
        help="write --out from the complete shards OUT.shard-I-of-N (with --num-shards N), in source order",
    )
    return p


def resolve_shard(p: argparse.ArgumentParser, args, env) -> None:
    """Set ``args.shard_id`` / ``args.num_shards``: the flags, else torchrun's RANK / WORLD_SIZE
    (a launcher's processes each decode their shard; no process group is needed), else one
    process (``shard_id`` None: today's output, OUT written at the end)."""
    launched = "RANK" in env and "WORLD_SIZE" in env
    if args.shard_id is None and launched:
        args.shard_id = int(env["RANK"])
    if args.num_shards is None and launched and args.shard_id is not None:
        args.num_shards = int(env["WORLD_SIZE"])
    if args.shard_id is None:
        if args.num_shards not in (None, 1):
            p.error(
                f"--num-shards {args.num_shards} needs --shard-id I (0..{args.num_shards - 1}), "
                "or torchrun's RANK / WORLD_SIZE"
            )
        args.num_shards = 1
        return
    if args.num_shards is None:
        p.error(f"--shard-id {args.shard_id} needs --num-shards N (or torchrun's WORLD_SIZE)")
    if args.num_shards < 1 or not 0 <= args.shard_id < args.num_shards:
        p.error(f"need 0 <= --shard-id < --num-shards, got --shard-id {args.shard_id} --num-shards {args.num_shards}")


def parse_args(argv=None, env=None):
    p = build_parser()
    args = p.parse_args(argv)
    if args.num_shards is not None and args.num_shards < 1:
        p.error(f"--num-shards must be at least 1, got {args.num_shards}")
    if args.merge:
        if not args.out or not args.num_shards:
            p.error("--merge needs --out OUT and --num-shards N (the shards are OUT.shard-I-of-N)")
        return args
    missing = [f"--{name.replace('_', '-')}" for name in ("data", "path", "src", "out") if not getattr(args, name)]
    if missing:
        p.error(f"the following arguments are required: {', '.join(missing)}")
    if args.beam < 1 or not 1 <= args.nbest <= args.beam:
        p.error(f"need 1 <= --nbest <= --beam, got --nbest {args.nbest} --beam {args.beam}")
    if args.nbest > 1 and not args.select_by_bleu:
        p.error("--nbest > 1 only makes sense with --select-by-bleu REF (otherwise the top hypothesis is kept)")
    resolve_shard(p, args, os.environ if env is None else env)
    return args


def select_device(args) -> bool:
    """Threads and device of this run (under torchrun each process takes its LOCAL_RANK's GPU);
    returns whether it decodes on a GPU."""
    if args.threads:
        torch.set_num_threads(args.threads)
    use_cuda = torch.cuda.is_available() and not args.cpu
    if args.fp16 and not use_cuda:
        raise SystemExit("--fp16 needs a GPU")
    if use_cuda and "LOCAL_RANK" in os.environ:  # torchrun / a launcher: this process's GPU
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    return use_cuda


def read_inputs(args):
    """``(source lines, reference lines or None)``, refused in one line when unreadable or not
    aligned."""
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
    return src, refs


def distill_all(args, task, model, src: List[str], refs: Optional[List[str]], use_cuda: bool) -> None:
    """Decode every line in one process and write ``args.out`` at the end."""
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
        best = choose_hypothesis(cands, refs[i] if refs is not None else None, args.post_process)
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


def main(argv=None):
    install_refusal_hook()  # under `python -m fairseq_hrt.distill` only: a refusal is one line
    args = parse_args(argv)
    setup_logging(args.log_file)
    if args.merge:
        merge_shards(args.out, args.num_shards)
        return
    use_cuda = select_device(args)
    src, refs = read_inputs(args)
    if args.decoder_engine not in engine_choices():
        raise SystemExit(f"--decoder-engine must be one of {', '.join(engine_choices())}, got {args.decoder_engine!r}")
    model, task = load_teacher(args)
    if args.fp16:
        model.half()
    if use_cuda:
        model.cuda()
    logger.info(
        "distilling %d lines of %s with %s: beam %d, n-best %d, %s; %s, %d thread(s)%s",
        len(src),
        args.src,
        args.path,
        args.beam,
        args.nbest,
        f"select by sentence-BLEU against {args.select_by_bleu}" if refs else "keep the top hypothesis",
        "GPU" if use_cuda else "CPU",
        torch.get_num_threads(),
        f"; shard {args.shard_id} of {args.num_shards}" if args.shard_id is not None else "",
    )
    check_nbest(task, model, src, args, use_cuda)
    if args.shard_id is not None:
        run_shard(args, build_parser(), task, model, src, refs, use_cuda)
    else:
        distill_all(args, task, model, src, refs, use_cuda)


if __name__ == "__main__":
    main()
