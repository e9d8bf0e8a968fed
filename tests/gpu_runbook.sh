#!/usr/bin/env bash
# GPU checks and measurements (figures for the README, not a test), in groups that each end within 8 minutes,
# one 10-minute call of the device tool, on a machine with no network:
#
#   bash tests/gpu_runbook.sh prepare  # here, with network or ../shared: fills .bench/ (git-ignored)
#   bash tests/gpu_runbook.sh smoke    # on the GPU: the commands a user runs there, a PASS or FAIL line each
#   bash tests/gpu_runbook.sh speed    # on the GPU: build-nanogpt vs ours, --no-compile, --recompute
#   bash tests/gpu_runbook.sh modes    # on the GPU: HellaSwag speed, now and before; the paths check's cost
#   bash tests/gpu_runbook.sh muon     # on the GPU: --optimizer muon against adamw, loss and step time
#
# On the device tool: carry .bench and run one group a call. Each run's output goes to NAME.log in $OUT if set,
# else in .bench/logs/GROUP/; a measuring group ends with table.txt, the figures of all its runs; smoke exits
# non-zero if any of its commands failed.
#
# `prepare` needs build-nanogpt's train_gpt2.py and hellaswag.py saved by hand in .bench/build-nanogpt/
# (github.com/karpathy/build-nanogpt, the final version, which reads edu_fineweb10B/ shards): the runbook sets
# its micro batch to 64, its steps to 30 and compile on, and gives it the shards it can read. EXTRA_FLAGS, if
# set, is appended to each of our commands (the last value of a flag wins):
# `EXTRA_FLAGS="--device cpu --n_layer 2 --n_head 2 --n_embd 64 --micro_batch_size 2 --total_batch_size 4096
# --no-compile" EXPECT_DEVICE=cpu` tries a group on a CPU in minutes, skipping build-nanogpt (it needs CUDA) and
# smoke's out-of-memory run.
set -uo pipefail
cd "$(dirname "$0")/.."
BENCH=.bench
group=${1:-}
case $group in
  prepare | smoke | speed | modes | muon) ;;
  *) echo "usage: bash tests/gpu_runbook.sh prepare|smoke|speed|modes|muon"; exit 2 ;;
esac
LOGDIR=${OUT:-$PWD/$BENCH/logs/$group}  # NAME.log of each run, and table.txt
RUNDIR=$PWD/$BENCH/runs/$group  # train_gpt2.py's --log_dir of each run
export PYTHONUNBUFFERED=1 TIKTOKEN_CACHE_DIR="$PWD/$BENCH/tiktoken_cache"
read -r -a extra <<< "${EXTRA_FLAGS:-}"
DEADLINE=$((SECONDS + 470))  # every group ends within 8 minutes: a run gets at most what is left of them
# The benchmark command of the README's Performance section, on the prepared shards.
BENCHMARK=(--data_dir "$BENCH/edu_fineweb10B" --max_steps 30 --warmup_steps 10 --eval_every 0 --sample_every 0
           --ckpt_every 0)
SHORT=("${BENCHMARK[@]}" --max_steps 20)  # for the variants: 17 timed steps, to fit a group in one call
# A loss compared over 300 steps: micro batch 16 x 1024, one micro-step a step (16,384 tokens), 4.9 passes over
# the 1.0M training tokens of the 700-document sample; validation on its first 112,000 tokens, never trained on.
LOSS_RUN=(--data_dir "$BENCH/edu_fineweb10B" --micro_batch_size 16 --total_batch_size 16384 --max_steps 300
          --warmup_steps 30 --eval_every 100 --eval_steps 6 --sample_every 0 --ckpt_every 0)

