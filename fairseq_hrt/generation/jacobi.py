"""Exact parallel decoding of greedy search: Jacobi decoding (PJ, PGJ, HGJ; Santilli et al.
2023, "Accelerating Transformer Inference for Translation via Parallel Decoding") and
``hrt-spec``, speculative decoding of an HRT model drafted by its own non-autoregressive mode.

Greedy decoding solves ``y_i = argmax p(. | y_<i, x)`` for ``i = 1, 2, ..`` one token per
decoder pass. Here one causal pass evaluates a *block* of positions at once from a guess of
their inputs (the current iterate ``y^(t-1)``), giving ``y^(t)`` for the whole block. A token
is *final* once every token before it is final and it was predicted from final inputs: the
first non-final position is final after every pass, and so is each following one as long as
the guessed input agreed with its new value. Final tokens are exactly greedy's tokens, so
the output is greedy's (tokens and scores, to float rounding), whatever the guesses; only the
number of passes changes.

* ``pj``  -- parallel Jacobi: one block of the whole sentence (the maximum length, as the
  target length is not known before decoding), initialised with ``<pad>`` (the paper's
  initialisation).
* ``pgj`` -- parallel GS-Jacobi: blocks of ``b`` positions (``--jacobi-block-size``) one after
  the other, each iterated by Jacobi until it is final (Gauss-Seidel across blocks).
* ``hgj`` -- hybrid GS-Jacobi: PGJ over the first ``P`` positions (``--jacobi-parallel-length``,
  default 1.1 x the source length as the paper's reference implementation), then one
  autoregressive step per pass until ``</s>``.

Stopping (the paper's eq. 13): a block stops when its iterate no longer changes,
``y^(t) == y^(t-1)``. A block whose inputs all agree with its outputs is final, so this
engine stops a block as soon as all its tokens are final -- which is implied by eq. 13 and
never takes more passes than it (nor more than ``b``: Proposition 1) -- and a sentence stops
as soon as a final token is ``</s>``. The key/value cache keeps the final prefix: a pass
feeds only the block's positions from the last final token on.

``hrt-spec`` drafts ``b`` tokens after the final prefix with one non-autoregressive pass of
the HRT model (masks after the final prefix, the CMLM / stage-II fill), then verifies them
with the same model in AT mode in one causal pass: the longest agreeing prefix of the draft
plus AT mode's next token become final. Output: AT-mode greedy's.

Every sentence of a batch moves on its own (its own block, its own final prefix) and leaves
the batch when it is done. Each hypothesis reports its decoder passes (``steps``).
"""

import logging
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch
from torch import Tensor

from fairseq_hrt import chunking
from fairseq_hrt.cli_logging import RefusedOptions
from fairseq_hrt.generation.hrt_generator import check_at_mode
from fairseq_hrt.generation.hypotheses import hypothesis, reject_unsupported_inputs
from fairseq_hrt.generation.strategies import DecodingContext, LeftToRightDecoding, register_decoding
from fairseq_hrt.models.kinds import family_of
from fairseq_hrt.passes.decoder_pass import EncoderKV, decoder_pass
from fairseq_hrt.passes.output_vocab import OutputLayer
from fairseq_hrt.passes.search_rules import SearchRules
from hrt_runtime.search import SearchConfig, positional_scores

logger = logging.getLogger(__name__)

JACOBI_METHODS = ("pj", "pgj", "hgj")
SPEC_METHOD = "hrt-spec"
DEFAULT_BLOCK_SIZE = {"pgj": 3, "hgj": 3, SPEC_METHOD: 4}  # the paper's best b; hrt-spec: docs/how-it-works.md
HGJ_SOURCE_FACTOR = 1.1  # HGJ's parallel length: 1.1 x source length (the paper's reference code)


# ------------------------------------------------------------------------- pure functions


