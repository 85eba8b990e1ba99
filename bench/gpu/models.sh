#!/usr/bin/env bash
# Model families (mixture of experts included), validation and generation on one H200, through `holotrain train` on
# the shipped configs.
# Usage (repo root, on the GPU machine): bash bench/gpu/models.sh OUT_DIR PART [ARGS...]
# Parts, one line each (the comment above each part_ function below gives the details and the environment knobs):
#   families [STEPS] [WHAT]   the Qwen3 shape's MFU beside the 1.4b's, the planner's first prediction, the FP8 peer
#   eval [STEPS] [WHAT]       validation's cost against none, generation's speed against transformers
#   moe [STEPS] [WHAT]        the Qwen3-30B-A3B layer shape against transformers' Qwen3-MoE; expert load balancing
# Each part writes its logs, metrics and summaries into OUT_DIR (made if missing).
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

# Model families. WHAT (default "mfu plan peer") picks among:
#   mfu    the 1.4b (llama) and the Qwen3-1.7B shape (qwen3) with their defaults plus training.fp8=auto, STEPS (100)
#          steps each: the median tokens/s and MFU of the logged rows after step 30
#   plan   the planner's first prediction (plan.trials=0: before any trial) against the planned setting trained
#          (`holotrain train --plan auto`); PLANS (default "1.4b qwen3 1.4b-8k") picks the jobs: the 1.4b, the Qwen3
#          shape, the 1.4b at T=8192, B=4 under hw.gpu_memory_gb=40; "qwen3-only" plans the Qwen3 shape without
#          training it (its prediction read against the mfu part's run, where the settings agree)
#   peer   the fp8 peer (compile + torchao float8, bench/peers.py) beside holotrain's fp8 step, in one process
# Summary: bench/families_summary.py OUT_DIR.
part_families() {
  local steps=${1:-100} what=${2:-mfu plan peer}
  cache_env
  local quiet=(--profile.progress=false --profile.tensorboard=false --checkpoint.save_final=false)
  fam() {  # name, args...
    local name=$1
    shift
    logged "$name" "$out/$name.log" "${FAM_CAP:-300}" python3 -m holotrain.cli train "$@" --training.steps="$steps" \
      --job.run_dir=/tmp/fam-$name "${quiet[@]}"
    grep -E "^holotrain: .*(fp8|checkpointing|goodput)" "$out/$name.log" | head -4
    cp /tmp/fam-$name/plan.json "$out/$name-plan.json" 2>/dev/null
    keep_metrics /tmp/fam-$name "$name"
  }
  for w in $what; do case $w in
    mfu) fam llama-1.4b --config 1.4b --training.fp8=auto
         fam qwen3-1.7b --config qwen3-1.7b --training.fp8=auto ;;
    plan) for job in ${PLANS:-1.4b qwen3 1.4b-8k}; do case $job in
            1.4b) fam plan-1.4b --config 1.4b --plan auto --plan.trials=0 ;;
            qwen3) fam plan-qwen3 --config qwen3-1.7b --plan auto --plan.trials=0 ;;
            qwen3-only)
              logged "plan qwen3-only" "$out/plan-qwen3-only.log" 200 python3 -m holotrain.cli plan \
                --config qwen3-1.7b --plan.trials=0 --out "$out/plan-qwen3-only"
              tail -4 "$out/plan-qwen3-only.log" ;;
            1.4b-8k) fam plan-1.4b-8k --config 1.4b --data.seq_len=8192 --training.batch_size=4 \
                       --hw.gpu_memory_gb=40 --plan auto --plan.trials=0 ;;
          esac; done ;;
    peer) logged peers "$out/peers-fp8.log" 400 python3 bench/peers.py --variants compile-float8,holotrain-fp8
          tail -6 "$out/peers-fp8.log" ;;
  esac; done
  python3 bench/families_summary.py "$out"
}

