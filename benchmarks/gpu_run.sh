#!/usr/bin/env bash
# The GPU run in one command each side (docs/gpu.md).
#
#   here (any machine with this checkout, its venv and a trained AT / HRT pair):
#     bash benchmarks/gpu_run.sh prepare AT_CHECKPOINT HRT_CHECKPOINT DATA_DIR [MP_CHECKPOINT]
#   DATA_DIR: the recipe's data folder (data-bin/, spm/, raw/). Builds .gpu/ (ignored by git,
#   under 64 MiB with the checkout): the Python packages the GPU image lacks (fairseq, hydra,
#   omegaconf, antlr4, bitarray) packed for PYTHONPATH, the two checkpoints without their
#   optimizer state and in float16, and the test set.
#
#   there (the GPU machine; carry .gpu):
#     bash benchmarks/gpu_run.sh device OUT_DIR [STAGE ...]
#   STAGES (default all, in this order): env cudagraph bench split gputests fairseq compile
#     env       nvidia-smi, torch, the packages
#     cudagraph tests/test_cuda_graph.py (the CUDA-graph engine against the lean engine)
#     bench     benchmark.py --fp16: AT greedy, HRT k = 2 (b_at 1 and 5) and AT mode on the lean and
#               cuda-graph engines, batch 1, 8 and 128 (ratios to the run's fastest AT greedy)
#     split     time_split.py --fp16 on cuda-graph and lean, batch 1: encoder, steps, stage II, the rest
#     gputests  tests/test_gpu.py (fp16 training and decoding through the fairseq commands)
#     fairseq   the same systems on the lean, cuda-graph and fairseq engines, batch 1, 50 sentences
#     compile   the same on lean, lean --compile and cuda-graph, batch 1, 50 sentences
#     bs1all    AT greedy and HRT k = 2 (b_at 1) on cuda-graph, batch 1, all 1000 sentences
#     split1000 split on cuda-graph over the same 1000 sentences (these two: not in the default list)
#     shapes    paper_shapes.py --device cuda --fp16 (base and E12D1, random weights, newstest2014 lengths,
#               every row at the same output length): lean, cuda-graph, fairseq's SequenceGenerator
#               (batch 8 and 128 only) and CTranslate2 float16 / int8_float16 where it sees the GPU;
#               the fixed-length split and bound at batch 1 and 128; fits a 15-minute lease with the
#               start on its own (named only: `device OUT shapes`; the newstest files from .gpu/newstest,
#               which prepare copies, or ../shared/data beside the checkout)
#     variants  the same on cuda-graph, cuda-graph-stepped (without its greedy device loop) and
#               cuda-graph-fused (its attention one scaled_dot_product_attention) alone, batch 1 and 8,
#               the bound at batch 1: what each change gives, in one run (named only: `device OUT env
#               variants`, or after shapes where the lease has 5 minutes more)
#     wmtslice  the WMT recipe's slice with --gpus 1 --fp16 end to end (tests/test_wmt_recipe_steps.py
#               -k gpu; named only; needs ../shared/data beside the checkout)
#   Each stage has its own time limit and writes <stage>.log (and report.{md,json} as
#   <stage>.report.md/json) into OUT_DIR/gpu-run.tar.gz, packed again after every stage: a stage
#   that fails or runs out of time loses only itself (one archive: a lent machine hands back
#   few files).
set -u -o pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
G="$REPO/.gpu"

