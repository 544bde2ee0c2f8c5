#!/usr/bin/env bash
# On a GPU machine with vLLM, megatron-core and this project importable: runs the GPU test tier
# and the benchmarks, writing logs and results to $1 (default ./gpu-results).
#   scripts/gpu_checks.sh [OUT_DIR] [GROUP[,GROUP...]|all]
# groups: tests, bench, exact (exact on-policy mode's GPU tests and the train step's wall vs kernel
# time), exact-loop (the loop with exact mode off, on), fp32res-loop (with actor.fp32_residual off,
# on, off), fused-loop (with actor.logprob_kernel chunked, fused, chunked), norm-loop (with
# actor.norm_kernel eager, fused, eager), logprobs (the logprobs' kernels alone, chunked vs fused),
# exact-curves (the tiny recipe's learning with exact mode off and on), pack (the sync's packing and
# the engine's replayed copies alone at the 30B cut's tensors, each in its earlier and current form), sync30b (Qwen3-30B-A3B's
# first 12 layers through the weight sync), loop8b (Qwen3-8B through the loop with host Adam and
# full recompute), loop8b-1024 and loop30b-1024 (Qwen3-8B, Qwen3-30B-A3B's first 12 layers:
# 1024-token responses; LOOP_SET adds settings, e.g. actor.expert_kernel=sequential), loop30b-4096
# (the 30B cut at 4096-token responses, 8 prompts), onload-probe (every part offloaded; where an
# onload's seconds go, with actor.overlap_onload off and on), experts (the
# grouped experts' GPU test and benchmarks/kernels/expert_kernels.py), trl, trl256-pair and trl1024-pair (the next pair of ours vs TRL at 256
# tokens, 3 timed steps a side, or at 1024, 1 timed step a side: one lease's series in ABBA order,
# summarized after each command; PAIR_ARGS adds gpu_vs_trl.py options, e.g. --fp32-residual=false),
# verl-smoke, verl256-pair and verl1024-pair (benchmarks/peers/gpu_vs_verl.py: verl alone for one
# timed step of 16 x 8 x 64, then the next pair of ours vs verl at 256 tokens, 3 timed steps a side,
# or the next side at 1024, 1 timed step; VERL_ARGS adds options, e.g. --verl-profile=matched; verl's
# packages come from scripts/verl_bundle.sh's install script, in $VERL_SITE, default /tmp/verl/site),
# learn-probe, learn-sweep, learn-seeds (benchmarks/learning/learning_at_width.py's stages, LEARN_ARGS for their
# options, LEARN_RECIPE and LEARN_PRESET for another preset, e.g. recipes/dsv4_flash_grpo.py learn-mini), partial
# (benchmarks/step/partial_gpu.py: partial rollouts against whole batches on long-tailed answers, alternating runs), disagg, dsv4, dsv4-fp8 (the mini preset's step-1 gap without and with actor.emulate_rollout_fp8).
# Each group fits one 10-minute command of the lent GPU machine (dsv4 ones once the JIT caches are warm).
set -uo pipefail
out="${1:-gpu-results}"; what="${2:-all}"
mkdir -p "$out"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export COLOCATE_RL_CACHE="${COLOCATE_RL_CACHE:-/tmp/colocate_rl-cache}" PYTHONUNBUFFERED=1
export TMPDIR="$COLOCATE_RL_CACHE/tmp" VLLM_CACHE_ROOT="$COLOCATE_RL_CACHE/vllm" \
  TORCHINDUCTOR_CACHE_DIR="$COLOCATE_RL_CACHE/inductor" TRITON_CACHE_DIR="$COLOCATE_RL_CACHE/triton" \
  HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 WANDB_MODE=disabled
mkdir -p "$TMPDIR"
cd "$root" || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt" 2>&1 || true
rc=0
run() { [ "$what" = all ] || [[ ",$what," == *",$1,"* ]]; }
if run tests; then  # one log per file, written as it goes
  for f in tests/gpu/test_*.py; do
    python3 -m pytest -q -rs "$f" > "$out/$(basename "$f" .py).log" 2>&1 || rc=1
    tail -3 "$out/$(basename "$f" .py).log"
  done