def block_ends(method: str, final: Tensor, block_size: int, parallel_end: Optional[Tensor], max_end: int) -> Tensor:
    """``(N,)`` exclusive end of the block each row works on.

    ``final``: ``(N,)`` number of final positions of each row (position 0 is the start
    symbol, always final), so ``final`` is also the first non-final position. Target
    positions run ``1..max_end - 1``. ``parallel_end``: HGJ's ``(N,)`` last position decoded
    by blocks (``P``).
    """
    if method == "pj":
        end = torch.full_like(final, max_end)
    elif method in ("pgj", "hgj"):
        end = ((final - 1) // block_size + 1) * block_size + 1  # blocks [j*b + 1, (j+1)*b]
        if method == "hgj":
            end = torch.where(final <= parallel_end, torch.minimum(end, parallel_end + 1), final + 1)
    elif method == SPEC_METHOD:
        end = final + block_size + 1  # b drafted tokens, and AT mode's token after them
    else:
        raise ValueError(f"unknown parallel decoding method {method!r}")
    return end.clamp(max=max_end)


def accepted_lengths(inputs: Tensor, predictions: Tensor, widths: Tensor) -> Tensor:
    """``(N,)`` tokens that become final in a pass.

    ``inputs``: ``(N, W)`` the pass's inputs at positions ``f - 1 .. f + W - 2`` (the last final
    token, then guesses); ``predictions``: ``(N, W)`` its outputs at positions ``f .. f + W - 1``;
    ``widths``: ``(N,)`` how many slots of each row are real. The first prediction is final;
    each next one is final while the guessed input before it equals the prediction there.
    """
    w = inputs.size(1)
    agree = inputs[:, 1:].eq(predictions[:, :-1])
    agree &= torch.arange(1, w, device=inputs.device).unsqueeze(0) < widths.unsqueeze(1)
    return 1 + agree.long().cumprod(dim=1).sum(dim=1)


def first_true(mask: Tensor) -> Tensor:
    """``(N,)`` index of the first True of every row of ``(N, W)`` (``W`` where none)."""
    w = mask.size(1)
    index = torch.arange(w, device=mask.device).expand_as(mask)
    return torch.where(mask, index, torch.full_like(index, w)).min(dim=1).values


def hgj_parallel_end(src_lengths: Tensor, parallel_length: int) -> Tensor:
    """HGJ's last block-decoded position per row: ``--jacobi-parallel-length``, or (0) 1.1 x
    the source length (non-pad tokens, ``</s>`` included)."""
    if parallel_length > 0:
        return torch.full_like(src_lengths, parallel_length)
    return (src_lengths.double() * HGJ_SOURCE_FACTOR).long().clamp(min=1)


# ---------------------------------------------------------------------------- drafters


class NATDrafter:
    """Drafts of ``hrt-spec``: one non-causal pass of an HRT model over the final prefix
    followed by masks (the CMLM / stage-II fill of :func:`hrt_runtime.search.fill_masks`),
    argmax in the masks, never a banned symbol. The pass is the decoder's one
    (:func:`~fairseq_hrt.passes.decoder_pass.decoder_pass`); the encoder keys/values of
    a batch are projected once (:meth:`begin`) and serve every drafting round."""

    def __init__(self, model, mask: int, pad: int, banned: Tensor):
        self.model, self.mask, self.pad = model, mask, pad
        self.output = OutputLayer(model.decoder, banned)
        self.encoder: Optional[EncoderKV] = None
        self.decoder_pass = decoder_pass(model.decoder)

    def begin(self, encoder_out, encoder: Optional[EncoderKV] = None):
        """A new batch: its encoder keys/values, ``encoder`` when the caller has them (made by
        this drafter's decoder pass), else projected here."""
        self.encoder = encoder if encoder is not None else self.decoder_pass.encoder(encoder_out)

    def keep(self, rows: Tensor):
        """Only the sentences ``rows`` go on."""
        self.encoder = self.encoder.select(rows)

    def __call__(self, tokens: Tensor, final: Tensor, end: Tensor) -> Tensor:
        """Write drafts into ``tokens`` at the guessed input positions ``final .. end - 2``;
        returns ``(N,)`` whether a row got any (none when its block is one token)."""
        lengths = end - 2  # positions 1..end-2: final tokens, then masks
        width = int(lengths.max())
        slot = torch.arange(1, width + 1, device=tokens.device).unsqueeze(0)
        real = slot <= lengths.unsqueeze(1)
        masked = real & (slot >= final.unsqueeze(1))
        drafted = masked.any(dim=1)
        if not bool(drafted.any()):
            return drafted
        inputs = tokens[:, 1 : width + 1].masked_fill(masked, self.mask).masked_fill(~real, self.pad)
        features = self.decoder_pass.non_causal(self.encoder, inputs, chunking.nat_positions(real))
        _, drafts = self.output.best(features[masked])
        tokens[:, 1 : width + 1] = inputs.masked_scatter(masked, drafts.to(inputs))
        return drafted


# ---------------------------------------------------------------------------- generator


@dataclass
class PassRecord:
    """One (verifying) decoder pass of one sentence, for DDGviz: the positions evaluated, the
    tokens and probabilities predicted there, and how many became final."""

    sentence: int
    final_before: int
    positions: List[int]
    tokens: List[int]
    probs: List[float]
    accepted: int


class ParallelGreedyGenerator:
    """fairseq's generator interface (``generate(models, sample)``) for ``pj``/``pgj``/``hgj``
    and ``hrt-spec``: greedy search's hypotheses in fewer decoder passes.

    ``banned``: symbols never generated (``<pad>`` always), as the greedy search it replaces;
    ``drafter``: ``hrt-spec``'s :class:`NATDrafter`. With ``trace=True`` every pass is kept
    in ``self.trace`` (:class:`PassRecord`, for DDGviz).
    """

    def __init__(
        self,
        model,
        tgt_dict,
        config: SearchConfig,
        method: str,
        block_size: int,
        banned: Sequence[int] = (),
        parallel_length: int = 0,
        drafter: Optional[NATDrafter] = None,
        trace: bool = False,
        temperature: float = 1.0,
    ):
        check_parallel_options(method, config.beam, block_size, parallel_length)
        if method == SPEC_METHOD and drafter is None:
            raise RefusedOptions("hrt-spec needs a drafter (an HRT model's non-autoregressive mode)")
        self.model = model
        self.decoder_pass = decoder_pass(model.decoder)
        self.config = config
        self.method, self.block_size, self.parallel_length = method, block_size, parallel_length
        self.drafter = drafter
        self.pad, self.eos, self.unk = tgt_dict.pad(), tgt_dict.eos(), tgt_dict.unk()
        self.rules = SearchRules(config, tgt_dict, banned, temperature)
        self.max_len_cap = model.max_decoder_positions() - 1
        self.trace: Optional[List[PassRecord]] = [] if trace else None
        self.stats = {"sentences": 0, "passes": 0, "draft_passes": 0, "tokens": 0}

    def max_len(self, src_tokens: Tensor) -> int:
        """fairseq's maximum length (the padded source width), as greedy search has it."""
        return self.config.max_len(src_tokens.size(1), self.max_len_cap)

    @torch.no_grad()
    def generate(self, models, sample, bos_token: Optional[int] = None, **kwargs) -> List[List[Dict[str, Tensor]]]:
        reject_unsupported_inputs(f"--decoding {self.method}", **kwargs)
        if bos_token is not None and bos_token != self.eos:
            raise RefusedOptions(f"--decoding {self.method} decodes left to right from </s> (AT mode)")
        net_input = sample["net_input"]
        src_tokens = net_input["src_tokens"]
        encoder_out = self.model.encoder.forward_torchscript(net_input)
        finalized = self._decode(encoder_out, src_tokens, self.max_len(src_tokens))
        passes = sum(int(h[0]["steps"]) for h in finalized)
        self.stats["sentences"] += len(finalized)
        self.stats["passes"] += passes
        self.stats["draft_passes"] += sum(int(h[0].get("draft_passes", 0)) for h in finalized)
        self.stats["tokens"] += sum(h[0]["tokens"].numel() for h in finalized)
        self.stats["batches"] = self.stats.get("batches", 0) + 1
        if self.stats["batches"] % self.LOG_EVERY_BATCHES == 1 or self.LOG_EVERY_BATCHES == 1:
            logger.info("--decoding %s: %s", self.method, self.summary())
        return finalized

    LOG_EVERY_BATCHES = 100

    def passes_per_sentence(self) -> float:
        return self.stats["passes"] / max(1, self.stats["sentences"])

    def summary(self) -> str:
        """Running totals: decoder passes per sentence and tokens per pass (hrt-spec: tokens
        accepted per verifying pass)."""
        st = self.stats
        text = (
            f"{st['sentences']} sentences so far, {self.passes_per_sentence():.2f} decoder passes per sentence, "
            f"{st['tokens'] / max(1, st['passes']):.2f} output tokens per pass"
        )
        if self.drafter is not None:
            verify = st["passes"] - st["draft_passes"]
            text += f", {st['tokens'] / max(1, verify):.2f} tokens accepted per verifying pass"
        return text

    def _choose(self, logits: Tensor, steps: Tensor, max_len: int):
        """Greedy's choice at every slot: ``logits`` ``(M, V)``, ``steps`` ``(M,)`` the step
        each slot predicts for (its input position), by greedy search's rules."""
        return self.rules.greedy(self.rules.logits(logits), steps, max_len)

    def _decode(self, encoder_out, src_tokens: Tensor, max_len: int):
        device = src_tokens.device
        bsz = src_tokens.size(0)
        max_end = max_len + 2  # target positions 1..max_len + 1 (the last one: forced </s>)
        widest = max_end if self.method == "pj" else self.block_size + 1
        cap = max_end + widest  # guessed slots of short rows may reach past max_end
        # a block's queries see (masked) cache slots past their position: zeroed caches
        state = self.decoder_pass.begin(encoder_out, bsz, cap, self.eos, zeroed=True)
        tokens = torch.full((bsz, cap + 1), self.pad, dtype=torch.long, device=device)
        tokens[:, 0] = self.eos
        scores = torch.zeros(bsz, cap + 1, dtype=torch.float32, device=device)
        final = torch.ones(bsz, dtype=torch.long, device=device)
        passes = torch.zeros(bsz, dtype=torch.long, device=device)
        draft_passes = torch.zeros(bsz, dtype=torch.long, device=device)
        sentence = torch.arange(bsz, device=device)
        parallel_end = None
        if self.method == "hgj":
            parallel_end = hgj_parallel_end(src_tokens.ne(self.pad).long().sum(dim=1), self.parallel_length)
        if self.drafter is not None:
            same_pass = self.drafter.decoder_pass is self.decoder_pass  # the verifier's projections serve it
            self.drafter.begin(encoder_out, state.encoder if same_pass else None)
        slots = torch.arange(widest, device=device)
        finalized: List[List[Dict[str, Tensor]]] = [[] for _ in range(bsz)]
        while True:
            end = block_ends(self.method, final, self.block_size, parallel_end, max_end)
            if self.drafter is not None:
                draft_passes += self.drafter(tokens, final, end).long()
            widths = end - final
            w = int(widths.max())
            in_positions = (final - 1).unsqueeze(1) + slots[:w]  # (N, W)
            inputs = tokens.gather(1, in_positions)
            logits = self.decoder_pass.block(state, inputs, final - 1)
            n = inputs.size(0)
            score, pred = self._choose(logits.view(n * w, -1), in_positions.view(-1), max_len)
            score, pred = score.view(n, w), pred.view(n, w)
            accepted = accepted_lengths(inputs, pred, widths)
            score = self._jacobi_update(tokens, scores, in_positions, pred, score, widths, slots[:w])
            passes += 1
            if self.trace is not None:
                self._record(sentence, final, in_positions, pred, score, widths, accepted)
            final_eos = pred.eq(self.eos) & (slots[:w].unsqueeze(0) < accepted.unsqueeze(1))
            final = final + accepted
            done = final_eos.any(dim=1)
            if not bool(done.any()):
                continue
            # tokens up to and including the first final </s>
            lengths = final - accepted + first_true(final_eos)
            for r, hypo in self._finished(tokens, scores, done.nonzero().view(-1), lengths, passes, draft_passes):
                finalized[int(sentence[r])].append(hypo)
            keep = (~done).nonzero().view(-1)
            if keep.numel() == 0:
                return finalized
            state.reorder_rows(keep, int(final[keep].max()))
            state.select_sentences(keep)
            if self.drafter is not None:
                self.drafter.keep(keep)
            tokens, scores = tokens.index_select(0, keep), scores.index_select(0, keep)
            final, passes, draft_passes, sentence = final[keep], passes[keep], draft_passes[keep], sentence[keep]
            if parallel_end is not None:
                parallel_end = parallel_end[keep]

    @staticmethod
    def _jacobi_update(tokens, scores, in_positions, pred, score, widths, slots) -> Tensor:
        """The Jacobi update, in place: every real slot's prediction (and its score) becomes the
        iterate there; slots past a row's block keep what they held. Returns the scores kept."""
        out_positions = in_positions + 1
        if int(widths.min()) < slots.numel():
            real = slots.unsqueeze(0) < widths.unsqueeze(1)
            pred_kept = torch.where(real, pred, tokens.gather(1, out_positions))
            score = torch.where(real, score, scores.gather(1, out_positions))
        else:
            pred_kept = pred
        tokens.scatter_(1, out_positions, pred_kept)
        scores.scatter_(1, out_positions, score)
        return score

    def _finished(self, tokens, scores, rows: Tensor, lengths, passes, draft_passes):
        """``(row, hypothesis)`` of each of the ``rows`` that produced a final ``</s>``: its
        tokens up to and including it (``lengths``)."""
        cumulative = scores[rows, 1:].cumsum(dim=1)
        for i, r in enumerate(rows.tolist()):
            length = int(lengths[r])
            total = cumulative[i, length - 1]
            if self.config.normalize_scores:
                total = total / length**self.config.len_penalty
            # steps: every decoder pass (hrt-spec: drafting and verifying ones)
            steps = int(passes[r]) + int(draft_passes[r])
            hypo = hypothesis(
                tokens[r, 1 : length + 1].clone(),
                total,
                torch.from_numpy(positional_scores(cumulative[i : i + 1, :length].cpu().numpy())[0]).to(
                    cumulative.device
                ),
                steps=steps,
            )
            if self.drafter is not None:
                hypo["draft_passes"] = int(draft_passes[r])
            yield r, hypo

    def _record(self, sentence, final, in_positions, pred, score, widths, accepted):
        for r in range(pred.size(0)):
            w = int(widths[r])
            self.trace.append(
                PassRecord(
                    sentence=int(sentence[r]),
                    final_before=int(final[r]),
                    positions=(in_positions[r, :w] + 1).tolist(),
                    tokens=pred[r, :w].tolist(),
                    probs=score[r, :w].exp().tolist(),
                    accepted=int(accepted[r]),
                )
            )


def check_parallel_options(method: str, beam: int, block_size: int, parallel_length: int = 0):
    """One clear error for options the parallel decoders cannot honour."""
    name = f"--decoding {method}"
    if method not in JACOBI_METHODS + (SPEC_METHOD,):
        raise ValueError(f"unknown parallel decoding method {method!r}")
    if beam != 1:
        raise RefusedOptions(
            f"{name} reproduces greedy search (beam 1), got --beam {beam}; add --beam 1 (fairseq's default beam is 5)"
        )
    if block_size is None or block_size < 1:
        raise RefusedOptions(f"--jacobi-block-size must be >= 1, got {block_size}")
    if parallel_length < 0:
        raise RefusedOptions(
            f"--jacobi-parallel-length must be >= 0 (0 = 1.1 x the source length), got {parallel_length}"
        )


# ------------------------------------------------------------------------ strategies


def build_parallel_generator(ctx: DecodingContext, method: str) -> ParallelGreedyGenerator:
    task, model, options = ctx.task, ctx.model, ctx.options
    if len(ctx.models) != 1:
        raise RefusedOptions(f"--decoding {method} decodes a single model (no ensembles)")
    if options.sequence_generator_only:
        raise RefusedOptions(
            f"--decoding {method} does not support {', '.join(options.sequence_generator_only)} "
            "(it reproduces plain greedy search)"
        )
    block_size = options.jacobi_block_size
    if block_size is None:
        block_size = DEFAULT_BLOCK_SIZE.get(method, 1)
    parallel_length = int(options.jacobi_parallel_length or 0)
    check_parallel_options(method, options.search_config.beam, block_size, parallel_length)
    hrt = family_of(model).chunk_sizes
    check_at_mode(ctx, f"--decoding {method}")
    # the symbols greedy search of the same model never produces (HRT's AT mode bans its
    # special symbols, AT models only <pad>)
    tgt_dict = task.target_dictionary
    banned = ctx.banned()
    drafter = NATDrafter(model, task.mask_idx, tgt_dict.pad(), torch.tensor(banned)) if method == SPEC_METHOD else None
    generator = ParallelGreedyGenerator(
        model,
        tgt_dict,
        options.search_config,
        method,
        block_size,
        banned,
        parallel_length,
        drafter,
        temperature=options.temperature,
    )
    if ctx.engine.name != "lean":
        logger.info(
            "--decoding %s runs its own block passes (the lean engine's caches); --decoder-engine %s is not used",
            method,
            ctx.engine.name,
        )
    logger.info(
        "--decoding %s: block size %s%s, exact greedy output of the %s",
        method,
        "whole sentence" if method == "pj" else block_size,
        f", parallel length {parallel_length or '1.1 x source length'}" if method == "hgj" else "",
        "HRT model's AT mode" if hrt else "AT model",
    )
    return generator


class _ParallelDecoding(LeftToRightDecoding):
    @classmethod
    def uses_engine(cls, engine):
        return False  # its own block passes over the lean engine's caches, whatever --decoder-engine says

    @classmethod
    def build(cls, ctx: DecodingContext):
        return build_parallel_generator(ctx, cls.name)


JACOBI_NAMES = {"pj": "parallel Jacobi", "pgj": "parallel GS-Jacobi", "hgj": "hybrid GS-Jacobi"}
for _method in JACOBI_METHODS:
    register_decoding(_method)(
        type(
            f"{_method.upper()}Decoding",
            (_ParallelDecoding,),
            {
                "__doc__": f"Jacobi decoding ({_method}): greedy search's output in fewer decoder passes.",
                "summary": f"Jacobi decoding ({JACOBI_NAMES[_method]}): greedy search's output in fewer decoder passes "
                "(needs --beam 1)",
            },
        )
    )


@register_decoding(SPEC_METHOD)
class HRTSpeculativeDecoding(_ParallelDecoding):
    """HRT drafts with its non-autoregressive mode, verifies with its AT mode: AT-mode greedy."""

    @classmethod
    def supports(cls, model):
        family = family_of(model)
        if not (family.non_causal and family.left_to_right):
            return (
                f"hrt-spec drafts with the model's non-autoregressive mode and verifies with its AT mode: "
                f"it needs an HRT model (--arch hrt_*), not a {type(model).__name__}"
                + (
                    " (an AT model has no non-autoregressive mode; use --decoding pgj/hgj)"
                    if family.left_to_right
                    else ""
                )
            )
        return None
