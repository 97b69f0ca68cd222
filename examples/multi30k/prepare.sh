#!/usr/bin/env bash
# Prepare Multi30k (Task 1, En-De, test2016 Flickr) for fairseq:
#   raw text -> one joint SentencePiece model -> pieces -> fairseq-preprocess (joined dict).
# Every step is skipped when its output already exists, so the script is safe to re-run
# and resumes after an interruption. Run with --help for the options.
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$SCRIPT_DIR/../.." && pwd)"

# Snapshot of https://github.com/multi30k/dataset used for downloads (the files under
# data/task1/raw/ have not changed since they were added in 2018).
MULTI30K_COMMIT="a3d2e0d26b56f3846f66a952536ffed4e401d05a"
MULTI30K_URL="${MULTI30K_URL:-https://raw.githubusercontent.com/multi30k/dataset/$MULTI30K_COMMIT/data/task1/raw}"

usage() {
    cat <<EOF
Usage: $(basename "$0") [options]

Prepare Multi30k English-German (Task 1; test = test2016 Flickr) for fairseq:
download or copy the raw text, train one joint SentencePiece model on train.en+train.de,
encode every split and binarize it with fairseq-preprocess (--joined-dictionary).

Options:
  --raw-dir DIR        directory holding raw train.{en,de} valid.{en,de} test.{en,de}
  --out DIR            output directory (default: \$REPO_ROOT/work/multi30k,
                       here $REPO_ROOT/work/multi30k)
  --vocab-size N       SentencePiece vocabulary size (default: 8000)
  --model-type TYPE    SentencePiece model type: unigram or bpe (default: unigram)
  --subset N           keep only the first N training sentence pairs (quick runs, tests)
  --workers N          fairseq-preprocess workers (default: 2)
  -h, --help           print this help and exit

Where the raw text comes from, first match wins:
  1. --raw-dir DIR
  2. the environment variable MULTI30K_DIR
  3. \$REPO_ROOT/../shared/data/multi30k-en-de, if it exists
  4. download from https://github.com/multi30k/dataset (data/task1/raw/, commit
     ${MULTI30K_COMMIT:0:12}; override the base URL with MULTI30K_URL), needs curl or wget

Outputs under --out:
  raw/        the raw text used (train cut to --subset); raw/test.de and raw/test.en are
              the detokenised references for sacreBLEU
  spm/        spm.model, spm.vocab and the encoded splits {train,valid,test}.{en,de}
  data-bin/   fairseq binarized data and dict.{en,de}.txt (identical, joined)

Multi30k is for non-commercial research and educational use only (see README.md).
EOF
}

log() { printf '[prepare] %s\n' "$*" >&2; }
die() { printf '[prepare] ERROR: %s\n' "$*" >&2; exit 1; }

