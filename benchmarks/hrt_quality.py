#!/usr/bin/env python
"""Where an HRT model loses quality: AT mode vs HRT decoding on the same model, by stage.

For an HRT checkpoint (``--chunk-size k``, default 2):

* BLEU of AT mode (C_d = 1) and of HRT at k with b_at = 1 and 5 (b_nat = 1), and the gap
  ``D = BLEU(AT mode) - BLEU(k)`` at the same beam;
* per system: outputs that ran to the length limit, BLEU by source length in words
  (< 10, 10-20, > 20);
* two stage-II oracles, each one non-causal pass of the model's own stage II over a given
  skeleton (every k-th token, ``</s>``-padded as in training):
  - ``reference``: the reference's skeleton, the ceiling of the non-autoregressive stage;
  - ``at_mode``: the skeleton of AT mode's own greedy output. Its BLEU against AT mode's
    says what stage II costs; AT mode minus BLEU(k) beyond that is stage I's (Skip-AT's) loss.
* with ``--skeleton-from AT_CHECKPOINT`` (the AT student HRT is measured against), a third
  oracle, ``at_student``: that AT model's greedy output, its skeleton filled by this model's
  stage II. The gap to the AT student, ``BLEU(AT student) - BLEU(k)``, splits into stage II
  (the AT student minus that fill) and stage I (the fill minus BLEU(k)). This split holds
  where AT mode does not: a model trained on with p_k = 1 loses its AT mode. The difference
  ``BLEU(k) - BLEU(AT student)`` (b_at = 1) comes with its 95 % paired-bootstrap interval
  (``paired_bootstrap_vs_at_student_b1``): whether the test set can tell the two apart.

For an AT checkpoint (fairseq ``transformer`` / ``at_*``) only greedy and beam 5 are
decoded. Prints a JSON report (and writes it with ``--json``).

Example::

    python benchmarks/hrt_quality.py --data D/data-bin --spm D/spm/spm.model \\
        --src D/spm/test.en --ref-pieces D/spm/test.de --raw-src D/raw/test.en \\
        --raw-ref D/raw/test.de --path R/hrt/checkpoint_last.pt --json out.json
"""

import argparse
import json
import logging
import os
from typing import Dict, List, Optional

import torch
from torch import Tensor

if not __package__:  # python benchmarks/NAME.py (a file): the repository root on sys.path, as -m benchmarks.NAME has it
    import sys

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fairseq.data import data_utils  # noqa: E402

from benchmarks.measure import (  # noqa: E402
    add_data_arguments,
    build_generator,
    decode,
    detok,
    load,
    make_batches,
    read_lines,
)
from benchmarks.report_files import write_file  # noqa: E402
from fairseq_hrt import chunking  # noqa: E402
from fairseq_hrt.cli_logging import setup_logging  # noqa: E402
from fairseq_hrt.generation.lean import TorchBackend  # noqa: E402
from fairseq_hrt.models.kinds import family_of  # noqa: E402
from fairseq_hrt.passes.search_rules import banned_symbols  # noqa: E402
from fairseq_hrt.scoring.metrics import paired_bleu_difference, sacrebleu_score  # noqa: E402
from hrt_runtime.search import banned_bias_of, fill_masks  # noqa: E402

logger = logging.getLogger("hrt_quality")

LENGTH_BUCKETS = (("<10", 0, 9), ("10-20", 10, 20), (">20", 21, 10**9))


def length_buckets(raw_src: List[str]) -> Dict[str, List[int]]:
    """Sentence indices by source length in whitespace words."""
    out = {name: [] for name, _, _ in LENGTH_BUCKETS}
    for i, line in enumerate(raw_src):
        n = len(line.split())
        for name, lo, hi in LENGTH_BUCKETS:
            if lo <= n <= hi:
                out[name].append(i)
    return out


def limit_hits(hyps: Dict[int, torch.Tensor], max_len: int, k: int) -> int:
    """Outputs that ran to the length limit: stage I stops after ``max_len // k`` steps, so
    a runaway output has at least ``max_len - k + 1`` tokens (``</s>`` included)."""
    return sum(int(t.numel() >= max_len - k + 1) for t in hyps.values())


