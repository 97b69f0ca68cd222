#!/usr/bin/env bash
# Quickstart: Multi30k En->De end to end in a few minutes on a CPU.
#   1. prepare.sh (SentencePiece 4k joint vocabulary, fairseq-preprocess)
#   2. fairseq-train a tiny HRT model (hrt_translation / hrt_loss, chunk size 2) for a
#      fixed number of updates (the same model on any machine, however busy)
#   3. fairseq-generate the test set (test2016 Flickr) with HRT decoding (k = 2) and score it
#      with sacreBLEU
# Everything is configured through environment variables; see README.md next to this file.
# Switching models is a one-line change, e.g.
#   ARCH=my_arch TASK=my_task CRITERION=my_criterion EXTRA_TRAIN_ARGS="..." ./quickstart.sh
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$SCRIPT_DIR/../.." && pwd)"

if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then
    sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'
    cat <<'EOF'

Environment variables (defaults in brackets):
  VOCAB_SIZE [4000]      SUBSET [all]          PREPARE_ARGS []    DATA_DIR [work/multi30k-sp$VOCAB_SIZE]
  ARCH [hrt_transformer] TASK [hrt_translation] MODEL_ARGS [tiny dims for the default archs]
  CRITERION [hrt_loss]   LABEL_SMOOTHING [0.1]
  TASK_TRAIN_ARGS [--chunk-sizes 2, for hrt_translation]
  TASK_GEN_ARGS [--decode-chunk-size 2 --b-nat 1, for hrt_translation]
  LR [4e-3]  WARMUP [150]  MAX_TOKENS [4096]  MAX_UPDATE [600]  SEED [1]
  EXTRA_TRAIN_ARGS []    EXTRA_GEN_ARGS []     BEAM [5]            CHECKPOINT [checkpoint_best.pt]
  USER_DIR [fairseq_hrt] DEVICE_ARGS [--cpu when no GPU]  THREADS [idle cores at start, >= 1]
  RUN_DIR [$DATA_DIR/runs/$TASK-$ARCH]         FRESH [0; 1 deletes RUN_DIR and retrains]
  DRY_RUN [0; 1 prints the training and generation commands and exits]
EOF
    exit 0
fi

log() { printf '[quickstart] %s\n' "$*" >&2; }
die() { printf '[quickstart] ERROR: %s\n' "$*" >&2; exit 1; }
now() { date +%s; }

split_args() {  # NAME STRING: shell-split STRING (quotes are honoured) into the array NAME
    eval "$1=($2)" || die "could not parse $1: $2"
}

# ---------------------------------------------------------------------------------------
# Configuration
VOCAB_SIZE="${VOCAB_SIZE:-4000}"
SUBSET="${SUBSET:-}"
DATA_DIR="${DATA_DIR:-$REPO_ROOT/work/multi30k-sp$VOCAB_SIZE${SUBSET:+-sub$SUBSET}}"
PREPARE_ARGS="${PREPARE_ARGS:-}"

USER_DIR="${USER_DIR:-$REPO_ROOT/fairseq_hrt}"
TASK="${TASK:-hrt_translation}"
ARCH="${ARCH:-hrt_transformer}"
if [[ -z "${MODEL_ARGS+set}" ]]; then
    if [[ "$ARCH" == hrt_transformer || "$ARCH" == transformer ]]; then
        # A tiny pre-norm deep-encoder/shallow-decoder model (about 1.3M parameters with a
        # 4k vocabulary): 3 encoder layers, 1 decoder layer, as HRT's E*D1 shapes.
        MODEL_ARGS="--share-all-embeddings --dropout 0.1
            --encoder-embed-dim 128 --encoder-ffn-embed-dim 256 --encoder-attention-heads 2 --encoder-layers 3
            --decoder-embed-dim 128 --decoder-ffn-embed-dim 256 --decoder-attention-heads 2 --decoder-layers 1
            --encoder-normalize-before --decoder-normalize-before"
    else
        MODEL_ARGS="--share-all-embeddings"  # the registered defaults of $ARCH
    fi
fi
if [[ "$TASK" == hrt_translation ]]; then
    CRITERION="${CRITERION:-hrt_loss}"
else
    CRITERION="${CRITERION:-label_smoothed_cross_entropy}"