# Validation and generation. WHAT (default "cost gen") picks among:
#   cost  the 1.4b with training.fp8=auto, STEPS (300) steps, an eval of 10 batches (of the embedded corpus's two
#         sources, from a 5% hold-out) every 100 steps, against eval.every=0, one after the other (the run without
#         eval first; the run with eval takes the FP8 recipe that auto chose for it)
#   gen   the eval run's final checkpoint exported (`holotrain export`), then bench/generate_speed.py: 256 new tokens
#         at batch 1, holotrain generate against transformers' generate() on the export (STATIC=1: also
#         transformers' static cache under torch.compile)
# Summary: bench/eval_summary.py OUT_DIR (the cost part).
part_eval() {
  local steps=${1:-300} what=${2:-cost gen}
  cache_env
  local train=(python3 -m holotrain.cli train --config 1.4b --training.fp8=auto --training.steps="$steps"
               --checkpoint.every=0 --profile.progress=false --profile.tensorboard=false --eval.holdout=0.05)
  for w in $what; do case $w in
    cost) local fp8=auto
          for run in noeval eval; do
            local extra=(--eval.every=0 --checkpoint.save_final=false)
            [ $run = eval ] && extra=(--eval.every=100 --eval.batches=10 --checkpoint.save_final=true)
            logged $run "$out/$run.log" 280 "${train[@]}" --training.fp8=$fp8 "${extra[@]}" --job.run_dir=/tmp/eval-$run
            grep -E "^holotrain: (eval|goodput|training.fp8)" "$out/$run.log"
            # The second run takes the first's choice: the probe's prediction sits near its threshold on some GPUs
            # (the 1.4b on an H100: 1.04x-1.08x against 1.05x), and a cost is read between runs of one setting.
            fp8=$(sed -n 's/^holotrain: training.fp8 = auto -> \([a-z]*\).*/\1/p' "$out/$run.log" | head -1)
            fp8=${fp8:-auto}
            cp /tmp/eval-$run/metrics.jsonl "$out/$run.jsonl"
          done
          python3 bench/eval_summary.py "$out" ;;
    gen) logged export "$out/export.log" 120 python3 -m holotrain.cli export /tmp/eval-eval /tmp/eval-hf
         timeout 300 python3 bench/generate_speed.py /tmp/eval-eval /tmp/eval-hf ${STATIC:+--static} 2>&1 \
           | grep -v -i warn | tee "$out/generate.log" ;;
  esac; done
}