def reference_skeletons(ref_tokens: List[torch.Tensor], k: int, pad: int, eos: int) -> List[torch.Tensor]:
    """Every k-th token of each reference (``</s>``-padded to a multiple of k), ending in
    ``</s>``: exactly the Skip-AT target of training (SPEC section 2)."""
    out = []
    for tokens in ref_tokens:
        padded = chunking.pad_to_chunk_multiple(tokens.unsqueeze(0), k, pad, eos)[0]
        out.append(padded[k - 1 :: k])
    return out


@torch.no_grad()
def fill_skeleton_tensors(
    model,
    skeleton: Tensor,
    skeleton_scores: Tensor,
    k: int,
    encoder_out,
    banned: Tensor,
    mask: int,
    eos: int,
    pad: int,
    vocab: Optional[Tensor] = None,
    refine_fraction: float = 0.0,
):
    """Stage II of right-padded skeletons ``(B, M)`` (each ending in ``</s>``) given as
    tensors, by the one search (:func:`hrt_runtime.search.fill_masks`) over the model's
    :class:`~fairseq_hrt.generation.lean.TorchBackend`: the oracles of
    ``benchmarks/hrt_quality.py`` fill the reference's or AT mode's skeleton with it (and
    ``tests/test_hrt_options.py`` checks the refinement pass with it).
    ``encoder_out``: fairseq's encoder output, one row per skeleton; ``vocab``: the sorted
    target ids the masks may take (default all). Returns ``(stage II input as a
    DecoderSample, tokens, positional_scores, lengths)`` (tokens padded after the first
    ``</s>``; the sum of ``positional_scores`` is eq. (2) over the kept tokens)."""
    backend = TorchBackend(model, model.decoder.dictionary, mask=mask)
    device = skeleton.device
    rows = backend.rows(None if vocab is None else vocab.cpu().numpy())
    size = backend.vocab_size if rows.ids is None else rows.ids.size
    bias = banned_bias_of(banned.tolist(), rows, size)
    encoded = backend.encoding(encoder_out)
    tokens, positions, filled, scores, lengths, _ = fill_masks(
        backend, encoded, skeleton.cpu().numpy(), skeleton_scores.float().cpu().numpy(), k, bias, rows, refine_fraction
    )
    sample = chunking.DecoderSample(torch.from_numpy(tokens).to(device), torch.from_numpy(positions).to(device), None)
    return (
        sample,
        torch.from_numpy(filled).to(device),
        torch.from_numpy(scores).to(device),
        torch.from_numpy(lengths).to(device),
    )


@torch.no_grad()
def oracle_fill(model, task, sample, skeletons: List[torch.Tensor], k: int) -> List[torch.Tensor]:
    """Stage II over given skeletons (one per row of ``sample``): the HRT generator's own
    stage II (:func:`fill_skeleton_tensors`), with no stage-I scores."""
    d = task.target_dictionary
    net_input = sample["net_input"]
    skeleton = data_utils.collate_tokens(skeletons, d.pad()).to(net_input["src_tokens"].device)
    enc = model.encoder(net_input["src_tokens"], src_lengths=net_input["src_lengths"])
    banned = torch.tensor(banned_symbols(task, model))
    _, tokens, _, lengths = fill_skeleton_tensors(
        model,
        skeleton,
        torch.zeros(skeleton.shape, device=skeleton.device),
        k,
        enc,
        banned,
        task.mask_idx,
        d.eos(),
        d.pad(),
    )
    return [tokens[i, : int(lengths[i])] for i in range(tokens.size(0))]


def score(text, hyps, refs, buckets, max_len, k) -> dict:
    """BLEU of the detokenized ``text`` (from the token ``hyps``, for the length-limit count)."""
    bleu = sacrebleu_score(text, refs)
    return {
        "bleu": bleu["score"],
        "signature": bleu["signature"],
        "length_ratio": bleu["sys_len"] / max(1, bleu["ref_len"]),
        "brevity_penalty": bleu["bp"],
        "limit_hits": limit_hits(hyps, max_len, k),
        "bleu_by_length": {
            name: (sacrebleu_score([text[i] for i in idx], [refs[i] for i in idx])["score"] if idx else None)
            for name, idx in buckets.items()
        },
        "bucket_sizes": {name: len(idx) for name, idx in buckets.items()},
    }