prepare() {
  local needed file
  for needed in ../shared/tiktoken_cache ../shared/data/{tinyshakespeare.txt,fineweb_10BT_sample.jsonl}; do
    [ -e "$needed" ] || { echo "prepare reads the team's data beside the repository: $needed is missing"; exit 2; }
  done
  mkdir -p "$BENCH/wheels" "$BENCH/old"
  mkdir -p .git/info  # a fresh clone may lack it
  grep -qxF '/.bench/' .git/info/exclude 2>/dev/null || echo '/.bench/' >> .git/info/exclude
  cp -r ../shared/tiktoken_cache "$BENCH/"
  cp ../shared/data/tinyshakespeare.txt "$BENCH/input.txt"
  # 1,123,459 tokens: a validation shard of 112,000, then 10 training shards, 1,011,459 tokens (more than the
  # 524,288 of one step of the recipe, so a 30-step benchmark runs, starting new epochs at the same speed).
  python3 fineweb.py --input ../shared/data/fineweb_10BT_sample.jsonl --out_dir "$BENCH/edu_fineweb10B" \
    --shard_size 112000 --overwrite
  git show 4b9a546:train_gpt2.py > "$BENCH/old/train_gpt2.py"  # HellaSwag scored one example at a time
  python3 -m pip download -q --no-deps -d "$BENCH/wheels" blobfile  # for --export_hf; pure Python
  [ -f input.txt ] || cp "$BENCH/input.txt" .  # the made-up HellaSwag records' words
  python3 -c 'import json, sys; sys.path.insert(0, "tests"); from hellaswag_speed import made_up_records
print("\n".join(json.dumps(record) for record in made_up_records(200)))' > "$BENCH/hellaswag_made_up.jsonl"
  for file in train_gpt2.py hellaswag.py; do
    test -f "$BENCH/build-nanogpt/$file" || echo "missing: $BENCH/build-nanogpt/$file (save it by hand)"
  done
  du -sh "$BENCH"
}

# run NAME SECONDS COMMAND...: one run, its output in LOGDIR/NAME.log, stopped after SECONDS or at the deadline.
run() {
  local name=$1 seconds=$2 left=$((DEADLINE - SECONDS))
  shift 2
  local command="$*"
  echo "=== $name: ${command//$'\n'/; }" | tee "$LOGDIR/$name.log"
  if [ "$left" -lt 10 ]; then
    echo "=== $name: not run, the group's 8 minutes are spent" | tee -a "$LOGDIR/$name.log"
    return
  fi
  local started=$SECONDS
  timeout --kill-after=10 "$((seconds < left ? seconds : left))" "$@" >> "$LOGDIR/$name.log" 2>&1
  echo "=== $name: exit $?, $((SECONDS - started)) s" | tee -a "$LOGDIR/$name.log"
}

ours() {  # ours NAME SECONDS FLAGS...: train_gpt2.py, its --log_dir RUNDIR/NAME
  local name=$1 seconds=$2
  shift 2
  run "$name" "$seconds" python3 train_gpt2.py --log_dir "$RUNDIR/$name" "$@" "${extra[@]}"
}

# check NAME STATUS PATTERN...: PASS if run NAME exited with STATUS and its output has a line matching each
# extended regex PATTERN, printing the last pattern's line; else FAIL, printing the run's last line.
failed=0
check() {
  local name=$1 status=$2 log=$LOGDIR/$1.log line="" pattern exited
  shift 2
  exited=$(sed -n 's/^=== .*: exit \([0-9]*\), .*/\1/p' "$log")
  for pattern in "$@"; do
    line=$(grep -E -m1 -- "$pattern" "$log") || { line=""; break; }
  done
  if [ "$exited" = "$status" ] && [ -n "$line" ]; then
    echo "PASS $name: $line"
  else
    failed=1
    echo "FAIL $name (exit ${exited:-none}, expected $status): $(grep -v -e '^===' -e '^ *$' "$log" | tail -1)"
  fi
}

build_nanogpt() {  # build-nanogpt with torch.compile, micro batch 64 x 1024, 30 steps, in its own folder
  local folder=$BENCH/build-nanogpt-run
  rm -rf "$folder" && mkdir -p "$folder/edu_fineweb10B"
  sed -e 's/^B = 16 .*/B = 64/' -e 's/^max_steps = .*/max_steps = 30/' \
    -e 's/^use_compile = False.*/use_compile = True/' "$BENCH/build-nanogpt/train_gpt2.py" > "$folder/train_gpt2.py"
  grep -q '^B = 64' "$folder/train_gpt2.py" && grep -q '^max_steps = 30' "$folder/train_gpt2.py" || {
    echo "build-nanogpt: could not set B = 64 and max_steps = 30"; return; }
  cp "$BENCH/build-nanogpt/hellaswag.py" "$BENCH/input.txt" "$folder/"  # its script imports hellaswag.py
  # its loader views a shard's first 64 x 1024 + 1 tokens as a batch, and crashes on a shard shorter than that
  python3 - "$PWD/$BENCH/edu_fineweb10B" "$folder/edu_fineweb10B" <<'EOF'
import glob, os, sys
import numpy as np
for path in glob.glob(os.path.join(sys.argv[1], "*.npy")):
    if len(np.load(path, mmap_mode="r")) > 64 * 1024:
        os.symlink(path, os.path.join(sys.argv[2], os.path.basename(path)))
EOF
  (cd "$folder" && run build-nanogpt 150 python3 train_gpt2.py)
}