# Mixture of experts. STEPS is the train part's; WHAT (default "train peer") picks among:
#   train    the Qwen3-30B-A3B layer shape at the depth one H200 holds (--config qwen3-30b-a3b: 10 layers, T=2048,
#            B=32), STEPS (40) steps with the levers the planner picks (`holotrain train --plan auto`, TRIALS (2)
#            trials; PLAN=0: the config's micro-batch and the memory plan's checkpointing instead): tokens/s, TFLOP/s
#            and MFU by active parameters, the median of the rows after the first (logged every step, so that a slow
#            step shows at once); no eval. LAYERS sets another depth (the peer's too: the same variable). 20 s before
#            its cap (TRAIN_CAP, 540 s) the trainer gets SIGUSR1: its threads' stacks in the log, if it is still there
#            (STACKS: the seconds after the start at which it gets one, e.g. "100 200"); EXTRA: more trainer overrides
#   peer     bench/moe_peer.py: transformers' Qwen3MoeForCausalLM of the same shape, depth and batch under
#            torch.compile, once per PEERS entry "experts:precision" (default "grouped_mm:bf16 grouped_mm:autocast
#            eager:autocast"), each capped at PEER_CAP (150) s; batched_mm is left out (it gathers every token copy's
#            expert weights: hundreds of GB a layer at this shape)
#   balance  moe-balance (12 layers of d 1024, 64 experts, top 8) on the embedded corpus, its 300 steps once per
#            BALANCE entry (default "batch aux"): "batch", the config as shipped (the softmax router balanced by a
#            bias solved within each training forward); "aux", the softmax router with model.moe_aux_loss_coef = 0.01
#            and no bias; "none", the softmax router with neither; "batchaux", the shipped bias and that loss
#            together (balance from the bias, the loss's gradient on the routers); "batchw", the shipped bias with
#            the chosen experts weighted by the biased logits' softmax (model.router_bias_weights); "batchz", the
#            shipped bias with the router z-loss at 1e-3; "sigbatch", the sigmoid router with
#            the in-forward bias; "solve", the sigmoid router's bias solved after each step from its scores; "sigmoid", the sign
#            rule (BIAS_RATE sets model.router_bias_rate). BALANCE_BATCH sets the sequences a step (micro-batches of
#            16: the floor of a one-step-late bias falls with the documents a step holds, bench/balance_floor.py);
#            BALANCE_CAP: seconds a run may take (240). An entry KIND.N (e.g. "aux.2") is one more run of KIND's
#            settings, from job.seed N (other initial weights): the summary's loss ratio is then over the runs' means.
# Summary: bench/moe_summary.py OUT_DIR.
part_moe() {
  local steps=${1:-40} what=${2:-train peer}
  cache_env
  for w in $what; do case $w in
    train) local plan=(--plan auto --plan.trials="${TRIALS:-2}")
           [ "${PLAN:-1}" = 0 ] && plan=()
           local cap=${TRAIN_CAP:-540} at stacks=()
           for at in ${STACKS:-$((cap - 20))}; do
             ( sleep "$at"; pkill -USR1 -f "holotrain.cli train --config qwen3-30b-a3b" ) &
             stacks+=($!)
           done
           logged moe-train "$out/moe-train.log" "$cap" python3 -m holotrain.cli train \
             --config qwen3-30b-a3b ${LAYERS:+--model.n_layers=$LAYERS} --training.steps="$steps" \
             --training.log_every=1 --eval.every=0 --job.run_dir=/tmp/moe-train "${plan[@]}" "${QUIET[@]}" "${NO_CKPT[@]}" \
             ${EXTRA:-}
           kill "${stacks[@]}" 2>/dev/null
           grep -E "^holotrain: .*(plan|fp8|checkpointing|took|goodput)" "$out/moe-train.log" | head -7
           grep -E "^step " "$out/moe-train.log" | head -4
           grep -A16 "^Current thread" "$out/moe-train.log" | head -40
           cp /tmp/moe-train/plan.json "$out/moe-train-plan.json" 2>/dev/null
           keep_metrics /tmp/moe-train moe-train ;;
    peer) for run in ${PEERS:-grouped_mm:bf16 grouped_mm:autocast eager:autocast}; do
            local impl=${run%%:*} precision=${run#*:}
            logged "peer $run" "$out/peer-$impl-$precision.log" "${PEER_CAP:-150}" python3 bench/moe_peer.py \
              --config qwen3-30b-a3b ${LAYERS:+--layers $LAYERS} --experts "$impl" --precision "$precision" \
              --out "$out/peer-$impl-$precision.json"
            grep "^moe_peer: $impl" "$out/peer-$impl-$precision.log" | tail -3
          done ;;
    balance) for run in ${BALANCE:-batch aux}; do
               local kind=${run%%.*} extra=(${BIAS_RATE:+--model.router_bias_rate=$BIAS_RATE})
               [ $kind = solve ] && extra=(--model.router=sigmoid --model.router_bias_update=solve)
               [ $kind = sigmoid ] && extra+=(--model.router=sigmoid --model.router_bias_update=sign)
               [ $kind = aux ] && extra=(--model.router_bias=false --model.moe_aux_loss_coef=0.01)
               [ $kind = none ] && extra=(--model.router_bias=false)
               [ $kind = batchaux ] && extra=(--model.moe_aux_loss_coef=0.01)
               [ $kind = batchw ] && extra=(--model.router_bias_weights=true)
               [ $kind = batchz ] && extra=(--model.router_z_loss_coef=0.001)
               [ $kind = sigbatch ] && extra=(--model.router=sigmoid)
               [ "$kind" != "$run" ] && extra+=(--job.seed="${run#*.}")  # KIND.N: KIND's settings from seed N
               [ -n "${BALANCE_BATCH:-}" ] && extra+=(--training.batch_size="$BALANCE_BATCH" --training.micro_batch_size=16)
               logged "balance $run" "$out/balance-$run.log" "${BALANCE_CAP:-240}" python3 -m holotrain.cli train --config moe-balance \
                 --job.run_dir=/tmp/moe-balance-$run "${extra[@]}" "${QUIET[@]}" "${NO_CKPT[@]}"
               keep_metrics /tmp/moe-balance-$run balance-$run
             done ;;
  esac; done
  python3 bench/moe_summary.py "$out"
}

dispatch "$@"