prepare() {
    local at="$1" hrt="$2" data="$3" mp="${4:-}"
    local py="${PYTHON:-python3}"
    rm -rf "$G" && mkdir -p "$G/site" "$G/ckpt" "$G/data" "$G/wheels"
    # wheels for the GPU image's Python (3.12, manylinux x86-64): fairseq's and its needs the image lacks
    local plat="--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
    # ... and what the WMT recipe's slice runs besides (the wmtslice stage): SentencePiece, submitit,
    # sacreBLEU, sacremoses and their own needs
    for req in ve-fairseq==0.12.3 hydra-core==1.3.2 omegaconf==2.3.0 bitarray sentencepiece==0.2.0 submitit==1.5.4 \
        cloudpickle sacrebleu portalocker tabulate colorama lxml sacremoses==0.2.0 click joblib regex; do
        "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $plat -d "$G/wheels" "$req" || exit 1
    done
    "$py" -m pip download -q --no-deps --no-binary=:all: -d "$G/wheels" antlr4-python3-runtime==4.9.3 || exit 1
    (
        cd "$G/site" || exit 1
        for w in "$G"/wheels/*.whl; do unzip -q -o "$w"; done
        tar xzf "$G"/wheels/antlr4-python3-runtime-*.tar.gz
        mv antlr4-python3-runtime-*/src/antlr4 . && rm -rf antlr4-python3-runtime-* ./*.dist-info
        # what decoding and training here never load: the Levenshtein/BASE-layer extensions,
        # the alignment binding and the examples' data files (their .py stay: fairseq imports some)
        rm -f fairseq/libnat*.so fairseq/libbase*.so alignment_train_cpu_binding*.so
        find fairseq/examples -type f ! -name "*.py" -delete
    )
    rm -rf "$G/wheels"
    tar cJf "$G/site.tar.xz" -C "$G" site && rm -rf "$G/site"  # Python sources pack about 5x
    "$py" "$REPO/benchmarks/slim_checkpoint.py" "$at" "$G/ckpt/at.pt" || exit 1
    "$py" "$REPO/benchmarks/slim_checkpoint.py" "$hrt" "$G/ckpt/hrt.pt" || exit 1
    if [ -n "$mp" ]; then "$py" "$REPO/benchmarks/slim_checkpoint.py" "$mp" "$G/ckpt/mp.pt" || exit 1; fi
    cp "$data"/data-bin/dict.*.txt "$data"/spm/spm.model "$G/data/"
    cp "$data"/spm/test.en "$G/data/test.spm.en"
    cp "$data"/raw/test.en "$data"/raw/test.de "$G/data/"
    prepare_newstest
    du -sh "$G"
    echo "carry: .gpu   command: bash benchmarks/gpu_run.sh device \$OUT"
}

prepare_newstest() {  # the shapes stage's sources: newstest2014 and the BPE's newstest2013 (under 1 MB)
    local news="$REPO/../shared/data/wmt14-en-de-newstest"
    [ -f "$news/test.en" ] || return 0
    mkdir -p "$G/newstest" && cp "$news/test.en" "$news/valid.en" "$news/valid.de" "$G/newstest/"
}

shapes() {  # shapes OUT_NAME [MORE...]: paper_shapes.py on the GPU in float16
    local news="$G/newstest"
    [ -f "$news/test.en" ] || news="$REPO/../shared/data/wmt14-en-de-newstest"
    python3 benchmarks/paper_shapes.py --device cuda --fp16 --shapes base,e12d1 --src "$news/test.en" \
        --spm-train "$news/valid.en,$news/valid.de" --sentences 1:12,8:32,128:128 --runs 3 --bound-runs 3 \
        --bound-batches 1,128 --fairseq-batches 8,128 --workdir /tmp/gpu-shapes-work --out-dir "/tmp/gpu-$1" "${@:2}"
    local rc=$?  # each shape is written as soon as it is measured: keep what there is
    cp "/tmp/gpu-$1/report.md" "$RUN/$1.report.md" 2>/dev/null
    cp "/tmp/gpu-$1/report.json" "$RUN/$1.report.json" 2>/dev/null
    return $rc
}

stage() {  # stage NAME SECONDS COMMAND...
    local name="$1" seconds="$2"
    shift 2
    echo "=== $name ($(date -u +%T), at most ${seconds}s)"
    timeout "$seconds" "$@" >"$RUN/$name.log" 2>&1
    local rc=$?
    echo "=== $name: exit $rc"
    tail -n 25 "$RUN/$name.log"
    tar czf "$OUT/gpu-run.tar.gz" -C "$(dirname "$RUN")" "$(basename "$RUN")"
    return 0
}

bench() {  # bench NAME ENGINES BATCHES BS1_SENTENCES [MORE...]
    local name="$1" engines="$2" batches="$3" sentences="$4"
    shift 4
    local mp=()
    [ -f "$G/ckpt/mp.pt" ] && mp=(--mp "$G/ckpt/mp.pt")  # Mask-Predict rows when prepare was given one
    python3 benchmarks/benchmark.py --data "$G/data" --spm "$G/data/spm.model" --src "$G/data/test.spm.en" \
        --raw-src "$G/data/test.en" --raw-ref "$G/data/test.de" --at "$G/ckpt/at.pt" --at-beams 1 \
        --hrt "$G/ckpt/hrt.pt" --hrt-chunk-sizes 2 --hrt-beams 1/1,5/1 --engines "$engines" --fp16 \
        --batch-sizes "$batches" --bs1-sentences "$sentences" --runs 3 --max-len-a 1.2 --max-len-b 10 \
        --ctranslate2 auto --int8 no "${mp[@]}" --out-dir "/tmp/gpu-$name" "$@" || return 1
    cp "/tmp/gpu-$name/report.md" "$RUN/$name.report.md"
    cp "/tmp/gpu-$name/report.json" "$RUN/$name.report.json"
}

split() {  # split ENGINE [SENTENCES]: where batch-1 time goes on that engine
    local sentences="${2:-100}" name="split-$1${2:+-$2}"
    python3 benchmarks/time_split.py --data "$G/data" --src "$G/data/test.spm.en" --at "$G/ckpt/at.pt" \
        --hrt "$G/ckpt/hrt.pt" --engine "$1" --fp16 --batch-sizes 1 --bs1-sentences "$sentences" --runs 3 \
        --out-dir "/tmp/gpu-$name" || return 1
    cp "/tmp/gpu-$name/time_split.md" "$RUN/$name.md"
    cp "/tmp/gpu-$name/time_split.json" "$RUN/$name.json"
}

device_pythonpath() {  # device_pythonpath SITE: what the device stages import from (the GPU image has
    # neither fairseq nor the runtime's distribution: the packed site, the checkout and its runtime/)
    echo "$1:$REPO:$REPO/runtime${PYTHONPATH:+:$PYTHONPATH}"
}

device() {
    export OUT="$1" RUN=/tmp/gpu-run
    shift
    local stages=("$@")
    [ ${#stages[@]} -eq 0 ] && stages=(env cudagraph bench split gputests fairseq compile)
    mkdir -p "$OUT" "$RUN" /tmp/gpu-site
    tar xJf "$G/site.tar.xz" -C /tmp/gpu-site || exit 1
    PYTHONPATH="$(device_pythonpath /tmp/gpu-site/site)"
    export PYTHONPATH PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
    cd "$REPO" || exit 1
    for s in "${stages[@]}"; do
        case "$s" in
        env) stage env 60 bash -c 'nvidia-smi; python3 -c "import torch, numpy, fairseq, onnxruntime; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(), numpy.__version__, fairseq.__version__, onnxruntime.__version__, onnxruntime.get_available_providers())"; python3 -c "import ctranslate2; print(ctranslate2.__version__, ctranslate2.get_cuda_device_count())"' ;;
        cudagraph) stage cudagraph 150 python3 -m pytest -q -rs -p no:cacheprovider -s tests/test_cuda_graph.py ;;
        bench) stage bench 200 bash "$REPO/benchmarks/gpu_run.sh" bench bench lean,cuda-graph 1,8,128 100 ;;
        split) stage split 150 bash -c 'bash "$0" split cuda-graph && bash "$0" split lean' "$REPO/benchmarks/gpu_run.sh" ;;
        gputests) stage gputests 200 python3 -m pytest -q -rs -p no:cacheprovider tests/test_gpu.py ;;
        fairseq) stage fairseq 120 bash "$REPO/benchmarks/gpu_run.sh" bench fairseq lean,cuda-graph,fairseq 1 50 --max-sentences 50 ;;
        bs1all) stage bs1all 150 bash "$REPO/benchmarks/gpu_run.sh" bench bs1all cuda-graph 1 1000 --hrt-beams 1/1 ;;
        split1000) stage split1000 120 bash "$REPO/benchmarks/gpu_run.sh" split cuda-graph 1000 ;;
        wmtslice) stage wmtslice 420 bash -c 'mkdir -p /tmp/gpu-bin && for c in train:train preprocess:preprocess generate:generate; do printf "#!/bin/sh\nexec python3 -m fairseq_cli.%s \"\$@\"\n" "${c#*:}" >"/tmp/gpu-bin/fairseq-${c%%:*}"; done && printf "#!/bin/sh\nexec python3 -m fairseq_hrt.export.exporter \"\$@\"\n" >/tmp/gpu-bin/fairseq-hrt-export && chmod +x /tmp/gpu-bin/* && PATH="/tmp/gpu-bin:$PATH" python3 -m pytest -q -rs -p no:cacheprovider tests/test_wmt_recipe_steps.py -k gpu' ;;
        shapes) stage shapes 540 bash "$REPO/benchmarks/gpu_run.sh" shapes shapes ;;
        variants) stage variants 300 bash "$REPO/benchmarks/gpu_run.sh" shapes variants --engines cuda-graph,cuda-graph-stepped,cuda-graph-fused --sentences 1:12,8:32 --bound-batches 1 --fairseq-batches none ;;
        compile) stage compile 200 bash "$REPO/benchmarks/gpu_run.sh" bench compile lean,cuda-graph 1 50 --max-sentences 50 --compile yes ;;
        *) echo "unknown stage $s" && exit 2 ;;
        esac
    done
}

case "${1:-}" in
prepare) shift && prepare "$@" ;;
device) shift && device "$@" ;;
bench) shift && bench "$@" ;;  # one benchmark of the device stages (RUN set)
split) shift && split "$@" ;;  # one time split of the device stages (RUN set)
shapes) shift && shapes "$@" ;;  # the paper shapes on the GPU (RUN set)
prepare-newstest) prepare_newstest ;;  # .gpu/newstest alone (the shapes stage needs no checkpoint)
pythonpath) shift && device_pythonpath "$@" ;;  # the device stages' PYTHONPATH for a packed site
-h | --help) sed -n '2,/^set -u/p' "$0" | sed '$d' ;;
*) sed -n '2,/^set -u/p' "$0" | sed '$d' && exit 2 ;;
esac