table() {  # the figures of every log in LOGDIR: summary lines, val losses, build-nanogpt's median, HellaSwag
  python3 - "$LOGDIR" <<'EOF'
import pathlib, re, statistics, sys
for log in sorted(pathlib.Path(sys.argv[1]).glob("*.log"), key=lambda path: path.stat().st_mtime):  # run order
    text = log.read_text(errors="replace")
    figures = re.findall(r"^step +0(?:/\d+)? \| loss:? \S+", text, re.M)  # both start near ln(50304) = 10.83
    figures += re.findall(r"^(summary: .*|step +\d+/\d+ \| val loss .*|\d+ examples: .*|error: .*|paths check .*)$",
                          text, re.M)
    speeds = [float(s) for step, s in re.findall(r"^step +(\d+) \|.*tok/sec: ([\d.]+)", text, re.M) if int(step) >= 3]
    if speeds:  # build-nanogpt: the median of its printed tok/sec over steps 3 and later
        figures.append(f"median {statistics.median(speeds):,.0f} tokens/s over {len(speeds)} steps")
    print(f"{log.stem}: " + ("\n    ".join(figures) or "no figures: " + text.strip().splitlines()[-1]))
EOF
}

smoke() {
  # 124M, 4 steps of 16 x 1024 tokens (val, samples and a checkpoint at the end), on the sample's shards
  local small=(--data_dir "$BENCH/edu_fineweb10B" --micro_batch_size 16 --total_batch_size 16384 --max_steps 4
               --warmup_steps 2 --eval_every 4 --eval_steps 1 --sample_every 4 --ckpt_every 4)
  local device=${EXPECT_DEVICE:-cuda:0} checkpoint=$RUNDIR/plain/ckpt_4.pt variant from_checkpoint=()
  # a run from the checkpoint takes its shape: of EXTRA_FLAGS, only a CPU try's --device
  [[ " ${extra[*]} " == *" --device cpu "* ]] && from_checkpoint=(--device cpu)
  ours plain 120 "${small[@]}"  # no --device; compile on, the default on CUDA
  check plain 0 "^device $device(, [^(]+)? \([a-z0-9]+, compile $([ -z "${EXTRA_FLAGS:-}" ] && echo on || echo off)[,)]" \
    "^summary: "
  run torchrun 90 python3 -m torch.distributed.run --standalone --nproc_per_node=1 train_gpt2.py \
    --log_dir "$RUNDIR/torchrun" "${small[@]}" --no-compile "${extra[@]}"
  check torchrun 0 "^device $device[ ,].*, 1 process" "^summary: "
  run resume 90 python3 train_gpt2.py --log_dir "$RUNDIR/plain" "${small[@]}" --max_steps 6 --resume auto \
    "${extra[@]}"
  check resume 0 "^resumed from step 4 " "^step +5/6 \| val loss"
  run eval-only 60 python3 train_gpt2.py --eval_only --init_from "$checkpoint" --data_dir "$BENCH/edu_fineweb10B" \
    --hellaswag_path "$BENCH/hellaswag_made_up.jsonl" "${from_checkpoint[@]}"
  check eval-only 0 "^val loss [0-9.]+ over [0-9]+ x [0-9,]+ tokens \| HellaSwag acc_norm .* over 200 examples"
  # the 124M shape, 4 samples x 256 tokens; the goals: 1,500 tokens/s or more, 5,000 with --compile
  for variant in cache:--kv_cache no-cache:--no-kv_cache compiled:--compile; do
    run "generate-${variant%%:*}" 120 python3 train_gpt2.py --generate --init_from "$checkpoint" --num_samples 4 \
      --max_new_tokens 256 "${variant#*:}" "${from_checkpoint[@]}"
    check "generate-${variant%%:*}" 0 "^sample 3: " " tokens/s "
  done
  if [ -z "${EXTRA_FLAGS:-}" ]; then  # float16 (slow on a CPU), and a micro batch far too large: the one-line error
    ours float16 90 "${small[@]}" --dtype float16 --no-compile
    check float16 0 "^device $device(, [^(]+)? \(float16" "^summary: "
    ours out-of-memory 90 "${small[@]}" --model gpt2-large --micro_batch_size 64 --total_batch_size 65536 \
      --no-compile
    check out-of-memory 2 "^error: out of memory on $device at micro batch 64 x 1024: lower --micro_batch_size"
  fi
  if python3 -c 'import transformers, blobfile' 2>/dev/null; then
    run export-hf 90 python3 train_gpt2.py --init_from "$checkpoint" --export_hf "$RUNDIR/hf"
    check export-hf 0 "^wrote "
    run load-hf 60 python3 -c 'import sys, transformers as hf; folder = sys.argv[1]
tokenizer, model = hf.AutoTokenizer.from_pretrained(folder), hf.GPT2LMHeadModel.from_pretrained(folder)
ids = tokenizer("Hello, I am a language model,", return_tensors="pt").input_ids
print("loaded back:", tokenizer.decode(model.generate(ids, max_new_tokens=8, do_sample=False)[0]))' "$RUNDIR/hf"
    check load-hf 0 "^loaded back: Hello, I am a language model,"
  else
    echo "SKIP export-hf: transformers or blobfile is not installed"
  fi
  if [ "$failed" = 0 ]; then echo "smoke: every command passed"; else echo "smoke: some commands FAILED"; fi
  exit "$failed"
}