fi
LABEL_SMOOTHING="${LABEL_SMOOTHING:-0.1}"
LR="${LR:-4e-3}"
WARMUP="${WARMUP:-150}"
MAX_TOKENS="${MAX_TOKENS:-4096}"
MAX_UPDATE="${MAX_UPDATE:-600}"
SEED="${SEED:-1}"
BEAM="${BEAM:-5}"
CHECKPOINT="${CHECKPOINT:-checkpoint_best.pt}"
if [[ -z "${TASK_TRAIN_ARGS+set}" ]]; then
    if [[ "$TASK" == hrt_translation ]]; then
        # One chunk size (the papers train one model per k) and the papers' curriculum:
        # p_k = t / T reaches 1 at the last update (T = --max-update), so AT samples are
        # trained until the end and the model's AT mode stays usable.
        TASK_TRAIN_ARGS="--chunk-sizes 2"
    else
        TASK_TRAIN_ARGS=""
    fi
fi
if [[ -z "${TASK_GEN_ARGS+set}" ]]; then
    if [[ "$TASK" == hrt_translation && "$ARCH" == hrt* ]]; then
        TASK_GEN_ARGS="--decode-chunk-size 2 --b-nat 1"
    else
        TASK_GEN_ARGS=""
    fi
fi
EXTRA_TRAIN_ARGS="${EXTRA_TRAIN_ARGS:-}"
EXTRA_GEN_ARGS="${EXTRA_GEN_ARGS:-}"
RUN_DIR="${RUN_DIR:-$DATA_DIR/runs/$TASK-$ARCH}"
FRESH="${FRESH:-0}"

PYTHON="${PYTHON:-python}"
for tool in fairseq-train fairseq-generate sacrebleu "$PYTHON"; do
    command -v "$tool" >/dev/null || die "$tool not found on PATH; activate the environment where fairseq is installed"
done
[[ -d "$USER_DIR" ]] || die "USER_DIR does not exist: $USER_DIR"
if [[ -z "${DEVICE_ARGS+set}" ]]; then
    if "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
        DEVICE_ARGS=""
    else
        DEVICE_ARGS="--cpu"
    fi
fi

# CPU threads for PyTorch. With 2 threads on 2 cores, every other busy process makes
# OpenMP's threads wait on each other: we measured 2 threads 2-4x SLOWER than 1 thread on a
# busy 2-core machine, and 2x faster than 1 thread on an idle one. So by default use the
# cores that are idle at start, at least 1; THREADS=N overrides. "Idle" is measured over one
# second from /proc/stat, not with the 1-minute load average, which right after
# `pip install` still counts the finished install and would halve the threads for nothing.
busy_cores() {  # NCPU: cores kept busy by other processes during one second
    local a b
    read -r -a a < /proc/stat || return 1
    sleep 1
    read -r -a b < /proc/stat || return 1
    # cpu user nice system idle iowait irq softirq steal
    awk -v n="$1" \
        -v busy="$(( (b[1]+b[2]+b[3]+b[6]+b[7]+b[8]) - (a[1]+a[2]+a[3]+a[6]+a[7]+a[8]) ))" \
        -v total="$(( (b[1]+b[2]+b[3]+b[4]+b[5]+b[6]+b[7]+b[8]) - (a[1]+a[2]+a[3]+a[4]+a[5]+a[6]+a[7]+a[8]) ))" \
        'BEGIN { printf "%.1f\n", (total > 0 ? n * busy / total : 0) }'
}
if [[ -z "${THREADS:-}" ]]; then
    NCPU=$(nproc 2>/dev/null || echo 1)
    BUSY=$(busy_cores "$NCPU" 2>/dev/null || echo 0)
    THREADS=$(awk -v n="$NCPU" -v b="$BUSY" 'BEGIN { t = int(n - b + 0.5); if (t < 1) t = 1; if (t > n) t = n; print t }')
    THREADS_WHY="$NCPU cores, $BUSY busy with other processes"
else
    THREADS_WHY="THREADS"
fi
export OMP_NUM_THREADS="$THREADS" MKL_NUM_THREADS="$THREADS"
# glibc keeps freed big tensors in the heap instead of faulting them in again every step
# (docs/training.md, "On a Linux CPU"); values you set win
export MALLOC_MMAP_THRESHOLD_="${MALLOC_MMAP_THRESHOLD_:-4294967296}" \
    MALLOC_TRIM_THRESHOLD_="${MALLOC_TRIM_THRESHOLD_:-17179869184}" \
    MALLOC_TOP_PAD_="${MALLOC_TOP_PAD_:-536870912}"

split_args MODEL_ARGV "$MODEL_ARGS"
split_args TASK_TRAIN_ARGV "$TASK_TRAIN_ARGS"
split_args TASK_GEN_ARGV "$TASK_GEN_ARGS"
split_args EXTRA_TRAIN_ARGV "$EXTRA_TRAIN_ARGS"
split_args EXTRA_GEN_ARGV "$EXTRA_GEN_ARGS"
split_args DEVICE_ARGV "$DEVICE_ARGS"
split_args PREPARE_ARGV "$PREPARE_ARGS"