fi
if run bench; then  # the colocated handoff: Qwen3-0.6B shape, then a small Qwen3-MoE shape
  for shape in qwen3-0.6b qwen3-moe-small; do
    python3 benchmarks/step/handoff.py --shape "$shape" --out "$out/handoff_$shape.json" --profile "$out/profile_$shape.txt" \
      > "$out/handoff_$shape.log" 2>&1 || rc=1
    grep -vE "INFO|^\(" "$out/handoff_$shape.log" | tail -60
  done
fi
if run exact; then
  python3 -m pytest -q -rsx -s tests/gpu/test_exact_gpu.py > "$out/test_exact_gpu.log" 2>&1 || rc=1
  grep -E "T=[0-9.]+ (scoring|step)| vs vLLM| first response|passed|failed|xfail|XPASS|Error" "$out/test_exact_gpu.log" | tail -20
  python3 benchmarks/gap/exact_train_step_gpu.py --out "$out/exact_train_step.json" > "$out/exact_train_step.log" 2>&1 || rc=1
  tail -20 "$out/exact_train_step.log"
fi
if run exact-curves; then  # learning: the tiny recipe with exact mode off and on, three seeds each (bf16, one GPU, ~7 min)
  runs=()
  for seed in 1 2 3; do runs+=(--run "default_$seed=rollout.exact=false seed=$seed" --run "exact_$seed=rollout.exact=true seed=$seed"); done
  python3 benchmarks/step/recipe_runs.py --recipe recipes/qwen3_grpo.py --base preset=tiny model.dtype=bfloat16 rollout.enforce_eager=true \
    "${runs[@]}" --out "$out/exact_curves.json" > "$out/exact_curves.log" 2>&1 || rc=1
  tail -8 "$out/exact_curves.log"