if [ "$group" = prepare ]; then prepare; exit; fi
[ -d "$BENCH/edu_fineweb10B" ] || { echo "$BENCH is not prepared: run tests/gpu_runbook.sh prepare"; exit 2; }
rm -rf "$RUNDIR" && mkdir -p "$RUNDIR" "$LOGDIR"  # a clean slate: train_gpt2.py resumes from a --log_dir's checkpoint
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
python3 -c 'import torch; print("torch", torch.__version__)'
if [ -d "$BENCH/wheels" ]; then  # blobfile, for --export_hf: nothing can be fetched there
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$BENCH"/wheels/*.whl &&
    export PYTHONPATH=/tmp/site
fi
case $group in
  smoke) smoke ;;
  speed)
    [ -z "${EXTRA_FLAGS:-}" ] && build_nanogpt  # about 2 minutes with compilation
    ours ours 120 "${BENCHMARK[@]}"
    ours no-compile 70 "${SHORT[@]}" --no-compile
    ours recompute 100 "${SHORT[@]}" --recompute
    ours recompute-no-compile 70 "${SHORT[@]}" --recompute --no-compile ;;
  modes)
    [ -f input.txt ] || cp "$BENCH/input.txt" .  # the made-up HellaSwag records' words
    for version in now:. 4b9a546:"$BENCH/old"; do
      run "hellaswag-${version%%:*}" 120 python3 tests/hellaswag_speed.py --examples 2000 \
        --code "${version#*:}" -- --n_layer 12 --n_head 12 --n_embd 768 --block_size 1024 --device cuda --seq_len 1024 \
        --total_batch_size 8192 "${extra[@]}"
    done
    # the check train() runs before step 0, at 124M in float32 (TF32 off while it runs); CUDA, unless EXPECT_DEVICE
    run paths-check 120 python3 -c 'import sys, time, torch, train_gpt2 as t
device = sys.argv[1]; model = t.GPT(t.GPTConfig()).to(device)
torch.set_float32_matmul_precision("high")  # as a run on CUDA sets it
for attempt in ("first", "second"):
    started = time.perf_counter(); t.check_paths_agree(model, device)  # it waits for the device itself
    print(f"paths check at 124M, {attempt} call: {time.perf_counter() - started:.2f} s")' "${EXPECT_DEVICE:-cuda}" ;;
  muon)
    # The 124M shape at the recipe's lr, 300 steps of 16,384 tokens, then a step of 2**19 tokens. Predictions:
    # Muon's val loss at step 299 below AdamW's (on the CPU at 4 layers, width 128: 0.58 lower, each at its best
    # lr; 0.31 lower at the same 3e-3); its step 1-5% slower (Newton-Schulz: about 1.5 TFLOP a step for the 48
    # matrices, in some 700 small bf16 matmuls, beside the step's 390 TFLOP).
    ours loss-adamw 150 "${LOSS_RUN[@]}"
    ours loss-muon 150 "${LOSS_RUN[@]}" --optimizer muon
    ours speed-adamw 100 "${SHORT[@]}"
    ours speed-muon 100 "${SHORT[@]}" --optimizer muon ;;
esac
table | tee "$LOGDIR/table.txt"