DATA_BIN="$DATA_DIR/data-bin"
REF="$DATA_DIR/raw/test.de"
SAVE_DIR="$RUN_DIR/checkpoints"
TRAIN_CMD=(
    fairseq-train "$DATA_BIN"
    --user-dir "$USER_DIR"
    --task "$TASK" --source-lang en --target-lang de
    "${TASK_TRAIN_ARGV[@]}"
    --arch "$ARCH" "${MODEL_ARGV[@]}"
    --criterion "$CRITERION" --label-smoothing "$LABEL_SMOOTHING"
    --optimizer adam --adam-betas "(0.9, 0.98)" --clip-norm 1.0
    --lr "$LR" --lr-scheduler inverse_sqrt --warmup-updates "$WARMUP" --warmup-init-lr 1e-07
    --max-tokens "$MAX_TOKENS" --max-update "$MAX_UPDATE"
    --save-dir "$SAVE_DIR" --no-epoch-checkpoints
    --log-format simple --log-interval 50
    --seed "$SEED" "${DEVICE_ARGV[@]}"
    "${EXTRA_TRAIN_ARGV[@]}"
)
TRAIN_CMD_STR="$(printf '%q ' "${TRAIN_CMD[@]}")"
GEN_DIR="$RUN_DIR/gen-test"
GEN_OUT="$GEN_DIR/generate-test.txt"
HYP="$GEN_DIR/hyp.detok.de"
GEN_CMD=(
    fairseq-generate "$DATA_BIN"
    --user-dir "$USER_DIR"
    --task "$TASK" --source-lang en --target-lang de
    --gen-subset test --path "$SAVE_DIR/$CHECKPOINT"
    "${TASK_GEN_ARGV[@]}"
    --beam "$BEAM" --batch-size 128
    --scoring sacrebleu --post-process sentencepiece
    --results-path "$GEN_DIR"
    "${DEVICE_ARGV[@]}"
    "${EXTRA_GEN_ARGV[@]}"
)
GEN_CMD_STR="$(printf '%q ' "${GEN_CMD[@]}")"
if [[ "${DRY_RUN:-0}" == 1 ]]; then
    printf 'train: %s\ngenerate: %s\n' "$TRAIN_CMD_STR" "$GEN_CMD_STR"
    exit 0
fi

T_START=$(now)
log "using $THREADS CPU thread(s) for PyTorch ($THREADS_WHY)"

# ---------------------------------------------------------------------------------------
# 1. Data
log "1/3 prepare: $DATA_DIR"
T0=$(now)
"$SCRIPT_DIR/prepare.sh" --out "$DATA_DIR" --vocab-size "$VOCAB_SIZE" ${SUBSET:+--subset "$SUBSET"} "${PREPARE_ARGV[@]}"
T_PREPARE=$(( $(now) - T0 ))

# ---------------------------------------------------------------------------------------
# 2. Train

if [[ "$FRESH" == 1 && -d "$RUN_DIR" ]]; then
    log "FRESH=1: deleting $RUN_DIR"
    rm -rf "$RUN_DIR"
fi
mkdir -p "$RUN_DIR"

T0=$(now)
if [[ -f "$RUN_DIR/train.done" && "$(cat "$RUN_DIR/train.cmd")" == "$TRAIN_CMD_STR" ]]; then
    log "2/3 train: skipped, $RUN_DIR already holds a finished run of this command (FRESH=1 retrains)"
    T_TRAIN_NOTE=" (skipped, finished earlier)"
else
    if [[ -f "$RUN_DIR/train.cmd" && "$(cat "$RUN_DIR/train.cmd")" != "$TRAIN_CMD_STR" ]]; then
        die "$RUN_DIR holds a run of a different training command (see $RUN_DIR/train.cmd); set FRESH=1 to delete it or RUN_DIR to use another directory"
    fi
    if [[ -f "$SAVE_DIR/checkpoint_last.pt" ]]; then
        log "2/3 train: resuming the interrupted run in $SAVE_DIR"
    else
        log "2/3 train: $TASK / $ARCH, $MAX_UPDATE updates, log in $RUN_DIR/train.log"
    fi
    printf '%s\n' "$TRAIN_CMD_STR" > "$RUN_DIR/train.cmd"
    log "  $TRAIN_CMD_STR"
    "${TRAIN_CMD[@]}" 2>&1 | tee -a "$RUN_DIR/train.log"
    touch "$RUN_DIR/train.done"
    T_TRAIN_NOTE=""
fi
T_TRAIN=$(( $(now) - T0 ))
[[ -f "$SAVE_DIR/$CHECKPOINT" ]] || die "training produced no $SAVE_DIR/$CHECKPOINT"