fi
for group in exact-loop:rollout.exact:false,true fp32res-loop:actor.fp32_residual:false,true,false \
             fused-loop:actor.logprob_kernel:chunked,fused,chunked norm-loop:actor.norm_kernel:eager,fused,eager; do
  IFS=: read -r name key values <<< "$group"  # the loop with one setting off and on, one run after another
  if run "$name"; then
    i=0
    for v in ${values//,/ }; do
      i=$((i + 1)); tag="${name%-loop}_${v}_$i"
      python3 benchmarks/step/handoff.py --set "$key=$v" --out "$out/handoff_$tag.json" > "$out/handoff_$tag.log" 2>&1 || rc=1
      grep -vE "INFO|^\(" "$out/handoff_$tag.log" | tail -20
    done
  fi
done
if run logprobs; then  # the logprobs' forward + backward, chunked vs fused, one micro-batch's logits
  python3 benchmarks/kernels/logprobs_kernels.py --out "$out/logprobs_kernels.json" > "$out/logprobs_kernels.log" 2>&1 || rc=1
  grep -E "rows x|Error" "$out/logprobs_kernels.log" | tail -5
fi
if run experts; then  # the grouped experts: their GPU test, then one layer at Qwen3-30B-A3B's width, sequential vs grouped
  python3 -m pytest -q -rs tests/gpu/test_grouped_experts_gpu.py > "$out/test_grouped_experts_gpu.log" 2>&1 || rc=1
  tail -3 "$out/test_grouped_experts_gpu.log"
  python3 benchmarks/kernels/expert_kernels.py --out "$out/expert_kernels.json" > "$out/expert_kernels.log" 2>&1 || rc=1
  grep -vE "INFO|^\(" "$out/expert_kernels.log" | tail -4
fi
if run onload-probe; then  # every part offloaded each step: onload serial (then timed piece by piece), overlapped
  for overlap in false true; do
    probe=(); [ $overlap = false ] && probe=(--probe-onload)
    python3 benchmarks/step/handoff.py --offload all --steps 2 --set actor.overlap_onload=$overlap \
      "${probe[@]}" --out "$out/handoff_onload_overlap_$overlap.json" \
      > "$out/handoff_onload_overlap_$overlap.log" 2>&1 || rc=1
    grep -vE "INFO|^\(" "$out/handoff_onload_overlap_$overlap.log" | grep -E "^step|onload probe|Error" | tail -8
  done
fi
if run pack; then  # the sync's two copies alone at the 30B cut's tensors (torch only): packing and the engine's replay
  python3 benchmarks/sync/pack.py --layers 12 --out "$out/pack_replay.json" > "$out/pack_replay.log" 2>&1 || rc=1
  grep -E '"(per_tensor|batched|replay_[a-z_]+|load_[a-z_]+|one_copy_of_all_bytes_s)"' "$out/pack_replay.log" | head -12
fi
if run sync30b; then
  python3 benchmarks/sync/weight_sync.py --model qwen3-30b-a3b@12 --in-process --repeats 3 --out "$out/weight_sync_30b_a3b_12.json" \
    > "$out/weight_sync_30b.log" 2>&1 || rc=1
  grep -vE "INFO|^\(" "$out/weight_sync_30b.log" | tail -20
fi
if run loop8b; then
  python3 benchmarks/step/handoff.py --shape qwen3-8b --prompts 16 --n 8 --tokens 256 --steps 2 --gpu-mem 0.35 \
    --set actor.optimizer_cpu_offload=true actor.optimizer_state_dtype=bfloat16 actor.recompute=true --memory-snapshot "$out/handoff_8b_memory.pickle" \
    --out "$out/handoff_8b.json" > "$out/handoff_8b.log" 2>&1 || rc=1
  grep -vE "INFO|^\(" "$out/handoff_8b.log" | tail -30
fi
# real widths, long responses, one GPU: group:shape:tokens:prompts
for group in loop8b-1024:qwen3-8b:1024:16 loop30b-1024:qwen3-30b-a3b@12:1024:16 loop30b-4096:qwen3-30b-a3b@12:4096:8; do
  IFS=: read -r gname shape tokens prompts <<< "$group"; name="handoff_${shape/@/_}_$tokens"
  if run "$gname"; then
    python3 benchmarks/step/handoff.py --shape "$shape" --prompts "$prompts" --n 8 --tokens "$tokens" --steps 2 --gpu-mem 0.35 --micro 4 \
      --set actor.optimizer_cpu_offload=true actor.optimizer_state_dtype=bfloat16 actor.recompute=true ${LOOP_SET:-} \
      --out "$out/$name.json" > "$out/$name.log" 2>&1 || rc=1
    grep -vE "INFO|^\(" "$out/$name.log" | tail -20
  fi
done
if run trl; then  # ours vs TRL's GRPOTrainer (vLLM colocate mode), one GPU
  python3 benchmarks/peers/gpu_vs_trl.py --out "$out/gpu_vs_trl.json" > "$out/gpu_vs_trl.log" 2>&1 || rc=1
  grep -vE "INFO|^\(" "$out/gpu_vs_trl.log" | tail -40
fi
for group in trl256-pair:256:3:2 trl1024-pair:1024:1:2; do  # the next runs of this lease's series
  IFS=: read -r name tokens steps sides <<< "$group"
  if run "$name"; then  # the series lives in the cache, so the runs of one lease add up (ABBA order)
    python3 benchmarks/peers/gpu_vs_trl.py --tokens "$tokens" --steps "$steps" --sides "$sides" ${PAIR_ARGS:-} \
      --out "$out/gpu_vs_trl_${tokens}_pairs.json" > "$out/gpu_vs_trl_$tokens.log" 2>&1 || rc=1
    grep -vE "INFO|^\(" "$out/gpu_vs_trl_$tokens.log" | grep -E "^\[|step|no pair" | tail -12
    [ -f "$out/gpu_vs_trl_${tokens}_pairs.json" ] && python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print({k: v for k, v in d.items() if 'per_pair' in k or k.startswith('step_s')})" "$out/gpu_vs_trl_${tokens}_pairs.json"
  fi
done
if run verl-smoke; then  # verl's side alone, small: does it run on this machine?
  python3 benchmarks/peers/gpu_vs_verl.py --smoke --prompts 16 --tokens 64 --steps 1 ${VERL_ARGS:-} \
    --out "$out/gpu_vs_verl_smoke.json" > "$out/gpu_vs_verl_smoke.log" 2>&1 || rc=1
  grep -E "^\[|step|Error|error" "$out/gpu_vs_verl_smoke.log" | tail -30
  cp "$COLOCATE_RL_CACHE/gpu_vs_verl/smoke/verl.log" "$out/verl_smoke_console.log" 2>/dev/null || true
fi
for group in verl256-pair:256:3:2 verl1024-pair:1024:1:1; do  # the next runs of this lease's series, ABBA
  IFS=: read -r name tokens steps sides <<< "$group"
  if run "$name"; then
    python3 benchmarks/peers/gpu_vs_verl.py --tokens "$tokens" --steps "$steps" --sides "$sides" ${VERL_ARGS:-} \
      --out "$out/gpu_vs_verl_${tokens}_pairs.json" > "$out/gpu_vs_verl_$tokens.log" 2>&1 || rc=1
    grep -vE "INFO|^\(" "$out/gpu_vs_verl_$tokens.log" | grep -E "^\[|step|no pair|Error|exited|timed out" | tail -14
    [ -f "$out/gpu_vs_verl_${tokens}_pairs.json" ] && python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print({k: v for k, v in d.items() if 'per_pair' in k or k.startswith('step_s')})" "$out/gpu_vs_verl_${tokens}_pairs.json"
  fi
done
for stage in probe sweep seeds; do  # learning at width: Qwen3-0.6B's shape on 3-digit addition (LEARN_ARGS adds options)
  if run "learn-$stage"; then  # the stages pick from each other through the cache, so they run in one lease
    python3 benchmarks/learning/learning_at_width.py "$stage" --recipe "${LEARN_RECIPE:-recipes/qwen3_grpo.py}" --preset "${LEARN_PRESET:-learn-0.6b}" \
      --state "$COLOCATE_RL_CACHE/learn/${LEARN_PRESET:-learn-0.6b}" ${LEARN_ARGS:-} 2>&1 | grep -E "^\[|^no |Error" | tee "$out/learn_$stage.log"
    cp "$COLOCATE_RL_CACHE/learn/${LEARN_PRESET:-learn-0.6b}/results.json" "$out/learn_${LEARN_PRESET:-learn-0.6b}.json" 2>/dev/null || rc=1
  fi
done
if run partial; then  # Qwen3-0.6B's shape, answers long-tailed by construction; PARTIAL_ARGS adds options
  python3 benchmarks/step/partial_gpu.py --out "$out/partial_rollouts.json" --pairs 2 --tokens 2048 --steps 5 ${PARTIAL_ARGS:-} \
    > "$out/partial.log" 2>&1 || rc=1
  grep -E "^off_|^on_|^step_s_ratio|Error" "$out/partial.log" | tail -10
fi
if run disagg; then  # needs two GPUs
  python3 benchmarks/step/disagg_gpu.py --out "$out/disagg.json" 2>&1 | tee "$out/disagg.log" | grep -vE "INFO|^\(" | tail -40 || rc=1
fi
if run dsv4; then  # vLLM's DeepSeek-V4 needs tilelang and a CUDA compiler too (scripts/dsv4_gpu_wheels.sh)
  python3 benchmarks/gap/dsv4_parity_gpu.py "$out/dsv4_parity.json" --kv-cache-dtype fp8 > "$out/dsv4.log" 2>&1 || rc=1
  grep -vE "INFO|^\(" "$out/dsv4.log" | tail -40
fi
if run dsv4-fp8; then  # the same wheels as dsv4; a cold JIT takes ~7 minutes of the first run
  VLLM_DEEP_GEMM_WARMUP=skip python3 benchmarks/step/recipe_runs.py --recipe recipes/dsv4_flash_grpo.py \
    --base preset=mini-1gpu rollout.enforce_eager=true steps=1 \
    --run plain="actor.emulate_rollout_fp8=false" --run emulated="actor.emulate_rollout_fp8=true" \
    --out "$out/dsv4_fp8_emulation.json" > "$out/dsv4_fp8.log" 2>&1 || rc=1
  grep -vE "INFO|^\(" "$out/dsv4_fp8.log" | tail -30
fi
exit $rc
