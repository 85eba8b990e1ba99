#!/usr/bin/env bash
# A careless user's mistakes on the CPU, each timed: what the command printed last and its exit code.
# Usage (repo root; transformers installed, as for the tests): bash bench/careless_user.sh WORK_DIR
# The default job runs 20 steps here (not 150) to keep the walk short; every other setting is the embedded default.
set -uo pipefail
work=$(realpath -m "${1:?work directory}"); repo=$(pwd)
rm -rf "$work"; mkdir -p "$work/data"; cd "$work"
export PYTHONPATH=$repo HOLOTRAIN_CACHE=${HOLOTRAIN_CACHE:-$work/cache}
ht() { python3 -m holotrain.cli "$@"; }
timed() {  # label, command...: the command's last stderr/stdout line, exit code and seconds
  local label=$1; shift; local s=$(date +%s.%N)
  "$@" > "$work/out.txt" 2>&1; local rc=$?
  printf '%-34s rc=%-3s %5.1f s  %s\n' "$label" "$rc" "$(echo "$(date +%s.%N) - $s" | bc)" "$(tail -1 "$work/out.txt" | cut -c1-150)"
}
python3 -c "import sys; sys.path.insert(0, '$repo'); from pathlib import Path; from tests.hf_models import make_hf_model; make_hf_model(Path('hf-chat'), 'qwen2')"
python3 - <<'PY'
import json
ok = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
with open("data/sft.jsonl", "w") as f:
    for i in range(400):
        f.write(json.dumps(ok) + "\n")
with open("data/broken.jsonl", "w") as f:
    for i in range(400):
        f.write((json.dumps({"text": f"document {i} " * 20}) if i % 2 else '{"text": "cut sh') + "\n")
PY
printf '[model]\ninit_from = "../hf-chat"\n[[data.sources]]\nname = "sft"\npath = "../data/sft.jsonl"\nformat = "chat"\n[data]\nseq_len = 64\n[training]\nlr = 1e-5\nsteps = 4\n' > "$work/data/sft.toml"
sed 's#sft.jsonl#sfft.jsonl#' "$work/data/sft.toml" > "$work/data/typo.toml"
printf '[[data.sources]]\nname = "broken"\npath = "broken.jsonl"\n' > "$work/data/broken.toml"

timed "default job, 20 steps" ht train --training.steps=20 --profile.progress=false
sha_before=$(cd runs/default && sha256sum config.toml tokenizer.json checkpoints/*/* | sha256sum)
timed "fine-tune config in the same folder" ht train --config data/sft.toml --job.device=cpu --profile.progress=false
timed "another model into runs/default" ht train --training.steps=20 --model.dim=128
sha_after=$(cd runs/default && sha256sum config.toml tokenizer.json checkpoints/*/* | sha256sum)
echo "runs/default unchanged: $([ "$sha_before" = "$sha_after" ] && echo yes || echo NO)"; ls runs
timed "mistyped data path, init_from set" ht train --config data/typo.toml --job.device=cpu
timed "half of the records malformed" ht train --config data/broken.toml --job.run_dir=runs/broken
touch not-a-dir
timed "unwritable run directory" ht train --job.run_dir=not-a-dir/run
# Ctrl-C reaches the whole foreground process group: the trainer, its data plane and loaders (setsid: a group here).
setsid python3 -m holotrain.cli train --training.steps=400 --profile.progress=false --job.run_dir=runs/long \
  > long.txt 2>&1 &
pid=$!
until [ "$( (wc -l < runs/long/metrics.jsonl) 2>/dev/null || echo 0)" -ge 2 ]; do sleep 0.2; done
timed "second process into a running run" ht train --training.steps=400 --job.run_dir=runs/long
s=$(date +%s.%N); kill -INT -- -$pid; wait $pid; rc=$?
printf '%-34s rc=%-3s %5.1f s  %s\n' "Ctrl-C of the running one" $rc "$(echo "$(date +%s.%N) - $s" | bc)" \
  "$(tail -1 long.txt | cut -c1-150)"
grep -c Traceback long.txt | xargs echo "tracebacks in its output:"; ls /dev/shm | grep -c "^ht" | xargs echo "blocks left in /dev/shm:"
timed "raise training.steps on resume" ht train --training.steps=30 --profile.progress=false
grep "schedule changed" "$work/out.txt"
timed "export of the fine-tune" ht export runs/sft hf-out
python3 -c "import json; print('generation_config.json:', json.load(open('hf-out/generation_config.json')))"
timed "export of the default job" ht export runs/default default-out
ls default-out
timed "a misspelt key" ht train --training.stpes=5
ht train --help | grep -c " = " | xargs echo "keys listed by train --help:"