# ---------------------------------------------------------------------------------------
# 3. Generate the test set and score it

T0=$(now)
if [[ -s "$HYP" && "$HYP" -nt "$SAVE_DIR/$CHECKPOINT" && -f "$GEN_DIR/generate.cmd" \
      && "$(cat "$GEN_DIR/generate.cmd")" == "$GEN_CMD_STR" ]]; then
    log "3/3 generate: skipped, $HYP is newer than the checkpoint"
    T_GEN_NOTE=" (skipped, done earlier)"
else
    log "3/3 generate: test set, beam $BEAM, output in $GEN_OUT"
    log "  $GEN_CMD_STR"
    rm -rf "$GEN_DIR"
    mkdir -p "$GEN_DIR"
    "${GEN_CMD[@]}"
    [[ -s "$GEN_OUT" ]] || die "fairseq-generate wrote no $GEN_OUT"
    # D-<id>\t<score>\t<detokenised hypothesis>, in the order of the corpus.
    grep '^D-' "$GEN_OUT" | sed 's/^D-//' | sort -t $'\t' -k1,1n | cut -f3 > "$HYP.part"
    mv "$HYP.part" "$HYP"
    printf '%s\n' "$GEN_CMD_STR" > "$GEN_DIR/generate.cmd"
    T_GEN_NOTE=""
fi
T_GEN=$(( $(now) - T0 ))

N_HYP=$(wc -l < "$HYP")
N_REF=$(wc -l < "$REF")
[[ "$N_HYP" -eq "$N_REF" ]] || die "$HYP has $N_HYP lines but the reference $REF has $N_REF"

# sacreBLEU on detokenised output against the raw references (the numbers to report).
BLEU_LINE="$(sacrebleu "$REF" -i "$HYP" -m bleu -f text)"
CHRF_LINE="$(sacrebleu "$REF" -i "$HYP" -m chrf -f text)"
printf '%s\n%s\n' "$BLEU_LINE" "$CHRF_LINE" > "$RUN_DIR/score.txt"
FAIRSEQ_LINE="$(grep -m1 '^Generate test' "$GEN_OUT" || true)"

# An HRT model: the same model in AT mode beside its k (BLEU, and both speeds at batch 1), so
# that a few minutes' model is read against itself rather than taken for HRT's quality.
DECODE_K=""
for ((i = 0; i < ${#TASK_GEN_ARGV[@]} - 1; i++)); do
    [[ "${TASK_GEN_ARGV[i]}" == --decode-chunk-size ]] && DECODE_K="${TASK_GEN_ARGV[i + 1]}"
done
MODES_BLOCK=""
if [[ "$DECODE_K" =~ ^[0-9]+$ && "$DECODE_K" -gt 1 ]]; then
    log "comparing k = $DECODE_K with the same model's AT mode (BLEU; batch-1 speed of 100 sentences)"
    MODES_BLOCK="$(python "$SCRIPT_DIR/compare_modes.py" --checkpoint-dir "$SAVE_DIR" --checkpoint-file "$CHECKPOINT" \
        --data "$DATA_BIN" --raw-src "$DATA_DIR/raw/test.en" --raw-ref "$REF" --chunk-size "$DECODE_K" \
        --beam "$BEAM" --json "$RUN_DIR/modes.json")" || die "compare_modes.py failed"
fi
MODES_TEXT=""  # ends with a line break when set: the box's next line follows it
if [[ -n "$MODES_BLOCK" ]]; then
    MODES_TEXT=" HRT decoding against the same model's AT mode ($RUN_DIR/modes.json):
$MODES_BLOCK
"
fi
T_TOTAL=$(( $(now) - T_START ))

cat <<EOF

==================================================================================
 Multi30k En->De quickstart: $TASK / $ARCH
----------------------------------------------------------------------------------
 time: prepare ${T_PREPARE}s, train ${T_TRAIN}s${T_TRAIN_NOTE}, generate ${T_GEN}s${T_GEN_NOTE}, total ${T_TOTAL}s
 test2016 (Flickr), $N_HYP sentences, sacreBLEU on detokenised output vs $REF:
   $BLEU_LINE
   $CHRF_LINE
 fairseq's own scorer (references rebuilt from the binarized data):
   ${FAIRSEQ_LINE:-n/a}
${MODES_TEXT} data:        $DATA_BIN
 checkpoints: $SAVE_DIR
 train log:   $RUN_DIR/train.log
 generation:  $GEN_OUT
 hypotheses:  $HYP
 scores:      $RUN_DIR/score.txt
==================================================================================
EOF