class Systems:
    """Decodes and scores the systems of one run into ``report["systems"]`` (their
    detokenised outputs in ``texts``)."""

    def __init__(self, args, task, model, batches, use_cuda: bool, refs: List[str], buckets, report: dict):
        self.args, self.task, self.model, self.batches, self.use_cuda = args, task, model, batches, use_cuda
        self.refs, self.buckets, self.report = refs, buckets, report
        self.texts: Dict[str, List[str]] = {}  # system -> its detokenized outputs

    def run(self, name: str, chunk_size: int, beam: int, on=None):
        """Decode system ``name`` (``on``: another ``(task, model, batches)``); returns its hypotheses."""
        args = self.args
        on_task, on_model, on_batches = on or (self.task, self.model, self.batches)
        gen = build_generator(
            on_task,
            on_model,
            {"beam": beam, "max_len_b": args.max_len_b, "lenpen": 1.0},
            {"decoder_engine": "lean", "decode_chunk_size": str(chunk_size), "b_nat": 1},
        )
        hyps, seconds = decode(on_task, on_model, gen, on_batches, self.use_cuda)
        self.texts[name] = detok(self.task, hyps, args.spm, len(self.refs))
        systems = self.report["systems"]
        systems[name] = score(self.texts[name], hyps, self.refs, self.buckets, args.max_len_b, chunk_size)
        systems[name]["seconds"] = round(seconds, 2)
        logger.info("%-12s BLEU %.2f, %d at the length limit", name, systems[name]["bleu"], systems[name]["limit_hits"])
        return hyps


def read_test_set(args):
    """``(src, refs, raw_src)``, refused unless aligned."""
    src = read_lines(args.src, args.max_sentences)
    refs = read_lines(args.raw_ref, args.max_sentences)
    raw_src = read_lines(args.raw_src, args.max_sentences)
    if not len(src) == len(refs) == len(raw_src):
        raise SystemExit(
            f"--src, --raw-ref, --raw-src have {len(src)}, {len(refs)}, {len(raw_src)} lines; they must be aligned"
        )
    return src, refs, raw_src


def load_student(args, hrt: bool, src: List[str], use_cuda: bool):
    """``(task, model, batches)`` of ``--skeleton-from``'s AT student, refused in one line when
    the measured model is not HRT or the student is."""
    if not hrt:
        raise SystemExit(f"--skeleton-from: {args.path} is an AT model; the option measures an HRT model")
    # loaded with --data's dictionary, as the HRT model: a checkpoint of another one is refused at load
    student, student_task = load(args.skeleton_from, args.data, use_cuda, args.fp16)
    if family_of(student).chunk_sizes:
        raise SystemExit(f"--skeleton-from {args.skeleton_from}: an HRT model; give the AT student to compare with")
    return student_task, student, make_batches(student_task, student, src, args.batch_size, use_cuda)


def oracle_scores(args, systems: Systems, sources, k: int) -> dict:
    """The stage-II oracle's scores on each source of skeletons (every k-th token of it)."""
    task, model, d = systems.task, systems.model, systems.task.target_dictionary
    oracles = {}
    for name, source in sources:
        skeletons = reference_skeletons(source, k, d.pad(), d.eos())
        hyps = {}
        for sample in systems.batches:
            ids = sample["id"].tolist()
            filled = oracle_fill(model, task, sample, [skeletons[i] for i in ids], k)
            hyps.update(zip(ids, filled))
        oracles[name] = score(
            detok(task, hyps, args.spm, len(systems.refs)), hyps, systems.refs, systems.buckets, args.max_len_b, k
        )
        logger.info("oracle %-9s BLEU %.2f", name, oracles[name]["bleu"])
    return oracles