abspath() {  # absolute path of a (possibly not yet existing) path, relative to the cwd
    case "$1" in
        /*) printf '%s\n' "$1" ;;
        *) printf '%s\n' "$PWD/$1" ;;
    esac
}

need_value() { [[ $# -ge 2 && -n "$2" ]] || die "option $1 needs a value (see --help)"; }

RAW_DIR_OPT=""
OUT="$REPO_ROOT/work/multi30k"
VOCAB_SIZE=8000
MODEL_TYPE=unigram
SUBSET=""
WORKERS=2

while [[ $# -gt 0 ]]; do
    case "$1" in
        --raw-dir) need_value "$@"; RAW_DIR_OPT="$(abspath "$2")"; shift 2 ;;
        --raw-dir=*) RAW_DIR_OPT="$(abspath "${1#*=}")"; shift ;;
        --out) need_value "$@"; OUT="$(abspath "$2")"; shift 2 ;;
        --out=*) OUT="$(abspath "${1#*=}")"; shift ;;
        --vocab-size) need_value "$@"; VOCAB_SIZE="$2"; shift 2 ;;
        --vocab-size=*) VOCAB_SIZE="${1#*=}"; shift ;;
        --model-type) need_value "$@"; MODEL_TYPE="$2"; shift 2 ;;
        --model-type=*) MODEL_TYPE="${1#*=}"; shift ;;
        --subset) need_value "$@"; SUBSET="$2"; shift 2 ;;
        --subset=*) SUBSET="${1#*=}"; shift ;;
        --workers) need_value "$@"; WORKERS="$2"; shift 2 ;;
        --workers=*) WORKERS="${1#*=}"; shift ;;
        -h|--help) usage; exit 0 ;;
        *) die "unknown argument: $1 (see --help)" ;;
    esac
done

is_posint() { [[ "$1" =~ ^[1-9][0-9]*$ ]]; }
is_posint "$VOCAB_SIZE" || die "--vocab-size must be a positive integer, got '$VOCAB_SIZE'"
is_posint "$WORKERS" || die "--workers must be a positive integer, got '$WORKERS'"
[[ -z "$SUBSET" ]] || is_posint "$SUBSET" || die "--subset must be a positive integer, got '$SUBSET'"
[[ "$MODEL_TYPE" == unigram || "$MODEL_TYPE" == bpe ]] || die "--model-type must be unigram or bpe, got '$MODEL_TYPE'"

PYTHON="${PYTHON:-python}"
command -v "$PYTHON" >/dev/null || die "'$PYTHON' not found; activate the environment with fairseq and sentencepiece"
"$PYTHON" -c 'import sentencepiece' 2>/dev/null || die "the Python module sentencepiece is not installed (pip install sentencepiece)"
command -v fairseq-preprocess >/dev/null || die "fairseq-preprocess not found on PATH; activate the environment where fairseq is installed"

SPLITS=(train valid test)
LANGS=(en de)

# ---------------------------------------------------------------------------------------
# Settings are recorded in $OUT so that a re-run with different ones cannot silently reuse
# outputs built with the old ones.
mkdir -p "$OUT"
SETTINGS="vocab_size=$VOCAB_SIZE model_type=$MODEL_TYPE subset=${SUBSET:-all}"
if [[ -f "$OUT/settings.txt" ]]; then
    OLD_SETTINGS="$(cat "$OUT/settings.txt")"
    [[ "$OLD_SETTINGS" == "$SETTINGS" ]] || die "$OUT was prepared with '$OLD_SETTINGS', now asked for '$SETTINGS'. Use another --out or delete $OUT."
fi
log "output directory: $OUT ($SETTINGS)"

check_raw_dir() {  # DIR: all six files exist, are non-empty, and en/de line counts match
    local dir="$1" split lang n_en n_de
    for split in "${SPLITS[@]}"; do
        for lang in "${LANGS[@]}"; do
            [[ -s "$dir/$split.$lang" ]] || die "missing or empty raw file: $dir/$split.$lang (expected train, valid, test .en and .de)"
        done
        n_en=$(wc -l < "$dir/$split.en")
        n_de=$(wc -l < "$dir/$split.de")
        [[ "$n_en" -eq "$n_de" ]] || die "$dir/$split.en has $n_en lines but $dir/$split.de has $n_de; the sides must be line-aligned"
        log "  $split: $n_en sentence pairs"
    done
}

all_exist() { local f; for f in "$@"; do [[ -e "$f" ]] || return 1; done; }

# sha256 of the decompressed files of commit $MULTI30K_COMMIT, checked after a download.
declare -A SHA256=(
    [train.en]=460a15fbd157e34a7a9957ee388c1ca247fe47af3ef25fb50442af6c274e0fc6
    [train.de]=2c2b73fd2b548fbcde3a875e0a78d6ee94d498bfdee6bd3eae3945779e9ddf72
    [valid.en]=1f2a23d992769b5b3d209b0a10dd0b77c08cceb1f20dfb97ed0aafa49d107227
    [valid.de]=660e09eb7e1da2f856ea13ee5ad3cf6d36b3d5b0b733c857e94c5747a3dfc660
    [test.en]=399a4382932c1aadd3ceb9bef1008d388a64c76d4ae4e9d4728c6f4301cac182
    [test.de]=4be6b5b3236b79c25475c6bb829800a7ce559e9ba7a1f6c2394fe4d40be46d16
)

download_multi30k() {  # DIR: download, gunzip and rename into DIR
    local dir="$1" split lang remote url tmp
    local -A REMOTE=([train]=train [valid]=val [test]=test_2016_flickr)
    if command -v curl >/dev/null; then
        fetch() { curl -fsSL --retry 3 -o "$2" "$1"; }
    elif command -v wget >/dev/null; then
        fetch() { wget -q -O "$2" "$1"; }
    else
        die "no raw data found and neither curl nor wget is available to download it; pass --raw-dir"
    fi
    mkdir -p "$dir"
    for split in "${SPLITS[@]}"; do
        for lang in "${LANGS[@]}"; do
            [[ -s "$dir/$split.$lang" ]] && continue
            remote="${REMOTE[$split]}.$lang.gz"
            url="$MULTI30K_URL/$remote"
            tmp="$dir/$remote.part"
            log "  downloading $url"
            fetch "$url" "$tmp" || { rm -f "$tmp"; die "download failed: $url (no network? pass --raw-dir or set MULTI30K_DIR)"; }
            gunzip -c "$tmp" > "$dir/$split.$lang.part" || { rm -f "$tmp" "$dir/$split.$lang.part"; die "could not gunzip $url"; }
            rm -f "$tmp"
            mv "$dir/$split.$lang.part" "$dir/$split.$lang"
        done
    done
    if command -v sha256sum >/dev/null; then
        local f sum
        for f in "${!SHA256[@]}"; do
            sum=$(sha256sum "$dir/$f" | cut -d' ' -f1)
            [[ "$sum" == "${SHA256[$f]}" ]] || die "checksum mismatch for downloaded $dir/$f (got $sum); delete $dir and retry"
        done
        log "  checksums of the downloaded files are correct"
    fi
}

# ---------------------------------------------------------------------------------------
# Step 1: raw text -> $OUT/raw (train cut to --subset)
RAW_OUT="$OUT/raw"
RAW_FILES=()
for split in "${SPLITS[@]}"; do for lang in "${LANGS[@]}"; do RAW_FILES+=("$RAW_OUT/$split.$lang"); done; done

if all_exist "${RAW_FILES[@]}"; then
    log "step 1/4 raw text: $RAW_OUT already exists, skipping"
else
    if [[ -n "$RAW_DIR_OPT" ]]; then
        SRC="$RAW_DIR_OPT"; SRC_WHY="--raw-dir"
    elif [[ -n "${MULTI30K_DIR:-}" ]]; then
        SRC="$(abspath "$MULTI30K_DIR")"; SRC_WHY="MULTI30K_DIR"
    elif [[ -d "$REPO_ROOT/../shared/data/multi30k-en-de" ]]; then
        SRC="$(cd "$REPO_ROOT/../shared/data/multi30k-en-de" && pwd)"; SRC_WHY="shared data directory"
    else
        SRC="$OUT/download"; SRC_WHY="download"
        log "step 1/4 raw text: no local copy found, downloading Multi30k into $SRC"
        download_multi30k "$SRC"
    fi
    [[ -d "$SRC" ]] || die "raw data directory does not exist: $SRC (from $SRC_WHY)"
    log "step 1/4 raw text: from $SRC ($SRC_WHY)"
    check_raw_dir "$SRC"
    mkdir -p "$RAW_OUT"
    for split in "${SPLITS[@]}"; do
        for lang in "${LANGS[@]}"; do
            if [[ "$split" == train && -n "$SUBSET" ]]; then
                head -n "$SUBSET" "$SRC/$split.$lang" > "$RAW_OUT/$split.$lang.part"
            else
                cp "$SRC/$split.$lang" "$RAW_OUT/$split.$lang.part"
            fi
        done
    done
    # Rename only when every copy is complete, so an interrupted copy is redone.
    for f in "${RAW_FILES[@]}"; do mv "$f.part" "$f"; done
    echo "$SETTINGS" > "$OUT/settings.txt"
    [[ -z "$SUBSET" ]] || log "  kept the first $(wc -l < "$RAW_OUT/train.en") training pairs (--subset $SUBSET)"
    log "  wrote $RAW_OUT"
fi

# ---------------------------------------------------------------------------------------
# Step 2: one joint SentencePiece model on train.en + train.de
SPM_DIR="$OUT/spm"
SPM_MODEL="$SPM_DIR/spm.model"
if [[ -f "$SPM_MODEL" ]]; then
    log "step 2/4 SentencePiece: $SPM_MODEL already exists, skipping"
else
    log "step 2/4 SentencePiece: training a joint $MODEL_TYPE model, vocab $VOCAB_SIZE, on train.en + train.de"
    mkdir -p "$SPM_DIR"
    "$PYTHON" - "$RAW_OUT/train.en,$RAW_OUT/train.de" "$SPM_DIR/spm.part" "$VOCAB_SIZE" "$MODEL_TYPE" "$WORKERS" <<'EOF'
import sys
import sentencepiece as spm

inputs, prefix, vocab_size, model_type, threads = sys.argv[1:]
spm.SentencePieceTrainer.train(
    input=inputs,
    model_prefix=prefix,
    vocab_size=int(vocab_size),
    model_type=model_type,
    character_coverage=1.0,     # en+de: small alphabet, keep every character
    hard_vocab_limit=False,     # a small --subset may not support the full vocab size
    num_threads=int(threads),
    minloglevel=1,              # warnings and errors only
)
EOF
    mv "$SPM_DIR/spm.part.vocab" "$SPM_DIR/spm.vocab"
    mv "$SPM_DIR/spm.part.model" "$SPM_MODEL"
    log "  wrote $SPM_MODEL ($(wc -l < "$SPM_DIR/spm.vocab") pieces)"
fi

# ---------------------------------------------------------------------------------------
# Step 3: encode every split into space-separated pieces
ENC_FILES=()
for split in "${SPLITS[@]}"; do for lang in "${LANGS[@]}"; do ENC_FILES+=("$SPM_DIR/$split.$lang"); done; done
if all_exist "${ENC_FILES[@]}"; then
    log "step 3/4 encode: $SPM_DIR/{train,valid,test}.{en,de} already exist, skipping"
else
    log "step 3/4 encode: applying $SPM_MODEL to train, valid and test"
    "$PYTHON" - "$SPM_MODEL" "$RAW_OUT" "$SPM_DIR" "${SPLITS[@]}" <<'EOF'
import os
import sys
import sentencepiece as spm

model, raw_dir, out_dir, *splits = sys.argv[1:]
sp = spm.SentencePieceProcessor(model_file=model)
for split in splits:
    for lang in ("en", "de"):
        src = os.path.join(raw_dir, f"{split}.{lang}")
        dst = os.path.join(out_dir, f"{split}.{lang}")
        if os.path.exists(dst):
            continue
        with open(src, encoding="utf-8") as f:
            lines = [line.rstrip("\n") for line in f]
        pieces = sp.encode(lines, out_type=str)
        with open(dst + ".part", "w", encoding="utf-8") as f:
            for p in pieces:
                f.write(" ".join(p) + "\n")
        os.replace(dst + ".part", dst)
        n_tok = sum(len(p) for p in pieces)
        print(f"[prepare]   {dst}: {len(lines)} lines, {n_tok} pieces", file=sys.stderr)
EOF
fi

# ---------------------------------------------------------------------------------------
# Step 4: fairseq-preprocess with a joined dictionary
DATA_BIN="$OUT/data-bin"
if all_exist "$DATA_BIN/dict.en.txt" "$DATA_BIN/dict.de.txt" "$DATA_BIN"/{train,valid,test}.en-de.{en,de}.{bin,idx}; then
    log "step 4/4 binarize: $DATA_BIN already exists, skipping"
else
    log "step 4/4 binarize: fairseq-preprocess -> $DATA_BIN"
    rm -rf "$DATA_BIN.part"
    fairseq-preprocess \
        --source-lang en --target-lang de \
        --trainpref "$SPM_DIR/train" --validpref "$SPM_DIR/valid" --testpref "$SPM_DIR/test" \
        --joined-dictionary \
        --destdir "$DATA_BIN.part" \
        --workers "$WORKERS"
    rm -rf "$DATA_BIN"
    mv "$DATA_BIN.part" "$DATA_BIN"
    log "  wrote $DATA_BIN (joined dictionary: $(wc -l < "$DATA_BIN/dict.en.txt") entries in dict.en.txt, plus 4 special symbols)"
fi

log "done: binarized data in $DATA_BIN, SentencePiece model $SPM_MODEL, references $RAW_OUT/test.{de,en}"