def split_gap_to_student(report: dict, oracles: dict, texts, refs, k: int) -> None:
    """The gap to the AT student, split as the gap to AT mode is."""
    s = report["systems"]
    report["gap_to_at_student_b1"] = s["at_student_b1"]["bleu"] - s[f"k{k}_b1"]["bleu"]
    report["stage_losses_vs_at_student_b1"] = {
        "stage2": s["at_student_b1"]["bleu"] - oracles["at_student"]["bleu"],
        "stage1": oracles["at_student"]["bleu"] - s[f"k{k}_b1"]["bleu"],
    }
    # one test set's sampling noise is of the order of a 0.3-BLEU target: the interval says
    # whether this test set can tell HRT from its AT student at all
    report["paired_bootstrap_vs_at_student_b1"] = paired_bleu_difference(
        texts[f"k{k}_b1"], texts["at_student_b1"], refs
    )


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    use_cuda = torch.cuda.is_available() and not args.cpu
    model, task = load(args.path, args.data, use_cuda, args.fp16)
    src, refs, raw_src = read_test_set(args)
    batches = make_batches(task, model, src, args.batch_size, use_cuda)
    hrt = family_of(model).chunk_sizes
    k = args.chunk_size
    report = {"checkpoint": os.path.basename(args.path), "sentences": len(src), "systems": {}}
    systems = Systems(args, task, model, batches, use_cuda, refs, length_buckets(raw_src), report)
    student = load_student(args, hrt, src, use_cuda) if args.skeleton_from else None  # before anything is decoded
    if not hrt:
        systems.run("greedy", 1, 1)
        systems.run("beam5", 1, 5)
        return report
    if k not in model.get_trained_chunk_sizes():
        raise SystemExit(f"--chunk-size {k}: the model was trained for {model.get_trained_chunk_sizes()}")
    report["chunk_size"] = k
    at_hyps = systems.run("at_mode_b1", 1, 1)
    systems.run(f"k{k}_b1", k, 1)
    systems.run("at_mode_b5", 1, 5)
    systems.run(f"k{k}_b5", k, 5)
    s = report["systems"]
    report["gap"] = {b: s[f"at_mode_{b}"]["bleu"] - s[f"k{k}_{b}"]["bleu"] for b in ("b1", "b5")}

    d = task.target_dictionary
    ref_pieces = read_lines(args.ref_pieces, args.max_sentences)
    ref_tokens = [d.encode_line(line, add_if_not_exist=False).long() for line in ref_pieces]
    sources = [("reference", ref_tokens), ("at_mode", [at_hyps[i].cpu() for i in range(len(src))])]
    if student is not None:
        student_hyps = systems.run("at_student_b1", 1, 1, on=student)
        report["at_student"] = os.path.basename(args.skeleton_from)
        sources.append(("at_student", [student_hyps[i].cpu() for i in range(len(src))]))
    oracles = oracle_scores(args, systems, sources, k)
    report["oracles"] = oracles
    # the stage-II oracle on AT mode's skeleton vs AT mode itself: what stage II costs; the
    # rest of D is stage I's
    report["stage_losses_b1"] = {
        "stage2": s["at_mode_b1"]["bleu"] - oracles["at_mode"]["bleu"],
        "stage1": oracles["at_mode"]["bleu"] - s[f"k{k}_b1"]["bleu"],
    }
    if student is not None:  # the same split of the gap to the AT student
        split_gap_to_student(report, oracles, systems.texts, refs, k)
    return report


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_data_arguments(p)
    p.add_argument("--path", required=True, help="HRT (or AT) checkpoint")
    p.add_argument("--ref-pieces", required=True, help="test reference as SentencePiece pieces (stage-II oracle)")
    p.add_argument("--chunk-size", type=int, default=2, help="HRT chunk size k (trained by the model)")
    p.add_argument(
        "--skeleton-from",
        help="AT checkpoint of the same dictionary (the AT student the HRT model is measured against): its greedy "
        "output is decoded, its skeleton filled by the HRT model's stage II, and the gap to it split by stage",
    )
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--max-len-b", type=int, default=200, help="L, the maximum target length")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--fp16", action="store_true")
    p.add_argument("--json", help="write the report here")
    p.add_argument("--log-file")
    args = p.parse_args(argv)
    if args.chunk_size < 2:
        p.error("--chunk-size must be >= 2 (1 is AT mode, which is always measured)")
    return args


def main(argv=None):
    args = parse_args(argv)
    setup_logging(args.log_file)
    report = run(args)
    text = json.dumps(report, indent=2)
    if args.json:
        write_file(args.json, text + "\n")
    print(text)
    return report


if __name__ == "__main__":
    main()
